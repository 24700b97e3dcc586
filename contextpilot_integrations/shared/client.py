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
import os
import re
import secrets
import ssl
import threading
import time
import urllib.parse
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..core.validation import MAX_BLOCKS
from ..errors import SharedSettingsError
from .apply import Applier
from .entries import Batch, Entry, block_count, decode_batch, encode_batch, encode_entry, seal, unseal
from .replica import LockOf, Replica

__all__ = ["SECRET_ENV", "SharedIndex", "SharedOptions", "redact"]

log = logging.getLogger("contextpilot_integrations.shared")

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
_SCHEMES = ("nats", "tls", "ws", "wss")
SECRET_ENV = "CONTEXTPILOT_SHARED_SECRET"


def redact(url: str) -> str:
    """The broker URL(s) fit for logs: no user, password or token."""
    shown = []
    for one in url.split(","):
        parts = urllib.parse.urlsplit(one.strip())
        try:
            port = parts.port
        except ValueError:
            port = None
        host = parts.hostname or ""
        shown.append(f"{parts.scheme}://{host}" + (f":{port}" if port else ""))
    return ",".join(shown)


def _check_url(url: object) -> None:
    """Each comma-separated server a well-formed ``nats://host:port`` (or tls, ws, wss)."""
    if not isinstance(url, str) or not url:
        raise SharedSettingsError(f"shared: expected a nats:// URL, got {url!r}")
    for one in url.split(","):
        shown = redact(one)
        if one != one.strip() or any(c.isspace() for c in one):
            raise SharedSettingsError(f"shared: the broker URL {shown!r} contains white space")
        parts = urllib.parse.urlsplit(one)
        if parts.scheme not in _SCHEMES:
            raise SharedSettingsError(f"shared: expected a nats:// URL (or tls, ws, wss), got {shown!r}")
        try:
            port = parts.port
        except ValueError:
            raise SharedSettingsError(f"shared: the broker URL {shown!r} has no valid port (1-65535)") from None
        if not parts.hostname or port == 0:
            raise SharedSettingsError(f"shared: the broker URL {shown!r} needs a host and a port in 1-65535")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise SharedSettingsError(f"shared: the broker URL {shown!r} has a path or a query; give host:port")


