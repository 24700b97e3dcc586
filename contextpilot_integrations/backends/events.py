"""Eviction sync: an HTTP callback server that keeps the pilot's index true.

SGLang (through our plugin, :mod:`.sglang_plugin`) POSTs its KV-cache event batches to
``/kv-events``; engines that only know request ids POST ``/evict``. Each batch updates
the :class:`EngineBlockMap` and shortens or drops the affected requests in the pilot.
A missing sequence number means events were lost: the pilot's index is then reset, since
it must never predict a hit it cannot confirm. ``AllBlocksCleared`` (engine restart,
``/flush_cache``) resets it too.

The server is the standard library's threading HTTP server (no hand-written parsing). It
binds 127.0.0.1 by default, refuses bodies over ``max_body_bytes`` (413) and, when a
token is set, requests without it (401).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import deque
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..pilot import ContextPilot
from .kv_mapping import EngineBlockMap

__all__ = ["EvictionListener", "KvEventBatch", "KvEventSink", "SinkStats"]

TOKEN_HEADER = "X-ContextPilot-Token"


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class BlockStoredEvent(_Event):
    type: Literal["BlockStored"]
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int]
    block_size: int = Field(gt=0)
    medium: str | None = None

    @model_validator(mode="after")
    def _pages_match_tokens(self) -> BlockStoredEvent:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(
                f"{len(self.block_hashes)} blocks of {self.block_size} tokens but {len(self.token_ids)} token ids"
            )
        return self


class BlockRemovedEvent(_Event):
    type: Literal["BlockRemoved"]
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksClearedEvent(_Event):
    type: Literal["AllBlocksCleared"]


KvEvent = Annotated[BlockStoredEvent | BlockRemovedEvent | AllBlocksClearedEvent, Field(discriminator="type")]


class KvEventBatch(BaseModel):
    """One batch as our SGLang plugin sends it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    seq: int = Field(ge=0)
    events: list[KvEvent]
    ts: float | None = None
    """Publisher's wall-clock time when the batch was published (for latency)."""
    rank: int = 0
    publisher: str = "default"


class EvictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_ids: list[str]


class SinkStats(BaseModel):
    """What the sink has received and done."""

    batches: int = 0
    events: int = 0
    sequence_gaps: int = 0
    index_resets: int = 0
    requests_shortened: int = 0
    requests_evicted: int = 0
    unknown_request_ids: int = 0
    rejected: int = 0
    tracked_requests: int = 0
    engine_blocks: int = 0
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None


