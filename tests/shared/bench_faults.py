"""Figures for issue 40 (faults and trust, round four), against a real nats-server on 127.0.0.1.

Not a test (no asserts on speed): prints what the closing note quotes.

1. a worker with the wrong secret: its status, and how many of 41 requests a worker starting
   later learns (the stream keeps 5 messages; the snapshot holds the rest);
2. a rolling deploy to a new secret: how many of 10 requests the first new worker knows;
3. ``SharedOptions(max_age=60)``: refused with its reason, or shares;
4. ``prepare`` latency on a serving worker while another worker process publishes eight signed
   entries of 87,040 blocks each (~0.7 MB), and this process's memory growth;
5. the lag a worker reports when a worker's clock is a year off (each direction).

Usage: python tests/shared/bench_faults.py
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from typing import Any

os.environ.setdefault("CONTEXTPILOT_SHARED_SECRET", secrets.token_hex(16))

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SharedOptions
from contextpilot_integrations.shared.server import NatsServer

WAIT = 60.0
YEAR = 365 * 86_400
DOCS = [{"id": f"d{n}", "text": f"document {n} " * 10, "tokens": 30} for n in range(40)]


def request(n: int, width: int = 3) -> list[dict[str, Any]]:
    return [DOCS[(n + k) % len(DOCS)] for k in range(width)]


def until(condition: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def wrong_secret() -> None:
    with NatsServer() as broker:
        options = {"url": broker.url, "max_entries": 5}
        writer = ContextPilot(shared=SharedOptions(**options, snapshot_interval=0.2))
        writer.shared.wait_caught_up(WAIT)
        for n in range(41):
            writer.prepare(request(n), "q", request_id=f"r{n}")
            writer.shared.flush(WAIT)
        until(lambda: writer.shared.details()["snapshot_seq"] >= 41, WAIT)
        writer.shared.close(timeout=2)
        wrong = ContextPilot(
            shared=SharedOptions(**options, snapshot_interval=0.2, secret="not the deployment's secret 0123")
        )
        wrong.shared.wait_caught_up(WAIT)
        until(lambda: wrong.shared.details()["snapshot_seq"] > 0, 3.0)
        stats = wrong.stats()
        late = ContextPilot(shared=SharedOptions(**options, snapshot_interval=0))
        late.shared.wait_caught_up(WAIT)
        print(
            f"1. wrong secret: shared_connected={stats.shared_connected} "
            f"status={getattr(stats, 'shared_status', None)}; a worker starting later learns "
            f"{len(late.live_request_ids())}/41 requests"
        )
        for pilot in (wrong, late):
            pilot.shared.close(timeout=2)


def rotation() -> None:
    old, new = "the old secret of this deployment", "the new secret of this deployment"
    with NatsServer() as broker:
        before = ContextPilot(shared=SharedOptions(url=broker.url, secret=old, snapshot_interval=0))
        before.shared.wait_caught_up(WAIT)
        for n in range(10):
            before.prepare(request(n), "q", request_id=f"o{n}")
        before.shared.flush(WAIT)
        try:
            options = SharedOptions(url=broker.url, secret=[new, old], snapshot_interval=0)
        except Exception as exc:  # no rotation: the new secret alone
            print(f"   (a list of secrets refused: {type(exc).__name__})")
            options = SharedOptions(url=broker.url, secret=new, snapshot_interval=0)
        rolled = ContextPilot(shared=options)
        rolled.shared.wait_caught_up(WAIT)
        print(f"2. rolling deploy to a new secret: the new worker knows {len(rolled.live_request_ids())}/10")
        for pilot in (before, rolled):
            pilot.shared.close(timeout=2)


def short_max_age() -> None:
    try:
        SharedOptions(url="nats://127.0.0.1:4222", max_age=60)
        print("3. SharedOptions(max_age=60): accepted")
    except Exception as exc:
        print(f"3. SharedOptions(max_age=60): refused: {exc}")
    with NatsServer() as broker:
        try:
            pilot = ContextPilot(shared=SharedOptions(url=broker.url, max_age=60, snapshot_interval=30))
        except Exception as exc:
            print(f"   max_age=60, snapshot_interval=30: refused: {exc}")
            return
        print(f"   max_age=60, snapshot_interval=30: caught up in 10 s: {pilot.shared.wait_caught_up(10)}")
        pilot.shared.close(timeout=1)


PUBLISHER = """
import sys
from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SharedOptions
pilot = ContextPilot(shared=SharedOptions(url=sys.argv[1], snapshot_interval=0))
pilot.shared.wait_caught_up(60)
for e in range(8):
    pilot.shared.publish("sent", f"big{e}", [f"{e}-{n:05d}" for n in range(87_040)], [])
