"""Asking a served model: one prompt flattening for every arm, greedy decoding.

A base model (no chat template, such as Gemma 3 270M) is asked through ``/v1/completions``
with the messages flattened into one prompt: the system line, then each turn as its user
message followed by ``Answer:`` and the answer, the same flattening for every arm, so the
arms differ only in what ContextPilot changed. A model with a chat template is asked
through ``/v1/chat/completions`` instead (``api="chat"``). Decoding is greedy
(``temperature`` 0), one line (stop at a newline), a few tokens: on one build of one
engine the same prompt gets the same answer, so arms can be compared exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ...engines import wire
from ...engines.client import redact_url
from ...errors import EngineError

__all__ = ["Answer", "AnswerClient", "flatten"]

API = Literal["completion", "chat"]


def flatten(messages: Sequence[Mapping[str, str]]) -> str:
    """Chat messages as one completion prompt: ``system``, then each user message followed
    by ``Answer:`` and, for earlier turns, the answer given."""
    parts = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            parts.append(content + "\n\n")
        elif role == "user":
            parts.append(content + "\nAnswer:")
        else:
            parts.append(" " + content.strip() + "\n\n")
    return "".join(parts)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the model said, and what the engine reported about the prompt."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    prompt_ms: float | None = None
    """llama-server's own prefill time (``timings.prompt_ms``), where it reports one."""
    computed_tokens: int | None = None
    """Prompt tokens the engine computed rather than reused (``timings.prompt_n``)."""


class AnswerClient:
    """Asks one OpenAI-compatible server (llama-server, vLLM, SGLang, or any other)."""

    def __init__(
        self, url: str, api: API = "completion", model: str = "default", max_tokens: int = 24, timeout: float = 600
    ) -> None:
        if api not in ("completion", "chat"):
            raise ValueError(f"api must be 'completion' or 'chat', got {api!r}")
        self.url, self.api, self.model, self.max_tokens = url.rstrip("/"), api, model, max_tokens
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AnswerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def answer(self, messages: Sequence[Mapping[str, str]]) -> Answer:
        """The model's answer to these messages (greedy, one line)."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stop": ["\n"]}
        if self.api == "chat":
            path, body["messages"] = "/v1/chat/completions", [dict(m) for m in messages]
        else:
            path, body["prompt"] = "/v1/completions", flatten(messages)
        where = redact_url(self.url) + path
        try:
            response = self._http.post(self.url + path, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(f"{where}: {exc}") from exc
        if response.status_code >= 400:
            raise EngineError(f"{where} answered HTTP {response.status_code}: {response.text[:300]}")
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if self.api == "chat" else choice["text"]
            usage = data.get("usage") or {}
            timings = data.get("timings") or {}
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"{where} answered something that is not a completion: {exc}") from exc
        return Answer(
            str(text or "").strip(),
            int(usage.get("prompt_tokens") or 0),
            int(usage.get("completion_tokens") or 0),
            wire.prompt_ms(data),
            timings.get("prompt_n"),
        )
