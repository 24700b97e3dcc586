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

Trust: every message is signed when it is published, bound to the stream's identity (its
name and creation time) and carrying the time it was signed by the broker's clock (each
session measures this worker's offset to it); a message that does not verify is never
applied, and the first one is logged; one stored long after it was signed (a copy) is not
applied either. A worker that reads only what it cannot verify says so
(``shared_status="unauthenticated"``) and writes no snapshot; snapshots are kept under the
name of the secret that signs them, so a worker with another secret never replaces them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import ssl
import threading
import time
import urllib.parse
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from ..core.events import IndexEvent
from ..core.validation import MAX_BLOCKS
from ..errors import SharedSettingsError
from .apply import Applier, Snapshot
from .entries import (
    Batch,
    Entry,
    block_count,
    context,
    decode_batch,
    encode_batch,
    encode_entry,
    entry_of,
    evicted_ids,
    key_id,
    seal,
    unseal,
)
from .replica import LockOf, Replica

__all__ = ["SECRET_ENV", "SharedIndex", "SharedOptions", "redact"]

log = logging.getLogger("contextpilot_integrations.shared")

_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
_STREAM_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")
_SCHEMES = ("nats", "tls", "ws", "wss")
SECRET_ENV = "CONTEXTPILOT_SHARED_SECRET"

