"""Online, against the published ``contextpilot`` 0.5.0: tokens saved per family (a script, not a test).

For every synthetic family of ``whatif.synthetic`` and the bundled MultiHop-RAG trace, at
each cache capacity (a share of the working set), one request at a time in arrival order
(``interleave``, as ``bench_families.py`` sends them), side by side in one run:

* ``without``: prefill tokens without ContextPilot (retrieval order, every block sent);
* tokens each plan saves over that (``without - with``): our default (``keep_top=True``),
  ours with ``keep_top=False`` (the top block anywhere, as upstream puts it), upstream
  0.5.0's online orders (``bench_upstream.run_upstream``: its own throwaway environment, no
  eviction feedback), and an oracle that sees the engine's cache and the next ``--window``
  requests (each request's cached head, then its other blocks ordered for the requests
  ahead that can still follow it), with the top block kept first and free;
* an upper bound on what any orders save, served one at a time in arrival order, even
  knowing the future, at any capacity: a cached prefix is a prefix of ONE earlier prompt,
  so each request reuses at most its overlap with one earlier request; with the top block
  kept first, with one earlier request of the same top block (a prompt shares more than
  the system prompt only with those). Below twice upstream's saving, 2x is out of reach;
* the ratios ours / upstream of the tokens saved, like for like (``keep_top=False``) and
  for the default.

``--feedback`` adds our two settings under other eviction feedback (``replay``'s ``none``,
``usage``, ``exact``; ``request`` is the default and always measured). ``--windows`` adds
micro-batching: every N arriving requests planned together (ours: ``replay(window=N)``, each
window a ``plan`` on the live pilot; upstream: one ``reorder`` call a window on its live
index) and served in the plan's schedule. Requests wait for their window: not one at a
time, so the bound above does not hold for them.

Every plan is served by the same cache simulator with the same prompts (system prompt,
blocks as their text alone, question); upstream's orders and the oracle's through
``serve_orders``.

Usage: python benchmarks/bench_online.py [--families memory-snippets,...,multihop]
       [--capacity 0.01,0.05,0.25,1] [--feedback none,usage,exact] [--window 30]
       [--windows 8,32] [--no-oracle] [--requests N] [--seed 0] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy.sparse import csr_matrix

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_bounds import best_head, lookahead_tail
from bench_families import capacity_base, upstream_orders
from bench_upstream import upstream_python

from contextpilot_integrations import Block
from contextpilot_integrations.core.prepared import PreparedRequest
from contextpilot_integrations.whatif.replay import (
    PromptShape,
    arrival_order,
    prompt_units,
    replay,
    serve_orders,
)
from contextpilot_integrations.whatif.simulate import RadixCacheSimulator
from contextpilot_integrations.whatif.synthetic import FAMILIES, generate
from contextpilot_integrations.whatif.trace import TraceRequest, multihop_trace

MULTIHOP = "multihop"
"""The bundled MultiHop-RAG trace (``--families``)."""

Orders = list[tuple[int, list[str]]]


@dataclass
class Row:
    family: str
    capacity: float
    without: int
    """Prefill tokens without ContextPilot."""
    default: int
    """Tokens saved (without - with): ours, keep_top=True, feedback ``request``."""
    free: int
    """Ours, keep_top=False."""
    upstream: int
    oracle_top: int | None = None
    oracle_free: int | None = None
    bound_top: int = 0
    """:func:`predecessor_bound` with the top block first, less ``without``'s cached tokens."""
    bound_free: int = 0
    feedback: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Other feedback settings: (default, free) tokens saved."""
    windows: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    """Micro-batching windows (requests planned together): (default, free, upstream) tokens saved."""

    def over(self, saved: int | None) -> float | None:
        if saved is None:
            return None
        return saved / self.upstream if self.upstream > 0 else float("inf") if saved > 0 else None


# ---- the traces and upstream's orders -------------------------------------------------------------
def trace_of(name: str, requests: int | None, seed: int) -> list[TraceRequest]:
    if name == MULTIHOP:
        trace = multihop_trace()
        return trace[:requests] if requests else trace
    spec = FAMILIES[name] if requests is None else FAMILIES[name].with_requests(requests)
    return generate(spec, seed=seed)


WINDOWS_RUNNER = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from contextpilot.server.live_index import ContextPilot  # the public class

contexts, size = json.load(open(sys.argv[1])), int(sys.argv[3])
pilot = ContextPilot(use_gpu=False)  # one live index, one reorder() call a window
sent = []  # [position in the arrival order, order], in send order
for start in range(0, len(contexts), size):
    window = [list(map(str, c)) for c in contexts[start : start + size]]
    try:
        got, schedule = pilot.reorder([list(c) for c in window])
    except Exception:  # keep the retrieval order and the arrival order
        got, schedule = window, list(range(len(window)))
    # the first call returns contexts in schedule order, later ones in input order: match by blocks
    by_blocks = {}
    for context in got:
        by_blocks.setdefault(frozenset(map(str, context)), []).append(list(map(str, context)))
    orders = [(by_blocks.get(frozenset(c)) or [c]).pop() for c in window]
    if sorted(schedule) != list(range(len(window))):
        schedule = list(range(len(window)))
    sent += [[start + i, orders[i]] for i in schedule]
json.dump(sent, open(sys.argv[2], "w"))
"""


