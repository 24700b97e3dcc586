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
import json
import math
import re
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import httpx

from ..core.annotations import render_block
from ..core.partitions import partition_of_body
from ..core.prepared import PreparedRequest
from ..errors import EngineError, EngineHTTPError, EngineTimeout, EngineUnavailable
from ..pilot import ContextPilot
from ..pilot.telemetry import record_model_call
from . import wire
from .deadline import deadline, deadline_transport, time_left
from .engine_info import DISCOVERY_TIMEOUT, EngineInfo, alearn_engine, learn_engine
from .feedback import estimate_prompt_tokens, report_failed, report_served
from .kv_mapping import block_token_ends
from .tokens import redact_url  # re-exported: imported from here too

if TYPE_CHECKING:
    from .listener import EvictionListener
    from .sink import KvEventSink

__all__ = [
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

MAX_LINE_BYTES = 16 * 1024 * 1024
"""A longer stream line is refused (SGLang's or vLLM's prompt token ids of a million-token
prompt take about 8 MB)."""


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


@dataclass(frozen=True, slots=True)
class _Parsed:
    text: str
    usage: dict[str, Any]
    first_s: float | None  # perf_counter of the first content chunk
    input_ids: list[int] | None
    answer_id: str | None = None
    prompt_ms: float | None = None


class _Reader:
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

    def result(self) -> _Parsed:
        if self.stream:
            if not self.done:
                raise EngineError(f"{self.where} ended the stream before [DONE]: the answer may be cut short")
            return _Parsed("".join(self.text), self.usage, self.first, self.input_ids, self.answer_id, self.prompt_ms)
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
        return _Parsed(text, usage, None, ids, answer_id, wire.prompt_ms(payload))


class BlockTokenizer:
    """Token ids of rendered blocks, from the engine's own ``/tokenize`` endpoint, cached.

    A block's rendered text depends on the block alone (byte-identical prefixes), so each
    distinct block is tokenized once; :meth:`block_ends` then locates the blocks of a
    prompt in the token ids the engine returned for it (:func:`.kv_mapping.block_token_ends`).
    SGLang tokenizes a list of texts in one call; vLLM one text per call. Anything that
    goes wrong yields ``None`` (no block ends: the conservative mapping), never an error.

    Args:
        base_url: the engine (``/v1`` is stripped).
        engine: ``"sglang"`` or ``"vllm"`` (others have no usable endpoint: ``None``).
        max_entries: distinct block texts remembered (least recently used forgotten first).
    """

    def __init__(
        self,
        base_url: str,
        engine: str,
        *,
        model: str = "default",
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
        max_entries: int = 8_192,
    ) -> None:
        root = base_url.rstrip("/")
        self.url = (root[: -len("/v1")] if root.endswith("/v1") else root) + "/tokenize"
        self.engine = engine
        self.model = model
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.max_entries = max_entries
        self._cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()
        self._http: httpx.Client | None = None

    def tokens(self, text: str) -> tuple[int, ...] | None:
        """The cached token ids of a rendered block (``None`` if not tokenized yet)."""
        with self._lock:
            return self._cache.get(text)

    def block_ends(
        self, prepared: PreparedRequest, prompt_ids: Sequence[int], http: httpx.Client | None = None
    ) -> list[int] | None:
        """Where each of the request's blocks ends in the prompt's token ids (``None``:
        unknown). ``http``: the caller's client (default: one of this tokenizer's own, made
        on first use; :meth:`close` closes it)."""
        texts = _block_texts(prepared)
        if not texts or self.engine not in ("sglang", "vllm"):
            return None
        try:
            missing = self._missing(texts)
            if missing and http is None:
                http = self._own_client()
            with deadline(self.timeout):  # within the caller's deadline, if it ends sooner
                for batch in self._batches(missing):
                    assert http is not None
                    response = http.post(self.url, json=self._body(batch), headers=self.headers, timeout=self.timeout)
                    self._store(batch, response)
        except (httpx.HTTPError, ValueError):
            return None
        return self._ends(texts, prompt_ids)

    def close(self) -> None:
        """Close the client :meth:`block_ends` made for itself (if any)."""
        with self._lock:
            http, self._http = self._http, None
        if http is not None:
            http.close()

    def _own_client(self) -> httpx.Client:
        with self._lock:
            if self._http is None:
                self._http = httpx.Client(timeout=self.timeout, transport=deadline_transport())
                # a chat model that owns this tokenizer has no close(): the client goes with it
                weakref.finalize(self, self._http.close)
            return self._http

    async def ablock_ends(
        self, prepared: PreparedRequest, prompt_ids: Sequence[int], http: httpx.AsyncClient
    ) -> list[int] | None:
        texts = _block_texts(prepared)
        if not texts or self.engine not in ("sglang", "vllm"):
            return None
        left = time_left()
        try:
            missing = self._missing(texts)
            await asyncio.wait_for(
                self._afetch(missing, http), self.timeout if left is None else min(left, self.timeout)
            )
        except (httpx.HTTPError, ValueError, asyncio.TimeoutError):  # out of time: block ends unknown
            return None
        return self._ends(texts, prompt_ids)

    async def _afetch(self, missing: list[str], http: httpx.AsyncClient) -> None:
        for batch in self._batches(missing):
            response = await http.post(self.url, json=self._body(batch), headers=self.headers, timeout=self.timeout)
            self._store(batch, response)

    def _missing(self, texts: list[str]) -> list[str]:
        with self._lock:
            return list(dict.fromkeys(text for text in texts if text not in self._cache))

    def _batches(self, texts: list[str]) -> list[list[str]]:
        if not texts:
            return []
        return [texts] if self.engine == "sglang" else [[text] for text in texts]

    def _body(self, texts: list[str]) -> dict[str, Any]:
        prompt: str | list[str] = texts if self.engine == "sglang" else texts[0]
        return {"model": self.model, "prompt": prompt, "add_special_tokens": False}

    def _store(self, texts: list[str], response: httpx.Response) -> None:
        response.raise_for_status()
        tokens = response.json().get("tokens")
        if self.engine == "sglang" and isinstance(tokens, list) and tokens and isinstance(tokens[0], int):
            tokens = [tokens]  # one text answered flat
        if self.engine == "vllm":
            tokens = [tokens]
        if not isinstance(tokens, list) or len(tokens) != len(texts):
            raise ValueError("the engine's /tokenize answered an unexpected shape")
        for ids in tokens:
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError("the engine's /tokenize answered malformed token ids")
        with self._lock:
            for text, ids in zip(texts, tokens, strict=True):
                self._cache[text] = tuple(ids)
                self._cache.move_to_end(text)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)

    def _ends(self, texts: list[str], prompt_ids: Sequence[int]) -> list[int] | None:
        with self._lock:
            ids = [self._cache.get(text) for text in texts]
        if any(block is None for block in ids):
            return None  # forgotten meanwhile (a tiny cache): conservative
        return block_token_ends(prompt_ids, [block for block in ids if block is not None])


