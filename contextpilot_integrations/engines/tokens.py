"""Tokens as the engine makes them: its own ``POST /tokenize``.

The send decision weighs block reuse against the tokens labels and the order annotation
add (:mod:`contextpilot_integrations.core.gain`); it is only right when both are counted in
the engine's units. A model's tokenizer is the engine's business (tiny test models read one
token a character, real ones about four), so the counter asks the engine:
``ContextPilot(token_counter=EngineTokenCounter(url))``. SGLang and vLLM take
``{"model", "prompt", "add_special_tokens"}``, llama-server ``{"content", "add_special"}``;
both answer ``{"tokens": [...]}``. The first text finds which body the server reads.
:class:`TokenizeEndpoint` is that exchange, for the counter and for the what-if comparison's
:class:`~contextpilot_integrations.whatif.engine_predict.EngineTokenizer` (which also asks
for chat messages' ids, template included: SGLang and vLLM).

The counter does I/O, so it says ``remote = True``: the pilot calls it before it takes its
lock and remembers each text's count (:class:`~contextpilot_integrations.core.units.TokenUnits`,
bounded), never under the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import httpx

from ..errors import EngineError, EngineHTTPError, EngineTimeout, EngineUnavailable
from .client import redact_url

__all__ = ["EngineTokenCounter", "TokenizeEndpoint"]

_BODIES = ("openai", "llamacpp")
_Self = TypeVar("_Self", bound="TokenizeEndpoint")


class TokenizeEndpoint:
    """The engine at ``base_url``'s ``POST /tokenize``: token ids with the library's errors;
    thread-safe (one connection pool).

    Args:
        base_url: the server (``http://127.0.0.1:30000``; a trailing ``/v1`` is dropped).
        model: the model name SGLang and vLLM expect in the body (ignored by llama-server).
        timeout: seconds a request may take.

    Raises (on a call): :class:`~contextpilot_integrations.errors.EngineUnavailable` (not
    reachable), :class:`~contextpilot_integrations.errors.EngineTimeout`,
    :class:`~contextpilot_integrations.errors.EngineHTTPError` (an error status), or
    :class:`~contextpilot_integrations.errors.EngineError` (an answer without tokens).
    """

    def __init__(self, base_url: str, model: str = "default", *, timeout: float = 30.0) -> None:
        base = base_url.rstrip("/")
        self.url = (base[: -len("/v1")] if base.endswith("/v1") else base) + "/tokenize"
        self.model = model
        self._http = httpx.Client(timeout=timeout)
        self._body: str | None = None  # which body the server reads, once known
        self._lock = threading.Lock()

    def text(self, text: str) -> tuple[int, ...]:
        """The ids of ``text``, no special tokens added (a piece of a prompt, not a prompt of its own)."""
        if not text:
            return ()
        body = self._body
        if body is not None:
            return self._ids(self._text_payload(body, text), strict=True)
        for candidate in _BODIES:  # the first that comes back with the text's tokens
            ids = self._ids(self._text_payload(candidate, text), strict=candidate == _BODIES[-1])
            if ids:
                with self._lock:
                    self._body = candidate
                return ids
        raise AssertionError("unreachable: the last body raises")  # pragma: no cover

    def messages(self, messages: Sequence[Mapping[str, str]]) -> tuple[int, ...]:
        """The ids of a chat prompt, the chat template and generation prompt included (SGLang, vLLM)."""
        payload = {"model": self.model, "messages": [dict(m) for m in messages], "add_generation_prompt": True}
        return self._ids(payload, strict=True)

    def _text_payload(self, body: str, text: str) -> dict[str, Any]:
        if body == "openai":
            return {"model": self.model, "prompt": text, "add_special_tokens": False}
        return {"content": text, "add_special": False}

    def _ids(self, payload: dict[str, Any], *, strict: bool) -> tuple[int, ...]:
        """The answer's ids; not ``strict``: ``()`` for an error status or no tokens (another body may do)."""
        where = redact_url(self.url)
        try:
            response = self._http.post(self.url, json=payload)
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"{where} did not tokenize in time: {exc}") from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{where} is not reachable: {exc}") from exc
        if response.status_code >= 400:
            if not strict:
                return ()
            raise EngineHTTPError(
                f"{where} answered {response.status_code} to a tokenize request", response.status_code
            )
        try:
            tokens = response.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            tokens = None
        # llama-server reads no "prompt": an empty list
        if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
            if not strict:
                return ()
            raise EngineError(f"{where} answered a tokenize request without the text's tokens")
        return tuple(tokens)

    def close(self) -> None:
        self._http.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EngineTokenCounter(TokenizeEndpoint):
    """The tokens of a text as the engine at ``base_url`` counts them (no special tokens:
    a piece of a prompt, not a prompt of its own). Arguments and errors: :class:`TokenizeEndpoint`."""

    remote = True
    """It does I/O: the pilot counts with it off its lock only."""

    def __call__(self, text: str) -> int:
        return len(self.text(text))
