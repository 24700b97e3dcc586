"""The NATS JetStream client that keeps one worker's index in step with the others.

:class:`SharedIndex` composes parts with one job each: the pilot's observer hook only
appends an entry to the :class:`~.outbox.Outbox` (so :meth:`ContextPilot.prepare` never
waits for the network); the :class:`~.connection.Connection` runs the client's own thread
and event loop, publishes the outbox in batches (one message per batch, a message id per
batch, so a retried publish is stored once) and hands every message of the stream, in
order, to the :class:`~.follower.Follower`, which checks it and applies it to the local
index; :class:`~.snapshots.Snapshots` loads the newest snapshot at start (the stream is
replayed after it) and writes one now and then. The settings are
:class:`~.options.SharedOptions`.

When the broker is unreachable the worker keeps preparing on its local view: entries
wait in the outbox (bounded by ``max_unsent``; the oldest go first, counted), the stats say
``shared_connected=False``, one warning is logged per outage, and once the broker is back
the entries go out and the stream is followed from where it was left.

Trust: every message is signed when it is published, bound to the stream's identity (its
name and creation time) and carrying the time it was signed by the broker's clock (each
session measures this worker's offset to it); a message that does not verify is never
applied, and the first one is logged; one stored long after it was signed (a copy) is not
applied either. A worker that reads only what it cannot verify says so
(``shared_status="unauthenticated"``) and writes no snapshot; snapshots are kept under the
name of the secret that signs them, so a worker with another secret never replaces them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..core.events import IndexEvent
from .apply import Applier
from .broker import BrokerClock
from .connection import Connection
from .entries import Entry, entry_of, evicted_ids
from .follower import Follower
from .options import SECRET_ENV, SharedOptions, redact
from .outbox import Outbox
from .replica import LockOf, Replica
from .snapshots import Snapshots

__all__ = ["SECRET_ENV", "SharedIndex", "SharedOptions", "redact"]

log = logging.getLogger("contextpilot_integrations.shared")


class SharedIndex:
    """Keeps ``pilot``'s index (a :class:`~.replica.Replica`) shared with every other worker of the same scope.

    The pilot owns it (``pilot.shared``) and is held only weakly: dropped, it is collected and its client
    stops (what is pending is sent first, briefly). After a fork (``gunicorn --preload``, ``multiprocessing``)
    the child gets a client of its own, with its own identity, started when the child first uses the pilot.
    """

    def __init__(self, pilot: Replica, options: SharedOptions, lock_of: LockOf | None = None) -> None:
        self.options = options
        self.applier = Applier(pilot, lock_of=lock_of)
        self.clock = BrokerClock()
        self.outbox = Outbox(options)
        self.follower = Follower(self.applier, options, self.clock, self._origin, self._pilot_gone)
        self.snapshots = Snapshots(options, self.applier, self.follower)
        self.connection = Connection(options, self.outbox, self.follower, self.snapshots, self.clock, self._drained)
        pilot.add_observer(self._observe)
        self.connection.start()
        self.connection.ready.wait(5.0)
        atexit.register(self._at_exit)  # a worker that exits normally sends what it learned last
        dropped = weakref.finalize(pilot, SharedIndex._pilot_dropped, self)
        dropped.atexit = False  # at exit, _at_exit sends what is pending before the process goes
        _CLIENTS.add(self)

    @property
    def pilot(self) -> Replica:
        return self.applier.pilot

    @property
    def origin(self) -> str:
        """This worker's identity on the log (a fresh one per process)."""
        return self.outbox.origin

    def _origin(self) -> str:
        return self.outbox.origin

    def on(self, kind: str, handler: Callable[..., None]) -> None:
        """Hand other workers' entries of ``kind`` (see :meth:`publish`) to ``handler``, on this client's thread."""
        self.applier.on(kind, handler)

    # ---- lifecycle -----------------------------------------------------------------------------
    def _at_exit(self) -> None:
        self.close(timeout=2.0)

    def _drained(self) -> None:
        atexit.unregister(self._at_exit)

    def _pilot_gone(self) -> None:
        self.connection.stopping = True  # the pilot was dropped while its client applied an entry

    @staticmethod
    def _pilot_dropped(client: SharedIndex) -> None:
        """The pilot was collected: stop without blocking the collector (pending entries go out
        first, for at most a couple of seconds; the process exiting meanwhile waits for them as long)."""
        client.connection.closed = True
        client.connection.drain_deadline = time.monotonic() + 2.0
        client.connection.stop()

    def _hold(self) -> list[Any]:
        """Before a fork: take the locks the client thread takes, so the child gets them free."""
        locks = self.applier.locks()
        for lock in locks:
            lock.acquire()
        return locks

    def _forked(self) -> None:
        """In a forked child: the parent's thread, connection and identity are not ours. The
        child keeps the index it inherited (and where in the stream it was), takes an identity
        of its own and starts its own client when first used. What the parent had not sent
        yet is the parent's to send."""
        self.outbox.forked()
        self.applier._lock = threading.Lock()
        self.connection.forked()

    # ---- the pilot's side (any thread, under the pilot's lock: quick) --------------------------
    def _observe(self, event: IndexEvent) -> None:
        self._queue(entry_of(event, time.time()))

    def publish(self, kind: str, *details: Any) -> None:
        """Publish an entry that is not an index event (a router's ``("stick", conversation_id,
        target)``); other workers hand it to the handler given to :meth:`on`."""
        self._queue((kind, *details, time.time()))

    def _queue(self, entry: Entry) -> None:
        """Append an entry to the outbox (not one this thread learned by applying the stream), and wake the thread."""
        if self.follower.is_applying():
            return
        if self.connection.thread is None:
            self.connection.start()  # a forked child's first request
        if evicted := evicted_ids(entry):
            self.applier.remember_evicted(evicted)
        self.outbox.append(entry)
        self.connection.nudge()

    # ---- what it says --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """What :meth:`ContextPilot.stats` reports (connected: this process's client runs, the
        broker answers, and what other workers publish verifies under this worker's secret)."""
        state = self._state()
        return {
            "shared_connected": state == "connected",
            "shared_status": state,
            "shared_unsent": self.unsent,
            "shared_applied": self.applier.applied,
            "shared_rejected": self.follower.rejected,
            "shared_behind": self.follower.behind,
            "shared_lag_seconds": self.follower.newest_lag(),
        }

    def _state(self) -> str:
        connection = self.connection
        running = connection.running()
        if connection.closed or not running:
            return "closed"
        if not connection.connected:
            return "refused" if connection.refused else "unreachable"
        if not self.follower.authenticated:
            return "unauthenticated"  # it read only what it cannot verify: its secret is likely not theirs
        return "connected"

    @property
    def unsent(self) -> int:
        return self.outbox.unsent

    def details(self) -> dict[str, Any]:
        """Everything this client counts (for logs and benchmarks)."""
        follower, outbox = self.follower, self.outbox
        lags = sorted(follower.lags)
        return {
            **self.status(),
            "origin": self.origin,
            "subject": self.options.subject,
            "stream_id": follower.stream_id,
            "applied_seq": follower.seq,
            "stream_last_seq": follower.last,
            "snapshot_seq": self.snapshots.seq,
            "published_entries": outbox.published,
            "dropped_unsent": outbox.dropped,
            "dropped_oversize": outbox.oversize,
            "rejected_messages": follower.rejected,
            "malformed_messages": follower.malformed,
            "replayed_messages": follower.replayed,
            "stale_messages": follower.stale,
            "stream_gaps": follower.gaps,
            "skipped": self.applier.skipped,
            "lag_ms_p50": 1000 * lags[len(lags) // 2] if lags else None,
            "lag_ms_p99": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None,
            "clock_offset_ms": 1000 * self.clock.offset,
        }

    def lags(self) -> list[float]:
        """Seconds from another worker learning an entry to this one applying it (recent ones),
        both times by the broker's clock: a worker's clock set wrong does not show here."""
        return list(self.follower.lags)

    def clear_lags(self) -> None:
        self.follower.lags.clear()

    # ---- waiting, closing ----------------------------------------------------------------------
    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout``) until every entry of this worker is acknowledged."""
        self.connection.running()
        deadline = time.monotonic() + timeout
        while self.outbox.unsent or self.outbox.inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def wait_caught_up(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout``) until this worker applied everything the stream held
        when called. A worker that starts can call it before serving."""
        connection = self.connection
        connection.running()
        deadline = time.monotonic() + timeout
        if not connection.started.wait(max(0.0, deadline - time.monotonic())):
            return False
        target = connection.call(self.follower.newest(connection.js), deadline)
        if not isinstance(target, int):
            return False
        while self.follower.seq < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is pending (for at most ``timeout``), then stop the thread. What could
        not be sent is logged (other workers will not learn it)."""
        atexit.unregister(self._at_exit)
        connection = self.connection
        connection.closed = True
        pilot = self.applier._pilot()
        if pilot is not None:
            pilot.remove_observer(self._observe)
        down = connection.warned or connection.refused is not None
        if (connection.connected or not down) and connection.thread is not None and connection.thread.is_alive():
            self.flush(timeout)  # connected, or still connecting: not known to be down
        if self.unsent:
            log.warning(
                "shared index: %d entries of %s not sent at close (the broker at %s %s); other workers will not "
                "learn them",
                self.unsent,
                self.options.subject,
                redact(self.options.url),
                "refuses the stream" if connection.refused else "unreachable",
            )
        connection.stop()
        if connection.thread is not None and connection.thread is not threading.current_thread():
            connection.thread.join(timeout)


_CLIENTS: weakref.WeakSet[SharedIndex] = weakref.WeakSet()
_forking = threading.local()  # the locks the forking thread took (two threads may fork at once)


def _before_fork() -> None:
    _forking.held = [lock for client in list(_CLIENTS) for lock in client._hold()]


def _release_held() -> None:
    held = getattr(_forking, "held", [])
    while held:
        held.pop().release()


def _after_fork_in_child() -> None:
    _release_held()
    for client in list(_CLIENTS):
        if not client.connection.closed:
            client._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_release_held, after_in_child=_after_fork_in_child)
