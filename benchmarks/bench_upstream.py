"""Side by side with the published ``contextpilot`` 0.5.0 (a script, not a test).

The upstream package is installed only in this benchmark's own throwaway virtual
environment (under the system temp directory), never in ours, and only its public API is
called, in a subprocess. Every plan, ours or upstream, is then served by the same
block-granular radix-cache simulator on the bundled MultiHop-RAG trace. Upstream's online
mode gets no eviction feedback: its library users never see request ids.

Prints hit ratio and planning time per capacity for: retrieval order, upstream 0.5.0,
our ``paper`` strategy and our default ``trie`` strategy, plus the reuse bound.

Usage: python benchmarks/bench_upstream.py [--capacity 0.1,0.25,0.5,1]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

from contextpilot_integrations.whatif import (
    ReplayResult,
    TraceRequest,
    multihop_trace,
    replay,
    reuse_bound_of_prompts,
    serve_orders,
    working_set_tokens,
)

UPSTREAM = "contextpilot==0.5.0"
ENV_DIR = Path(tempfile.gettempdir()) / "contextpilot-upstream-0.5.0"

RUNNER = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from contextpilot.server.live_index import ContextPilot  # the public class

contexts = json.load(open(sys.argv[1]))
out = {}
pilot = ContextPilot(use_gpu=False)
start = time.perf_counter()
reordered, order = pilot.reorder(contexts)
out["offline_seconds"] = time.perf_counter() - start
out["offline"] = [[i, list(map(str, ctx))] for ctx, i in zip(reordered, order)]

pilot = ContextPilot(use_gpu=False)
online, errors, spent = [], [], 0.0
for i, ctx in enumerate(contexts):
    start = time.perf_counter()
    try:
        got, _ = pilot.reorder(list(ctx))
        online.append(list(map(str, got[0])))
    except Exception as exc:  # upstream fails here; keep the retrieval order, count it
        online.append(list(ctx))
        errors.append(f"{i}: {type(exc).__name__}: {exc}"[:200])
    spent += time.perf_counter() - start
out["online"] = online
out["online_seconds"] = spent
out["online_errors"] = len(errors)
out["first_error"] = errors[0] if errors else None
json.dump(out, open(sys.argv[2], "w"))
"""


def upstream_python() -> Path:
    python = ENV_DIR / "bin" / "python"
    if not python.exists():
        print(f"creating the throwaway environment for {UPSTREAM} in {ENV_DIR} ...", flush=True)
        venv.create(ENV_DIR, with_pip=True)
        # its declared dependencies include servers and GPU tooling; the index needs only these
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", UPSTREAM], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "numpy", "scipy", "tqdm"], check=True)
    return python


def run_upstream(trace: list[TraceRequest]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        contexts = Path(tmp) / "contexts.json"
        result = Path(tmp) / "result.json"
        runner = Path(tmp) / "runner.py"
        contexts.write_text(json.dumps([list(r.blocks) for r in trace]))
        runner.write_text(RUNNER)
        subprocess.run(
            [str(upstream_python()), str(runner), str(contexts), str(result)],
            check=True,
            stdout=subprocess.DEVNULL,  # upstream prints banners
        )
        return json.loads(result.read_text())


def serve(
    trace: list[TraceRequest], orders: list[list[str]], capacity: int, in_order: list[int] | None = None
) -> float:
    """Upstream's orders with the same whole prompts as ours (system, blocks, annotation, question)."""
    indices = in_order if in_order is not None else list(range(len(orders)))
    return serve_orders(trace, [(i, orders[n]) for n, i in enumerate(indices)], capacity).hit_ratio


def cell(result: ReplayResult, requests: int) -> str:
    """Hit ratio and the time ContextPilot spent (offline: total; online: per request)."""
    if result.mode == "offline":
        return f"{result.hit_ratio:.1%} ({result.pilot_seconds:.2f}s)"
    return f"{result.hit_ratio:.1%} ({result.pilot_seconds / requests * 1e3:.2f}ms/req)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", default="0.1,0.25,0.5,1")
    args = parser.parse_args()
    fractions = [float(x) for x in args.capacity.split(",")]
    trace = multihop_trace()
    upstream = run_upstream(trace)
    offline_orders = [order for _, order in upstream["offline"]]
    for _, order in upstream["offline"]:
        assert len(order) == 15, "upstream dropped blocks"
    working_set = working_set_tokens(trace)
    bound = reuse_bound_of_prompts(trace)
    print(
        f"\nMultiHop-RAG, {len(trace):,} requests; hit ratio = cached / prompt tokens (system prompt, blocks, "
        f"order annotation, question); reuse bound {bound:.1%}; online feedback: ours request-level, upstream none"
    )
    print(f"upstream online errors: {upstream['online_errors']} ({upstream['first_error']})")
    header = f"{'mode':<8}{'capacity':>9}{'retrieval':>12}{'upstream 0.5.0':>22}{'paper (ours)':>22}{'trie (ours)':>22}"
    print(header)
    for mode in ("offline", "online"):
        for fraction in fractions:
            capacity = int(working_set * fraction)
            ours = {s: replay(trace, s, mode, capacity) for s in ("retrieval", "paper", "trie")}  # type: ignore[arg-type]
            if mode == "offline":
                up_hit = serve(trace, offline_orders, capacity, [index for index, _ in upstream["offline"]])
                up_time = f"{upstream['offline_seconds']:.2f}s"
            else:
                up_hit = serve(trace, upstream["online"], capacity)
                up_time = f"{upstream['online_seconds'] / len(trace) * 1e3:.2f}ms/req"

            print(
                f"{mode:<8}{fraction:>9.0%}{ours['retrieval'].hit_ratio:>12.1%}"
                f"{f'{up_hit:.1%} ({up_time})':>22}"
                f"{cell(ours['paper'], len(trace)):>22}{cell(ours['trie'], len(trace)):>22}"
            )


if __name__ == "__main__":
    sys.exit(main())