def upstream_windows(trace: Sequence[TraceRequest], arrival: list[int], size: int) -> Orders:
    """Upstream's orders and schedule when every ``size`` arriving requests go to one
    ``reorder`` call on its live index (its batch API, as a micro-batch)."""
    with tempfile.TemporaryDirectory() as tmp:
        contexts, result, runner = Path(tmp) / "contexts.json", Path(tmp) / "result.json", Path(tmp) / "runner.py"
        contexts.write_text(json.dumps([list(trace[i].blocks) for i in arrival]))
        runner.write_text(WINDOWS_RUNNER)
        command = [str(upstream_python()), str(runner), str(contexts), str(result), str(size)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)  # upstream prints banners
        return [(arrival[position], order) for position, order in json.loads(result.read_text())]


# ---- the oracle ------------------------------------------------------------------------------------
def oracle_orders(
    trace: Sequence[TraceRequest], arrival: list[int], capacity: int, shape: PromptShape, window: int, keep_top: bool
) -> Orders:
    """Each request: the longest head of its blocks the cache holds now (after its top block
    with ``keep_top``), then its other blocks ordered for the next ``window`` requests that
    can still follow that head (``bench_bounds.lookahead_tail``). Served with the same
    prompts as ``serve_orders``."""
    cache = RadixCacheSimulator(capacity)
    blocks: dict[tuple[str, int], Block] = {}
    system = [(("system",), shape.system_tokens)] if shape.system_tokens > 0 else []
    seen: Counter[str] = Counter()
    orders: Orders = []
    for n, index in enumerate(arrival):
        request = trace[index]
        counts = request.token_counts()
        tokens = dict(zip(request.blocks, counts, strict=True))
        seen.update(request.blocks)
        top = request.blocks[0]
        required = [key for key, _ in system] + ([("plain", top)] if keep_top else [])
        found = best_head(cache, {("plain", b) for b in request.blocks}, required)
        head = [key[1] for key in found[len(system) :]] or ([top] if keep_top else [])
        ahead = [trace[j] for j in arrival[n + 1 : n + 1 + window]]  # with keep_top, of the same top block
        future = [frozenset(r.blocks) for r in ahead if not keep_top or r.blocks[0] == top]
        future = [s for s in future if s.issuperset(head)]
        order = head + lookahead_tail([b for b in request.blocks if b not in set(head)], future, tokens, seen)
        by_id = {
            b: blocks.setdefault((b, t), Block(id=b, text=f"[{b}]", tokens=t))
            for b, t in zip(request.blocks, counts, strict=True)
        }
        prepared = PreparedRequest(
            f"r{index}",
            request.question or "",
            tuple(by_id[b] for b in order),
            ranking=tuple(by_id.values()),
            labels=False,
            annotate_order=shape.annotate,
        )
        units, _, _ = prompt_units(prepared, request, shape)
        cache.request(prepared.request_id, system + units)
        orders.append((index, order))
    return orders


