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
bounded), never under the lock. A counter the pilot was given by the engine itself
(:mod:`.engine_info`) has a ``fallback``: when the engine does not answer, a text is counted
with the estimate instead, and the engine is not asked again for a while; the user's call
never fails for it.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import httpx

from ..errors import EngineError, EngineHTTPError, EngineTimeout, EngineUnavailable
from .deadline import deadline_transport

__all__ = ["EngineTokenCounter", "TokenizeEndpoint", "engine_root", "redact_url"]

_BODIES = ("openai", "llamacpp")
_Self = TypeVar("_Self", bound="TokenizeEndpoint")
_log = logging.getLogger(__name__)


def redact_url(url: str) -> str:
    """A URL fit for messages and logs: no user, password or query string."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def engine_root(base_url: str) -> str:
    """The server's root, where ``/tokenize`` and its info endpoints are: no trailing ``/`` or ``/v1``."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


class TokenizeEndpoint:
    """The engine at ``base_url``'s ``POST /tokenize``: token ids with the library's errors;
    thread-safe (one connection pool).

    Args:
        base_url: the server (``http://127.0.0.1:30000``; a trailing ``/v1`` is dropped).
        model: the model name SGLang and vLLM expect in the body (ignored by llama-server;
            vLLM refuses a name it does not serve).
        timeout: seconds a request may take.
        headers: sent with every request (``Authorization`` for a server with an API key).

    Raises (on a call): :class:`~contextpilot_integrations.errors.EngineUnavailable` (not
    reachable), :class:`~contextpilot_integrations.errors.EngineTimeout`,
    :class:`~contextpilot_integrations.errors.EngineHTTPError` (an error status), or
    :class:`~contextpilot_integrations.errors.EngineError` (an answer without tokens).
    """

    def __init__(
        self, base_url: str, model: str = "default", *, timeout: float = 30.0, headers: Mapping[str, str] | None = None
    ) -> None:
        self.url = engine_root(base_url) + "/tokenize"
        self.model = model
        # bounded by an enclosing deadline too (engines.deadline), as the client's calls are
        self._http = httpx.Client(timeout=timeout, headers=dict(headers or {}), transport=deadline_transport())
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

    @property
    def body_kind(self) -> str | None:
        """Which body the server reads, once known: ``"openai"`` (``{"model", "prompt"}``) or
        ``"llamacpp"`` (``{"content"}``)."""
        return self._body

    def probe(self, text: str, *, timeout: float | None = None, first: str | None = None) -> int | None:
        """The tokens of ``text`` if the server tokenizes it (which body it reads is then
        known); ``None`` otherwise. Never raises: an engine that cannot be asked says nothing.
        ``timeout``: seconds each request may take (default: the endpoint's); ``first``: the
        body to try first (``"llamacpp"`` for a llama-server)."""
        for candidate in _bodies(first):
            try:
                response = self._http.post(self.url, json=self._text_payload(candidate, text), timeout=timeout)
            except httpx.HTTPError:
                return None  # not reachable, or too slow: no other body will do better
            if self._known(candidate, response):
                return len(self._tokens(response))
        return None

    async def aprobe(
        self, http: httpx.AsyncClient, text: str, *, timeout: float | None = None, first: str | None = None
    ) -> int | None:
        """:meth:`probe` over the caller's async client (its headers are the caller's)."""
        for candidate in _bodies(first):
            try:
                response = await http.post(self.url, json=self._text_payload(candidate, text), timeout=timeout)
            except httpx.HTTPError:
                return None
            if self._known(candidate, response):
                return len(self._tokens(response))
        return None

    def _known(self, body: str, response: httpx.Response) -> bool:
        """Whether ``response`` carries tokens; if so, ``body`` is the one the server reads."""
        if response.status_code >= 400 or not self._tokens(response):
            return False
        with self._lock:
            self._body = body
        return True

    @staticmethod
    def _tokens(response: httpx.Response) -> list[int]:
        """The answer's token ids (``[]``: none, or not a list of ints)."""
        try:
            tokens = response.json()["tokens"]
        except (ValueError, KeyError, TypeError):
            return []
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return []
        return tokens

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
        tokens = self._tokens(response)
        if not tokens:  # llama-server reads no "prompt": an empty list
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


def _bodies(first: str | None) -> list[str]:
    return sorted(_BODIES, key=lambda body: body != first)


class EngineTokenCounter(TokenizeEndpoint):
    """The tokens of a text as the engine at ``base_url`` counts them (no special tokens:
    a piece of a prompt, not a prompt of its own). Arguments and errors: :class:`TokenizeEndpoint`.

    Args:
        fallback: a counter for when the engine does not count a text (e.g.
            :func:`~contextpilot_integrations.core.gain.estimate_tokens`): the text is then
            counted with it; an engine that does not answer (unreachable, slow, an error
            status) is logged once and left alone for ``quiet_s`` seconds. ``None``
            (default): the error is raised.
        quiet_s: seconds without asking the engine after a failure (with ``fallback``).
    """

    remote = True
    """It does I/O: the pilot counts with it off its lock only."""

    def __init__(
        self,
        base_url: str,
        model: str = "default",
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        fallback: Callable[[str], int] | None = None,
        quiet_s: float = 30.0,
    ) -> None:
        super().__init__(base_url, model, timeout=timeout, headers=headers)
        self.fallback = fallback
        self.quiet_s = quiet_s
        self._quiet_until = 0.0
        self._failed = False

    def __call__(self, text: str) -> int:
        fallback = self.fallback
        if fallback is None:
            return len(self.text(text))
        if time.monotonic() < self._quiet_until:
            return fallback(text)
        try:
            return len(self.text(text))
        except (EngineUnavailable, EngineHTTPError) as exc:  # the engine, not this text: leave it alone a while
            with self._lock:
                self._quiet_until = time.monotonic() + self.quiet_s
                first, self._failed = not self._failed, True
            if first:
                _log.info(
                    "%s did not count a text's tokens (%s); counting with the estimate for %.0f s at a time "
                    "until it answers again",
                    redact_url(self.url),
                    exc,
                    self.quiet_s,
                )
            return fallback(text)
        except EngineError:  # an answer without this text's tokens: this text alone is estimated
            return fallback(text)