class KvEventSink:
    """Applies event batches and evictions to a pilot (thread-safe)."""

    def __init__(self, pilot: ContextPilot, block_map: EngineBlockMap | None = None) -> None:
        self.pilot = pilot
        self.block_map = block_map or EngineBlockMap()
        self._lock = threading.Lock()
        self._last_seq: dict[tuple[str, int], int] = {}
        self._stats = SinkStats()
        self._latencies: deque[float] = deque(maxlen=10_000)

    def track(self, request_id: str, token_ids: Iterable[int], block_ends: Iterable[int] | None = None) -> None:
        """Record a sent request's prompt token ids (and where each of its blocks ends)."""
        with self._lock:
            self.block_map.track(request_id, list(token_ids), list(block_ends) if block_ends is not None else None)

    def apply(self, batch: KvEventBatch) -> None:
        with self._lock:
            stats = self._stats
            source = (batch.publisher, batch.rank)
            last = self._last_seq.get(source)
            if (last is not None and batch.seq != last + 1) or (
                last is None and batch.seq > 0 and self.pilot.stats().live_requests
            ):
                stats.sequence_gaps += 1
                self._reset()  # events were lost: predict nothing we cannot confirm
            self._last_seq[source] = batch.seq
            for event in batch.events:
                if isinstance(event, BlockStoredEvent):
                    grown = self.block_map.stored(
                        event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size, event.medium
                    )
                    for request_id, tokens in grown.items():
                        self.pilot.restore(request_id, self.block_map.blocks_within(request_id, tokens))
                elif isinstance(event, BlockRemovedEvent):
                    for request_id, tokens in self.block_map.removed(event.block_hashes, event.medium).items():
                        keep = self.block_map.blocks_within(request_id, tokens)
                        if keep is not None and self.pilot.truncate(request_id, keep):
                            stats.requests_shortened += 1
                else:
                    self._reset()
            stats.batches += 1
            stats.events += len(batch.events)
            if batch.ts is not None:
                self._latencies.append(max(0.0, time.time() - batch.ts))

    def evict(self, request_ids: list[str]) -> int:
        with self._lock:
            for request_id in request_ids:
                self.block_map.forget(request_id)
            known = self.pilot.evict(request_ids)
            self._stats.requests_evicted += known
            self._stats.unknown_request_ids += len(set(request_ids)) - known
            return known

    def reject(self) -> None:
        with self._lock:
            self._stats.rejected += 1

    def stats(self) -> SinkStats:
        with self._lock:
            latencies = sorted(self._latencies)
            update: dict[str, Any] = {
                "tracked_requests": len(self.block_map),
                "engine_blocks": self.block_map.stored_blocks,
            }
            if latencies:
                update["latency_p50_ms"] = latencies[len(latencies) // 2] * 1e3
                update["latency_p99_ms"] = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3
            return self._stats.model_copy(update=update)

    def _reset(self) -> None:
        self.block_map.cleared()
        self.pilot.reset()
        self._stats.index_resets += 1


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    sink: KvEventSink
    token: str | None
    max_body_bytes: int


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"  # keep-alive: the plugin reuses one connection
    wbufsize = -1  # headers and body leave in one segment (no delayed-ACK stalls)
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: counted in /stats instead

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/stats":
            sink = self.server.sink
            self._reply(200, {"events": sink.stats().model_dump(), "pilot": sink.pilot.stats().model_dump()})
        else:
            self._reply(404, {"error": f"no such endpoint: GET {self.path}"})

    def do_POST(self) -> None:
        if not self._authorised():
            return
        if self.path not in ("/kv-events", "/evict"):
            self._drain()
            self._reply(404, {"error": f"no such endpoint: POST {self.path}"})
            return
        body = self._body()
        if body is None:
            return
        sink = self.server.sink
        try:
            payload = json.loads(body)
            if self.path == "/kv-events":
                sink.apply(KvEventBatch.model_validate(payload))
                self._reply(200, {"status": "ok"})
            else:
                known = sink.evict(EvictRequest.model_validate(payload).request_ids)
                self._reply(200, {"evicted": known})
        except json.JSONDecodeError as exc:
            sink.reject()
            self._reply(400, {"error": f"malformed JSON: {exc.msg}"})
        except ValidationError as exc:
            sink.reject()
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            self._reply(400, {"error": f"invalid {self.path[1:]} body: {where}: {error['msg']}"})

    def _authorised(self) -> bool:
        token = self.server.token
        if token is None:
            return True
        given = self.headers.get(TOKEN_HEADER) or self.headers.get("Authorization", "").removeprefix("Bearer ")
        if hmac.compare_digest(given.encode(), token.encode()):
            return True
        self.server.sink.reject()
        self._drain()
        self._reply(401, {"error": "missing or wrong token"})
        return False

    def _body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.server.sink.reject()
            self._reply(411, {"error": "Content-Length required"}, close=True)
            return None
        if int(length) > self.server.max_body_bytes:
            self.server.sink.reject()
            self._reply(413, {"error": f"body over {self.server.max_body_bytes} bytes"}, close=True)
            return None
        return self.rfile.read(int(length))

    def _drain(self) -> None:
        length = self.headers.get("Content-Length", "0")
        if length.isdigit() and int(length) <= self.server.max_body_bytes:
            self.rfile.read(int(length))
        else:
            self.close_connection = True

    def _reply(self, status: int, payload: dict[str, Any], close: bool = False) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)


class EvictionListener:
    """The callback server, in a background thread. Use as a context manager or call
    :meth:`stop`.

    Args:
        pilot: the pilot whose index the events keep true.
        host: interface to bind; 127.0.0.1 by default (set a ``token`` for anything else).
        port: 0 picks a free port (see :attr:`url`).
        token: shared secret expected in the ``X-ContextPilot-Token`` header (or as a
            bearer token).
        max_body_bytes: larger requests are refused with 413.
        page_size: the engine's page size, if known before the first event.
    """

    def __init__(
        self,
        pilot: ContextPilot,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        max_body_bytes: int = 8 * 1024 * 1024,
        page_size: int | None = None,
    ) -> None:
        if host not in ("127.0.0.1", "localhost", "::1") and token is None:
            raise ValueError(f"binding {host} needs a token: anyone who can reach it could reset the index")
        self.sink = KvEventSink(pilot, EngineBlockMap(page_size))
        self._server = _Server((host, port), _Handler)
        self._server.sink = self.sink
        self._server.token = token
        self._server.max_body_bytes = max_body_bytes
        self._thread = threading.Thread(target=self._server.serve_forever, name="contextpilot-events", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def kv_events_url(self) -> str:
        """What to put in SGLang's ``--kv-events-config`` endpoint."""
        return self.url + "/kv-events"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> EvictionListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
