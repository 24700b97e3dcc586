"""Fakes of hosted APIs that cannot be reached from here, for tests and demos.

:class:`FakeAnthropic` is a local server speaking Anthropic's Messages wire format
(``POST /v1/messages``, JSON or server-sent events), driven by the real ``anthropic`` SDK
and ``langchain-anthropic``. It is a fake: it writes no model output worth reading. What it
does model is the prompt cache the provider documents: a prefix up to a ``cache_control``
breakpoint is written on first use and read by later requests that repeat it exactly, and
the usage it reports (``cache_read_input_tokens``, ``cache_creation_input_tokens``,
``input_tokens``) is computed from the requests, not canned. Tokens are counted as four
characters each. Every request body is recorded (``requests``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeAnthropic", "broken_stream_server", "fake_anthropic"]

MAX_BODY = 8 << 20
CHARS_PER_TOKEN = 4


@dataclass
class FakeAnthropic:
    """A running fake of Anthropic's Messages API on 127.0.0.1 (see the module docstring)."""

    url: str
    requests: list[dict[str, Any]] = field(default_factory=list)
    fail_next: int = 0
    """Answer the next this many requests with HTTP 529 (overloaded)."""
    _cached: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def usage(self, body: dict[str, Any]) -> dict[str, int]:
        """The usage this request is billed: cache reads, writes, and the rest."""
        pieces, marks = _flatten(body)
        total = sum(len(piece) for piece in pieces) // CHARS_PER_TOKEN
        read = written = 0
        with self._lock:
            for mark in marks:
                prefix = "\x00".join(pieces[: mark + 1])
                size = len("".join(pieces[: mark + 1])) // CHARS_PER_TOKEN
                if prefix in self._cached:
                    read = max(read, size)
                else:
                    self._cached.add(prefix)
                    written = max(written, size - read)
        return {
            "input_tokens": total - read - written,
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        }


def _flatten(body: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The prompt's texts in order (tools, system, messages) and where breakpoints are."""
    pieces: list[str] = []
    marks: list[int] = []

    def add(text: str, block: Any) -> None:
        pieces.append(text)
        if isinstance(block, dict) and block.get("cache_control"):
            marks.append(len(pieces) - 1)

    for tool in body.get("tools") or []:
        add(json.dumps(tool, sort_keys=True), tool)
    system = body.get("system")
    for block in [system] if isinstance(system, str) else system or []:
        add(block if isinstance(block, str) else str(block.get("text", "")), block)
    for message in body.get("messages") or []:
        content = message.get("content")
        for block in [content] if isinstance(content, str) else content or []:
            add(f"{message.get('role')}:" + (block if isinstance(block, str) else str(block.get("text", ""))), block)
    return pieces, marks


def _handler(fake: FakeAnthropic) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 30

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            if self.path.rstrip("/") != "/v1/messages":
                self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": self.path}})
                return
            if (
                not (self.headers.get("content-type") or "").startswith("application/json")
                or not 0 < length <= MAX_BODY
            ):
                self._json(400, {"type": "error", "error": {"type": "invalid_request_error", "message": "bad body"}})
                return
            body = json.loads(self.rfile.read(length))
            with fake._lock:
                fake.requests.append(body)
                failing = fake.fail_next > 0
                fake.fail_next -= failing
            if failing:
                self._json(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
                return
            usage = fake.usage(body)
            message = {
                "id": f"msg_fake_{len(fake.requests)}",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", "fake"),
                "content": [{"type": "text", "text": "ok"}],
                "stop_reason": "end_turn",
                "stop_sequence": None,
                "usage": {**usage, "output_tokens": 1},
            }
            if body.get("stream"):
                self._stream(message)
            else:
                self._json(200, message)

        def _stream(self, message: dict[str, Any]) -> None:
            start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 0}}
            events = [
                ("message_start", {"type": "message_start", "message": start}),
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                ),
                (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
                ),
                ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                (
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                        "usage": {"output_tokens": 1},
                    },
                ),
                ("message_stop", {"type": "message_stop"}),
            ]
            data = "".join(f"event: {name}\ndata: {json.dumps(payload)}\n\n" for name, payload in events).encode()
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def fake_anthropic() -> Iterator[FakeAnthropic]:
    """A :class:`FakeAnthropic` on a free port of 127.0.0.1, stopped on exit."""
    fake = FakeAnthropic(url="")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    server.daemon_threads = True
    fake.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="fake-anthropic", daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def broken_stream_server() -> Iterator[str]:
    """A fake of an engine that crashes mid-answer: an OpenAI-compatible chat endpoint that
    starts a streamed (or plain) answer and drops the connection. Yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            delta = {"index": 0, "delta": {"role": "assistant", "content": "par"}}
            chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [delta]}
            first = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            self.wfile.write(f"{len(first):x}\r\n".encode() + first + b"\r\n")
            self.wfile.write(b"400\r\npartial")  # a chunk announced, never finished: the engine died
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="broken-stream", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