# ---- the bound ---------------------------------------------------------------------------------------
def predecessor_bound(trace: Sequence[TraceRequest], arrival: list[int], shape: PromptShape, keep_top: bool) -> int:
    """Cached tokens at most, whatever the orders, even knowing the future (unbounded cache):
    the system prompt after the first request, and for each request its overlap with ONE
    earlier request (a cached prefix is a prefix of a single earlier prompt), in tokens;
    ``keep_top``: only an earlier request of the same top block (else the prefixes part
    right after the system prompt)."""
    ordered = [trace[i] for i in arrival]
    keys: dict[str, int] = {}
    rows, cols, weights = [], [], []
    for n, request in enumerate(ordered):
        for block, tokens in zip(request.blocks, request.token_counts(), strict=True):
            rows.append(n)
            cols.append(keys.setdefault(block, len(keys)))
            weights.append(tokens)
    shape_ = (len(ordered), len(keys))
    weighted = csr_matrix((np.array(weights, dtype=np.float64), (rows, cols)), shape=shape_)
    incidence = csr_matrix((np.ones(len(cols)), (rows, cols)), shape=shape_)
    overlap = np.tril((weighted @ incidence.T).toarray(), k=-1)  # row i: tokens of i an earlier j carries
    if keep_top:
        tops = np.array([keys[r.blocks[0]] for r in ordered])
        overlap *= tops[:, None] == tops[None, :]
    best = overlap.max(axis=1) if len(ordered) else np.zeros(0)
    return int(best.sum()) + shape.system_tokens * max(len(ordered) - 1, 0)


# ---- one trace -------------------------------------------------------------------------------------
def rows_of(
    name: str,
    trace: list[TraceRequest],
    fractions: list[float],
    feedbacks: list[str],
    window: int,
    oracle: bool,
    windows: Sequence[int] = (),
) -> list[Row]:
    shape = PromptShape()
    arrival = arrival_order(trace, "interleave")  # replay's default online arrival
    theirs = upstream_orders(trace)["online"]
    theirs_windowed = {size: upstream_windows(trace, arrival, size) for size in windows}
    base = capacity_base(trace, "online")
    bounds = {keep: predecessor_bound(trace, arrival, shape, keep) for keep in (True, False)}
    rows = []
    for fraction in fractions:
        capacity = max(1, int(base * fraction))
        without = replay(trace, "retrieval", "online", capacity, shape=shape, deduplicate=False)

        def saved(prefill: int, without: int = without.prefill_tokens) -> int:
            return without - prefill

        def ours(keep_top: bool, feedback: str = "request", capacity: int = capacity, window: int = 1) -> int:
            result = replay(
                trace,
                "trie",
                "online",
                capacity,
                shape=shape,
                keep_top=keep_top,
                feedback=feedback,
                window=window,  # type: ignore[arg-type]
            )
            return saved(result.prefill_tokens)

        row = Row(
            name,
            fraction,
            without.prefill_tokens,
            ours(True),
            ours(False),
            saved(serve_orders(trace, theirs, capacity, shape).prefill_tokens),
            bound_top=bounds[True] - without.cached_tokens,
            bound_free=bounds[False] - without.cached_tokens,
        )
        if oracle:
            for keep in (True, False):
                orders = oracle_orders(trace, arrival, capacity, shape, window, keep)
                value = saved(serve_orders(trace, orders, capacity, shape).prefill_tokens)
                if keep:
                    row.oracle_top = value
                else:
                    row.oracle_free = value
        for feedback in feedbacks:
            row.feedback[feedback] = (ours(True, feedback), ours(False, feedback))
        for size in windows:
            up = saved(serve_orders(trace, theirs_windowed[size], capacity, shape).prefill_tokens)
            row.windows[size] = (ours(True, window=size), ours(False, window=size), up)
        rows.append(row)
        print(f"  {name} {fraction:.0%}: done", file=sys.stderr, flush=True)
    return rows


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def print_extra(title: str, rows: list[Row], parts: list[tuple[str, Callable[[Row], tuple[int, int]]]]) -> None:
    """A table of (default, top free) tokens saved per setting, each over upstream's."""
    print(f"\n{title}: tokens saved (x: over upstream), default | top free")
    head = f"{'family':<16}{'cap':>5}" + "".join(
        f"{f'{name}: default':>24}{f'{name}: top free':>24}" for name, _ in parts
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r.family:<16}{r.capacity:>5.0%}"
        for _, get in parts:
            default, free = get(r)
            line += f"{f'{default:,} ({_ratio(r.over(default))})':>24}{f'{free:,} ({_ratio(r.over(free))})':>24}"
        print(line)