print(pilot.shared.flush(120))
pilot.shared.close(timeout=5)
"""


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def big_entries() -> None:
    with NatsServer() as broker:
        serving = ContextPilot(shared=SharedOptions(url=broker.url, snapshot_interval=0), max_live_requests=100_000)
        serving.shared.wait_caught_up(WAIT)
        for n in range(200):
            serving.prepare(request(n, 5), "q", request_id=f"warm{n}")
        latencies: list[float] = []
        stop = threading.Event()

        def serve() -> None:
            n = 0
            while not stop.is_set():
                start = time.perf_counter()
                serving.prepare(request(n, 5), "q", request_id=f"p{n}")
                latencies.append(time.perf_counter() - start)
                n += 1
                time.sleep(0.0005)

        before = rss_mb()
        thread = threading.Thread(target=serve)
        thread.start()
        subprocess.run([sys.executable, "-c", PUBLISHER, broker.url], check=True, timeout=600, capture_output=True)
        until(lambda: serving.shared.applier.applied >= 8, 300)
        time.sleep(0.5)
        stop.set()
        thread.join()
        ms = [1000 * value for value in sorted(latencies)]
        print(
            f"4. prepare while 8 entries of 87,040 blocks are applied: n={len(ms)} p50={ms[len(ms) // 2]:.2f} ms "
            f"p99={ms[int(0.99 * len(ms))]:.1f} ms max={ms[-1]:.1f} ms; memory +{rss_mb() - before:.0f} MB "
            f"(applied {serving.shared.applier.applied})"
        )
        serving.shared.close(timeout=2)


SKEWED = """
import sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[2])
from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SharedOptions
pilot = ContextPilot(shared=SharedOptions(url=sys.argv[1], snapshot_interval=0))
pilot.shared.wait_caught_up(60)
for n in range(50):
    pilot.prepare([{"id": f"s{n}", "text": "x", "tokens": 3}], "q", request_id=f"skewed{sys.argv[2]}-{n}")
    time.sleep(0.01)
pilot.shared.flush(60)
print(pilot.shared.wait_caught_up(60) and pilot.shared.details()["lag_ms_p50"])
pilot.shared.close(timeout=2)
"""


def clocks() -> None:
    with NatsServer() as broker:
        right = ContextPilot(shared=SharedOptions(url=broker.url, snapshot_interval=0))
        right.shared.wait_caught_up(WAIT)
        for offset in (YEAR, -YEAR):
            right.shared.clear_lags()
            feeder = threading.Thread(target=lambda: [  # entries for the skewed worker to apply
                (right.prepare(request(n), "q"), time.sleep(0.01)) for n in range(100)
            ])  # fmt: skip
            feeder.start()
            done = subprocess.run(
                [sys.executable, "-c", SKEWED, broker.url, str(offset)], timeout=300, capture_output=True, text=True
            )
            feeder.join()
            right.shared.wait_caught_up(WAIT)
            print(
                f"5. a worker's clock {offset / YEAR:+.0f} year: the right worker reports lag p50 "
                f"{right.shared.details()['lag_ms_p50']} ms; the skewed worker reports "
                f"{done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]} ms"
            )
        right.shared.close(timeout=2)


if __name__ == "__main__":
    wrong_secret()
    rotation()
    short_max_age()
    big_entries()
    clocks()