@dataclass(frozen=True)
class SharedOptions:
    """Where and how a pilot shares its index.

    Args:
        url: the NATS server (``nats://host:port``, ``tls://`` for TLS; several
            comma-separated for a cluster). Checked here: a malformed one fails at once.
        secret: the deployment's shared secret (default: ``CONTEXTPILOT_SHARED_SECRET``):
            every message and snapshot carries an HMAC under it, and a worker applies nothing
            it cannot authenticate. Required: without it anyone who can publish to the
            broker would write every worker's index.
        scope: the engine this pilot models: pilots with the same scope share one index
            (a router's pilots use their target names).
        stream: the JetStream stream holding every scope's log.
        max_age: seconds an entry stays in the stream (bounded retention; the snapshots
            cover what is older).
        max_entries: messages the stream keeps at most (the oldest go first).
        snapshot_interval: seconds between this worker's snapshots (0: never).
        max_unsent: entries kept while the broker is unreachable (the oldest dropped after).
        batch_entries: entries per message at most.
        user: the broker's user name (or in the URL, ``nats://user:pw@host:port``).
        password: that user's password (or in the URL).
        token: the broker's authentication token.
        creds: path of a NATS ``.creds`` file (a user JWT and its nkey: decentralised auth).
        nkey_seed: path of an nkey seed file (nkey auth).
        tls: the TLS context for ``tls://`` servers (client certificates, private CAs);
            ``None`` with ``tls://``: the system's default verification.
        tls_hostname: the name to verify the server's certificate against.
    """

    url: str = "nats://127.0.0.1:4222"
    secret: str | bytes | None = field(default=None, repr=False)
    scope: str = "default"
    stream: str = "CONTEXTPILOT"
    max_age: float = 3600.0
    max_entries: int = 1_000_000
    snapshot_interval: float = 60.0
    max_unsent: int = 1_000_000
    batch_entries: int = 512
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds: str | None = None
    nkey_seed: str | None = None
    tls: ssl.SSLContext | None = field(default=None, repr=False, compare=False)
    tls_hostname: str | None = None

    def __post_init__(self) -> None:
        _check_url(self.url)
        secret = self.secret if self.secret is not None else os.environ.get(SECRET_ENV)
        if isinstance(secret, str):
            secret = secret.encode()
        if not isinstance(secret, bytes) or not secret.strip():
            raise SharedSettingsError(
                f"shared: set a secret (SharedOptions(secret=...) or {SECRET_ENV}), the same for every worker: "
                "entries are signed with it, and a worker applies none it cannot authenticate"
            )
        object.__setattr__(self, "secret", secret)
        if not isinstance(self.scope, str) or not self.scope:
            raise SharedSettingsError("shared scope must be a non-empty str")
        if self.max_unsent < 1 or self.batch_entries < 1 or self.max_entries < 1:
            raise SharedSettingsError("max_unsent, batch_entries and max_entries must be at least 1")
        if self.tls is not None and not isinstance(self.tls, ssl.SSLContext):
            raise SharedSettingsError("tls must be an ssl.SSLContext")

    def __repr__(self) -> str:
        return f"SharedOptions(url={redact(self.url)!r}, scope={self.scope!r}, stream={self.stream!r})"

    @property
    def key(self) -> bytes:
        assert isinstance(self.secret, bytes)
        return self.secret

    @property
    def subject(self) -> str:
        return f"contextpilot.{self.stream.lower()}.{_TOKEN.sub('_', self.scope)}"

    @property
    def snapshot_name(self) -> str:
        return f"{self.stream}-{_TOKEN.sub('_', self.scope)}"

    def connect_options(self) -> dict[str, Any]:
        """The credentials and TLS settings, as ``nats.connect`` takes them."""
        given = {
            "user": self.user,
            "password": self.password,
            "token": self.token,
            "user_credentials": self.creds,
            "nkeys_seed": self.nkey_seed,
            "tls": self.tls,
            "tls_hostname": self.tls_hostname,
        }
        return {name: value for name, value in given.items() if value is not None}


_BUCKET = "contextpilot-snapshots"
_OVERHEAD = 512  # bytes of a message besides its entries (MAC, header fields)


