"""A fake of OpenAI's Chat Completions API (the hosted API cannot be reached from here).

:class:`FakeOpenAI` serves ``POST /v1/chat/completions`` (JSON, or server-sent events with
the usage chunk when ``stream_options.include_usage``), for the real ``openai`` SDK,
``langchain-openai`` and ``llama-index-llms-openai``. It writes no model output worth
reading; what it models is the prompt cache OpenAI documents, simply:

- automatic for prompts of at least ``min_tokens`` (1,024) tokens, hits counted in steps of
  ``granularity`` (128) tokens, reported as ``usage.prompt_tokens_details.cached_tokens``;
- a prefix is found only in the cache its request is routed to: by ``prompt_cache_key``
  when the request names one, else by a hash of its first 256 tokens;
- GPT-5.6 and later (a request with ``prompt_cache_breakpoint`` content parts or
  ``prompt_cache_options``): entries end exactly at the breakpoints (plus a managed one at
  the end of the prompt unless ``prompt_cache_options.mode`` is ``explicit``), matched
  exactly, writes reported as ``prompt_tokens_details.cache_write_tokens``.

The prompt is the tools (as JSON), then each message's role and text, in order; four
characters count as one token. With ``call_tools`` on, a request that offers tools and ends
with a user message gets a call of its first tool (its first parameter: that message's
text); one that ends with a tool result gets a plain answer. Every body is recorded.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from .fake_http import CHARS_PER_TOKEN, Answer, FakeProvider, PrefixCache, stepped_prefix_keys, tokens

__all__ = ["FakeOpenAI", "fake_openai", "prompt_text", "prompt_text_and_breakpoints"]

ROUTING_TOKENS = 256


@dataclass
class FakeOpenAI(FakeProvider):
    """A running fake of OpenAI's Chat Completions API (see the module docstring)."""

    min_tokens: int = 1024
    granularity: int = 128
    fail_next: int = 0
    """Answer the next this many requests with HTTP 500."""

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return self.url + "/v1"

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        """The usage this request is billed (and the prefixes it leaves in the cache)."""
        text, marks = prompt_text_and_breakpoints(body)
        total = tokens(text)
        scope = str(
            body.get("prompt_cache_key")
            or "route:" + hashlib.sha256(text[: ROUTING_TOKENS * CHARS_PER_TOKEN].encode()).hexdigest()
        )
        options = body.get("prompt_cache_options")
        if marks or isinstance(options, dict):
            cached, written = self._explicit(text, marks, scope, (options or {}).get("mode") == "explicit")
        else:
            cached, written = self._automatic(text, scope), 0
        details: dict[str, Any] = {"cached_tokens": cached, "audio_tokens": 0}
        if marks or isinstance(options, dict):
            details["cache_write_tokens"] = written
        return {
            "prompt_tokens": total,
            "completion_tokens": 1,
            "total_tokens": total + 1,
            "prompt_tokens_details": details,
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0},
        }

    def _automatic(self, text: str, scope: str) -> int:
        """Before GPT-5.6: every prefix of 1,024 tokens and more, in 128-token steps."""
        boundaries = [
            (size, key) for size, key in stepped_prefix_keys(text, self.granularity, scope) if size >= self.min_tokens
        ]
        cached = next((size for size, key in reversed(boundaries) if self._cache.holds(key)), 0)
        for _, key in boundaries:
            self._cache.add(key)
        return cached

    def _explicit(self, text: str, marks: list[int], scope: str, explicit_only: bool) -> tuple[int, int]:
        """GPT-5.6 and later: entries end exactly at breakpoints (the content parts' explicit
        ones, and in implicit mode a managed one at the end of the prompt); a request reads
        the longest one it repeats exactly and writes its latest four (three explicit and
        the managed one in implicit mode)."""
        ends = sorted(set(marks)) + ([] if explicit_only else [len(text)])
        keys = {end: PrefixCache.key([text[:end]], scope) for end in ends}
        read = max((end for end in ends if self._cache.holds(keys[end])), default=0)
        writing = sorted(set(marks))[-4:] if explicit_only else [*sorted(set(marks))[-3:], len(text)]
        fresh = [end for end in writing if tokens(text[:end]) >= self.min_tokens and not self._cache.holds(keys[end])]
        for end in fresh:
            self._cache.add(keys[end])
        written = tokens(text[: max(fresh)]) - tokens(text[:read]) if fresh and max(fresh) > read else 0
        return tokens(text[:read]), written

    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Answer:
        if method != "POST" or path.split("?")[0].rstrip("/") != "/v1/chat/completions" or body is None:
            return Answer(
                404, {"error": {"message": f"no such route: {method} {path}", "type": "invalid_request_error"}}
            )
        number = self.record(body)
        with self._lock:
            failing = self.fail_next > 0
            self.fail_next -= failing
        if failing:
            return Answer(500, {"error": {"message": "fake failure", "type": "server_error"}})
        usage = self.usage(body)
        message: dict[str, Any] = {"role": "assistant", "content": "ok", "refusal": None}
        finish = "stop"
        call = self._tool_call(body, number)
        if call is not None:
            message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
            finish = "tool_calls"
        base = {"id": f"chatcmpl-fake-{number}", "created": 0, "model": body.get("model", "fake")}
        if not body.get("stream"):
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            return Answer(payload={**base, "object": "chat.completion", "choices": [choice], "usage": usage})
        return Answer(events=self._chunks(base, message, finish, usage, body), tail="data: [DONE]\n\n")

    def _tool_call(self, body: dict[str, Any], number: int) -> dict[str, Any] | None:
        tools = body.get("tools") or []
        messages = body.get("messages") or []
        if not (self.call_tools and tools and messages and messages[-1].get("role") == "user"):
            return None
        function = tools[0].get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {"query": {}}
        arguments = {next(iter(properties)): _text(messages[-1].get("content"))}
        return {
            "id": f"call_fake_{number}",
            "type": "function",
            "function": {"name": function.get("name", "tool"), "arguments": json.dumps(arguments)},
        }

    @staticmethod
    def _chunks(
        base: dict[str, Any], message: dict[str, Any], finish: str, usage: dict[str, Any], body: dict[str, Any]
    ) -> list[tuple[str | None, dict[str, Any]]]:
        chunk = {**base, "object": "chat.completion.chunk"}
        if message.get("tool_calls"):
            call = message["tool_calls"][0]
            delta: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{"index": 0, **call}]}
        else:
            delta = {"role": "assistant", "content": message["content"]}
        events: list[tuple[str | None, dict[str, Any]]] = [
            (None, {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}),
            (None, {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
        ]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append((None, {**chunk, "choices": [], "usage": usage}))
        return events


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt a Chat Completions request stands for: tools, then each message, in order."""
    return prompt_text_and_breakpoints(body)[0]


def prompt_text_and_breakpoints(body: dict[str, Any]) -> tuple[str, list[int]]:
    """The prompt, and where its explicit ``prompt_cache_breakpoint`` content parts end."""
    text = "".join(json.dumps(tool, sort_keys=True) + "\n" for tool in body.get("tools") or [])
    marks: list[int] = []
    for message in body.get("messages") or []:
        text += f"{message.get('role')}:"
        content = message.get("content")
        for part in [content] if isinstance(content, str) else content or []:
            text += part if isinstance(part, str) else str(part.get("text", ""))
            if isinstance(part, dict) and part.get("prompt_cache_breakpoint"):
                marks.append(len(text))
        if message.get("tool_calls"):
            text += json.dumps(message["tool_calls"], sort_keys=True)
        text += "\n"
    return text, marks


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return ""


def fake_openai(**options: Any) -> AbstractContextManager[FakeOpenAI]:
    """A :class:`FakeOpenAI` on a free port of 127.0.0.1, stopped on exit."""
    return FakeOpenAI(**options).running("fake-openai")
