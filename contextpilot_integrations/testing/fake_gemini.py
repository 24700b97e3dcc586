"""A fake of Google's Gemini API ``generateContent`` (the hosted API cannot be reached from here).

:class:`FakeGemini` serves ``POST /{version}/models/{model}:generateContent`` (and
``:streamGenerateContent?alt=sse``) for the real ``google-genai`` client, so for
``langchain-google-genai``'s ``ChatGoogleGenerativeAI`` pointed at it with ``base_url``.
It writes no model output worth reading; what it models is Gemini's implicit cache, simply:
a request whose prompt (tools, system instruction, then contents, in order) starts like an
earlier request's reads that prefix from the cache (found in steps of ``granularity``
tokens), when the prefix is at least ``min_tokens`` long (Gemini 2.5 Flash and Pro: 2,048
in the docs read 2026-11); hits go to ``usageMetadata.cachedContentTokenCount``.
There are no markers: order is all that helps. Four characters count as one token. With
``call_tools`` on, a request that offers function declarations and ends with the user's
text gets a ``functionCall`` of the first one. Every request body is recorded, with its
model under ``"model"``.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from .fake_http import CHARS_PER_TOKEN, Answer, FakeProvider, stepped_prefix_keys

__all__ = ["FakeGemini", "fake_gemini"]


@dataclass
class FakeGemini(FakeProvider):
    """A running fake of the Gemini API (see the module docstring)."""

    min_tokens: int = 2048
    granularity: int = 32
    """Cached prefixes are found in steps of this many tokens (a simplification)."""

    def usage(self, body: dict[str, Any], model: str) -> dict[str, Any]:
        text = "".join(piece + "\n" for piece in _flatten(body))
        boundaries = [
            (size, key) for size, key in stepped_prefix_keys(text, self.granularity, model) if size >= self.min_tokens
        ]
        cached = next((size for size, key in reversed(boundaries) if self._cache.holds(key)), 0)
        for _, key in boundaries:
            self._cache.add(key)
        prompt = len(text) // CHARS_PER_TOKEN
        usage = {"promptTokenCount": prompt, "candidatesTokenCount": 1, "totalTokenCount": prompt + 1}
        return {**usage, "cachedContentTokenCount": cached} if cached else usage

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        route, _, query = path.partition("?")
        name, _, action = unquote(route).rpartition(":")
        model = name.split("/models/")[-1]
        if method != "POST" or "/models/" not in name or action not in ("generateContent", "streamGenerateContent"):
            return Answer(
                404, {"error": {"code": 404, "message": f"no such route {method} {path}", "status": "NOT_FOUND"}}
            )
        if body is None:
            return Answer(400, {"error": {"code": 400, "message": "no body", "status": "INVALID_ARGUMENT"}})
        self.record({**body, "model": model})
        part: dict[str, Any] = {"text": "ok"}
        call = self._function_call(body)
        if call is not None:
            part = {"functionCall": call}
        candidate = {"content": {"role": "model", "parts": [part]}, "finishReason": "STOP", "index": 0}
        payload = {"candidates": [candidate], "usageMetadata": self.usage(body, model), "modelVersion": model}
        if action == "streamGenerateContent":
            return (
                Answer(events=[(None, payload)]) if "alt=sse" in query else Answer(raw=json.dumps([payload]).encode())
            )
        return Answer(payload=payload)

    def _function_call(self, body: dict[str, Any]) -> dict[str, Any] | None:
        declarations = [d for tool in body.get("tools") or [] for d in tool.get("functionDeclarations") or []]
        contents = body.get("contents") or []
        if not (self.call_tools and declarations and contents and contents[-1].get("role") == "user"):
            return None
        parts = contents[-1].get("parts") or []
        if any("functionResponse" in part for part in parts):
            return None
        schema = declarations[0].get("parameters") or declarations[0].get("parametersJsonSchema") or {}
        properties = schema.get("properties") or {"query": {}}
        text = "".join(str(part.get("text", "")) for part in parts)
        return {"name": declarations[0].get("name"), "args": {next(iter(properties)): text}}


def _flatten(body: dict[str, Any]) -> list[str]:
    """The prompt's parts in order: tools, system instruction, contents."""
    pieces = [json.dumps(tool, sort_keys=True) for tool in body.get("tools") or []]
    system = body.get("systemInstruction") or body.get("system_instruction") or {}
    pieces += [f"system:{part.get('text', '')}" for part in system.get("parts") or []]
    for content in body.get("contents") or []:
        role = content.get("role")
        for part in content.get("parts") or []:
            pieces.append(f"{role}:{part['text'] if 'text' in part else json.dumps(part, sort_keys=True)}")
    return pieces


def fake_gemini(**options: Any) -> AbstractContextManager[FakeGemini]:
    """A :class:`FakeGemini` on a free port of 127.0.0.1, stopped on exit."""
    return FakeGemini(**options).running("fake-gemini")
