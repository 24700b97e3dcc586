"""The NATS JetStream client that keeps one worker's index in step with the others.

It runs on its own thread with its own event loop, so :meth:`ContextPilot.prepare` never
waits for the network: the pilot's observer hook only appends the entry to a deque. The
thread publishes the entries in batches (one message per batch, a message id per batch,
so a retried publish is stored once) and applies every message of the stream, in order,
to the local index. At start it loads the newest snapshot from the object store and
replays the stream after it; it writes a snapshot itself now and then.

When the broker is unreachable the worker keeps preparing on its local view: entries
wait in the deque (bounded by ``max_unsent``; the oldest go first, counted), the stats say
``shared_connected=False``, one warning is logged per outage, and once the broker is back
the entries go out and the stream is followed from where it was left.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import re
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .apply import Applier
from .entries import Batch, Entry, decode_batch, encode_batch

if TYPE_CHECKING:
    from ..pilot import ContextPilot

__all__ = ["SharedIndex", "SharedOptions"]

log = logging.getLogger("contextpilot_integrations.shared")

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class SharedOptions:
    """Where and how a pilot shares its index.

    Args:
        url: the NATS server (``nats://host:port``; several comma-separated for a cluster).
        scope: the engine this pilot models: pilots with the same scope share one index
            (a router's pilots use their target names).
        stream: the JetStream stream holding every scope's log.
        max_age: seconds an entry stays in the stream (bounded retention; the snapshots
            cover what is older).
        max_entries: messages the stream keeps at most (the oldest go first).
        snapshot_interval: seconds between this worker's snapshots (0: never).
        max_unsent: entries kept while the broker is unreachable (the oldest dropped after).
        batch_entries: entries per message at most.
    """

    url: str = "nats://127.0.0.1:4222"
    scope: str = "default"
    stream: str = "CONTEXTPILOT"
    max_age: float = 3600.0
    max_entries: int = 1_000_000
    snapshot_interval: float = 60.0
    max_unsent: int = 1_000_000
    batch_entries: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("nats://", "tls://", "ws://", "wss://")):
            raise ValueError(f"shared: expected a nats:// URL, got {self.url!r}")
        if not isinstance(self.scope, str) or not self.scope:
            raise ValueError("shared scope must be a non-empty str")
        if self.max_unsent < 1 or self.batch_entries < 1 or self.max_entries < 1:
            raise ValueError("max_unsent, batch_entries and max_entries must be at least 1")

    @property
    def subject(self) -> str:
        return f"contextpilot.{self.stream.lower()}.{_TOKEN.sub('_', self.scope)}"

    @property
    def snapshot_name(self) -> str:
        return f"{self.stream}-{_TOKEN.sub('_', self.scope)}"


_BUCKET = "contextpilot-snapshots"


class SharedIndex:
    """Keeps ``pilot``'s index shared with every other worker of the same scope."""

    def __init__(self, pilot: ContextPilot, options: SharedOptions) -> None:
        self.pilot = pilot
        self.options = options
        self.origin = secrets.token_hex(6)
        self.applier = Applier(pilot)
        self._outbox: deque[Entry] = deque()
        self._numbers = itertools.count()
        self._messages: deque[Batch] = deque()  # encoded batches waiting for the broker, in order
        self._local = threading.local()
        self._connected = False
        self._warned = False
        self._dropped = 0
        self._gaps = 0
        self._seq = 0  # last stream sequence applied
        self._stream_last = 0  # the stream's last sequence, as last seen
        self._snapshot_seq = 0
        self._published = 0
        self._lags: deque[float] = deque(maxlen=20_000)
        self._idle = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()  # the loop exists
        self._started = threading.Event()  # the snapshot (if any) was applied and the stream followed
        self._thread = threading.Thread(target=self._main, name=f"contextpilot-shared-{options.scope}", daemon=True)
        pilot.add_observer(self._observe)
        self._thread.start()
        self._ready.wait(5.0)
        atexit.register(self._at_exit)  # a worker that exits normally sends what it learned last

    def _at_exit(self) -> None:
        self.close(timeout=2.0)

    # ---- the pilot's side (any thread, under the pilot's lock: quick) --------------------------
    def _observe(self, kind: str, *details: Any) -> None:
        if getattr(self._local, "applying", False):
            return
        if kind == "evicted":
            self.applier.remember_evicted(details[0])
        self._outbox.append((kind, *details, time.time()))
        if len(self._outbox) > self.options.max_unsent:
            self._outbox.popleft()
            self._dropped += 1
        if self._idle and self._loop is not None and self._wake is not None:
            self._idle = False
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._wake.set)

    def publish(self, kind: str, *details: Any) -> None:
        """Publish an entry that is not an index event (a router's ``("stick",
        conversation_id, target)``); other workers hand it to ``applier.handlers[kind]``."""
        self._observe(kind, *details)

    def status(self) -> dict[str, Any]:
        """What :meth:`ContextPilot.stats` reports."""
        return {
            "shared_connected": self._connected,
            "shared_unsent": self.unsent,
            "shared_applied": self.applier.applied,
        }

    @property
    def unsent(self) -> int:
        return len(self._outbox) + sum(len(batch.entries) for batch in list(self._messages))

    def details(self) -> dict[str, Any]:
        """Everything this client counts (for logs and benchmarks)."""
        lags = sorted(self._lags)
        return {
            **self.status(),
            "origin": self.origin,
            "subject": self.options.subject,
            "applied_seq": self._seq,
            "stream_last_seq": self._stream_last,
            "snapshot_seq": self._snapshot_seq,
            "published_entries": self._published,
            "dropped_unsent": self._dropped,
            "stream_gaps": self._gaps,
            "skipped": self.applier.skipped,
            "lag_ms_p50": 1000 * lags[len(lags) // 2] if lags else None,
            "lag_ms_p99": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None,
        }

    def lags(self) -> list[float]:
        """Seconds from another worker learning an entry to this one applying it (recent ones)."""
        return list(self._lags)

    def clear_lags(self) -> None:
        self._lags.clear()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout``) until every entry of this worker is acknowledged."""
        deadline = time.monotonic() + timeout
        while self.unsent or self._inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def wait_caught_up(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout``) until this worker applied everything the stream held
        when called. A worker that starts can call it before serving."""
        deadline = time.monotonic() + timeout
        if not self._started.wait(max(0.0, deadline - time.monotonic())):
            return False
        target = self._call(self._last_seq(), deadline)
        if not isinstance(target, int):
            return False
        while self._seq < target:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is pending (for at most ``timeout``), then stop the thread."""
        atexit.unregister(self._at_exit)
        self.pilot.remove_observer(self._observe)
        if self._connected:
            self.flush(timeout)
        self._stopping = True
        loop = self._loop
        if loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(timeout)

    # ---- the thread ----------------------------------------------------------------------------
    _inflight = 0

    def _call(self, coro: Any, deadline: float) -> Any:
        loop = self._loop
        if loop is None or self._stopping:
            coro.close()
            return None
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(max(0.01, deadline - time.monotonic()))
        except Exception:
            future.cancel()
            return None

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._wake = asyncio.Event()
        self._ready.set()
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
            self._loop = None
            loop.close()

    def _down(self, error: object) -> None:
        self._connected = False
        if not self._warned:
            self._warned = True
            log.warning(
                "shared index: the broker at %s is unreachable (%s); preparing on this worker's own view until "
                "it is back",
                self.options.url,
                error,
            )

    def _up(self) -> None:
        self._connected = True
        if self._warned:
            self._warned = False
            log.warning("shared index: the broker at %s is back; catching up", self.options.url)

    async def _run(self) -> None:
        import nats  # the optional dependency: imported only when sharing is on

        backoff = 0.1
        while not self._stopping:
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
                    ),
                    5.0,
                )
                await self._session(nc)
                backoff = 0.1
            except Exception as exc:
                self._down(exc)
            finally:
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(nc.close(), 2)
            if self._stopping:
                break
            self._connected = False
            await self._sleep(backoff)
            backoff = min(backoff * 2, 2.0)

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

    async def _session(self, nc: Any) -> None:
        from nats.js import api

        js = nc.jetstream()
        options = self.options
        config = api.StreamConfig(
            name=options.stream,
            subjects=[f"contextpilot.{options.stream.lower()}.>"],
            storage=api.StorageType.FILE,
            max_age=options.max_age,
            max_msgs=options.max_entries,
            duplicate_window=120.0,
        )
        try:
            info = await js.add_stream(config)
        except Exception:
            info = await js.stream_info(options.stream)  # made by another worker with other limits: use it
        if info.state.last_seq < self._seq:  # a new, empty broker: follow its stream from the start
            self._seq = 0
        elif self._seq and info.state.first_seq > self._seq + 1:
            self._gaps += 1  # retention dropped entries this worker never saw (the snapshot was older)
            log.warning("shared index: %s entries expired before this worker read them", options.subject)
        self._stream_last = info.state.last_seq
        store = await self._object_store(js)
        if not self._started.is_set() and store is not None:
            await self._load_snapshot(store)
        subscription = await js.subscribe(
            options.subject,
            cb=self._on_message,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if self._seq else api.DeliverPolicy.ALL,
                opt_start_seq=self._seq + 1 if self._seq else None,
            ),
        )
        self._js = js
        self._up()
        self._started.set()
        next_snapshot = time.monotonic() + options.snapshot_interval * (0.5 + secrets.randbelow(1000) / 1000)
        try:
            while not self._stopping and nc.is_connected:
                await self._publish_pending(js)
                if store is not None and options.snapshot_interval > 0 and time.monotonic() >= next_snapshot:
                    next_snapshot = time.monotonic() + options.snapshot_interval
                    await self._write_snapshot(store)
                self._idle = True  # first: an entry queued from now on wakes the loop
                if not self._outbox and not self._messages:
                    await self._sleep(0.25)
                self._idle = False
            if not self._stopping:
                raise ConnectionError("connection lost")
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(subscription.unsubscribe(), 1)

    async def _last_seq(self) -> int:
        """The stream sequence of this scope's newest message (0: none)."""
        try:
            message = await self._js.get_last_msg(self.options.stream, self.options.subject)
        except Exception as exc:
            if type(exc).__name__ == "NotFoundError":
                return 0
            raise
        self._stream_last = max(self._stream_last, int(message.seq))
        return int(message.seq)

    async def _object_store(self, js: Any) -> Any:
        if self.options.snapshot_interval <= 0 and self._started.is_set():
            return None
        try:
            return await js.create_object_store(_BUCKET)
        except Exception:
            try:
                return await js.object_store(_BUCKET)
            except Exception:
                return None

    async def _load_snapshot(self, store: Any) -> None:
        try:
            result = await store.get(self.options.snapshot_name)
        except Exception:
            return  # none yet
        try:
            snapshot = json.loads(result.data)
        except ValueError:
            return
        self._local.applying = True
        try:
            seq = self.applier.load(snapshot)
        finally:
            self._local.applying = False
        if seq:
            self._seq = self._snapshot_seq = seq

    async def _write_snapshot(self, store: Any) -> None:
        if self._seq <= self._snapshot_seq:
            return
        snapshot = self.applier.snapshot(self._seq)
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        try:
            await store.put(self.options.snapshot_name, data)
            self._snapshot_seq = snapshot["seq"]
        except Exception as exc:
            log.debug("shared index: snapshot not written: %s", exc)

    async def _publish_pending(self, js: Any) -> None:
        outbox, limit = self._outbox, self.options.batch_entries
        while outbox:
            entries: list[Entry] = []
            while outbox and len(entries) < limit:
                entries.append(outbox.popleft())
            first = next(self._numbers)
            for _ in range(len(entries) - 1):
                next(self._numbers)
            self._messages.append(Batch(self.origin, first, entries))
        while self._messages:
            window = list(itertools.islice(self._messages, 16))
            self._inflight = len(window)
            results = await asyncio.gather(
                *[
                    js.publish(
                        self.options.subject, encode_batch(b), timeout=2.0, headers={"Nats-Msg-Id": b.message_id}
                    )
                    for b in window
                ],
                return_exceptions=True,
            )
            self._inflight = 0
            for batch, result in zip(window, results, strict=True):
                if isinstance(result, BaseException):
                    raise ConnectionError(f"publish failed: {result!r}")  # kept, in order, for the next session
                self._messages.popleft()
                self._published += len(batch.entries)
                del batch

    async def _on_message(self, message: Any) -> None:
        try:
            seq = int(message.metadata.sequence.stream)
        except Exception:
            return
        if seq <= self._seq:
            return  # seen (a resubscription can deliver it again)
        batch = decode_batch(message.data)
        if batch is not None:
            own = batch.origin == self.origin
            now = time.time()
            self._local.applying = True
            try:
                for entry in batch.entries:
                    self.applier.apply(entry, own)
                    if not own and isinstance(entry[-1], (int, float)):
                        self._lags.append(now - entry[-1])
            finally:
                self._local.applying = False
        self._seq = seq
        self._stream_last = max(self._stream_last, seq)
