"""Fakes of hosted APIs that cannot be reached from here, for tests and demos.

:class:`FakeAnthropic` is a local server speaking Anthropic's Messages wire format
(``POST /v1/messages``, JSON or server-sent events), driven by the real ``anthropic`` SDK,
``langchain-anthropic`` and ``llama-index-llms-anthropic``. It is a fake: it writes no
model output worth reading. What it does model is the prompt cache the provider documents
(:func:`~.fake_http.breakpoint_usage`): a prefix up to a ``cache_control`` breakpoint is
written on first use and read by later requests that repeat it, found at a breakpoint or up
to 20 blocks before one; a prefix below ``min_tokens`` is silently not cached; more than 4
breakpoints is an error (HTTP 400), as on the real API; the top-level ``cache_control``
(automatic caching: a marker on the last block) takes one of the 4 slots. The usage it reports
(``cache_read_input_tokens``, ``cache_creation_input_tokens``, ``input_tokens``) is
computed from the requests, not canned. Tokens are counted as four characters each. With
``call_tools`` on, a request that offers tools and ends with the user's text gets a
``tool_use`` of its first tool (its first parameter: that text); one that ends with tool
results gets a plain answer. Every request body is recorded (``requests``).

The other hosted APIs' fakes are siblings: :mod:`.fake_openai`, :mod:`.fake_bedrock`,
:mod:`.fake_gemini`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

from .fake_http import CHARS_PER_TOKEN, Answer, FakeProvider, breakpoint_usage, serve_handler

__all__ = ["FakeAnthropic", "broken_stream_server", "fake_anthropic"]

MAX_BREAKPOINTS = 4


@dataclass
class FakeAnthropic(FakeProvider):
    """A running fake of Anthropic's Messages API on 127.0.0.1 (see the module docstring)."""

    min_tokens: int = 1024
    """The minimum cacheable prompt length (Claude Sonnet and Opus 4: 1,024 tokens)."""
    fail_next: int = 0
    """Answer the next this many requests with HTTP 529 (overloaded)."""

    def usage(self, body: dict[str, Any]) -> dict[str, int]:
        """The usage this request is billed: cache reads, writes, and the rest (and the
        prefixes it leaves in the cache)."""
        pieces, marks = _flatten(body)
        if body.get("cache_control") and pieces and (not marks or marks[-1] != len(pieces) - 1):
            marks = [*marks, len(pieces) - 1]  # the top-level (automatic) marker: on the last block
        total = sum(len(piece) for piece in pieces) // CHARS_PER_TOKEN
        read, written = breakpoint_usage(
            self._cache, pieces, marks, scope=str(body.get("model")), min_tokens=self.min_tokens
        )
        return {
            "input_tokens": total - read - written,
            "cache_read_input_tokens": read,
            "cache_creation_input_tokens": written,
        }

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        if method != "POST" or path.split("?")[0].rstrip("/") != "/v1/messages" or body is None:
            return _error(404, "not_found_error", f"{method} {path}")
        number = self.record(body)
        with self._lock:
            failing = self.fail_next > 0
            self.fail_next -= failing
        if failing:
            return _error(529, "overloaded_error", "Overloaded")
        breakpoints = len(_flatten(body)[1]) + bool(body.get("cache_control"))  # the automatic one takes a slot
        if breakpoints > MAX_BREAKPOINTS:
            return _error(
                400,
                "invalid_request_error",
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {breakpoints}.",
            )
        usage = self.usage(body)
        content: list[dict[str, Any]] = [{"type": "text", "text": "ok"}]
        stop = "end_turn"
        call = self._tool_use(body, number)
        if call is not None:
            content, stop = [call], "tool_use"
        message = {
            "id": f"msg_fake_{number}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model", "fake"),
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 1},
        }
        return Answer(events=_events(message)) if body.get("stream") else Answer(payload=message)

    def _tool_use(self, body: dict[str, Any], number: int) -> dict[str, Any] | None:
        tools = body.get("tools") or []
        messages = body.get("messages") or []
        if not (self.call_tools and tools and messages and messages[-1].get("role") == "user"):
            return None
        content = messages[-1].get("content")
        parts = [content] if isinstance(content, str) else content or []
        if any(isinstance(part, dict) and part.get("type") == "tool_result" for part in parts):
            return None
        text = "".join(part if isinstance(part, str) else str(part.get("text", "")) for part in parts)
        properties = (tools[0].get("input_schema") or {}).get("properties") or {"query": {}}
        return {
            "type": "tool_use",
            "id": f"toolu_fake_{number}",
            "name": tools[0].get("name", "tool"),
            "input": {next(iter(properties)): text},
        }


def _error(status: int, kind: str, message: str) -> Answer:
    return Answer(status, {"type": "error", "error": {"type": kind, "message": message}})


def _flatten(body: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The prompt's pieces in order (tools, system, messages; a tool result's blocks one by
    one) and which pieces carry a breakpoint."""
    pieces: list[str] = []
    marks: list[int] = []

    def add(text: str, *blocks: Any) -> None:
        pieces.append(text)
        if any(isinstance(block, dict) and block.get("cache_control") for block in blocks):
            marks.append(len(pieces) - 1)

    for tool in body.get("tools") or []:
        add(json.dumps({k: v for k, v in tool.items() if k != "cache_control"}, sort_keys=True), tool)
    system = body.get("system")
    for block in [system] if isinstance(system, str) else system or []:
        add("system:" + (block if isinstance(block, str) else str(block.get("text", ""))), block)
    for message in body.get("messages") or []:
        content = message.get("content")
        role = message.get("role")
        for block in [content] if isinstance(content, str) else content or []:
            if isinstance(block, str):
                add(f"{role}:{block}", block)
            elif block.get("type") == "tool_result":
                inner = block.get("content")
                inner_blocks = [inner] if isinstance(inner, str) else inner or [""]
                for position, part in enumerate(inner_blocks):
                    text = part if isinstance(part, str) else str(part.get("text", ""))
                    last = position == len(inner_blocks) - 1
                    add(f"{role}:tool_result:{text}", part, *([block] if last else []))
            elif block.get("type") == "tool_use":
                add(f"{role}:tool_use:{json.dumps(block.get('input'), sort_keys=True)}", block)
            else:
                add(f"{role}:{block.get('text', '')}", block)
    return pieces, marks


def _events(message: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 0}}
    block = message["content"][0]
    if block["type"] == "tool_use":
        opening = {**block, "input": {}}
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
    else:
        opening = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": block["text"]}
    return [
        ("message_start", {"type": "message_start", "message": start}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": opening}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": 1},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def fake_anthropic(**options: Any) -> AbstractContextManager[FakeAnthropic]:
    """A :class:`FakeAnthropic` on a free port of 127.0.0.1, stopped on exit."""
    return FakeAnthropic(**options).running("fake-anthropic")


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

    with serve_handler(Handler, "broken-stream") as url:
        yield url
