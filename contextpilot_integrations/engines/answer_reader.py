"""Read one OpenAI-compatible answer, streamed (server-sent events) or whole, safely.

An engine's answer comes from outside: it is read within a byte budget and a deadline, a
stream line by line in linear time, and anything malformed, cut short or carrying an
error raises instead of passing for an answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from ..errors import EngineError, EngineTimeout
from . import wire

__all__ = ["MAX_LINE_BYTES", "AnswerReader", "ParsedAnswer"]

MAX_LINE_BYTES = 16 * 1024 * 1024
"""A longer stream line is refused (SGLang's or vLLM's prompt token ids of a million-token
prompt take about 8 MB)."""


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    """What an answer said: its text, usage, ids and timings, checked."""

    text: str
    usage: dict[str, Any]
    first_s: float | None  # perf_counter of the first content chunk
    input_ids: list[int] | None
    answer_id: str | None = None
    prompt_ms: float | None = None


class AnswerReader:
    """Reads one answer, streamed or whole, within a byte budget and a deadline.

    Bytes are kept in a ``bytearray`` and a stream is split into lines as they arrive,
    each chunk searched once: reading is linear in the answer's size. A stream line over
    :data:`MAX_LINE_BYTES` is refused."""

    def __init__(self, where: str, stream: bool, deadline: float | None, max_bytes: int) -> None:
        self.where = where
        self.stream = stream
        self.deadline = deadline
        self.max_bytes = max_bytes
        self.received = 0
        self.buffer = bytearray()
        self.text: list[str] = []
        self.usage: dict[str, Any] = {}
        self.first: float | None = None
        self.input_ids: list[int] | None = None
        self.answer_id: str | None = None
        self.prompt_ms: float | None = None
        self.done = False

    def feed(self, chunk: bytes) -> bool:
        """Take the next bytes; returns True once the answer is complete."""
        self.received += len(chunk)
        if self.received > self.max_bytes:
            raise EngineError(f"{self.where} answered more than {self.max_bytes} bytes")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise EngineTimeout(f"{self.where} timed out: no complete answer within the deadline")
        if not self.stream:
            self.buffer += chunk
            return False
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self.buffer += chunk[start:end]
            line, self.buffer = self.buffer, bytearray()
            start = end + 1
            if self._line(line.decode("utf-8", errors="replace").strip()):
                self.done = True
                return True
        self.buffer += chunk[start:]
        if len(self.buffer) > MAX_LINE_BYTES:
            raise EngineError(f"{self.where} sent a stream line longer than {MAX_LINE_BYTES:,} bytes")
        return False

    def _line(self, line: str) -> bool:
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):  # a number of 4,300+ digits is a ValueError
            raise EngineError(f"{self.where} sent a malformed stream chunk: {data[:100]!r}") from None
        if not isinstance(event, dict):
            raise EngineError(f"{self.where} sent a malformed stream chunk: {data[:100]!r}")
        message = wire.answer_error(event)
        if message is not None:
            raise EngineError(f"{self.where} reported an error mid-stream: {message}")
        choices = event.get("choices") or []
        if not isinstance(choices, list):
            raise EngineError(f"{self.where} sent malformed choices: {choices!r:.100}")
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            piece = delta.get("content") if isinstance(delta, dict) else None
            if not isinstance(piece, str):
                piece = ""
            if self.first is None and (piece or (isinstance(choice, dict) and choice.get("finish_reason"))):
                self.first = time.perf_counter()
            self.text.append(piece)
        if event.get("usage") is not None:
            self.usage = wire.usage(event["usage"], self.where)
        if self.answer_id is None and isinstance(event.get("id"), str):
            self.answer_id = event["id"]
        self.prompt_ms = wire.prompt_ms(event) or self.prompt_ms
        self.input_ids = wire.input_ids(event, self.where) or self.input_ids
        return False

    def result(self) -> ParsedAnswer:
        if self.stream:
            if not self.done:
                raise EngineError(f"{self.where} ended the stream before [DONE]: the answer may be cut short")
            return ParsedAnswer(
                "".join(self.text), self.usage, self.first, self.input_ids, self.answer_id, self.prompt_ms
            )
        try:
            payload = json.loads(self.buffer)
        except (ValueError, RecursionError):  # also a number of 4,300+ digits, or too deep
            raise EngineError(f"{self.where} answered with malformed JSON: {bytes(self.buffer[:100])!r}") from None
        if not isinstance(payload, dict):
            raise EngineError(f"{self.where} answered {type(payload).__name__} instead of a JSON object")
        message = wire.answer_error(payload)
        if message is not None:
            raise EngineError(f"{self.where} reported an error: {message}")
        choices = payload.get("choices") or [{}]
        if not isinstance(choices, list) or not isinstance(choices[0], dict):
            raise EngineError(f"{self.where} answered malformed choices: {choices!r:.100}")
        message_obj = choices[0].get("message")
        if not isinstance(message_obj, (dict, type(None))):
            raise EngineError(f"{self.where} answered a malformed message: {message_obj!r:.100}")
        text = (message_obj or {}).get("content") or ""
        if not isinstance(text, str):
            raise EngineError(f"{self.where} answered non-text content: {text!r:.100}")
        answer_id = payload.get("id") if isinstance(payload.get("id"), str) else None
        usage, ids = wire.usage(payload.get("usage"), self.where), wire.input_ids(payload, self.where)
        return ParsedAnswer(text, usage, None, ids, answer_id, wire.prompt_ms(payload))
