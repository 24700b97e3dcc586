"""Send prepared requests to an OpenAI-compatible server (SGLang, vLLM, llama.cpp).

The request id travels in the body (``rid`` for SGLang; ``session_id`` too, which SGLang
copies into its KV-cache events), time to first token is measured on the stream, and the
server's ``usage.prompt_tokens_details.cached_tokens`` is read back into the pilot's
statistics. A request that fails is removed from the pilot's index again (the engine
may not hold it, and the index must never predict a hit it cannot confirm), and its
conversation turn no longer counts as having shown its blocks.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from ..errors import ContextPilotError
from ..pilot import ContextPilot
from ..prepared import PreparedRequest

if TYPE_CHECKING:
    from .events import EvictionListener

__all__ = ["ChatResult", "EngineError", "EngineHTTPError", "EngineUnavailable", "OpenAICompatClient"]


class EngineError(ContextPilotError):
    """The engine did not serve the request; the message names the server."""


class EngineUnavailable(EngineError):
    """The server could not be reached, or did not answer in time."""


class EngineHTTPError(EngineError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True, slots=True)
class ChatResult:
    """One served request: the answer, the server's token accounting and timings."""

    request_id: str
    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_s: float
    """Seconds from sending to the first content chunk (the whole call without streaming)."""
    total_s: float
    usage: dict[str, Any] = field(default_factory=dict)


_Parsed = tuple[str, dict[str, Any], float, list[int] | None]  # text, usage, TTFT, prompt token ids


def _input_ids(payload: dict[str, Any]) -> list[int] | None:
    """SGLang's prompt token ids (``sglext.input_ids``), when it was asked for them."""
    ids = (payload.get("sglext") or {}).get("input_ids")
    if ids and isinstance(ids[0], list):  # one list per choice
        ids = ids[0]
    return [int(i) for i in ids] if ids else None


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return int(value) if value is not None else None


