"""A fake of Amazon Bedrock's Converse API (the hosted API cannot be reached from here).

:class:`FakeBedrock` serves ``POST /model/{modelId}/converse`` for the real ``boto3``
``bedrock-runtime`` client (point it at ``endpoint_url=fake.url`` with dummy credentials;
the fake checks no signature) and so for ``langchain-aws``'s ``ChatBedrockConverse``. It
writes no model output worth reading; what it models is the prompt cache Bedrock documents:
a ``{"cachePoint": {"type": "default"}}`` block in ``toolConfig.tools``, ``system`` or a
message's content marks the end of a prefix, written on first use and read by later
requests that repeat it (found at a cache point or up to 20 blocks before one), none below
``min_tokens`` (silently), at most 4 cache points (HTTP 400 otherwise). The usage
(``inputTokens``, ``cacheReadInputTokens``, ``cacheWriteInputTokens``) is computed from the
requests; four characters count as one token. With ``call_tools`` on, a request that
offers tools and ends with the user's text gets a ``toolUse`` of its first tool. The
streaming endpoint (``converse-stream``, AWS's binary event stream) is not faked. Every
request body is recorded, with its model id under ``"modelId"``.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from .fake_http import CHARS_PER_TOKEN, Answer, FakeProvider, breakpoint_usage

__all__ = ["FakeBedrock", "fake_bedrock"]

MAX_CACHE_POINTS = 4


@dataclass
class FakeBedrock(FakeProvider):
    """A running fake of Bedrock's Converse API (see the module docstring)."""

    min_tokens: int = 1024
    """The minimum tokens before a cache point (Claude 3.7 Sonnet and Claude 4 on Bedrock: 1,024)."""

    def usage(self, body: dict[str, Any], model: str) -> dict[str, int]:
        pieces, marks = _flatten(body)
        total = sum(len(piece) for piece in pieces) // CHARS_PER_TOKEN
        read, written = breakpoint_usage(self._cache, pieces, marks, scope=model, min_tokens=self.min_tokens)
        return {
            "inputTokens": total - read - written,
            "outputTokens": 1,
            "totalTokens": total + 1,
            "cacheReadInputTokens": read,
            "cacheWriteInputTokens": written,
        }

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        parts = path.split("?")[0].strip("/").split("/")
        if method != "POST" or len(parts) != 3 or parts[0] != "model" or parts[2] != "converse" or body is None:
            return Answer(404, {"message": f"fake Bedrock: no such route {method} {path}"})
        model = unquote(parts[1])
        number = self.record({**body, "modelId": model})
        points = len(_flatten(body)[1])
        if points > MAX_CACHE_POINTS:
            return Answer(400, {"message": f"The number of cachePoint blocks ({points}) exceeds {MAX_CACHE_POINTS}."})
        content: list[dict[str, Any]] = [{"text": "ok"}]
        stop = "end_turn"
        call = self._tool_use(body, number)
        if call is not None:
            content, stop = [call], "tool_use"
        return Answer(
            payload={
                "output": {"message": {"role": "assistant", "content": content}},
                "stopReason": stop,
                "usage": self.usage(body, model),
                "metrics": {"latencyMs": 1},
            }
        )

    def _tool_use(self, body: dict[str, Any], number: int) -> dict[str, Any] | None:
        tools = [tool for tool in (body.get("toolConfig") or {}).get("tools") or [] if "toolSpec" in tool]
        messages = body.get("messages") or []
        if not (self.call_tools and tools and messages and messages[-1].get("role") == "user"):
            return None
        content = messages[-1].get("content") or []
        if any("toolResult" in block for block in content):
            return None
        spec = tools[0]["toolSpec"]
        properties = ((spec.get("inputSchema") or {}).get("json") or {}).get("properties") or {"query": {}}
        text = "".join(str(block.get("text", "")) for block in content)
        return {
            "toolUse": {
                "toolUseId": f"tooluse_fake_{number}",
                "name": spec.get("name"),
                "input": {next(iter(properties)): text},
            }
        }


def _flatten(body: dict[str, Any]) -> tuple[list[str], list[int]]:
    """The prompt's pieces in order (tools, system, messages) and the pieces a cache point follows."""
    pieces: list[str] = []
    marks: list[int] = []

    def walk(blocks: list[dict[str, Any]], role: str) -> None:
        for block in blocks:
            if "cachePoint" in block:
                if pieces:
                    marks.append(len(pieces) - 1)
                continue
            if "toolResult" in block:
                for inner in block["toolResult"].get("content") or []:
                    pieces.append(f"{role}:tool_result:{inner.get('text', json.dumps(inner.get('json')))}")
            else:
                pieces.append(f"{role}:{block.get('text', json.dumps(block, sort_keys=True))}")

    walk((body.get("toolConfig") or {}).get("tools") or [], "tools")
    walk(body.get("system") or [], "system")
    for message in body.get("messages") or []:
        walk(message.get("content") or [], str(message.get("role")))
    return pieces, marks


def fake_bedrock(**options: Any) -> AbstractContextManager[FakeBedrock]:
    """A :class:`FakeBedrock` on a free port of 127.0.0.1, stopped on exit."""
    return FakeBedrock(**options).running("fake-bedrock")