def _block_texts(prepared: PreparedRequest) -> list[str]:
    return [render_block(block, prepared.templates, prepared.labels) for block in prepared.blocks]


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

    def _exchange(self, body: dict[str, Any], reader: _Reader) -> _Parsed:
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

    async def _aexchange(self, body: dict[str, Any], reader: _Reader) -> None:
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

    def _reader(self, stream: bool, end: float | None) -> _Reader:
        return _Reader(self.where, stream, end, self.max_response_bytes)

    def _http_error(self, status: int, body: bytes) -> EngineHTTPError:
        snippet = body[:300].decode("utf-8", errors="replace").strip()
        return EngineHTTPError(f"{self.where} answered HTTP {status}: {snippet}", status)

    def _finish(
        self,
        prepared: PreparedRequest,
        start: float,
        parsed: _Parsed,
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
        report_served(
            self.pilot,
            prepared,
            result.prompt_tokens,
            result.cached_tokens,
            before_tokens=before_tokens,
            usage_feedback=self.usage_feedback,
            tracker=self.tracker,
            input_ids=parsed.input_ids,
            block_ends=block_ends,
        )
        record_model_call(  # an OpenTelemetry span with the usage (the [otel] extra; else nothing)
            prepared,
            model=self.model,
            provider=self.engine,
            input_tokens=result.prompt_tokens,
            output_tokens=result.completion_tokens,
            cache_read_tokens=result.cached_tokens,
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