class OpenAICompatClient:
    """Chat completions for prepared requests, sync and async, streaming or not.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:30000`` (``/v1`` is added).
        pilot: the :class:`ContextPilot` whose requests are sent; it receives the cached
            token counts, and forgets requests that fail.
        model: the ``model`` field of the request.
        api_key: sent as a bearer token when given.
        timeout: seconds to connect and between chunks.
        id_fields: body fields that carry the request id (SGLang: ``rid`` and
            ``session_id``; vLLM: ``request_id``).
        extra_body: merged into every request body.
        listener: an :class:`~contextpilot_integrations.backends.events.EvictionListener`;
            the client then asks SGLang for the prompt's token ids
            (``return_input_ids_in_sglext``) and registers them, so KV events can be
            mapped to this request. Without block boundaries in tokens, a lost block drops
            the whole request from the index (conservative).
    """

    def __init__(
        self,
        base_url: str,
        pilot: ContextPilot | None = None,
        *,
        model: str = "default",
        api_key: str | None = None,
        timeout: float = 60.0,
        id_fields: tuple[str, ...] = ("rid", "session_id"),
        extra_body: dict[str, Any] | None = None,
        listener: EvictionListener | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.endpoint = self.base_url + (
            "/chat/completions" if self.base_url.endswith("/v1") else "/v1/chat/completions"
        )
        self.pilot = pilot
        self.model = model
        self.timeout = timeout
        self.id_fields = id_fields
        self.extra_body = dict(extra_body or {})
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.listener = listener
        if listener is not None:
            self.extra_body.setdefault("return_input_ids_in_sglext", True)
        # one pooled connection for sync calls (thread-safe); async calls open their own,
        # since an async client belongs to one event loop
        self._http = httpx.Client(timeout=self.timeout, headers=self._headers)

    def close(self) -> None:
        """Close the pooled connection."""
        self._http.close()

    def __enter__(self) -> OpenAICompatClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- request body ------------------------------------------------------------------
    def body(
        self,
        prepared: PreparedRequest,
        *,
        system_prompt: str | None = None,
        history: list[dict[str, str]] | None = None,
        stream: bool = True,
        **params: Any,
    ) -> dict[str, Any]:
        """The JSON body for a prepared request (history goes between system and prompt)."""
        messages = prepared.to_messages(system_prompt)
        if history:
            messages[-1:-1] = history
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        for name in self.id_fields:
            body[name] = prepared.request_id
        body.update(self.extra_body)
        body.update(params)
        return body

    # ---- sync ----------------------------------------------------------------------------
    def chat(
        self,
        prepared: PreparedRequest,
        *,
        system_prompt: str | None = None,
        history: list[dict[str, str]] | None = None,
        stream: bool = True,
        **params: Any,
    ) -> ChatResult:
        """Send one prepared request and wait for the answer.

        Raises:
            EngineUnavailable, EngineHTTPError: the request was not served; the pilot
                has forgotten it.
        """
        body = self.body(prepared, system_prompt=system_prompt, history=history, stream=stream, **params)
        start = time.perf_counter()
        http = self._http
        try:
            if stream:
                with http.stream("POST", self.endpoint, json=body) as response:
                    if response.status_code >= 400:
                        response.read()
                    self._check(response)
                    parser = _StreamParser(self.endpoint, start)
                    for line in response.iter_lines():
                        if parser.feed(line):
                            break
                    return self._finish(prepared, start, parser.result())
            response = http.post(self.endpoint, json=body)
            self._check(response)
            return self._finish(prepared, start, self._read_whole(response, start))
        except httpx.TransportError as exc:
            raise self._unavailable(prepared, exc) from exc
        except EngineError:
            self._forget(prepared)
            raise

    async def achat(
        self,
        prepared: PreparedRequest,
        *,
        system_prompt: str | None = None,
        history: list[dict[str, str]] | None = None,
        stream: bool = True,
        **params: Any,
    ) -> ChatResult:
        """Async variant of :meth:`chat`."""
        body = self.body(prepared, system_prompt=system_prompt, history=history, stream=stream, **params)
        start = time.perf_counter()
        try:
            async with httpx.AsyncClient(timeout=self.timeout, headers=self._headers) as http:
                if stream:
                    async with http.stream("POST", self.endpoint, json=body) as response:
                        if response.status_code >= 400:
                            await response.aread()
                        self._check(response)
                        parser = _StreamParser(self.endpoint, start)
                        async for line in response.aiter_lines():
                            if parser.feed(line):
                                break
                        return self._finish(prepared, start, parser.result())
                response = await http.post(self.endpoint, json=body)
                self._check(response)
                return self._finish(prepared, start, self._read_whole(response, start))
        except httpx.TransportError as exc:
            raise self._unavailable(prepared, exc) from exc
        except EngineError:
            self._forget(prepared)
            raise

    # ---- parsing ---------------------------------------------------------------------------
    def _check(self, response: httpx.Response) -> None:
        if response.status_code >= 400:
            snippet = response.text[:300].strip()
            raise EngineHTTPError(
                f"{self.endpoint} answered HTTP {response.status_code}: {snippet}", response.status_code
            )

    def _read_whole(self, response: httpx.Response, start: float) -> _Parsed:
        try:
            payload = response.json()
        except json.JSONDecodeError as exc:
            raise EngineError(f"{self.endpoint} answered with malformed JSON: {response.text[:100]!r}") from exc
        choices = payload.get("choices") or [{}]
        text = (choices[0].get("message") or {}).get("content") or ""
        return text, payload.get("usage") or {}, time.perf_counter() - start, _input_ids(payload)

    def _finish(self, prepared: PreparedRequest, start: float, parsed: _Parsed) -> ChatResult:
        text, usage, ttft, input_ids = parsed
        if self.listener is not None and input_ids:
            self.listener.sink.track(prepared.request_id, input_ids)
        result = ChatResult(
            request_id=prepared.request_id,
            text=text,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=_cached_tokens(usage),
            completion_tokens=usage.get("completion_tokens"),
            ttft_s=ttft,
            total_s=time.perf_counter() - start,
            usage=usage,
        )
        if self.pilot is not None:
            self.pilot.record_usage(prepared, result.prompt_tokens, result.cached_tokens)
        return result

    def _unavailable(self, prepared: PreparedRequest, exc: Exception) -> EngineUnavailable:
        self._forget(prepared)
        kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "is unreachable"
        return EngineUnavailable(f"{self.endpoint} {kind}: {exc}")

    def _forget(self, prepared: PreparedRequest) -> None:
        if self.pilot is not None:
            self.pilot.discard(prepared)


class _StreamParser:
    """Server-sent events of a streamed chat completion: text, usage, first-token time."""

    def __init__(self, endpoint: str, start: float) -> None:
        self.endpoint = endpoint
        self.start = start
        self.text: list[str] = []
        self.usage: dict[str, Any] = {}
        self.first: float | None = None
        self.input_ids: list[int] | None = None

    def feed(self, line: str) -> bool:
        """Take one line; returns True at the end of the stream."""
        line = line.strip()
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            return True
        try:
            event = json.loads(data)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{self.endpoint} sent a malformed stream chunk: {data[:100]!r}") from exc
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or ""
            if self.first is None and (piece or choice.get("finish_reason")):
                self.first = time.perf_counter()
            self.text.append(piece)
        self.usage = event.get("usage") or self.usage
        self.input_ids = _input_ids(event) or self.input_ids
        return False

    def result(self) -> _Parsed:
        first = self.first if self.first is not None else time.perf_counter()
        return "".join(self.text), self.usage, first - self.start, self.input_ids
