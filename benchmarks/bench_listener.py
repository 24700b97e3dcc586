"""The eviction callback server under load (a script, not a test).

Prints, in one run:
  1. concurrent clients: N clients POST /evict at the same instant; how many are served;
  2. sustained events: 2 publishers x 50 batches/s x 100 events (10,000 events/s) for
     ``--seconds``; events applied, lost, and publish -> applied latency p50 / p99;
  3. the most events/s the server applies (publishers sending back to back);
  4. /health latency while 1,000 idle sockets are open (they are closed oldest first at the
     connection bound, so a new client is still served).

Usage: python benchmarks/bench_listener.py [--clients 200] [--seconds 10]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import httpx

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines import EvictionListener


def concurrent_clients(clients: int) -> tuple[int, int, float]:
    pilot = ContextPilot()
    ids = [pilot.prepare([f"document {i}"], "q").request_id for i in range(clients)]
    with EvictionListener(pilot) as listener:
        barrier = threading.Barrier(clients)
        codes: list[int] = []

        def client(rid: str) -> None:
            barrier.wait()
            try:
                with httpx.Client(timeout=30) as http:
                    codes.append(http.post(listener.url + "/evict", json={"request_ids": [rid]}).status_code)
            except httpx.HTTPError:
                codes.append(0)

        threads = [threading.Thread(target=client, args=(rid,)) for rid in ids]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return codes.count(200), clients, time.perf_counter() - started


def batches(name: str, seq: int, base: int, events: int) -> dict[str, object]:
    stored = [
        {"type": "BlockStored", "block_hashes": [base + seq * events + i], "token_ids": [i], "block_size": 1}
        for i in range(events)
    ]
    return {"seq": seq, "publisher": name, "ts": time.time(), "events": stored}


def sustained(seconds: float, rate_per_sender: float | None) -> tuple[int, int, float, float | None, float | None]:
    """Two publishers; ``rate_per_sender`` batches/s each (None: as fast as possible)."""
    with EvictionListener(ContextPilot()) as listener:
        sent = [0, 0]

        def sender(index: int) -> None:
            with httpx.Client(timeout=30) as http:
                start = time.monotonic()
                seq = 0
                while time.monotonic() - start < seconds:
                    response = http.post(listener.kv_events_url, json=batches(f"s{index}", seq, index * 10**12, 100))
                    if response.status_code == 200:
                        sent[index] += 100
                    seq += 1
                    if rate_per_sender:
                        delay = start + seq / rate_per_sender - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)

        started = time.perf_counter()
        threads = [threading.Thread(target=sender, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
        stats = listener.sink.stats()
        return sum(sent), stats.events, elapsed, stats.latency_p50_ms, stats.latency_p99_ms


def health_with_idle_sockets(idle: int) -> tuple[float, float, int]:
    with EvictionListener(ContextPilot()) as listener:
        host, port = listener._server.server_address[:2]
        sockets = [socket.create_connection((host, port)) for _ in range(idle)]
        try:
            time.sleep(0.3)
            timings = []
            for _ in range(20):
                start = time.perf_counter()
                httpx.get(listener.url + "/health", timeout=10).raise_for_status()
                timings.append(time.perf_counter() - start)
            closed = listener.sink.stats().idle_connections_closed
        finally:
            for sock in sockets:
                sock.close()
    return statistics.median(timings) * 1e3, max(timings) * 1e3, closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    served, clients, elapsed = concurrent_clients(args.clients)
    print(f"concurrent clients: {served}/{clients} served ({served / clients:.0%}) in {elapsed:.2f} s")

    sent, applied, elapsed, p50, p99 = sustained(args.seconds, rate_per_sender=50)
    print(
        f"sustained 10,000 events/s for {args.seconds:.0f} s: {applied:,}/{sent:,} applied "
        f"({applied / elapsed:,.0f} events/s held, {sent - applied} lost); "
        f"publish -> applied p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    sent, applied, elapsed, p50, p99 = sustained(min(args.seconds, 5.0), rate_per_sender=None)
    print(f"as fast as 2 publishers can send: {applied / elapsed:,.0f} events/s applied, p99 {p99:.1f} ms")

    median, worst, closed = health_with_idle_sockets(1_000)
    print(f"/health with 1,000 idle sockets open: median {median:.1f} ms, max {worst:.1f} ms ({closed} idle closed)")


if __name__ == "__main__":
    main()