_MIN_SECRET = 16  # bytes: shorter ones can be guessed from any signed message
_MIN_DISTINCT = 5  # different bytes at least ("0" * 32 is no secret)
_MAX_SECRETS = 8
_MIN_MAX_AGE = 60.0  # seconds
_DUPLICATE_WINDOW = 120.0  # the broker's de-duplication window (NATS' default), max_age if shorter
_FRESH = 5.0  # seconds: a message is stored this close to when it was signed (the broker's clock)
_CLOCK_EVERY = 30.0  # seconds between measures of the offset to the broker's clock


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
            broker would write every worker's index. At least 16 bytes, e.g.
            ``openssl rand -hex 32``. A list (the variable: comma-separated) rotates it: the
            first signs, each one verifies, so a worker given ``[new, old]`` reads the workers
            still on ``old``.
        scope: the engine this pilot models: pilots with the same scope share one index
            (a router's pilots use their target names).
        stream: the JetStream stream holding every scope's log (letters, digits, ``_``, ``-``).
        max_age: seconds an entry stays in the stream (bounded retention; the snapshots
            cover what is older): at least 60, and twice ``snapshot_interval``. The broker's
            de-duplication window is 120 s, or ``max_age`` if shorter.
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
    secret: str | bytes | Sequence[str | bytes] | None = field(default=None, repr=False)
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
        object.__setattr__(self, "secret", _secrets(self.secret))
        if not isinstance(self.scope, str) or not self.scope:
            raise SharedSettingsError("shared scope must be a non-empty str")
        if not isinstance(self.stream, str) or not _STREAM_NAME.fullmatch(self.stream):
            raise SharedSettingsError(
                f"shared: the stream name {self.stream!r} must be 1-64 letters, digits, '_' or '-' (NATS refuses "
                "others, and it names the log's subjects)"
            )
        for name in ("max_entries", "max_unsent", "batch_entries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SharedSettingsError(f"shared: {name} must be an int of at least 1, got {value!r}")
        max_age, interval = _seconds("max_age", self.max_age), _seconds("snapshot_interval", self.snapshot_interval)
        if max_age < _MIN_MAX_AGE:
            raise SharedSettingsError(
                f"shared: max_age={max_age:g} s is too short: entries must stay at least {_MIN_MAX_AGE:g} s, so a "
                "worker restarting or cut off from the broker for a moment catches up from them"
            )
        if interval > 0 and max_age < 2 * interval:
            raise SharedSettingsError(
                f"shared: max_age={max_age:g} s must be at least twice snapshot_interval={interval:g} s: a worker "
                "starting late loads the newest snapshot and replays the stream after it, and entries between the "
                "two would be gone; raise max_age or lower snapshot_interval"
            )
        if self.tls is not None and not isinstance(self.tls, ssl.SSLContext):
            raise SharedSettingsError("tls must be an ssl.SSLContext")

    def __repr__(self) -> str:
        return f"SharedOptions(url={redact(self.url)!r}, scope={self.scope!r}, stream={self.stream!r})"

    @property
    def key(self) -> bytes:
        """The secret that signs (the first)."""
        return self.keys[0]

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every secret that verifies, the signing one first."""
        assert isinstance(self.secret, tuple)
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


def _secrets(given: object) -> tuple[bytes, ...]:
    """The deployment's secrets as bytes, the signing one first, each checked (never shown)."""
    if given is None:
        env = os.environ.get(SECRET_ENV)
        given = [part.strip() for part in env.split(",")] if env is not None else None
    missing = SharedSettingsError(
        f"shared: set a secret (SharedOptions(secret=...) or {SECRET_ENV}), the same for every worker: "
        "entries are signed with it, and a worker applies none it cannot authenticate"
    )
    if isinstance(given, (str, bytes)):
        given = [given]
    if not isinstance(given, (list, tuple)) or not given:
        raise missing
    keys: list[bytes] = []
    for position, item in enumerate(given, 1):
        key = item.encode() if isinstance(item, str) else item
        if not isinstance(key, bytes) or not key.strip():
            raise missing
        if len(key) < _MIN_SECRET or len(set(key)) < _MIN_DISTINCT:
            raise SharedSettingsError(
                f"shared: secret {position} of {len(given)} is too weak: a secret shorter than {_MIN_SECRET} bytes, or "
                f"of fewer than {_MIN_DISTINCT} different characters, can be guessed from any signed message; use "
                "e.g. `openssl rand -hex 32`"
            )
        if key not in keys:
            keys.append(key)
    if len(keys) > _MAX_SECRETS:
        raise SharedSettingsError(f"shared: at most {_MAX_SECRETS} secrets (the signing one, then those still read)")
    return tuple(keys)


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise SharedSettingsError(f"shared: {name} must be a finite number of seconds, at least 0, got {value!r}")
    return float(value)


def _rfc3339_ns(text: object) -> int | None:
    """Nanoseconds since the epoch of a broker's RFC 3339 time (``None``: not one)."""
    match = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        return None
    whole = datetime.fromisoformat(match[1] + ("+00:00" if match[3] == "Z" else match[3]))
    return int(whole.timestamp()) * 10**9 + int((match[2] or "").ljust(9, "0"))


class _Refused(Exception):
    """The broker answered, and refused the stream (its reason is the message)."""


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
        self._stale = 0
        self._gaps = 0
        self._seq = 0  # last stream sequence applied
        self._stream_last = 0  # the stream's last sequence, as last seen
        self._stream_id: str | None = None  # the stream's identity (name and creation time), once seen
        self._offset = 0.0  # the broker's clock less this worker's, in seconds (measured each session)
        self._confirmed = False  # a message of another worker verified: this worker's secret is the deployment's
        self._doubt = False  # something it read did not verify (a message; snapshots under another secret only)
        self._warned_rejected = False
        self._warned_stale = False
        self._refused: str | None = None  # the broker's reason for refusing the stream, while it does
        self._measure_clock = False  # an own message came back stored far from its signing: measure again
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
    def _observe(self, event: IndexEvent) -> None:
        self._queue(entry_of(event, time.time()))

    def publish(self, kind: str, *details: Any) -> None:
        """Publish an entry that is not an index event (a router's ``("stick", conversation_id,
        target)``); other workers hand it to the handler given to :meth:`on`."""
        self._queue((kind, *details, time.time()))

    def _queue(self, entry: Entry) -> None:
        """Append an entry to the outbox (not one this thread learned by applying the stream), and wake the thread."""
        if getattr(self._local, "applying", False):
            return
        if self._thread is None:
            self._start()  # a forked child's first request
        if evicted := evicted_ids(entry):
            self.applier.remember_evicted(evicted)
        self._outbox.append(entry)
        if len(self._outbox) > self.options.max_unsent:
            self._outbox.popleft()
            self._dropped += 1
        if self._idle and self._loop is not None and self._wake is not None:
            self._idle = False
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._wake.set)

    def status(self) -> dict[str, Any]:
        """What :meth:`ContextPilot.stats` reports (connected: this process's client runs, the
        broker answers, and what other workers publish verifies under this worker's secret)."""
        state = self._state()
        return {
            "shared_connected": state == "connected",
            "shared_status": state,
            "shared_unsent": self.unsent,
            "shared_applied": self.applier.applied,
            "shared_rejected": self._rejected,
            "shared_behind": max(0, self._stream_last - self._seq),
            "shared_lag_seconds": _newest(self._lags),
        }

    def _state(self) -> str:
        running = self._running()
        if self._closed or not running:
            return "closed"
        if not self._connected:
            return "refused" if self._refused else "unreachable"
        if self._doubt and not self._confirmed:
            return "unauthenticated"  # it read only what it cannot verify: its secret is likely not theirs
        return "connected"

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
            "stream_id": self._stream_id,
            "applied_seq": self._seq,
            "stream_last_seq": self._stream_last,
            "snapshot_seq": self._snapshot_seq,
            "published_entries": self._published,
            "dropped_unsent": self._dropped,
            "dropped_oversize": self._oversize,
            "rejected_messages": self._rejected,
            "malformed_messages": self._malformed,
            "replayed_messages": self._replayed,
            "stale_messages": self._stale,
            "stream_gaps": self._gaps,
            "skipped": self.applier.skipped,
            "lag_ms_p50": 1000 * lags[len(lags) // 2] if lags else None,
            "lag_ms_p99": 1000 * lags[int(0.99 * (len(lags) - 1))] if lags else None,
            "clock_offset_ms": 1000 * self._offset,
        }

    def lags(self) -> list[float]:
        """Seconds from another worker learning an entry to this one applying it (recent ones),
        both times by the broker's clock: a worker's clock set wrong does not show here."""
        return list(self._lags)

    def _broker_now(self) -> float:
        """Now by the broker's clock (as measured at the last session)."""
        return time.time() + self._offset

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
        down = self._warned or self._refused is not None
        if (self._connected or not down) and self._thread is not None and self._thread.is_alive():
            self.flush(timeout)  # connected, or still connecting: not known to be down
        if self.unsent:
            log.warning(
                "shared index: %d entries of %s not sent at close (the broker at %s %s); other workers will not "
                "learn them",
                self.unsent,
                self.options.subject,
                redact(self.options.url),
                "refuses the stream" if self._refused else "unreachable",
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

    def _refuse(self, reason: str) -> None:
        """The broker answers but refuses the stream: said once, with its reason (not as "unreachable")."""
        self._connected = False
        if self._refused != reason:
            log.warning(
                "shared index: the broker at %s refuses the stream %s: %s; preparing on this worker's own view (fix "
                "the stream on the broker, or this worker's SharedOptions)",
                redact(self.options.url),
                self.options.stream,
                reason,
            )
        self._refused = reason

    def _up(self) -> None:
        self._connected = True
        self._refused = None
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
            except _Refused as exc:
                self._refuse(str(exc))
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
        from nats.js.errors import APIError

        js = nc.jetstream()
        options = self.options
        config = api.StreamConfig(
            name=options.stream,
            subjects=[f"contextpilot.{options.stream.lower()}.>"],
            storage=api.StorageType.FILE,
            max_age=options.max_age,
            max_msgs=options.max_entries,
            duplicate_window=min(_DUPLICATE_WINDOW, options.max_age),  # NATS refuses a window beyond the age
        )
        try:
            await js.add_stream(config)
        except APIError as exc:
            try:
                await js.stream_info(options.stream)  # made by another worker with other limits: use it
            except APIError:
                raise _Refused(exc.description or str(exc)) from None
        stream_id, first_seq, last_seq = await self._stream_facts(nc, js)
        if self._stream_id is not None and stream_id != self._stream_id:
            log.warning("shared index: the stream %s was made again; following it from its start", options.stream)
            self._seq = 0  # its sequences are not the old stream's
        elif last_seq < self._seq:  # a new, empty broker: follow its stream from the start
            self._seq = 0
        self._stream_id = stream_id
        self._stream_last = last_seq
        if self._stopping:  # the pilot was dropped: send what is pending, follow nothing
            await asyncio.wait_for(self._publish_pending(js, nc.max_payload), 2.0)
            return
        store = await self._object_store(js)
        if not self._loaded and store is not None:
            await self._load_snapshot(store, last_seq)
            self._loaded = True
        if self._seq and first_seq > self._seq + 1:
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
        next_clock = time.monotonic() + _CLOCK_EVERY
        try:
            while not self._stopping and nc.is_connected:
                await self._publish_pending(js, nc.max_payload)
                if store is not None and options.snapshot_interval > 0 and time.monotonic() >= next_snapshot:
                    next_snapshot = time.monotonic() + options.snapshot_interval
                    await self._write_snapshot(store)
                if time.monotonic() >= next_clock or self._measure_clock:  # clocks drift, or were set
                    next_clock, self._measure_clock = time.monotonic() + _CLOCK_EVERY, False
                    if (await self._stream_facts(nc, js))[0] != self._stream_id:
                        return  # made again meanwhile: a new session follows the new stream
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

    async def _stream_facts(self, nc: Any, js: Any) -> tuple[str, int, int]:
        """The stream's identity (its name and creation time: a stream made again, or another
        deployment's, is another), first and last sequence; measures on the way the offset of
        the broker's clock to this worker's (the best of three round trips)."""
        subject = f"{getattr(js, '_prefix', '$JS.API')}.STREAM.INFO.{self.options.stream}"
        best: tuple[float, float] | None = None  # (round trip, offset)
        info: dict[str, Any] = {}
        for _ in range(3):
            sent = time.time()
            reply = await nc.request(subject, b"", timeout=2.0)
            got = time.time()
            info = json.loads(reply.data)
            if not isinstance(info, dict) or "error" in info or "created" not in info:
                error = info.get("error") if isinstance(info, dict) else None
                raise _Refused(str(error.get("description") if isinstance(error, dict) else "no stream information"))
            broker = _rfc3339_ns(info.get("ts"))
            if broker is not None and (best is None or got - sent < best[0]):
                best = (got - sent, broker / 1e9 - (sent + got) / 2)
        if best is not None:  # an older broker does not tell its time: the clocks are taken to agree
            self._offset = best[1]
        created = _rfc3339_ns(info["created"])
        state = info.get("state")
        state = state if isinstance(state, dict) else {}
        identity = f"{self.options.stream}:{created if created is not None else info['created']}"
        return identity, int(state.get("first_seq", 0)), int(state.get("last_seq", 0))

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

    def _snapshot_object(self, key: bytes) -> str:
        """Where the snapshots signed with ``key`` are kept: a worker with another secret
        writes elsewhere, and never replaces them."""
        return f"{self.options.snapshot_name}.{key_id(key)}"

    async def _load_snapshot(self, store: Any, last_seq: int) -> None:
        """Load the newest snapshot of this stream signed with one of this worker's secrets."""
        assert self._stream_id is not None
        mine = {self._snapshot_object(key): key for key in self.options.keys}
        best: Snapshot | None = None
        for name, key in mine.items():
            try:
                result = await store.get(name)
            except Exception:
                continue  # none yet
            body = unseal(key, context(self._stream_id, name), result.data or b"")
            if body is None:
                self._rejected += 1
                log.warning(
                    "shared index: the snapshot %s does not verify under this worker's secret (another stream's, or "
                    "written by a client of the broker without the secret); ignored",
                    name,
                )
                continue
            try:
                checked = Applier.check(json.loads(body), self._stream_id, last_seq)
            except (ValueError, RecursionError):
                checked = None
            if checked is None:
                log.warning("shared index: the snapshot %s is not of this stream; replaying the stream instead", name)
            elif best is None or checked.seq > best.seq:
                best = checked
        if best is None and await self._foreign_snapshots(store, set(mine)):
            self._doubt = True
            log.warning(
                "shared index: snapshots of %s exist signed with another secret, none with this worker's: if the "
                "other workers run with that secret, this worker's is not theirs (its status says "
                "'unauthenticated' until a message of another worker verifies)",
                self.options.subject,
            )
        if best is None:
            return
        self._local.applying = True
        try:
            self.applier.restore(best)
        finally:
            self._local.applying = False
        self._seq = self._snapshot_seq = best.seq

    async def _foreign_snapshots(self, store: Any, mine: set[str]) -> int:
        """Snapshots of this scope kept under secrets this worker does not have."""
        try:
            infos = await store.list(ignore_deletes=True)
        except Exception:
            return 0
        prefix = f"{self.options.snapshot_name}."
        return sum(
            1
            for info in infos
            if info.name.startswith(prefix) and _KEY_ID.fullmatch(info.name[len(prefix) :]) and info.name not in mine
        )

    async def _write_snapshot(self, store: Any) -> None:
        if self._seq <= self._snapshot_seq or self._stream_id is None:
            return
        if self._doubt and not self._confirmed:
            return  # a view no other worker's message confirmed is never offered to others
        name = self._snapshot_object(self.options.key)
        snapshot = self.applier.snapshot(self._stream_id, self._seq)
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        try:
            await store.put(name, seal(self.options.key, context(self._stream_id, name), data))
            self._snapshot_seq = snapshot["seq"]
        except Exception as exc:
            log.debug("shared index: snapshot not written: %s", exc)

    def _pack(self, max_bytes: int) -> None:
        """Move the outbox into messages of at most ``batch_entries`` entries, ``max_bytes``
        bytes and ``MAX_BLOCKS`` blocks, each entry's time by the broker's clock. An entry too
        large for any message is dropped (counted): no worker could take it."""
        outbox, limit, offset = self._outbox, self.options.batch_entries, self._offset
        room = max_bytes - _OVERHEAD
        while outbox:
            entries: list[Entry] = []
            encoded: list[bytes] = []
            size = blocks = 0
            while outbox and len(entries) < limit:
                entry = outbox[0]
                stamped = (*entry[:-1], entry[-1] + offset)
                data, count = encode_entry(stamped), block_count(entry)
                if len(data) > room or count > MAX_BLOCKS:
                    outbox.popleft()
                    self._oversize += 1
                    log.warning(
                        "shared index: an entry of %d bytes, %d blocks not shared (over the limits)", len(data), count
                    )
                    continue
                if entries and (size + len(data) + 1 > room or blocks + count > MAX_BLOCKS):
                    break
                outbox.popleft()
                entries.append(stamped)
                encoded.append(data)
                size, blocks = size + len(data) + 1, blocks + count
            if not entries:
                break
            first = next(self._numbers)
            for _ in range(len(entries) - 1):
                next(self._numbers)
            self._messages.append((Batch(self.origin, first, entries), b",".join(encoded)))

    async def _publish_pending(self, js: Any, max_bytes: int) -> None:
        """Publish what waits, in order, each message signed now: bound to this stream and
        stamped with the broker's time (a message kept through an outage is signed afresh)."""
        self._pack(max_bytes)
        assert self._stream_id is not None
        where = context(self._stream_id, self.options.subject)
        while self._messages:
            window = list(itertools.islice(self._messages, 16))
            self._inflight = len(window)
            signed = [
                seal(self.options.key, where, encode_batch(replace(batch, signed=self._broker_now()), encoded))
                for batch, encoded in window
            ]
            results = await asyncio.gather(
                *[
                    js.publish(self.options.subject, data, timeout=2.0, headers={"Nats-Msg-Id": batch.message_id})
                    for (batch, _), data in zip(window, signed, strict=True)
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
        assert self._stream_id is not None
        body = unseal(self.options.keys, context(self._stream_id, self.options.subject), message.data or b"")
        batch = decode_batch(body) if body is not None else None
        if body is None:
            self._rejected += 1  # not signed with this deployment's secret for this stream: never applied
            self._not_verified(seq)
        elif batch is None:
            self._malformed += 1
        elif batch.origin != self.origin and not self._timely(batch, message):
            self._stale += 1
        elif not self.applier.fresh(batch.origin, batch.first):
            self._replayed += 1
        else:
            own = batch.origin == self.origin
            stored = _stored_at(message)
            if own and stored is not None and abs(stored - batch.signed) > _FRESH / 2:
                self._measure_clock = True  # this worker's clock moved since it was measured
            if not own and not self._confirmed:
                self._confirmed = True
                if self._doubt:
                    log.warning("shared index: a message of another worker verifies under this worker's secret")
            self._local.applying = True
            try:
                for entry in batch.entries:  # checked whole before the first is applied
                    self.applier.apply(entry, own)
                    if not own:  # both times by the broker's clock
                        self._lags.append(max(0.0, self._broker_now() - entry[-1]))
            except ReferenceError:
                self._stopping = True  # the pilot was dropped
                return
            finally:
                self._local.applying = False
        self._seq = seq
        self._stream_last = max(self._stream_last, seq)

    def _not_verified(self, seq: int) -> None:
        """A message that does not verify: said at the first, loudly (a worker whose secret is
        not the deployment's reads nothing else)."""
        self._doubt = True
        if not self._warned_rejected:
            self._warned_rejected = True
            log.warning(
                "shared index: the message at sequence %d of %s does not verify under this worker's secret%s and was "
                "not applied. If every other worker's message is refused, this worker's secret is not theirs (its "
                "stats say shared_status='unauthenticated' and it writes no snapshot); else a client of the broker "
                "without the secret published it. details()['rejected_messages'] counts them",
                seq,
                self.options.subject,
                "s" if len(self.options.keys) > 1 else "",
            )

    def _timely(self, batch: Batch, message: Any) -> bool:
        """Whether another worker's message was stored when it was signed (both by the broker's
        clock), and is no older than the stream keeps: a signed message stored again later (a
        copy, its worker gone and no snapshot knowing it) is not applied."""
        stored = _stored_at(message)
        if stored is None:
            return True  # the broker did not say: the per-origin numbering still applies
        if abs(stored - batch.signed) > _FRESH:
            self._stale_warning(stored - batch.signed)
            return False
        return self._broker_now() - batch.signed <= self.options.max_age - _FRESH  # its original is gone

    def _stale_warning(self, late: float) -> None:
        if not self._warned_stale:
            self._warned_stale = True
            log.warning(
                "shared index: a signed message of %s was stored %.0f s from when it was signed (a copy stored again, "
                "or its worker's time is off); not applied. details()['stale_messages'] counts them",
                self.options.subject,
                late,
            )


def _stored_at(message: Any) -> float | None:
    """When the broker stored a message (seconds since the epoch, its clock)."""
    try:
        return float(message.metadata.timestamp.timestamp())
    except Exception:
        return None


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


def _newest(lags: deque[float]) -> float | None:
    """The newest applied entry's lag (``None``: none yet); the deque is appended on another thread."""
    try:
        return lags[-1]
    except IndexError:
        return None