def print_windows(rows: list[Row], windows: list[int]) -> None:
    """Micro-batching: ours and upstream's, each planning every window of arriving requests."""
    print(
        "\nmicro-batching windows of N arriving requests, each planned together and sent in its schedule "
        "(ours: plan(in_order=True); upstream: one reorder() call a window): tokens saved; x: ours / upstream's, "
        "same window"
    )
    head = f"{'family':<16}{'cap':>5}"
    head += "".join(f"{f'N={w} upstream':>16}{f'N={w} default':>22}{f'N={w} top free':>22}" for w in windows)
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r.family:<16}{r.capacity:>5.0%}"
        for w in windows:
            default, free, up = r.windows[w]
            ours = [f"{value:,} ({_ratio(value / up if up > 0 else None)})" for value in (default, free)]
            line += f"{up:>16,}{ours[0]:>22}{ours[1]:>22}"
        print(line)


def print_rows(rows: list[Row], window: int) -> None:
    print("\nonline, prefill tokens saved over retrieval order (without - with); x: ours / upstream 0.5.0")
    head = (
        f"{'family':<16}{'cap':>5}{'without':>12}{'default':>10}{'top free':>10}{'upstream':>10}"
        f"{'oracle top':>11}{'oracle free':>12}{'bound top':>11}{'bound free':>11}"
        f"{'free/up':>9}{'default/up':>11}{'orc free/up':>12}{'orc top/up':>11}{'bnd free/up':>12}{'bnd top/up':>11}"
    )
    print(head)
    print("-" * len(head))

    def num(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    for r in rows:
        print(
            f"{r.family:<16}{r.capacity:>5.0%}{r.without:>12,}{r.default:>10,}{r.free:>10,}{r.upstream:>10,}"
            f"{num(r.oracle_top):>11}{num(r.oracle_free):>12}{r.bound_top:>11,}{r.bound_free:>11,}"
            f"{_ratio(r.over(r.free)):>9}{_ratio(r.over(r.default)):>11}{_ratio(r.over(r.oracle_free)):>12}"
            f"{_ratio(r.over(r.oracle_top)):>11}{_ratio(r.over(r.bound_free)):>12}{_ratio(r.over(r.bound_top)):>11}"
            + ("  WORSE" if min(r.default, r.free) < 0 else "")
        )
    print(
        f"default: keep_top=True; top free: keep_top=False (both with request-level eviction feedback); "
        f"oracle: sees the cache and the next {window} requests; bound: each request's overlap with one "
        "earlier request (top: of the same top block), any order, unbounded cache"
    )
    feedbacks = sorted({f for r in rows for f in r.feedback})
    if feedbacks:
        print_extra("other eviction feedback", rows, [(f, lambda r, f=f: r.feedback[f]) for f in feedbacks])
    windows = sorted({w for r in rows for w in r.windows})
    if windows:
        print_windows(rows, windows)

    def below(value: Callable[[Row], int | None]) -> int:
        return sum((r.over(value(r)) or 0) < 2 for r in rows)

    print(
        f"\ncells below 2x upstream, of {len(rows)}: top free {below(lambda r: r.free)}, default "
        f"{below(lambda r: r.default)}; out of reach (bound below 2x): top free {below(lambda r: r.bound_free)}, "
        f"default {below(lambda r: r.bound_top)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join([*FAMILIES, MULTIHOP]))
    parser.add_argument("--capacity", default="0.01,0.05,0.25,1")
    parser.add_argument("--feedback", default="", help="other feedback settings: none,usage,exact")
    parser.add_argument("--window", type=int, default=30, help="requests the oracle sees ahead")
    parser.add_argument("--windows", default="", help="micro-batching windows to add, in requests: 8,32")
    parser.add_argument("--no-oracle", action="store_true")
    parser.add_argument("--requests", type=int, help="requests a trace (default: each trace's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    names = [n for n in args.families.split(",") if n]
    unknown = [n for n in names if n not in FAMILIES and n != MULTIHOP]
    if unknown:
        parser.error(f"unknown families: {', '.join(unknown)} (known: {', '.join([*FAMILIES, MULTIHOP])})")
    feedbacks = [f for f in args.feedback.split(",") if f and f != "request"]
    fractions = [float(c) for c in args.capacity.split(",")]
    windows = [int(w) for w in args.windows.split(",") if w]
    rows: list[Row] = []
    for name in names:
        trace = trace_of(name, args.requests, args.seed)
        rows += rows_of(name, trace, fractions, feedbacks, args.window, not args.no_oracle, windows)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=2))
    else:
        print_rows(rows, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
