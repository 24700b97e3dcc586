"""One application worker in its own process, sharing its pilot's index through NATS.

The tests drive it over a pipe: ("prepare", first, count) sends requests of random blocks
(ids ``w<n>-<i>``, a fixed seed per worker), ("evict", ids), ("truncate", id, n), ("reset",),
("state", timeout) answers with the index after catching up, ("stats",), ("flush", timeout),
("exit",). A worker can run with its clock set wrong (``clock_offset``). Every answer is a tuple (ok, value).
"""

from __future__ import annotations

import random
from multiprocessing.connection import Connection
from typing import Any

BLOCKS = [f"doc{n}" for n in range(24)]


def request_blocks(worker: int, index: int) -> list[dict[str, Any]]:
    rng = random.Random(worker * 100_003 + index)
    return [{"id": b, "text": b, "tokens": 10} for b in rng.sample(BLOCKS, 5)]


def run(worker: int, url: str, snapshot_interval: float, pipe: Connection, clock_offset: float = 0.0) -> None:
    """``clock_offset``: seconds this process's wall clock is off (a machine set wrong)."""
    if clock_offset:
        import time

        real = time.time
        time.time = lambda: real() + clock_offset
    from contextpilot_integrations import ContextPilot
    from contextpilot_integrations.shared import SharedOptions

    pilot = ContextPilot(shared=SharedOptions(url=url, snapshot_interval=snapshot_interval))
    shared = pilot.shared
    pipe.send((True, shared.wait_caught_up(20.0)))
    while True:
        command, *args = pipe.recv()
        try:
            if command == "prepare":
                first, count = args
                sent = {}
                for index in range(first, first + count):
                    prepared = pilot.prepare(request_blocks(worker, index), "q", request_id=f"w{worker}-{index}")
                    sent[prepared.request_id] = ()
                indexed = dict(pilot.live_orders())  # the index's keys: plain or labelled blocks
                pipe.send((True, {rid: indexed[rid] for rid in sent}))
            elif command == "evict":
                pipe.send((True, pilot.evict(args[0])))
            elif command == "reset":
                pilot.reset()
                pipe.send((True, None))
            elif command == "truncate":
                pipe.send((True, pilot.truncate(args[0], args[1])))
            elif command == "flush":
                pipe.send((True, shared.flush(args[0])))
            elif command == "state":
                caught_up = shared.wait_caught_up(args[0])
                pipe.send((caught_up, dict(pilot.live_orders())))
            elif command == "stats":
                pipe.send((True, (pilot.stats().model_dump(), shared.details())))
            elif command == "exit":
                shared.close()
                pipe.send((True, None))
                return
            else:
                pipe.send((False, f"unknown command {command}"))
        except Exception as exc:  # the test sees it
            pipe.send((False, repr(exc)))
