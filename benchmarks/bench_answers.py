"""Answer quality on a real model: does it answer as well with ContextPilot as without?
(a script, not a test; the CI test is tests/whatif/test_answers_real_model.py).

Starts llama-server (``scripts/build_llama_server.sh``) with the real model
(Gemma 3 270M, ``scripts/fetch_real_model.sh``; ``./run.sh bench`` fetches it), one server a
core, one slot each (greedy answers are then the same on every run of one build), and asks
every workload's questions once per arm: without ContextPilot (retrieval order, no
annotation, every document in full every turn), the defaults, and each annotation and
reference form (``contextpilot-integrations answers --help`` lists them). Prints, per
workload and arm, the share of questions answered ('contains': a gold answer in the answer)
with its Wilson 95% interval, exact match and token F1, the gap to the baseline over the same
questions with a paired bootstrap 95% interval, the verdict at a 5-point margin, how many
prompts changed, the references sent, and the prompt tokens after the history (what a turn
costs when its history is cached), against the baseline's.

A form is on by default only where its verdict is "not worse" or "better" (the README's
answer-quality table is this script's output at the default sizes: about three hours on two
cores). Point ``--engine URL`` at your own server to check your model instead.

Usage: python benchmarks/bench_answers.py [--workloads facts,facts-chat,...] [--questions N]
       [--arms a,b,...] [--servers 2] [--engine URL] [--api completion|chat] [--out results.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contextpilot_integrations.whatif.answers import ARMS, AnswerClient, WorkloadResult, arm, compare, workload
from contextpilot_integrations.whatif.answers.compare import dumps

SIZES = {"facts": 300, "facts-chat": 300, "memory": 200, "memory-chat": 300, "multihop": 60}
"""Questions a workload: 300 tell a 5-point loss from none where the arms disagree on ~15% of
them; MultiHop's ~2,500-token prompts take ~15 s each on one core, hence fewer."""
ARMS_ASKED = {
    "facts": ("without", "default", "offline", "annotated", "moved", "top-anywhere", "labels"),
    "facts-chat": ("without", "default", "refs-anywhere", "label-refs", "no-dedup"),
    "memory": ("without", "default", "offline", "annotated"),
    "memory-chat": ("without", "default", "refs-anywhere", "no-dedup"),
    "multihop": ("without", "default", "offline", "annotated"),
}
"""The arms each workload is asked with (``--arms`` for others)."""


def run(name: str, url: str, args: argparse.Namespace) -> WorkloadResult:
    questions = workload(name, args.questions or SIZES[name], args.seed)
    names = ["without", *[n for n in args.arms if n != "without"]] if args.arms else ARMS_ASKED[name]
    with AnswerClient(url, args.api, args.model) as client:
        return compare(questions, [arm(n) for n in names], client, name, progress=not args.quiet)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(SIZES), help="comma-separated, from: " + ", ".join(SIZES))
    parser.add_argument("--questions", type=int, help="questions a workload (default: SIZES)")
    parser.add_argument("--arms", help="comma-separated, from: " + ", ".join(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--servers", type=int, default=2, help="llama-servers to start, one thread each (2)")
    parser.add_argument("--engine", help="your own server instead (OpenAI-compatible)")
    parser.add_argument("--api", choices=("completion", "chat"), default="completion")
    parser.add_argument("--model", default="default")
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        parser.error(f"unknown workloads: {', '.join(unknown)}")
    args.arms = [n.strip() for n in args.arms.split(",")] if args.arms else None
    with ExitStack() as stack:
        if args.engine:
            urls = [args.engine]
        else:
            from contextpilot_integrations.testing.llama_server import real_llama_server

            def missing(reason: str) -> None:
                raise SystemExit(reason)

            workdir = Path(tempfile.mkdtemp(prefix="cp-answers-"))
            urls = []
            for number in range(max(1, args.servers)):
                server = real_llama_server(workdir, missing, f"server{number}.log", threads=1)
                stack.callback(server.stop)
                urls.append(server.url)
        print(f"asking {', '.join(names)} on {len(urls)} server(s); one slot each, greedy", file=sys.stderr)
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:  # one workload a server at a time
            futures = [pool.submit(run, name, urls[index % len(urls)], args) for index, name in enumerate(names)]
            results = [future.result() for future in futures]
    for result in results:
        result.print()
    if args.out:
        args.out.write_text(dumps(results), encoding="utf-8")
        print(f"\nresults: {args.out}")


if __name__ == "__main__":
    main()
