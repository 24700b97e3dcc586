"""The synthetic families: a script, not a test.

For every named family of ``whatif.synthetic`` (memory snippets, passages, scattered,
long chats, MultiHop-like), every mode (offline, online, chat) and cache capacity (a share
of the working set; chat: of what resending every block leaves in a cache that never
evicts), prints the engine's prefill (prompt tokens not served from the cache, every
prompt token counted: system, history, blocks, labels, references, annotation, question)
without ContextPilot (retrieval order, no labels, no annotation, every block resent) and
with it (the default strategy), side by side, their ratio, and WORSE where ContextPilot
computes more. ``--upstream`` adds the published ``contextpilot`` 0.5.0's orders
(offline and online, served with the same prompts; see ``bench_upstream.py``) and, like for
like (upstream moves the top block), ours with ``keep_top=False`` and the tokens it saves
over the tokens upstream saves.

The README's family table is this script's output at the default sizes.

Usage: python benchmarks/bench_families.py [--families memory-snippets,...] [--requests N]
       [--capacity 0.01,0.05,0.25,1] [--modes offline,online,chat] [--seed 0] [--upstream]
       [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contextpilot_integrations.whatif.replay import PromptShape, arrival_order, replay, serve_orders
from contextpilot_integrations.whatif.synthetic import FAMILIES, generate
from contextpilot_integrations.whatif.trace import TraceRequest, working_set_tokens


@dataclass
class Cell:
    family: str
    mode: str
    capacity: float
    without: int
    with_contextpilot: int
    upstream: int | None = None
    top_free: int | None = None
    """With ContextPilot(keep_top=False): the top block anywhere, as upstream puts it."""

    @property
    def ratio(self) -> float:
        return self.with_contextpilot / self.without if self.without else 1.0


def capacity_base(trace: list[TraceRequest], mode: str) -> int:
    if mode == "chat":
        return replay(trace, "retrieval", "chat", None, deduplicate=False).held_tokens
    return working_set_tokens(trace)


def upstream_orders(trace: list[TraceRequest]) -> dict[str, list[tuple[int, list[str]]]]:
    """The published ``contextpilot`` 0.5.0's send orders (``bench_upstream.py``: its own
    throwaway environment), offline and online, as (index into the trace, block ids), in send
    order; online, the requests reach it as they reach ours (``replay``'s default arrival)."""
    from bench_upstream import run_upstream

    arrival = arrival_order(trace, "interleave")
    raw = run_upstream([trace[i] for i in arrival])
    return {
        "offline": [(arrival[i], order) for i, order in raw["offline"]],
        "online": list(zip(arrival, raw["online"], strict=True)),
    }


def cells(
    name: str, trace: list[TraceRequest], modes: list[str], fractions: list[float], upstream: dict | None
) -> list[Cell]:
    out = []
    shape = PromptShape()
    for mode in modes:
        base = capacity_base(trace, mode)
        for fraction in fractions:
            capacity = max(1, int(base * fraction))
            without = replay(trace, "retrieval", mode, capacity, shape=shape, deduplicate=False)  # type: ignore[arg-type]
            ours = replay(trace, "trie", mode, capacity, shape=shape)  # type: ignore[arg-type]
            theirs = free = None
            if upstream is not None and mode != "chat":
                theirs = serve_orders(trace, upstream[mode], capacity, shape).prefill_tokens
                free = replay(trace, "trie", mode, capacity, shape=shape, keep_top=False).prefill_tokens  # type: ignore[arg-type]
            out.append(Cell(name, mode, fraction, without.prefill_tokens, ours.prefill_tokens, theirs, free))
            print(f"  {name} {mode} {fraction:.0%}: done", file=sys.stderr, flush=True)
    return out


def print_cells(rows: list[Cell], upstream: bool) -> None:
    head = f"{'family':<16}{'mode':<9}{'capacity':>9}{'without':>13}{'with CP':>13}{'ratio':>8}"
    head += f"{'upstream 0.5.0':>16}{'top free':>12}{'saved: free / upstream':>24}" if upstream else ""
    print("\nprefill tokens (prompt tokens not cached), without ContextPilot and with it; ratio = with / without")
    print(head)
    print("-" * (len(head) + 6))
    for r in rows:
        line = f"{r.family:<16}{r.mode:<9}{r.capacity:>9.0%}{r.without:>13,}{r.with_contextpilot:>13,}{r.ratio:>8.3f}"
        if upstream:
            if r.upstream is not None and r.top_free is not None:
                saved = (r.without - r.top_free) / max(r.without - r.upstream, 1)
                line += f"{r.upstream:>16,}{r.top_free:>12,}{saved:>23.2f}x"
            else:
                line += f"{'-':>16}{'-':>12}{'-':>24}"
        print(line + ("  WORSE" if r.with_contextpilot > r.without else ""))
    worse = [r for r in rows if r.with_contextpilot > r.without]
    print(f"\n{len(worse)} of {len(rows)} cells worse than retrieval order")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--requests", type=int, help="requests a family (default: each family's own)")
    parser.add_argument("--capacity", default="0.01,0.05,0.25,1")
    parser.add_argument("--modes", default="offline,online,chat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--upstream", action="store_true", help="add the published contextpilot 0.5.0's orders")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        parser.error(f"unknown families: {', '.join(unknown)} (known: {', '.join(FAMILIES)})")
    fractions = [float(c) for c in args.capacity.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    rows: list[Cell] = []
    for name in names:
        spec = FAMILIES[name] if args.requests is None else FAMILIES[name].with_requests(args.requests)
        trace = generate(spec, seed=args.seed)
        theirs = upstream_orders(trace) if args.upstream else None
        rows += cells(name, trace, modes, fractions, theirs)
    if args.json:
        print(json.dumps([{**asdict(r), "ratio": r.ratio} for r in rows], indent=2))
    else:
        print_cells(rows, args.upstream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
