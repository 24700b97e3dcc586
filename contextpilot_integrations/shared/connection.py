"""The client's own thread: its event loop and its sessions with the broker.

:meth:`ContextPilot.prepare` never waits for the network: the thread publishes what the
:class:`~.outbox.Outbox` holds and hands the stream's messages to the
:class:`~.follower.Follower`. Each session opens the stream, measures the broker's clock,
loads the newest snapshot once, subscribes from where the follower is, then publishes,
writes snapshots and measures the clock again until the connection goes. When the broker
is unreachable (or refuses the stream) it says so once per outage and tries again, backing
off; the worker keeps preparing on its own view meanwhile. Stopping, it sends what is
pending first, for a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from .broker import BrokerClock, Refused, open_stream, stream_facts
from .follower import Follower
from .options import SharedOptions, names_credentials, redact
from .outbox import Outbox
from .snapshots import Snapshots

__all__ = ["Connection"]

log = logging.getLogger("contextpilot_integrations.shared")

_CLOCK_EVERY = 30.0  # seconds between measures of the offset to the broker's clock


class Connection:
    """The thread that connects to the broker, publishes ``outbox`` and follows the stream.

    ``drained``: called when the thread ends after the pilot was dropped (nothing left to
    send at exit).
    """

    def __init__(
        self,
        options: SharedOptions,
        outbox: Outbox,
        follower: Follower,
        snapshots: Snapshots,
        clock: BrokerClock,
        drained: Callable[[], None],
    ) -> None:
        self.options, self.outbox, self.follower, self.snapshots, self.clock = (
            options,
            outbox,
            follower,
            snapshots,
            clock,
        )
        self._drained = drained
        self.closed = False
        self.connected = False
        self.warned = False  # the broker is down, and it was said
        self.refused: str | None = None  # the broker's reason for refusing the stream, while it does
        self.js: Any = None  # the session's JetStream context
        self.fresh()

    def fresh(self) -> None:
        """The state of a thread not started yet (at start, and in a forked child)."""
        self.idle = False
        self.stopping = False
        self.drain_deadline = 0.0  # stopping: keep trying to send what is pending until then
        self.loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self.ready = threading.Event()  # the loop exists
        self.started = threading.Event()  # the snapshot (if any) was applied and the stream followed
        self._start_lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def forked(self) -> None:
        """In a forked child: the parent's thread and connection are not ours."""
        self.connected = False
        self.warned = False
        self.fresh()

    def start(self) -> None:
        with self._start_lock:
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(
                    target=self._main, name=f"contextpilot-shared-{self.options.scope}", daemon=True
                )
                self.thread.start()

    def running(self) -> bool:
        """Whether this process's thread runs (started now if this is a forked child)."""
        if self.thread is None:
            self.start()
        return self.thread is not None and self.thread.is_alive()

    def nudge(self) -> None:
        """Wake the thread if it sleeps with nothing to do (an entry was queued)."""
        if self.idle and self.loop is not None and self._wake is not None:
            self.idle = False
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self._wake.set)

    def stop(self) -> None:
        self.stopping = True
        loop = self.loop
        if loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake.set)

    def call(self, coro: Any, deadline: float) -> Any:
        """Run ``coro`` on the thread's loop; its result, or ``None`` (stopped, failed, past ``deadline``)."""
        loop = self.loop
        if loop is None or self.stopping:
            coro.close()
            return None
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(max(0.01, deadline - time.monotonic()))
        except Exception:
            future.cancel()
            return None

    # ---- the thread ----------------------------------------------------------------------------
    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        self._wake = asyncio.Event()
        self.ready.set()
        try:
            loop.run_until_complete(self._run())
        finally:
            pending = asyncio.all_tasks(loop)  # the client's own tasks (heartbeat checks) end with it
            for task in pending:
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            with contextlib.suppress(Exception):
                loop.run_until_complete(loop.shutdown_asyncgens())
            self.loop = None
            self.connected = False
            loop.close()

    def _down(self, error: object) -> None:
        self.connected = False
        if not self.warned:
            self.warned = True
            log.warning(
                "shared index: the broker at %s is unreachable (%s); preparing on this worker's own view until "
                "it is back",
                redact(self.options.url),
                type(error).__name__ if names_credentials(error, self.options) else error,
            )

    def _refuse(self, reason: str) -> None:
        """The broker answers but refuses the stream: said once, with its reason (not as "unreachable")."""
        self.connected = False
        if self.refused != reason:
            log.warning(
                "shared index: the broker at %s refuses the stream %s: %s; preparing on this worker's own view (fix "
                "the stream on the broker, or this worker's SharedOptions)",
                redact(self.options.url),
                self.options.stream,
                reason,
            )
        self.refused = reason

    def _up(self) -> None:
        self.connected = True
        self.refused = None
        if self.warned:
            self.warned = False
            log.warning("shared index: the broker at %s is back; catching up", redact(self.options.url))

    async def _run(self) -> None:
        import nats  # the optional dependency: imported only when sharing is on

        backoff = 0.1
        while not self.stopping or self._draining():
            nc = None
            try:
                nc = await asyncio.wait_for(
                    nats.connect(
                        self.options.url,
                        connect_timeout=2,
                        allow_reconnect=False,  # this loop reconnects, and resubscribes from where it was
                        max_reconnect_attempts=1,  # the client's own first-connect retries: few and quick
                        reconnect_time_wait=0.1,
                        error_cb=self._quiet,
                        disconnected_cb=self._quiet_cb,
                        closed_cb=self._quiet_cb,
                        **self.options.connect_options(),
                    ),
                    5.0,
                )
                await self._session(nc)
                backoff = 0.1
            except Refused as exc:
                self._refuse(str(exc))
            except Exception as exc:
                self._down(exc)
            finally:
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(nc.close(), 2)
            if self.stopping and not self._draining():
                break
            self.connected = False
            await self._sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        if self.drain_deadline:
            self._drained()  # drained: nothing left to wait for at exit
        if self.drain_deadline and self.outbox.unsent:
            log.warning(
                "shared index: %d entries of %s not sent (the pilot was dropped and the broker at %s did not take "
                "them in time); other workers will not learn them",
                self.outbox.unsent,
                self.options.subject,
                redact(self.options.url),
            )

    def _draining(self) -> bool:
        return bool(self.outbox.unsent) and time.monotonic() < self.drain_deadline

    async def _quiet(self, _error: Exception) -> None:
        return None

    async def _quiet_cb(self) -> None:
        return None

    async def _sleep(self, seconds: float) -> None:
        """Sleep until woken (an entry queued, close) or ``seconds`` passed."""
        assert self._wake is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    async def _publish(self, js: Any, nc: Any) -> None:
        assert self.follower.stream_id is not None
        await self.outbox.publish(js, nc.max_payload, self.follower.stream_id, self.clock)

    async def _session(self, nc: Any) -> None:
        js = nc.jetstream()
        options, follower, snapshots = self.options, self.follower, self.snapshots
        await open_stream(js, options)
        facts = await stream_facts(nc, js, options.stream, self.clock)
        follower.at(facts)
        if self.stopping:  # the pilot was dropped: send what is pending, follow nothing
            await asyncio.wait_for(self._publish(js, nc), 2.0)
            return
        store = await snapshots.store(js)
        if not snapshots.loaded and store is not None:
            await snapshots.load(store, facts.last_seq)
            snapshots.loaded = True
        follower.check_gap(facts.first_seq)
        subscription = await follower.subscribe(js)
        self.js = js
        self._up()
        self.started.set()
        next_snapshot = time.monotonic() + options.snapshot_interval * (0.5 + secrets.randbelow(1000) / 1000)
        next_clock = time.monotonic() + _CLOCK_EVERY
        try:
            while not self.stopping and nc.is_connected:
                await self._publish(js, nc)
                if store is not None and options.snapshot_interval > 0 and time.monotonic() >= next_snapshot:
                    next_snapshot = time.monotonic() + options.snapshot_interval
                    await snapshots.write(store)
                if time.monotonic() >= next_clock or follower.measure_clock:  # clocks drift, or were set
                    next_clock, follower.measure_clock = time.monotonic() + _CLOCK_EVERY, False
                    if (await stream_facts(nc, js, options.stream, self.clock)).identity != follower.stream_id:
                        return  # made again meanwhile: a new session follows the new stream
                self.idle = True  # first: an entry queued from now on wakes the loop
                if not self.outbox.waiting:
                    await self._sleep(0.25)
                self.idle = False
            if not self.stopping:
                raise ConnectionError("connection lost")
            with contextlib.suppress(Exception):  # stopping: what is pending goes out, briefly
                await asyncio.wait_for(self._publish(js, nc), 2.0)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(subscription.unsubscribe(), 1)
