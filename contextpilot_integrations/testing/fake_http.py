"""What the fakes of hosted APIs share: a JSON server on 127.0.0.1 and a prefix cache.

The hosted APIs (OpenAI, Anthropic, Bedrock, Gemini) cannot be reached from here; their
fakes (:mod:`.fake_providers`, :mod:`.fake_openai`, :mod:`.fake_bedrock`,
:mod:`.fake_gemini`) speak each wire format over real HTTP so that the real SDKs and
framework classes can be driven against them. Each records every request body it gets.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol, TypeVar

__all__ = [
    "CHARS_PER_TOKEN",
    "Answer",
    "FakeProvider",
    "FakeServer",
    "PrefixCache",
    "breakpoint_usage",
    "prefix_keys",
    "serve",
    "stepped_prefix_keys",
    "tokens",
]

MAX_BODY = 8 << 20
CHARS_PER_TOKEN = 4
"""The fakes count four characters as one token."""


def tokens(text: str) -> int:
    return len(text) // CHARS_PER_TOKEN


@dataclass
class Answer:
    """What a fake sends back: a JSON object, or server-sent events (``(event, data)`` pairs;
    event ``None`` for plain ``data:`` lines), or raw bytes with their content type."""

    status: int = 200
    payload: dict[str, Any] | None = None
    events: list[tuple[str | None, dict[str, Any]]] | None = None
    raw: bytes | None = None
    content_type: str = "application/json"
    tail: str = ""
    """Sent after the events (OpenAI ends a stream with ``data: [DONE]``)."""


class FakeServer(Protocol):
    url: str

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Answer: ...


@dataclass
class PrefixCache:
    """Prefixes a provider holds, as hashes of their text (bounded: oldest dropped first)."""

    max_entries: int = 50_000
    _held: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def key(pieces: Sequence[str], scope: str = "") -> bytes:
        digest = hashlib.sha256(scope.encode())
        for piece in pieces:
            digest.update(hashlib.sha256(piece.encode()).digest())
        return digest.digest()

    def holds(self, key: bytes) -> bool:
        with self._lock:
            if key in self._held:
                self._held.move_to_end(key)
                return True
            return False

    def add(self, key: bytes) -> None:
        with self._lock:
            self._held[key] = None
            self._held.move_to_end(key)
            while len(self._held) > self.max_entries:
                self._held.popitem(last=False)


def prefix_keys(pieces: Sequence[str], scope: str = "") -> list[bytes]:
    """The key of every prefix of ``pieces`` (one per piece: the prefix ending there)."""
    running = hashlib.sha256(scope.encode())
    keys = []
    for piece in pieces:
        running.update(hashlib.sha256(piece.encode()).digest())
        keys.append(running.copy().digest())
    return keys


def stepped_prefix_keys(text: str, step_tokens: int, scope: str = "") -> list[tuple[int, bytes]]:
    """(tokens, key) of every prefix of ``text`` that is a whole number of ``step_tokens``."""
    step = step_tokens * CHARS_PER_TOKEN
    running = hashlib.sha256(scope.encode())
    keys = []
    for end in range(step, len(text) + 1, step):
        running.update(text[end - step : end].encode())
        keys.append((end // CHARS_PER_TOKEN, running.copy().digest()))
    return keys


def breakpoint_usage(
    cache: PrefixCache,
    pieces: Sequence[str],
    marks: Sequence[int],
    *,
    scope: str,
    min_tokens: int,
    lookback: int = 20,
) -> tuple[int, int]:
    """Cache reads and writes (tokens) of a prompt with explicit breakpoints (Anthropic's
    ``cache_control``, Bedrock's ``cachePoint``), as the providers document them: a prefix
    ending at a breakpoint is written on first use; a later request reads the longest
    cached prefix ending at one of its breakpoints or up to ``lookback`` blocks before it;
    a prefix shorter than ``min_tokens`` is neither read nor written (silently)."""
    keys = prefix_keys(pieces, scope)
    sizes: list[int] = []
    total = 0
    for piece in pieces:
        total += len(piece)
        sizes.append(total // CHARS_PER_TOKEN)
    usable = [mark for mark in marks if sizes[mark] >= min_tokens]
    read = 0
    for mark in usable:
        for index in range(mark, max(-1, mark - lookback - 1), -1):
            if sizes[index] >= min_tokens and cache.holds(keys[index]):
                read = max(read, sizes[index])
                break
    written = 0
    if usable:
        last = max(usable)
        if not cache.holds(keys[last]):
            written = max(0, sizes[last] - read)
        for mark in usable:
            cache.add(keys[mark])
    return read, written


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _send(self, answer: Answer) -> None:
            if answer.events is not None:
                data = (
                    "".join(
                        (f"event: {name}\n" if name else "") + f"data: {json.dumps(payload)}\n\n"
                        for name, payload in answer.events
                    ).encode()
                    + answer.tail.encode()
                )
                content_type = "text/event-stream"
            elif answer.raw is not None:
                data, content_type = answer.raw, answer.content_type
            else:
                data, content_type = json.dumps(answer.payload or {}).encode(), "application/json"
            self.send_response(answer.status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            if not 0 <= length <= MAX_BODY:
                self._send(Answer(413, {"error": {"message": "body too large"}}))
                return
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                self._send(Answer(400, {"error": {"message": "the body is not JSON"}}))
                return
            if body is not None and not isinstance(body, dict):
                self._send(Answer(400, {"error": {"message": "the body is not a JSON object"}}))
                return
            try:
                answer = fake.answer(method, self.path, body)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a malformed request
                answer = Answer(400, {"error": {"message": f"malformed request: {exc!r:.200}"}})
            self._send(answer)

        def do_POST(self) -> None:
            self._handle("POST")

        def do_GET(self) -> None:
            self._handle("GET")

    return Handler


@contextmanager
def serve(fake: FakeServer, name: str) -> Iterator[str]:
    """Serve ``fake`` on a free port of 127.0.0.1 until exit; yields its base URL."""
    with serve_handler(_handler(fake), name) as url:
        yield url


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    quiet = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not self.quiet:
            super().handle_error(request, client_address)


@contextmanager
def serve_handler(handler: type[BaseHTTPRequestHandler], name: str, *, quiet: bool = False) -> Iterator[str]:
    """Serve ``handler`` on a free port of 127.0.0.1 in a thread until exit; yields its base URL.
    ``quiet``: a client that hangs up on purpose is no error worth printing."""
    server = _Server(("127.0.0.1", 0), handler)
    server.quiet = quiet
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


F = TypeVar("F", bound="FakeProvider")


@dataclass
class FakeProvider:
    """What every hosted API's fake holds: where it runs, whether it calls tools, the bodies
    it got and the prefixes its cache holds."""

    url: str = ""
    """Its base URL, once :meth:`running`."""
    call_tools: bool = True
    """Answer a request that offers tools and ends with the user's text with a call of its first tool."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    """Every request body, in order of arrival."""
    _cache: PrefixCache = field(default_factory=PrefixCache)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        """The answer to one request, in the provider's wire format (each fake its own)."""
        raise NotImplementedError

    def record(self, body: dict[str, Any]) -> int:
        """Keep ``body``; its number (from 1)."""
        with self._lock:
            self.requests.append(body)
            return len(self.requests)

    @contextmanager
    def running(self: F, name: str) -> Iterator[F]:
        """This fake on a free port of 127.0.0.1 until exit (``url`` set)."""
        with serve(self, name) as url:
            self.url = url
            yield self
