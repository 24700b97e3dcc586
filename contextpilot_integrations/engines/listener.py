"""The HTTP callback server: SGLang's events (through our plugin) and ``/evict`` posts
reach the :class:`~contextpilot_integrations.engines.sink.KvEventSink` of a pilot.

It also answers ``GET /health``, ``GET /stats`` (JSON) and ``GET /metrics`` (the pilot's stats
in Prometheus' text format, with the ``[metrics]`` extra), behind the same checks as the posts.

SGLang (through our plugin, :mod:`.sglang_plugin`) POSTs its KV-cache event batches to
``/kv-events``; engines that only know request ids POST ``/evict``.

The server is the standard library's threading HTTP server (no hand-written parsing),
hardened for a loopback service a browser could reach: it binds 127.0.0.1 by default and
needs a non-empty token anywhere else; refuses bodies over ``max_body_bytes`` (413),
batches over ``max_batch_blocks`` blocks (413), non-JSON content types (415), foreign
``Host`` headers on a loopback bind and any ``Origin`` header (403: DNS rebinding and
cross-site requests from browser pages); refuses lists longer than a batch may be before
validating them, and validates up to the first bad item (a body of invalid items costs one
error); answers a body over the limit with 413 and reads the rest away, so the client sees
the answer, not a reset; closes connections idle for ``idle_timeout`` seconds and, at
``max_connections``, closes the longest-idle one, else the oldest that has proven nothing
(no token shown, no request answered), to seat a new client (503 only when every seat holds
a proven client busy with a request); gives a connection's first request ``header_timeout``
seconds from the connection to the end of its head (later ones from their first byte) and
``body_timeout`` more for its body, so a client dripping a header line at a time cannot keep
a connection busy (closed; 408 for a late body); and answers every malformed request with
400, never a traceback. Without a token, anyone on the host may post, so what it receives
stays in this worker's index and is never published to a shared log.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import math
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.validation import MAX_BLOCKS
from ..pilot import ContextPilot
from .kv_mapping import EngineBlockMap
from .sink import KvEventSink
from .wire import KvEventBatch

__all__ = ["EvictionListener"]

logger = logging.getLogger(__name__)

TOKEN_HEADER = "X-ContextPilot-Token"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")
_HOST = re.compile(r"\[?([^\[\]]+?)\]?(?::[0-9]+)?")


class EvictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_ids: list[str] = Field(fail_fast=True)


class _Server(ThreadingHTTPServer):
    """Thread per connection, with a bounded, idle-aware connection table."""

    daemon_threads = True
    request_queue_size = 1_024  # listen backlog: bursts of publishers are queued, not reset

    def __init__(
        self,
        address: tuple[str, int],
        sink: KvEventSink,
        *,
        token: str | None,
        max_body_bytes: int,
        max_batch_blocks: int,
        max_connections: int,
        idle_timeout: float,
        header_timeout: float,
        body_timeout: float,
        loopback: bool,
    ) -> None:
        super().__init__(address, _Handler)
        self.sink = sink
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.max_batch_blocks = max_batch_blocks
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.loopback = loopback
        self.stopped = False
        self._connections: dict[socket.socket, _Seat] = {}
        self._table_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._table_lock:
            if self.stopped:
                self._refuse(request)
                return
            if len(self._connections) >= self.max_connections and not self._make_room():
                self._refuse(request)
                return
            self._connections[request] = _Seat(time.monotonic())
        super().process_request(request, client_address)

    def _make_room(self) -> bool:
        """At the bound, close the longest-idle connection (a client's between its requests),
        else the oldest one that has not proven itself (no request answered, no token shown:
        one that sends nothing, or drips its request); a proven client busy with a request
        keeps its seat. Under the table lock."""
        seats = self._connections.items()
        idle = [(seat.idle_since, sock) for sock, seat in seats if seat.idle_since is not None]
        if idle:
            victim, counter = min(idle, key=lambda item: item[0])[1], "idle_connections_closed"
        else:
            unproven = [(seat.accepted, sock) for sock, seat in seats if not seat.proven]
            if not unproven:
                return False
            victim, counter = min(unproven, key=lambda item: item[0])[1], "unproven_connections_closed"
        self._connections.pop(victim)
        _close_quietly(victim)
        self.sink.count(counter)
        return True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that vanished mid-request (or a connection closed by stop()): no traceback
        logger.debug("contextpilot listener: connection from %s ended with an error", client_address, exc_info=True)

    def shutdown_request(self, request: Any) -> None:
        with self._table_lock:
            self._connections.pop(request, None)
        super().shutdown_request(request)

    def mark(self, connection: socket.socket, busy: bool) -> None:
        with self._table_lock:
            seat = self._connections.get(connection)
            if seat is not None:  # a connection is idle between requests, once one was answered
                seat.idle_since = None if busy or not seat.proven else time.monotonic()

    def prove(self, connection: socket.socket) -> None:
        """The client showed the token, or had a request answered: it keeps its seat."""
        with self._table_lock:
            seat = self._connections.get(connection)
            if seat is not None:
                seat.proven = True

    def close_all(self) -> None:
        with self._table_lock:
            self.stopped = True
            connections = list(self._connections)
            self._connections.clear()
        for connection in connections:
            _close_quietly(connection)

    def _refuse(self, request: socket.socket) -> None:
        self.sink.count("connections_refused")
        body = b'{"error": "too many connections"}'
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        try:
            request.settimeout(0.2)
            request.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)
        except OSError:
            pass
        _close_quietly(request)


LINGER_SECONDS = 2.0
"""How long a refused request's body is read away before its connection closes."""


def _linger(connection: socket.socket, max_bytes: int) -> None:
    """Half-close after the answer, then discard what the client still sends, within
    :data:`LINGER_SECONDS` and twice ``max_bytes``, so it reads the answer, not a reset."""
    end = time.monotonic() + LINGER_SECONDS
    left = 2 * max_bytes
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
        while left > 0 and (remaining := end - time.monotonic()) > 0:
            connection.settimeout(remaining)
            chunk = connection.recv(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)


@dataclass(slots=True)
class _Seat:
    """One open connection in the table."""

    accepted: float
    idle_since: float | None = None  # waiting for its next request since (None: none answered yet, or busy)
    proven: bool = False


def _close_quietly(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)
    connection.close()


class _DeadlineReader(io.RawIOBase):
    """A connection's reads, each within the idle timeout, and all of a request's within its
    deadline: the head ``header_timeout`` seconds from its first byte, the body
    ``body_timeout`` from the end of the head. Past it a read raises ``TimeoutError`` (the
    connection is closed), however steadily the client drips bytes."""

    def __init__(self, connection: socket.socket, idle_timeout: float) -> None:
        super().__init__()
        self._connection = connection
        self._idle = idle_timeout
        self._deadline: float | None = None
        self._head_budget: float | None = None  # starts the deadline when a request's first byte comes
        self.expired = False

    def readable(self) -> bool:
        return True

    def await_request(self, header_timeout: float, from_now: bool = False) -> None:
        """The next request's head is due ``header_timeout`` seconds from its first byte (from
        now, for a connection's first request: a client that connects and sends nothing goes)."""
        self._deadline, self._head_budget, self.expired = None, header_timeout, False
        if from_now:
            self._deadline, self._head_budget = time.monotonic() + header_timeout, None

    def expect_body(self, body_timeout: float) -> None:
        self._deadline, self._head_budget = time.monotonic() + body_timeout, None

    def readinto(self, buffer: Any) -> int:
        timeout, limited = self._idle, False
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                self.expired = True
                raise TimeoutError("the request was not received in time")
            timeout, limited = min(left, self._idle), left < self._idle
        self._connection.settimeout(timeout)
        try:
            received = self._connection.recv_into(buffer)
        except TimeoutError:
            self.expired = self.expired or limited
            raise
        finally:
            self._connection.settimeout(self._idle)  # writes keep the idle timeout
        if received and self._deadline is None and self._head_budget is not None:
            self._deadline = time.monotonic() + self._head_budget  # the request's first byte
        return received


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} is not allowed")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: the plugin reuses one connection
    wbufsize = -1  # headers and body leave in one segment (no delayed-ACK stalls)
    disable_nagle_algorithm = True

    _linger = False
    _answered = False  # a request of this connection was answered

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout)  # per connection: idle clients go
        self.rfile.close()
        self._reader = _DeadlineReader(self.connection, self.server.idle_timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.await_request(self.server.header_timeout, from_now=not self._answered)
        self._slow_counted = False
        try:
            super().handle_one_request()  # a TimeoutError while reading the head closes the connection
        finally:
            self.server.mark(self.connection, busy=False)
            if self._reader.expired:
                self.close_connection = True
                self._count_slow()

    def _count_slow(self) -> None:
        """A request that took too long is closed: counted once, before any answer leaves."""
        if not self._slow_counted:
            self._slow_counted = True
            self.server.sink.count("slow_requests_closed")

    def parse_request(self) -> bool:
        self.server.mark(self.connection, busy=True)  # the request line came: not idle
        parsed = super().parse_request()
        self._reader.expect_body(self.server.body_timeout)
        return parsed

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: counted in /stats instead

    def do_GET(self) -> None:
        if not self._admitted():
            return
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/stats":
            sink = self.server.sink
            self._reply(200, {"events": sink.stats().model_dump(), "pilot": sink.pilot.stats().model_dump()})
        elif self.path == "/metrics":
            self._metrics()
        else:
            self._reply(404, {"error": f"no such endpoint: GET {self.path}"})

    def _metrics(self) -> None:
        """The pilot's stats in Prometheus' text format (the ``[metrics]`` extra; 404 without it)."""
        try:
            from ..pilot.metrics import exposition  # prometheus_client: only when scraped
        except ImportError:
            self._reply(404, {"error": "GET /metrics needs prometheus-client: the [metrics] extra"})
            return
        body, content_type = exposition(self.server.sink.pilot.stats())
        self._reply_bytes(200, body, content_type)

    def do_POST(self) -> None:
        if not self._admitted():
            return
        sink = self.server.sink
        try:
            if self.path not in ("/kv-events", "/evict"):
                self._drain()
                raise _BadRequest(404, f"no such endpoint: POST {self.path}")
            content_type = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if content_type != "application/json":
                self._drain()
                raise _BadRequest(415, "Content-Type must be application/json")
            payload = self._json()
            if self.server.stopped:
                raise _BadRequest(503, "the listener is stopping")
            # without a token anyone on this host may post: what they say stays in this worker
            local = contextlib.nullcontext() if self.server.token is not None else sink.pilot.unshared()
            _check_sizes(payload, self.server.max_batch_blocks)  # before validating: one error, not millions
            if self.path == "/kv-events":
                batch = KvEventBatch.model_validate(payload)
                if batch.block_count > self.server.max_batch_blocks:
                    raise _BadRequest(413, f"batch over {self.server.max_batch_blocks} blocks")
                with local:
                    applied = sink.apply(batch)
                self._reply(200, {"status": "ok" if applied else "duplicate"})
            else:
                with local:
                    known = sink.evict(EvictRequest.model_validate(payload).request_ids)
                self._reply(200, {"evicted": known})
        except _BadRequest as exc:
            sink.reject()
            self._reply(exc.status, {"error": str(exc)}, close=exc.status in (408, 411, 413, 503))
        except ValidationError as exc:
            sink.reject()
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            self._reply(400, {"error": f"invalid {self.path[1:]} body: {where}: {error['msg']}"})
        except RecursionError:
            sink.reject()
            self._reply(400, {"error": "body nested too deeply"})
        except Exception:  # never a traceback and a dropped connection: log, answer 500
            logger.exception("contextpilot listener: applying %s failed", self.path)
            sink.reject()
            self._reply(500, {"error": "internal error; see the server log"}, close=True)

    def _admitted(self) -> bool:
        """Stopped, foreign Host or Origin, wrong token: refused before anything else."""
        server = self.server
        status, message = 0, ""
        if server.stopped:
            status, message = 503, "the listener is stopping"
        elif self.headers.get("Origin") is not None:
            status, message = 403, "requests from browser pages (an Origin header) are refused"
        elif server.loopback and not _loopback_host(self.headers.get("Host")):
            status, message = 403, "Host must be a loopback address"
        elif server.token is not None:
            given = self.headers.get(TOKEN_HEADER) or self.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), server.token.encode()):
                status, message = 401, "missing or wrong token"
        if not status:
            if server.token is not None:
                server.prove(self.connection)  # admitted by its token before its body is read
            return True
        server.sink.reject()
        self._drain()
        self._reply(status, {"error": message}, close=status == 503)
        return False

    def _json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not _CONTENT_LENGTH.fullmatch(length):
            raise _BadRequest(411, "Content-Length required (a decimal number)")
        if int(length) > self.server.max_body_bytes:
            raise _BadRequest(413, f"body over {self.server.max_body_bytes} bytes")
        try:
            body = self.rfile.read(int(length))
        except TimeoutError:
            self._count_slow()  # before the 408 is written: a client reading it sees the count
            raise _BadRequest(408, f"the body did not arrive within {self.server.body_timeout:g} s") from None
        try:
            return json.loads(body, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise _BadRequest(400, f"malformed JSON: {getattr(exc, 'msg', exc)}") from None

    def _drain(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if _CONTENT_LENGTH.fullmatch(length) and int(length) <= self.server.max_body_bytes:
            try:
                self.rfile.read(int(length))
            except TimeoutError:
                self.close_connection = True
        else:
            self.close_connection = self._linger = True

    def finish(self) -> None:
        super().finish()
        if self._linger:
            self._linger = False
            _linger(self.connection, self.server.max_body_bytes)

    def _reply(self, status: int, payload: dict[str, Any], close: bool = False) -> None:
        self._reply_bytes(status, json.dumps(payload, allow_nan=False).encode(), "application/json", close)

    def _reply_bytes(self, status: int, data: bytes, content_type: str, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
            # a body left unread (over the limit, or refused): read it away before closing, or
            # the client, still sending, gets a reset instead of this answer
            self._linger = self._linger or status in (411, 413)
        self.end_headers()
        self.wfile.write(data)
        self._answered = True
        if status < 400:
            self.server.prove(self.connection)


def _check_sizes(payload: Any, max_blocks: int) -> None:
    """Lists longer than any batch may be, refused (413) before they are validated item by item."""
    if not isinstance(payload, dict):
        return
    for name in ("events", "request_ids"):
        items = payload.get(name)
        if isinstance(items, list) and len(items) > max_blocks:
            raise _BadRequest(413, f"{name}: over {max_blocks} items")
    events = payload.get("events")
    if isinstance(events, list):
        named = sum(
            len(e["block_hashes"]) for e in events if isinstance(e, dict) and isinstance(e.get("block_hashes"), list)
        )
        if named > max_blocks:
            raise _BadRequest(413, f"batch over {max_blocks} blocks")


def _loopback_host(header: str | None) -> bool:
    if header is None:
        return True  # HTTP/1.0 clients send none; browsers always do
    match = _HOST.fullmatch(header.strip())
    return bool(match) and match.group(1).lower() in LOOPBACK_HOSTS  # type: ignore[union-attr]


class EvictionListener:
    """The callback server, in a background thread. Use as a context manager or call
    :meth:`stop`.

    Args:
        pilot: the pilot whose index the events keep true.
        host: interface to bind; 127.0.0.1 by default (anything else needs a ``token``).
        port: 0 picks a free port (see :attr:`url`).
        token: shared secret expected in the ``X-ContextPilot-Token`` header (or as a
            bearer token; the engine's plugin sends ``CONTEXTPILOT_EVENTS_TOKEN``); must not
            be empty. Needed for the events to reach other workers through a shared index.
        max_body_bytes: larger requests are refused with 413.
        max_batch_blocks: event batches naming more blocks are refused with 413
            (:data:`~contextpilot_integrations.core.validation.MAX_BLOCKS`, as everywhere).
        max_connections: open connections at most; at the bound the longest-idle one is
            closed for a new client, and new clients get 503 when none is idle.
        idle_timeout: seconds a connection may wait for a request, or between its bytes.
        header_timeout: seconds from a request's first byte to the end of its head.
        body_timeout: seconds from the end of a request's head to the end of its body.
        page_size: the engine's page size, if known before the first event.
        block_map: the engine block map to use (to choose its memory bounds).
    """

    def __init__(
        self,
        pilot: ContextPilot,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        max_batch_blocks: int = MAX_BLOCKS,
        max_connections: int = 256,
        idle_timeout: float = 30.0,
        header_timeout: float = 5.0,
        body_timeout: float = 10.0,
        page_size: int | None = None,
        block_map: EngineBlockMap | None = None,
    ) -> None:
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("token must be a non-empty string (an empty token would disable authentication)")
        loopback = host in LOOPBACK_HOSTS
        if not loopback and token is None:
            raise ValueError(f"binding {host} needs a token: anyone who can reach it could reset the index")
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        for name, seconds in (("idle", idle_timeout), ("header", header_timeout), ("body", body_timeout)):
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"{name}_timeout must be a positive number of seconds")
        if token is None and getattr(pilot, "shared", None) is not None:
            logger.warning(
                "contextpilot listener without a token: any process on this host may post to it, so the "
                "events it receives stay in this worker and are not shared; give it a token (and the engine "
                "CONTEXTPILOT_EVENTS_TOKEN) to share them with every worker"
            )
        self.sink = KvEventSink(pilot, block_map if block_map is not None else EngineBlockMap(page_size))
        self._server = _Server(
            (host, port),
            self.sink,
            token=token,
            max_body_bytes=max_body_bytes,
            max_batch_blocks=max_batch_blocks,
            max_connections=max_connections,
            idle_timeout=idle_timeout,
            header_timeout=header_timeout,
            body_timeout=body_timeout,
            loopback=loopback,
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="contextpilot-events", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        name = host.decode() if isinstance(host, bytes) else host
        return f"http://{name}:{port}"

    @property
    def kv_events_url(self) -> str:
        """What to put in SGLang's ``--kv-events-config`` endpoint."""
        return self.url + "/kv-events"

    def stop(self) -> None:
        """Stop serving: open keep-alive connections are closed, and nothing more is applied."""
        self._server.close_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> EvictionListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
