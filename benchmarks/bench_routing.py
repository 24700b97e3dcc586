"""Routing to where the prefix lives, on real llama-servers (a script, not a test).

Every pass starts on fresh servers (an empty cache). MultiHop-RAG queries (15 chunks each,
cut to ``--block-chars``), prints mean / p50 / p90 time to first token, the servers'
cached tokens, throughput and the busiest target's share of requests:

1. one server with ``--slots`` slots: the server's own slot choice (retrieval order, then
   ContextPilot's order) against ``id_slot`` routing (ContextPilot's cache-aware router);
2. ``--replicas`` servers: round-robin, least-loaded, and ContextPilot routing, with
   retrieval order and with ContextPilot's order;
3. concurrent bursts (``--burst`` requests at once) to the replicas: retrieval order and
   round-robin; ContextPilot routing without and with micro-batching;
4. the simulator's numbers for the same setups (``whatif.replay.replay_routed``).

Target: online mean TTFT >= 1.3x better than retrieval order with the engine's
default placement, no replica above 1.5x the mean load.

Usage: python benchmarks/bench_routing.py [--requests 60] [--block-chars 150] [--slots 4] [--replicas 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from contextpilot_integrations import Block, ContextPilot, MicroBatcher
from contextpilot_integrations.engines import Router, RoutingClient, Target
from contextpilot_integrations.engines.client import ChatResult, OpenAICompatClient
from contextpilot_integrations.testing.llama_server import LlamaServer, llama_server_binary, write_tiny_gguf
from contextpilot_integrations.whatif import multihop_trace, working_set_tokens
from contextpilot_integrations.whatif.replay import arrival_order, replay_routed
from contextpilot_integrations.whatif.trace import TraceRequest

SYSTEM = "Answer the question using the context documents."


@dataclass
class Pass:
    name: str
    results: list[ChatResult] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    wall: float = 0.0

    def row(self, baseline: Pass | None) -> str:
        ttft = [r.ttft_s for r in self.results]
        prompt = sum(r.prompt_tokens or 0 for r in self.results)
        cached = sum(r.cached_tokens or 0 for r in self.results)
        counts = [self.targets.count(t) for t in sorted(set(self.targets))]
        share = max(counts) / statistics.fmean(counts) if counts else 0.0
        mean = statistics.fmean(ttft)
        ratio = f"{statistics.fmean([r.ttft_s for r in baseline.results]) / mean:.2f}x" if baseline else "1.00x"
        ordered = sorted(ttft)
        return (
            f"{self.name:<44}{mean * 1e3:>8.0f}{ordered[len(ordered) // 2] * 1e3:>8.0f}"
            f"{ordered[int(0.9 * (len(ordered) - 1))] * 1e3:>8.0f}{cached / max(prompt, 1):>9.1%}"
            f"{len(self.results) / self.wall:>9.2f}{share:>8.2f}{ratio:>8}"
        )


HEADER = f"{'':<44}{'mean':>8}{'p50':>8}{'p90':>8}{'cached':>9}{'req/s':>9}{'load':>8}{'TTFT':>8}"


def queries(requests: int, sessions: int) -> list[TraceRequest]:
    """The trace in file order; or (``sessions`` > 0) that many users, each asking in turn
    about one story (queries grouped by evidence article), their requests interleaved."""
    trace = multihop_trace(texts=True, conversations=sessions > 0)
    if not sessions:
        return trace
    sizes = Counter(r.conversation for r in trace if r.conversation)
    topics = [topic for topic, n in sizes.most_common() if n >= requests // sessions][:sessions]
    chosen = [
        r.model_copy(update={"session": r.conversation, "conversation": None})
        for r in trace
        if r.conversation in topics
    ]
    return [chosen[i] for i in arrival_order(chosen, "interleave")]


def workload(trace: Sequence[TraceRequest], requests: int, chars: int) -> list[tuple[list[Block], str]]:
    """The first ``requests`` queries as blocks cut to ``chars`` characters."""
    return [
        ([Block(id=b, text=t[:chars]) for b, t in zip(r.blocks, r.texts or (), strict=True)], r.question or "")
        for r in trace[:requests]
    ]


class Servers:
    """Fresh llama-servers for one pass."""

    def __init__(self, binary: Path, model: Path, workdir: Path) -> None:
        self.binary, self.model, self.workdir = binary, model, workdir

    def start(self, stack: ExitStack, count: int, slots: int = 1) -> list[LlamaServer]:
        threads = max(1, 2 // count)
        servers = []
        for _ in range(count):
            server = LlamaServer(self.binary, self.model, None, (), context=8192 * slots, slots=slots, threads=threads)
            stack.callback(server.stop)
            servers.append(server)
        return servers


def sequential(
    name: str, items: list[tuple[list[Block], str]], send: Callable[[list[Block], str], tuple[ChatResult, str]]
) -> Pass:
    record = Pass(name)
    start = time.perf_counter()
    for blocks, query in items:
        result, target = send(blocks, query)
        record.results.append(result)
        record.targets.append(target)
    record.wall = time.perf_counter() - start
    return record


def own_placement(server: LlamaServer, items: list[tuple[list[Block], str]], strategy: str, name: str) -> Pass:
    pilot = ContextPilot(strategy)
    with OpenAICompatClient(server.url, pilot, engine="llamacpp", timeout=600) as client:
        return sequential(
            name, items, lambda b, q: (client.chat(pilot.prepare(b, q), system_prompt=SYSTEM, max_tokens=1), "server")
        )


def routed(
    targets: Sequence[Target], items: list[tuple[list[Block], str]], strategy: str, routing: str, name: str
) -> Pass:
    router = Router(list(targets), strategy=strategy, routing=routing)
    with RoutingClient(router, timeout=600) as client:

        def send(blocks: list[Block], query: str) -> tuple[ChatResult, str]:
            out = client.chat(blocks, query, system_prompt=SYSTEM, max_tokens=1)
            return out.result, out.target.name

        return sequential(name, items, send)


def bursts(
    targets: Sequence[Target], items: list[tuple[list[Block], str]], size: int, strategy: str, routing: str,
    batching: bool, name: str,
) -> Pass:  # fmt: skip
    router = Router(list(targets), strategy=strategy, routing=routing)
    batcher = MicroBatcher(router, window=0.01, max_batch=size) if batching else None
    record = Pass(name)

    async def run() -> None:
        with RoutingClient(router, timeout=600) as client:

            async def one(blocks: list[Block], query: str) -> None:
                routed = await batcher.aprepare(blocks, query) if batcher else router.prepare(blocks, query)
                out = await client.asend(routed, system_prompt=SYSTEM, max_tokens=1)
                record.results.append(out.result)
                record.targets.append(out.target.name)

            for start in range(0, len(items), size):
                await asyncio.gather(*(one(b, q) for b, q in items[start : start + size]))

    began = time.perf_counter()
    asyncio.run(run())
    record.wall = time.perf_counter() - began
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--block-chars", type=int, default=150)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--burst", type=int, default=6)
    parser.add_argument(
        "--sessions",
        type=int,
        default=0,
        help="interleave this many users, each asking about one story (0: the trace in file order)",
    )
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: slots,replicas,bursts,simulator")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    binary = llama_server_binary()
    if binary is None:
        raise SystemExit("llama-server is not built: run scripts/build_llama_server.sh")
    workdir = Path(tempfile.mkdtemp(prefix="cp-routing-"))
    servers = Servers(binary, write_tiny_gguf(workdir / "tiny.gguf"), workdir)
    trace = queries(args.requests, args.sessions)
    items = workload(trace, args.requests, args.block_chars)
    arrival = f"{args.sessions} users interleaved, each on one story" if args.sessions else "in trace order"
    print(f"{args.requests} MultiHop-RAG queries one at a time, {arrival} (15 chunks of <= {args.block_chars} chars)")
    print("TTFT in ms; cached = server-reported cached / prompt tokens; load = busiest target / mean\n")

    if "slots" not in skip:
        print(f"== one llama-server, {args.slots} slots (no RAM prompt cache) ==\n{HEADER}")
        rows = []
        for strategy, label in (
            ("retrieval", "retrieval order, server's slot choice"),
            ("trie", "ContextPilot order, server's slot choice"),
        ):
            with ExitStack() as stack:
                (server,) = servers.start(stack, 1, args.slots)
                rows.append(own_placement(server, items, strategy, label))
        for strategy, label in (
            ("retrieval", "retrieval order, id_slot routing"),
            ("trie", "ContextPilot order + id_slot routing"),
        ):
            with ExitStack() as stack:
                (server,) = servers.start(stack, 1, args.slots)
                targets = [Target(f"slot{n}", server.url, slot=n, engine="llamacpp") for n in range(args.slots)]
                rows.append(routed(targets, items, strategy, "cache_aware", label))
        for row in rows:
            print(row.row(rows[0]))

    if "replicas" not in skip:
        print(f"\n== {args.replicas} llama-server replicas, one slot each ==\n{HEADER}")
        rows = []
        for strategy, routing, label in (
            ("retrieval", "round_robin", "retrieval order, round-robin"),
            ("retrieval", "least_loaded", "retrieval order, least-loaded"),
            ("trie", "round_robin", "ContextPilot order, round-robin"),
            ("trie", "least_loaded", "ContextPilot order, least-loaded"),
            ("trie", "cache_aware", "ContextPilot order + routing"),
        ):
            with ExitStack() as stack:
                replicas = servers.start(stack, args.replicas)
                targets = [Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas)]
                rows.append(routed(targets, items, strategy, routing, label))
        for row in rows:
            print(row.row(rows[0]))

    if "bursts" not in skip:
        print(f"\n== bursts of {args.burst} concurrent requests, {args.replicas} replicas ==\n{HEADER}")
        rows = []
        for strategy, routing, batching, label in (
            ("retrieval", "round_robin", False, "retrieval order, round-robin"),
            ("trie", "cache_aware", False, "ContextPilot routing, no micro-batching"),
            ("trie", "cache_aware", True, "ContextPilot routing + micro-batching"),
        ):
            with ExitStack() as stack:
                replicas = servers.start(stack, args.replicas)
                targets = [Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas)]
                rows.append(bursts(targets, items, args.burst, strategy, routing, batching, label))
        for row in rows:
            print(row.row(rows[0]))

    if "simulator" not in skip:
        capacity = int(working_set_tokens(trace) * 0.25 / args.replicas)
        share = f"25%/{args.replicas}"
        caches = f"{args.replicas} caches of {share} each"
        print(f"\n== simulator: {len(trace):,} MultiHop queries one at a time, {arrival}, {caches} ==")
        print(f"{'':<44}{'hit':>8}{'load':>8}")
        for strategy, routing, label in (
            ("retrieval", "round_robin", "retrieval order, round-robin"),
            ("retrieval", "least_loaded", "retrieval order, least-loaded"),
            ("trie", "round_robin", "ContextPilot order, round-robin"),
            ("trie", "cache_aware", "ContextPilot order + routing"),
        ):
            result = replay_routed(trace, strategy, capacity, targets=args.replicas, routing=routing)
            print(f"{label:<44}{result.hit_ratio:>8.1%}{result.max_load_share:>8.2f}")


if __name__ == "__main__":
    main()
