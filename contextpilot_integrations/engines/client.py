"""Send prepared requests to an OpenAI-compatible server (SGLang, vLLM, llama.cpp).

The request id travels in the body (``rid`` for SGLang; ``session_id`` too, which SGLang
copies into its KV-cache events), time to first token is measured on the stream, and the
server's ``usage.prompt_tokens_details.cached_tokens`` is read back into the pilot's
statistics.

A request that is not served in full (unreachable server, HTTP error, timeout, a stream
cut short or carrying an error, a malformed answer, or the caller's cancellation) raises
and is removed from the pilot's index again (the engine may not hold it, and the index
must never predict a hit it cannot confirm); its conversation turn no longer counts as
having shown its blocks.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx

from ..core.partitions import partition_of_body
from ..core.prepared import PreparedRequest
from ..errors import EngineError, EngineHTTPError, EngineTimeout, EngineUnavailable
from ..pilot import ContextPilot
from . import wire
from .answer_reader import MAX_LINE_BYTES, AnswerReader, ParsedAnswer  # MAX_LINE_BYTES re-exported
from .block_tokenizer import BlockTokenizer  # re-exported: imported from here too
from .deadline import deadline, deadline_transport, time_left
from .engine_info import DISCOVERY_TIMEOUT, EngineInfo, alearn_engine, learn_engine
from .feedback import EngineUsage, estimate_prompt_tokens, report_call, report_failed
from .tokens import redact_url  # re-exported: imported from here too

if TYPE_CHECKING:
    from .listener import EvictionListener
    from .sink import KvEventSink

__all__ = [
    "MAX_LINE_BYTES",
    "BlockTokenizer",
    "ChatResult",
    "EngineError",
    "EngineHTTPError",
    "EngineTimeout",
    "EngineUnavailable",
    "OpenAICompatClient",
    "redact_url",
]

_CREDENTIALS = re.compile(r"(//)[^/@\s]+@")  # user:password@ in a URL


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
    prompt_token_ids: tuple[int, ...] | None = None
    """The prompt's token ids as the engine saw them (when it was asked for them: with a
    listener or ``return_prompt_ids``)."""
    answer_id: str | None = None
    """The engine's id for the answer (vLLM: ``chatcmpl-<request id>``; SGLang: the ``rid``)."""
    block_ends: tuple[int, ...] | None = None
    """Token position where each sent block ends in ``prompt_token_ids`` (see
    :func:`~.kv_mapping.block_token_ends`); ``None`` when they could not be located."""
    prompt_ms: float | None = None
    """The engine's own prefill time, where it reports one (llama-server: ``timings.prompt_ms``)."""


_CLIENT_SETTINGS = frozenset(
    {
        "timeout",
        "deadline",
        "api_key",
        "base_url",
        "engine",
        "id_fields",
        "extra_body",
        "listener",
        "usage_feedback",
        "pilot",
        "max_response_bytes",
        "discover",
    }
)
"""The client's own settings: given to a call, they would be sent inside the body."""