class SharedIndex:
    """Keeps ``pilot``'s index (a :class:`~.replica.Replica`) shared with every other worker of the same scope.

    The pilot owns it (``pilot.shared``) and is held only weakly: dropped, it is collected and its client
    stops (what is pending is sent first, briefly). After a fork (``gunicorn --preload``, ``multiprocessing``)
    the child gets a client of its own, with its own identity, started when the child first uses the pilot.
    """

    def __init__(self, pilot: Replica, options: SharedOptions, lock_of: LockOf | None = None) -> None:
        self._pilot = weakref.ref(pilot)
        self.options = options
        self.origin = secrets.token_hex(6)
        self.applier = Applier(pilot, lock_of=lock_of)
        self._outbox: deque[Entry] = deque()
        self._numbers = itertools.count()
        self._messages: deque[tuple[Batch, bytes]] = deque()  # batches waiting for the broker, in order
        self._local = threading.local()
        self._connected = False
        self._warned = False
        self._dropped = 0
        self._oversize = 0
        self._rejected = 0
        self._malformed = 0
        self._replayed = 0
        self._gaps = 0
        self._seq = 0  # last stream sequence applied
        self._stream_last = 0  # the stream's last sequence, as last seen
        self._stream_id: str | None = None  # the stream's identity (its creation time), once seen
        self._snapshot_seq = 0
        self._loaded = False  # a snapshot was looked for (and applied when there was one to use)
        self._published = 0
        self._lags: deque[float] = deque(maxlen=20_000)
        self._closed = False
        self._fresh_thread()
        pilot.add_observer(self._observe)
        self._start()
        self._ready.wait(5.0)
        atexit.register(self._at_exit)  # a worker that exits normally sends what it learned last
        dropped = weakref.finalize(pilot, SharedIndex._pilot_dropped, self)
        dropped.atexit = False  # at exit, _at_exit sends what is pending before the process goes
        _CLIENTS.add(self)

    def _fresh_thread(self) -> None:
        """The state of a client thread not started yet (at start, and in a forked child)."""
        self._pid = os.getpid()
        self._idle = False
        self._stopping = False
        self._drain_deadline = 0.0  # stopping: keep trying to send what is pending until then
        self._inflight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()  # the loop exists
        self._started = threading.Event()  # the snapshot (if any) was applied and the stream followed
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._main, name=f"contextpilot-shared-{self.options.scope}", daemon=True
                )
                self._thread.start()

    def _running(self) -> bool:
        """Whether this process's client thread runs (started now if this is a forked child)."""
        if self._thread is None:
            self._start()
        return self._thread is not None and self._thread.is_alive()

    @property
    def pilot(self) -> Replica:
        return self.applier.pilot

    def on(self, kind: str, handler: Callable[..., None]) -> None:
        """Hand other workers' entries of ``kind`` (see :meth:`publish`) to ``handler``, on this client's thread."""
        self.applier.on(kind, handler)

    def _at_exit(self) -> None:
        self.close(timeout=2.0)

    @staticmethod
    def _pilot_dropped(client: SharedIndex) -> None:
        """The pilot was collected: stop without blocking the collector (pending entries go out
        first, for at most a couple of seconds; the process exiting meanwhile waits for them as long)."""
        client._closed = True
        client._drain_deadline = time.monotonic() + 2.0
        client._stop()

    # ---- fork ----------------------------------------------------------------------------------
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
        self.origin = secrets.token_hex(6)
        self._numbers = itertools.count()
        self._outbox.clear()
        self._messages.clear()
        self._connected = False
        self._warned = False
        self.applier._lock = threading.Lock()
        self._fresh_thread()

    # ---- the pilot's side (any thread, under the pilot's lock: quick) --------------------------
    def _observe(self, kind: str, *details: Any) -> None:
        if getattr(self._local, "applying", False):
            return
        if self._thread is None:
            self._start()  # a forked child's first request
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
        """Publish an entry that is not an index event (a router's ``("stick", conversation_id,
        target)``); other workers hand it to the handler given to :meth:`on`."""
        self._observe(kind, *details)

    def status(self) -> dict[str, Any]:
        """What :meth:`ContextPilot.stats` reports (connected: this process's client runs and
        the broker answers)."""
        return {
            "shared_connected": self._connected and self._running(),
            "shared_unsent": self.unsent,
            "shared_applied": self.applier.applied,
        }

    @property
    def unsent(self) -> int:
        return len(self._outbox) + sum(len(batch.entries) for batch, _ in list(self._messages))

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
            "dropped_oversize": self._oversize,
            "rejected_messages": self._rejected,
            "malformed_messages": self._malformed,
            "replayed_messages": self._replayed,
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
        self._running()
        deadline = time.monotonic() + timeout
        while self.unsent or self._inflight:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def wait_caught_up(self, timeout: float = 10.0) -> bool:
        """Wait (at most ``timeout``) until this worker applied everything the stream held
        when called. A worker that starts can call it before serving."""
        self._running()
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
        """Send what is pending (for at most ``timeout``), then stop the thread. What could
        not be sent is logged (other workers will not learn it)."""
        atexit.unregister(self._at_exit)
        self._closed = True
        pilot = self.applier._pilot()
        if pilot is not None:
            pilot.remove_observer(self._observe)
        if (self._connected or not self._warned) and self._thread is not None and self._thread.is_alive():
            self.flush(timeout)  # connected, or still connecting: not known to be down
        if self.unsent:
            log.warning(
                "shared index: %d entries of %s not sent at close (the broker at %s unreachable); other workers "
                "will not learn them",
                self.unsent,
                self.options.subject,
                redact(self.options.url),
            )
        self._stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _stop(self) -> None:
        self._stopping = True
        loop = self._loop
        if loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake.set)

    # ---- the thread ----------------------------------------------------------------------------
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
            self._connected = False
            loop.close()

    def _down(self, error: object) -> None:
        self._connected = False
        if not self._warned:
            self._warned = True
            log.warning(
                "shared index: the broker at %s is unreachable (%s); preparing on this worker's own view until "
                "it is back",
                redact(self.options.url),
                type(error).__name__ if _names_credentials(error, self.options) else error,
            )

    def _up(self) -> None:
        self._connected = True
        if self._warned:
            self._warned = False
            log.warning("shared index: the broker at %s is back; catching up", redact(self.options.url))

    async def _run(self) -> None:
        import nats  # the optional dependency: imported only when sharing is on

        backoff = 0.1
        while not self._stopping or self._draining():
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
            except Exception as exc:
                self._down(exc)
            finally:
                if nc is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(nc.close(), 2)
            if self._stopping and not self._draining():
                break
            self._connected = False
            await self._sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        if self._drain_deadline:
            atexit.unregister(self._at_exit)  # drained: nothing left to wait for at exit
        if self._drain_deadline and self.unsent:
            log.warning(
                "shared index: %d entries of %s not sent (the pilot was dropped and the broker at %s did not take "
                "them in time); other workers will not learn them",
                self.unsent,
                self.options.subject,
                redact(self.options.url),
            )

    def _draining(self) -> bool:
        return bool(self.unsent) and time.monotonic() < self._drain_deadline

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
        stream_id = info.created.isoformat() if info.created is not None else ""
        if self._stream_id is not None and stream_id != self._stream_id:
            log.warning("shared index: the stream %s was made again; following it from its start", options.stream)
            self._seq = 0  # its sequences are not the old stream's
        elif info.state.last_seq < self._seq:  # a new, empty broker: follow its stream from the start
            self._seq = 0
        self._stream_id = stream_id
        self._stream_last = info.state.last_seq
        if self._stopping:  # the pilot was dropped: send what is pending, follow nothing
            await asyncio.wait_for(self._publish_pending(js, nc.max_payload), 2.0)
            return
        store = await self._object_store(js)
        if not self._loaded and store is not None:
            await self._load_snapshot(store, stream_id, info.state.last_seq)
            self._loaded = True
        if self._seq and info.state.first_seq > self._seq + 1:
            self._gaps += 1  # retention dropped entries this worker never saw (the snapshot was older)
            log.warning("shared index: %s entries expired before this worker read them", options.subject)
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
                await self._publish_pending(js, nc.max_payload)
                if store is not None and options.snapshot_interval > 0 and time.monotonic() >= next_snapshot:
                    next_snapshot = time.monotonic() + options.snapshot_interval
                    await self._write_snapshot(store)
                self._idle = True  # first: an entry queued from now on wakes the loop
                if not self._outbox and not self._messages:
                    await self._sleep(0.25)
                self._idle = False
            if not self._stopping:
                raise ConnectionError("connection lost")
            with contextlib.suppress(Exception):  # stopping: what is pending goes out, briefly
                await asyncio.wait_for(self._publish_pending(js, nc.max_payload), 2.0)
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
        if self.options.snapshot_interval <= 0 and self._loaded:
            return None
        try:
            return await js.create_object_store(_BUCKET)
        except Exception:
            try:
                return await js.object_store(_BUCKET)
            except Exception:
                return None

    async def _load_snapshot(self, store: Any, stream_id: str, last_seq: int) -> None:
        try:
            result = await store.get(self.options.snapshot_name)
        except Exception:
            return  # none yet
        body = unseal(self.options.key, self.options.snapshot_name, result.data or b"")
        if body is None:
            self._rejected += 1
            log.warning(
                "shared index: the snapshot %s is not signed with this deployment's secret; ignored",
                self.options.snapshot_name,
            )
            return
        try:
            snapshot = json.loads(body)
        except (ValueError, RecursionError):
            return
        self._local.applying = True
        try:
            seq = self.applier.load(snapshot, stream_id, last_seq)
        finally:
            self._local.applying = False
        if seq:
            self._seq = self._snapshot_seq = seq
        else:
            log.warning(
                "shared index: the snapshot %s is not of this stream; replaying the stream instead",
                self.options.snapshot_name,
            )

    async def _write_snapshot(self, store: Any) -> None:
        if self._seq <= self._snapshot_seq or self._stream_id is None:
            return
        snapshot = self.applier.snapshot(self._stream_id, self._seq)
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        try:
            await store.put(self.options.snapshot_name, seal(self.options.key, self.options.snapshot_name, data))
            self._snapshot_seq = snapshot["seq"]
        except Exception as exc:
            log.debug("shared index: snapshot not written: %s", exc)

    def _pack(self, max_bytes: int) -> None:
        """Move the outbox into messages of at most ``batch_entries`` entries, ``max_bytes``
        bytes and ``MAX_BLOCKS`` blocks. An entry too large for any message is dropped
        (counted): no worker could take it."""
        outbox, limit = self._outbox, self.options.batch_entries
        room = max_bytes - _OVERHEAD
        while outbox:
            entries: list[Entry] = []
            encoded: list[bytes] = []
            size = blocks = 0
            while outbox and len(entries) < limit:
                data, count = encode_entry(outbox[0]), block_count(outbox[0])
                if len(data) > room or count > MAX_BLOCKS:
                    outbox.popleft()
                    self._oversize += 1
                    log.warning(
                        "shared index: an entry of %d bytes, %d blocks not shared (over the limits)", len(data), count
                    )
                    continue
                if entries and (size + len(data) + 1 > room or blocks + count > MAX_BLOCKS):
                    break
                entries.append(outbox.popleft())
                encoded.append(data)
                size, blocks = size + len(data) + 1, blocks + count
            if not entries:
                break
            first = next(self._numbers)
            for _ in range(len(entries) - 1):
                next(self._numbers)
            batch = Batch(self.origin, first, entries)
            self._messages.append((batch, seal(self.options.key, self.options.subject, encode_batch(batch, encoded))))

    async def _publish_pending(self, js: Any, max_bytes: int) -> None:
        self._pack(max_bytes)
        while self._messages:
            window = list(itertools.islice(self._messages, 16))
            self._inflight = len(window)
            results = await asyncio.gather(
                *[
                    js.publish(self.options.subject, data, timeout=2.0, headers={"Nats-Msg-Id": batch.message_id})
                    for batch, data in window
                ],
                return_exceptions=True,
            )
            self._inflight = 0
            for (batch, _), result in zip(window, results, strict=True):
                if isinstance(result, BaseException):
                    raise ConnectionError(f"publish failed: {result!r}")  # kept, in order, for the next session
                self._messages.popleft()
                self._published += len(batch.entries)

    async def _on_message(self, message: Any) -> None:
        try:
            seq = int(message.metadata.sequence.stream)
        except Exception:
            return
        if seq <= self._seq:
            return  # seen (a resubscription can deliver it again)
        body = unseal(self.options.key, self.options.subject, message.data or b"")
        batch = decode_batch(body) if body is not None else None
        if body is None:
            self._rejected += 1  # not signed with this deployment's secret: never applied
        elif batch is None:
            self._malformed += 1
        elif not self.applier.fresh(batch.origin, batch.first):
            self._replayed += 1
        else:
            own = batch.origin == self.origin
            now = time.time()
            self._local.applying = True
            try:
                for entry in batch.entries:  # checked whole before the first is applied
                    self.applier.apply(entry, own)
                    if not own:
                        self._lags.append(now - entry[-1])
            except ReferenceError:
                self._stopping = True  # the pilot was dropped
                return
            finally:
                self._local.applying = False
        self._seq = seq
        self._stream_last = max(self._stream_last, seq)


def _names_credentials(error: object, options: SharedOptions) -> bool:
    """Whether an error's text would show a credential (a client's message quoting the URL)."""
    text = str(error)
    secrets_ = [options.password, options.token, urllib.parse.urlsplit(options.url.split(",")[0]).password]
    return any(s and s in text for s in secrets_)


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
        if not client._closed:
            client._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_release_held, after_in_child=_after_fork_in_child)