class OpenAICompatClient:
    """Chat completions for prepared requests, sync and async, streaming or not.

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:30000`` (``/v1`` is added).
            Credentials in it are used but never shown in messages.
        pilot: the :class:`ContextPilot` whose requests are sent; it receives the cached
            token counts, and forgets requests that fail.
        model: the ``model`` field of the request.
        api_key: sent as a bearer token when given.
        timeout: seconds to connect, and at most between two chunks of the answer.
        deadline: seconds a whole call may take (``None``: no limit beyond ``timeout``
            per chunk): connecting, the answer (headers, body, or an error page) and the
            ``/tokenize`` after it (whose block ends are then unknown); a server that drips
            bytes cannot hold a call longer. Within an outer
            :func:`~.deadline.deadline` (a routed call's), whichever ends first.
        max_response_bytes: larger answers are refused (error bodies are read up to
            64 KiB for the message).
        engine: ``"sglang"``, ``"vllm"``, ``"llamacpp"`` or ``"openai"``: which body
            fields carry the request id (SGLang: ``rid`` and ``session_id``; vLLM:
            ``request_id``) and how the prompt's token ids are asked for.
        id_fields: body fields that carry the request id, instead of the engine's.
        extra_body: merged into every request body.
        listener: an :class:`~contextpilot_integrations.engines.listener.EvictionListener`
            (or the :class:`~.sink.KvEventSink` a ZMQ subscriber feeds); the client then
            asks the engine for the prompt's token ids and registers them, so KV events
            can be mapped to this request, and where each block ends in them (the
            blocks tokenized once each through the engine's ``/tokenize``), so a lost
            tail page keeps the leading blocks predicted.
        usage_feedback: compare each answer's cached tokens with the prediction and drop
            what the engine no longer had (:meth:`ContextPilot.observe_cached`). Default:
            on without a listener (llama.cpp, hosted APIs), off with one (events are exact).
        discover: before its first request, read the engine's page size, KV pool and
            tokenizer and give the pilot those its user left unset (once per engine and
            pilot, at most :data:`~.engine_info.DISCOVERY_TIMEOUT` seconds before the
            request is sent, half the time left within an outer deadline; an engine that
            does not say leaves the estimates, logged once; see :mod:`.engine_info`).
            Default: on for SGLang, vLLM and llama.cpp, unless
            ``CONTEXTPILOT_DISCOVER_ENGINE=0``; ``engine="openai"`` only with ``True``;
            ``False``: never.
    """

    MAX_ERROR_BYTES = 64 * 1024

    def __init__(
        self,
        base_url: str,
        pilot: ContextPilot | None = None,
        *,
        model: str = "default",
        api_key: str | None = None,
        timeout: float = 60.0,
        deadline: float | None = None,
        max_response_bytes: int = 32 * 1024 * 1024,
        engine: str = "sglang",
        id_fields: tuple[str, ...] | None = None,
        extra_body: dict[str, Any] | None = None,
        listener: EvictionListener | KvEventSink | None = None,
        usage_feedback: bool | None = None,
        discover: bool | None = None,
    ) -> None:
        if engine not in wire.ENGINES:
            raise ValueError(f"engine must be one of {', '.join(wire.ENGINES)}, got {engine!r}")
        if timeout <= 0 or (deadline is not None and (deadline <= 0 or not math.isfinite(deadline))):
            raise ValueError("timeout and deadline must be positive numbers of seconds")
        self.base_url = base_url.rstrip("/")
        self.endpoint = self.base_url + (
            "/chat/completions" if self.base_url.endswith("/v1") else "/v1/chat/completions"
        )
        self.where = redact_url(self.endpoint)
        self.pilot = pilot
        self.model = model
        self.timeout = timeout
        self.deadline = deadline
        self.max_response_bytes = max_response_bytes
        self.engine = engine
        self.id_fields = id_fields if id_fields is not None else wire.REQUEST_ID_FIELDS[engine]
        self.extra_body = dict(extra_body or {})
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.listener = listener
        self.tracker: KvEventSink | None = listener.sink if isinstance(listener, _HasSink) else listener
        self.block_tokenizer = BlockTokenizer(self.base_url, engine, model=model, headers=self._headers)
        if self.tracker is not None:
            for name, value in wire.PROMPT_IDS_REQUEST[engine].items():
                self.extra_body.setdefault(name, value)
        self.usage_feedback = self.tracker is None if usage_feedback is None else usage_feedback
        self.discover = discover
        # one pooled connection for sync calls (thread-safe); async calls open their own,
        # since an async client belongs to one event loop
        self._http = httpx.Client(timeout=self._timeout(), headers=self._headers, transport=deadline_transport())

    def close(self) -> None:
        """Close the pooled connection."""
        self._http.close()

    def learn_engine(self) -> EngineInfo | None:
        """Read the engine's page size, KV pool and tokenizer for the pilot now (what its user
        left unset), as the first :meth:`chat` would: once, within
        :data:`~.engine_info.DISCOVERY_TIMEOUT` seconds, never raising for the engine.
        Returns what was read, or ``None`` (``discover`` off, read before, or nothing unset)."""
        budget = _discovery_budget()
        if budget is None:
            return None
        return learn_engine(
            self.pilot,
            self.base_url,
            engine=self.engine,
            model=self.model,
            headers=self._headers,
            discover=self.discover,
            timeout=budget,
        )

    async def alearn_engine(self) -> EngineInfo | None:
        """Async variant of :meth:`learn_engine`."""
        budget = _discovery_budget()
        if budget is None:
            return None
        return await alearn_engine(
            self.pilot,
            self.base_url,
            engine=self.engine,
            model=self.model,
            headers=self._headers,
            discover=self.discover,
            timeout=budget,
        )

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
        """The JSON body for a prepared request (history goes between system and prompt; a
        reference whose block it does not carry goes out as the block's text)."""
        messages: list[dict[str, Any]] = list(prepared.to_messages(system_prompt, history or ()))
        return self._body(messages, prepared.request_id, stream, params)

    def _partitioned(self, prepared: PreparedRequest, body: dict[str, Any]) -> PreparedRequest:
        """The request indexed in the cache partition its body names (``cache_salt``, ``extra_key``,
        ``lora_path``), where that is not the one it was prepared in."""
        partition = partition_of_body(body)
        if partition is None or partition == prepared.partition or self.pilot is None:
            return prepared
        return self.pilot.repartition(prepared, partition)

    def _body(
        self, messages: list[dict[str, Any]], request_id: str, stream: bool, params: dict[str, Any]
    ) -> dict[str, Any]:
        """The JSON body: ``params`` are body fields (``max_tokens``, ``temperature``, ...);
        a name of the client's own settings there is refused, never sent to the engine."""
        settings = sorted(_CLIENT_SETTINGS.intersection(params))
        if settings:
            raise TypeError(
                f"{', '.join(settings)}: a setting of OpenAICompatClient (OpenAICompatClient(..., {settings[0]}=...)), "
                "not a field of the request body; keyword arguments of a call go into the body"
            )
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        for name in self.id_fields:
            body[name] = request_id
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
            EngineUnavailable, EngineHTTPError, EngineError: the request was not served
                in full; the pilot has forgotten it.
        """
        body = self.body(prepared, system_prompt=system_prompt, history=history, stream=stream, **params)
        if self.discover is not False and self.pilot is not None:  # once: the page and tokenizer, off the lock
            try:
                self.learn_engine()
            except BaseException:  # interrupted while reading: the request never left
                self._forget(prepared)
                raise
        prepared = self._partitioned(prepared, body)
        start = time.perf_counter()
        before = _before_tokens(system_prompt, history)
        try:
            with deadline(self.deadline) as end:  # the answer and /tokenize after it
                parsed = self._exchange(body, self._reader(stream, end))
                ends = None
                if parsed.input_ids and self.tracker is not None:
                    ends = self.block_tokenizer.block_ends(prepared, parsed.input_ids, self._http)
            return self._finish(prepared, start, parsed, before, ends)
        except httpx.TransportError as exc:
            self._forget(prepared)
            raise self._unavailable(exc) from exc
        except BaseException:
            self._forget(prepared)
            raise

    def send_messages(
        self, messages: Sequence[dict[str, str]], *, request_id: str | None = None, stream: bool = True, **params: Any
    ) -> ChatResult:
        """Send chat messages exactly as given, with no prepared request and no pilot
        bookkeeping: what an application without ContextPilot sends (a comparison's
        baseline). ``request_id`` (a fresh one if ``None``) goes in the engine's id fields.

        Raises:
            EngineUnavailable, EngineHTTPError, EngineError: as :meth:`chat`.
        """
        request_id = request_id if request_id is not None else f"plain-{uuid.uuid4().hex}"
        body = self._body([dict(m) for m in messages], request_id, stream, params)
        start = time.perf_counter()
        try:
            with deadline(self.deadline) as end:
                parsed = self._exchange(body, self._reader(stream, end))
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc
        usage = parsed.usage
        now = time.perf_counter()
        return ChatResult(
            request_id=request_id,
            text=parsed.text,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            ttft_s=(parsed.first_s if parsed.first_s is not None else now) - start,
            total_s=now - start,
            usage=usage,
            prompt_token_ids=tuple(parsed.input_ids) if parsed.input_ids else None,
            answer_id=parsed.answer_id,
            prompt_ms=parsed.prompt_ms,
        )

    def _exchange(self, body: dict[str, Any], reader: AnswerReader) -> ParsedAnswer:
        with self._http.stream("POST", self.endpoint, json=body, timeout=self._timeout(time_left())) as response:
            if response.status_code >= 400:
                raise self._http_error(response.status_code, _limited(response.iter_bytes()))
            for chunk in response.iter_bytes():
                if reader.feed(chunk):
                    break
        return reader.result()

    async def achat(
        self,
        prepared: PreparedRequest,
        *,
        system_prompt: str | None = None,
        history: list[dict[str, str]] | None = None,
        stream: bool = True,
        **params: Any,
    ) -> ChatResult:
        """Async variant of :meth:`chat`; cancelling it forgets the request too."""
        body = self.body(prepared, system_prompt=system_prompt, history=history, stream=stream, **params)
        if self.discover is not False and self.pilot is not None:
            try:
                await self.alearn_engine()
            except BaseException:  # cancelled while reading: the request never left
                self._forget(prepared)
                raise
        prepared = self._partitioned(prepared, body)
        start = time.perf_counter()
        before = _before_tokens(system_prompt, history)
        try:
            with deadline(self.deadline) as end:  # the answer and /tokenize after it
                reader = self._reader(stream, end)
                left = time_left()
                await asyncio.wait_for(self._aexchange(body, reader), left if left is None else max(0.0, left))
                parsed = reader.result()
                ends = None
                if parsed.input_ids and self.tracker is not None:
                    async with httpx.AsyncClient(timeout=self._timeout(), headers=self._headers) as http:
                        ends = await self.block_tokenizer.ablock_ends(prepared, parsed.input_ids, http)
            return self._finish(prepared, start, parsed, before, ends)
        except (httpx.TransportError, asyncio.TimeoutError) as exc:
            self._forget(prepared)
            raise self._unavailable(exc) from exc
        except BaseException:
            self._forget(prepared)
            raise

    async def _aexchange(self, body: dict[str, Any], reader: AnswerReader) -> None:
        async with (
            httpx.AsyncClient(timeout=self._timeout(), headers=self._headers) as http,
            http.stream("POST", self.endpoint, json=body) as response,
        ):
            if response.status_code >= 400:
                received = b""
                async for chunk in response.aiter_bytes():
                    received += chunk
                    if len(received) >= self.MAX_ERROR_BYTES:
                        break
                raise self._http_error(response.status_code, received[: self.MAX_ERROR_BYTES])
            async for chunk in response.aiter_bytes():
                if reader.feed(chunk):
                    break

    # ---- answers ---------------------------------------------------------------------------
    def _timeout(self, left: float | None = None) -> httpx.Timeout:
        """Per chunk: ``timeout``, at most the deadline; ``left``: waiting for a pooled
        connection takes no longer than the time left."""
        per_chunk = min(self.timeout, self.deadline) if self.deadline is not None else self.timeout
        return httpx.Timeout(per_chunk, pool=per_chunk if left is None else max(0.001, min(per_chunk, left)))

    def _reader(self, stream: bool, end: float | None) -> AnswerReader:
        return AnswerReader(self.where, stream, end, self.max_response_bytes)

    def _http_error(self, status: int, body: bytes) -> EngineHTTPError:
        snippet = body[:300].decode("utf-8", errors="replace").strip()
        return EngineHTTPError(f"{self.where} answered HTTP {status}: {snippet}", status)

    def _finish(
        self,
        prepared: PreparedRequest,
        start: float,
        parsed: ParsedAnswer,
        before_tokens: int,
        block_ends: list[int] | None = None,
    ) -> ChatResult:
        usage = parsed.usage
        details = usage.get("prompt_tokens_details") or {}
        now = time.perf_counter()
        result = ChatResult(
            request_id=prepared.request_id,
            text=parsed.text,
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=details.get("cached_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            ttft_s=(parsed.first_s if parsed.first_s is not None else now) - start,
            total_s=now - start,
            usage=usage,
            prompt_token_ids=tuple(parsed.input_ids) if parsed.input_ids else None,
            answer_id=parsed.answer_id,
            block_ends=tuple(block_ends) if block_ends is not None else None,
            prompt_ms=parsed.prompt_ms,
        )
        usage_read = EngineUsage(
            result.prompt_tokens,
            result.cached_tokens,
            result.completion_tokens,
            input_ids=parsed.input_ids,
            model=self.model,
            provider=self.engine,
        )
        report_call(
            self.pilot,
            prepared,
            usage_read,
            before_tokens=before_tokens,
            usage_feedback=self.usage_feedback,
            tracker=self.tracker,
            block_ends=block_ends,
        )
        return result

    def _unavailable(self, exc: BaseException) -> EngineUnavailable:
        """Unreachable (refused, reset, no connection within ``timeout``), or slow: a
        timeout once connected is an :class:`EngineTimeout` (the server has the request)."""
        detail = _CREDENTIALS.sub(r"\1", str(exc)) or type(exc).__name__
        if isinstance(exc, httpx.ConnectTimeout) or not isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
            return EngineUnavailable(f"{self.where} is unreachable: {detail}")
        return EngineTimeout(f"{self.where} timed out: {detail}")

    def _forget(self, prepared: PreparedRequest) -> None:
        report_failed(self.pilot, prepared, self.tracker)


@runtime_checkable
class _HasSink(Protocol):
    sink: KvEventSink


def _discovery_budget() -> float | None:
    """Seconds reading the engine may take: :data:`~.engine_info.DISCOVERY_TIMEOUT`, at most
    half the time an outer deadline leaves (``None``: too little left, not now)."""
    left = time_left()
    if left is None:
        return DISCOVERY_TIMEOUT
    return min(DISCOVERY_TIMEOUT, left / 2) if left > 0.05 else None


def _before_tokens(system_prompt: str | None, history: list[dict[str, str]] | None) -> int:
    """Our estimate of the tokens before the blocks: the system prompt and the history."""
    texts = [system_prompt or ""] + [str(message.get("content") or "") for message in history or ()]
    return sum(estimate_prompt_tokens(text) for text in texts)


def _limited(chunks: Iterator[bytes], limit: int = OpenAICompatClient.MAX_ERROR_BYTES) -> bytes:
    """At most ``limit`` bytes of a body (an error page can be arbitrarily large)."""
    received = b""
    for chunk in chunks:
        received += chunk
        if len(received) >= limit:
            break
    return received[:limit]
