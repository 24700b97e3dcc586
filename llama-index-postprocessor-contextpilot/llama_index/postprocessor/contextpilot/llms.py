"""LLMs that send ContextPilot's prepared request and report what the engine cached.

:class:`ContextPilotLLM` wraps the LlamaIndex LLM you already use (``OpenAI``,
``OpenAILike``, ``Anthropic``, ...). :class:`SGLangLLM` is ``OpenAILike`` preset for SGLang
and other OpenAI-compatible engines (``llama-index-llms-sglang`` talks to
``/v1/completions`` and returns no usage, so the maintained ``OpenAILike`` is the base).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms import LLM
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations.core.validation import refuse_unknown, retries_resend_ids
from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.block_tokenizer import BlockTokenizer
from contextpilot_integrations.engines.loop_local import loop_local_async_client
from contextpilot_integrations.integration.call_plan import callers_cache_key, mark_bound_call
from contextpilot_integrations.integration.model_call import EngineAccess, ModelCall, id_fields, reraise
from contextpilot_integrations.pilot.binding import Binding
from contextpilot_integrations.providers.cache_key import ConversationKeys

from . import _llm_calls, cache_points
from ._binding import span_binder, take
from ._llm_calls import BINDING_KWARG

__all__ = ["BINDING_KWARG", "ContextPilotLLM", "SGLangLLM"]

_log = logging.getLogger(__name__)


class _Reports:
    """Bookkeeping around one provider call (shared by both LLM classes): the core's
    :class:`~contextpilot_integrations.integration.model_call.ModelCall` after the answer."""

    event_sink: Any
    usage_feedback: bool | None
    engine: str | None
    discover: bool | None

    def _block_tokenizer(self) -> BlockTokenizer | None:
        """The core client's tokenizer of blocks, where the engine has ``/tokenize``."""
        return None

    def _body_fields(self) -> dict[str, Any]:
        """The request body's own fields beside the messages (a ``cache_salt`` there names the
        engine's cache partition: :func:`~contextpilot_integrations.partition_of_body`)."""
        llm = getattr(self, "llm", self)
        extra = dict(getattr(llm, "additional_kwargs", None) or {})
        return {**extra, **(extra.get("extra_body") or {})}

    def _engine_access(self) -> EngineAccess | None:
        """Where the engine answers (``None``: no engine)."""
        return None

    def _hosted(self) -> str | None:
        """The hosted API whose cache markers this LLM writes (``None``: none)."""
        return None

    def _done(self, call: ModelCall, response: Any, ids: list[int] | None = None) -> Any:
        if response is None:
            return None
        provider = self._hosted()
        if provider is not None:
            # a hosted API's short read is no eviction
            usage = call.served_hosted(response.raw, provider, usage_feedback=bool(self.usage_feedback))
            if usage is not None:
                response.additional_kwargs["cached_tokens"] = usage.cache_read_tokens
                response.additional_kwargs["cache_write_tokens"] = usage.cache_write_tokens
            return response
        call.learn_engine(self.engine, self._engine_access(), self.discover)  # once, for the next requests
        tokenizer = self._block_tokenizer() if self.event_sink is not None and call.binding is not None else None
        cached = _llm_calls.report(
            call.binding,
            response.raw,
            usage_feedback=self.event_sink is None if self.usage_feedback is None else self.usage_feedback,
            tracker=self.event_sink,
            ids=ids,
            tokenizer=tokenizer,
        )
        if cached is not None:
            response.additional_kwargs["cached_tokens"] = cached
        return response

    def _streamed(self, call: ModelCall, stream: Any) -> Generator[Any, None, None]:
        last, ids = None, None
        try:
            for response in stream:
                ids = ids or _llm_calls.usage_of(response.raw)[2]
                last = response
                yield response
        except GeneratorExit:  # the reader stopped early: the request was served
            raise
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        self._done(call, last, ids)

    async def _astreamed(self, call: ModelCall, stream: Any) -> AsyncGenerator[Any, None]:
        last, ids = None, None
        try:
            async for response in stream:
                ids = ids or _llm_calls.usage_of(response.raw)[2]
                last = response
                yield response
        except GeneratorExit:
            raise
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        self._done(call, last, ids)


class ContextPilotLLM(_Reports, LLM):
    """Any LlamaIndex LLM, sending the prepared request of its query or chat turn.

    ``ContextPilotLLM(llm=OpenAI(...))`` (or ``OpenAILike``, ``Anthropic``, ...) where the
    LLM goes (``Settings.llm``, ``index.as_query_engine(llm=...)``):

    - it takes the request that ``ContextPilotPostprocessor`` prepared earlier in the same
      query (through the instrumentation span tree, never by searching the prompt), or the
      one ``ContextPilotChatEngine`` names;
    - a location reference whose text is not in the messages sent is replaced by that text
      (``pilot.stats().references_restored``);
    - with ``engine="sglang"`` / ``"vllm"`` (an OpenAI-compatible ``llm`` built with
      ``max_retries=0``: a retry inside the call would send the id again) the request id
      goes out in the body;
    - the provider's cached tokens (OpenAI ``prompt_tokens_details.cached_tokens``,
      Anthropic ``cache_read_input_tokens``) go back to the request's pilot and into
      ``response.additional_kwargs["cached_tokens"]``; a failed call makes the pilot forget it.

    An argument it does not know (a misspelt ``provder=``, ``server=`` for ``engine=``, or
    ``pilot=``, which belongs to the postprocessor or chat engine) is refused.
    """

    llm: Any = Field(description="The LlamaIndex LLM that talks to the provider.")
    engine: str | None = Field(default=None, description="sglang, vllm: body fields for the request id.")
    event_sink: Any = Field(default=None, exclude=True)
    usage_feedback: bool | None = None
    discover: bool | None = Field(
        default=None,
        description="With engine=: after the first answer, the request's pilot reads the engine's page size, KV "
        "pool and tokenizer (at the llm's api_base), once, where its user left them unset (default: on unless "
        "CONTEXTPILOT_DISCOVER_ENGINE=0; False: never).",
    )
    provider: str | None = Field(
        default="auto",
        description="The hosted API whose prompt cache to mark (openai, anthropic); auto: from the wrapped "
        "class (OpenAI only at OpenAI's own URL); None: no markers. See cache_points.",
    )
    _keys: ConversationKeys = PrivateAttr(default_factory=ConversationKeys)
    """The OpenAI key each conversation was first sent under (its later turns keep it)."""

    def __init__(self, **kwargs: Any) -> None:
        refuse_unknown(type(self), kwargs, _PILOT_HINT, where="the wrapped llm's api_base")
        _check_engine(kwargs.get("engine"))
        super().__init__(**kwargs)
        if not isinstance(self.llm, LLM):
            raise TypeError(f"llm must be a LlamaIndex LLM, got {type(self.llm).__name__}")
        if self.provider not in (None, "auto", *cache_points.PROVIDERS):
            raise ValueError(
                f"provider must be one of {[*cache_points.PROVIDERS, 'auto']} or None, got {self.provider!r}"
            )
        if wire.REQUEST_ID_FIELDS.get(self.engine or "") and not hasattr(self.llm, "additional_kwargs"):
            raise ValueError(f"engine={self.engine!r} sends the request id in the body: llm must be OpenAI-compatible")
        resent = wire.REQUEST_ID_FIELDS.get(self.engine or "") and retries_resend_ids(
            type(self).__name__, str(self.engine), self.llm, "retry the query or chat turn"
        )
        if resent:
            raise ValueError(resent)
        span_binder()

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return self.llm.metadata  # type: ignore[no-any-return]

    def _engine_access(self) -> EngineAccess | None:
        url = getattr(self.llm, "api_base", None)
        key = getattr(self.llm, "api_key", None)
        headers = {"Authorization": f"Bearer {key}"} if isinstance(key, str) and key else {}
        model = str(getattr(self.llm, "model", None) or "default")
        return EngineAccess(url, model, headers) if isinstance(url, str) and url else None

    def _streaming(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Ask an OpenAI-compatible model for usage at the end of a stream."""
        if _is_openai(self.llm):
            return {"stream_options": {"include_usage": True}, **kwargs}
        return kwargs

    def _with_ids(self, call: ModelCall, kwargs: dict[str, Any]) -> dict[str, Any]:
        if not wire.REQUEST_ID_FIELDS.get(self.engine or ""):
            return kwargs
        base = (self.llm.additional_kwargs or {}).get("extra_body")
        extra = call.id_fields(self.engine, {**(base or {}), **(kwargs.get("extra_body") or {})}, prompt_ids=False)
        return {**kwargs, "extra_body": extra}

    def _hosted(self) -> str | None:
        if self.engine is not None or self.provider is None:
            return None
        return cache_points.provider_of(self.llm) if self.provider == "auto" else self.provider

    def _bind_chat(
        self, kwargs: dict[str, Any], messages: Sequence[ChatMessage]
    ) -> tuple[ModelCall, list[ChatMessage], dict[str, Any]]:
        """The call and its prepared request, and the messages and arguments to send (markers placed)."""
        call, sent = _llm_calls.bind(kwargs, messages, self._body_fields(), self.event_sink)
        binding, provider = call.binding, self._hosted()
        if binding is None or provider is None:
            return call, sent, kwargs
        sent, kwargs = mark_bound_call(
            binding,
            sent,
            kwargs,
            lambda: cache_points.mark_chat(
                provider,
                cache_points.model_name(self.llm),
                binding,
                sent,
                kwargs,
                settings=[getattr(self.llm, "additional_kwargs", None) or {}],
                cache_idx=getattr(self.llm, "cache_idx", None),
                callers_key=callers_cache_key(kwargs, self.llm),
                keys=self._keys,
            ),
            _log,
        )
        return call, sent, kwargs

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call, sent, kwargs = self._bind_chat(kwargs, messages)
        try:
            response = self.llm.chat(sent, **self._with_ids(call, kwargs))
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._done(call, response)  # type: ignore[no-any-return]

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        call, sent, kwargs = self._bind_chat(kwargs, messages)
        try:
            response = await self.llm.achat(sent, **self._with_ids(call, kwargs))
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._done(call, response)  # type: ignore[no-any-return]

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        call, sent, kwargs = self._bind_chat(kwargs, messages)
        try:
            stream = self.llm.stream_chat(sent, **self._streaming(self._with_ids(call, kwargs)))
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._streamed(call, stream)

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        call, sent, kwargs = self._bind_chat(kwargs, messages)
        try:
            stream = await self.llm.astream_chat(sent, **self._streaming(self._with_ids(call, kwargs)))
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._astreamed(call, stream)

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call, sent = _llm_calls.bind_prompt(kwargs, prompt, self._body_fields(), self.event_sink)
        try:
            response = self.llm.complete(sent, formatted=formatted, **self._with_ids(call, kwargs))
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._done(call, response)  # type: ignore[no-any-return]

    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        call, sent = _llm_calls.bind_prompt(kwargs, prompt, self._body_fields(), self.event_sink)
        try:
            response = await self.llm.acomplete(sent, formatted=formatted, **self._with_ids(call, kwargs))
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._done(call, response)  # type: ignore[no-any-return]

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        call, sent = _llm_calls.bind_prompt(kwargs, prompt, self._body_fields(), self.event_sink)
        try:
            stream = self.llm.stream_complete(
                sent, formatted=formatted, **self._streaming(self._with_ids(call, kwargs))
            )
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._streamed(call, stream)

    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        call, sent = _llm_calls.bind_prompt(kwargs, prompt, self._body_fields(), self.event_sink)
        try:
            stream = await self.llm.astream_complete(
                sent, formatted=formatted, **self._streaming(self._with_ids(call, kwargs))
            )
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._astreamed(call, stream)


_PILOT_HINT = (
    "the component that prepares the request (ContextPilotPostprocessor, ContextPilotChatEngine); "
    "the LLM takes that request from its query"
)
"""Who takes ``pilot=`` (pydantic would drop an unknown name silently: ``engine="vllm"`` to a
class that took another name sent SGLang's ids)."""


def _check_engine(engine: object) -> None:
    if engine is not None and engine not in wire.ENGINES:
        raise ValueError(f"engine must be one of {list(wire.ENGINES)} or None, got {engine!r}")


class SGLangLLM(_Reports, OpenAILike):
    """``OpenAILike`` preset for SGLang (and other OpenAI-compatible engines).

    Each call sends the request ContextPilot prepared for it (named by
    ``ContextPilotChatEngine``, or left by ``ContextPilotPostprocessor`` in the same query,
    as :class:`ContextPilotLLM` takes it), else a fresh id; it goes out as ``rid`` and
    ``session_id`` (``engine="vllm"``: ``request_id``); no retries inside a call (``max_retries=0``:
    SGLang refuses a second request with the id of one still running). The server's cached tokens come back
    in ``response.additional_kwargs["cached_tokens"]`` and, with the token counts, to the
    request's pilot: its statistics, the prompt's token ids for ``event_sink`` (KV-event
    mapping), or without one ``usage_feedback`` (cached-token shortfalls drop what the
    engine no longer has). A call that fails makes the pilot forget the request. A local
    server needs no API key (``SGLANG_API_KEY`` or ``"EMPTY"``, never ``OPENAI_API_KEY``).
    """

    is_chat_model: bool = True
    event_sink: Any = Field(default=None, exclude=True)
    """Where prompt token ids go for KV-event mapping (``listener.sink``)."""
    usage_feedback: bool | None = None
    """Report cached-token shortfalls to the index (default: on without ``event_sink``)."""
    discover: bool | None = None
    """After the first answer, the request's pilot reads the engine's page size, KV pool and
    tokenizer, once, where its user left them unset (default: on unless
    ``CONTEXTPILOT_DISCOVER_ENGINE=0``; ``False``: never)."""
    engine: str | None = "sglang"
    """``sglang``, ``vllm``, ``llamacpp`` or ``openai``: which body fields carry the id."""
    slot: int | None = None
    """llama-server slot to pin (``id_slot``)."""
    router: Any = Field(default=None, exclude=True)
    """An ``engines.Router``: each call goes to the target whose cache the prepared request
    was ordered for (``api_base`` is then unused); an unreachable target is routed around."""

    def __init__(self, **kwargs: Any) -> None:
        refuse_unknown(type(self), kwargs, _PILOT_HINT, also=_OPENAI_PARAMETERS, where="api_base=")
        _check_engine(kwargs.get("engine", "sglang"))
        # a local engine takes any key: "EMPTY" unless one is given (never OPENAI_API_KEY)
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get("SGLANG_API_KEY") or "EMPTY"
        # no retries inside the call: a timed-out request may still run in the engine, and a
        # retry with its id is refused (SGLang: "Duplicate request ID"); retry the query,
        # which prepares its request afresh
        kwargs.setdefault("max_retries", 0)
        # and so an async client whose connections belong to the event loop using them: the
        # LLM answers from one asyncio.run after another (a shared pool dies with its loop)
        if kwargs.get("async_http_client") is None and kwargs.get("async_openai_client") is None:
            kwargs["async_http_client"] = loop_local_async_client()
        super().__init__(**kwargs)
        span_binder()

    @classmethod
    def class_name(cls) -> str:
        return "SGLangLLM"

    def _engine_access(self) -> EngineAccess | None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return EngineAccess(self.api_base, self.model, headers) if self.api_base else None

    def _block_tokenizer(self) -> BlockTokenizer | None:
        """Block ends for ``event_sink`` (exact mapping): each distinct block tokenized once
        by the engine (SGLang, vLLM); called on the thread that finished the call."""
        if self.engine not in ("sglang", "vllm") or not self.api_base:
            return None
        tokenizers: dict[str, BlockTokenizer] = self.__dict__.setdefault("_contextpilot_tokenizers", {})
        if self.api_base not in tokenizers:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            tokenizer = BlockTokenizer(self.api_base, self.engine, model=self.model, headers=headers)
            tokenizers.setdefault(self.api_base, tokenizer)
        return tokenizers[self.api_base]

    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        rid = kwargs.pop(_RID_KWARG, None) or ModelCall(None).request_id
        model_kwargs = super()._get_model_kwargs(**kwargs)
        extra = id_fields(self.engine, rid, model_kwargs.get("extra_body"), prompt_ids=self.event_sink is not None)
        if self.slot is not None:
            extra["id_slot"] = self.slot
        model_kwargs["extra_body"] = extra
        if model_kwargs.get("stream"):
            model_kwargs.setdefault("stream_options", {"include_usage": True})
        return model_kwargs

    def _bind(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> tuple[ModelCall, list[ChatMessage]]:
        call, sent = _llm_calls.bind(kwargs, messages, self._body_fields(), self.event_sink)
        kwargs[_RID_KWARG] = call.request_id
        return call, sent

    # ---- routing across targets ----------------------------------------------------------------
    def _delegate(self, target: Any) -> SGLangLLM:
        """An LLM for one target (cached): this one's settings, that target's engine."""
        delegates: dict[str, SGLangLLM] = self.__dict__.setdefault("_delegates", {})
        if target.name not in delegates:
            skip = {"router", "api_base", "slot", "engine", "callback_manager"}
            settings = {name: getattr(self, name) for name in type(self).model_fields if name not in skip}
            delegates[target.name] = type(self)(
                **settings,
                api_base=target.base_url.rstrip("/") + "/v1",
                slot=target.slot,
                engine=target.engine,
                http_client=self._http_client,  # the caller's connection pools (and hooks)
                async_http_client=self._async_http_client,
            )
        return delegates[target.name]

    def _route(self, kwargs: dict[str, Any], call: Any, *, run: Any = None) -> Any:
        binding = kwargs.pop(BINDING_KWARG, None) or take()
        router_call = run or self.router.call
        return router_call(binding, self._sender(kwargs, call))

    def _sender(self, kwargs: dict[str, Any], call: Any) -> Any:
        """Send through the target's delegate, naming the request as that target's state knows it."""

        def send(target: Any, prepared: Any) -> Any:
            named = {BINDING_KWARG: Binding(self.router.pilot(target), prepared)} if prepared is not None else {}
            return call(self._delegate(target), {**kwargs, **named})

        return send

    # ---- every call style ----------------------------------------------------------------------
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if self.router is not None:
            return self._route(kwargs, lambda llm, kw: llm.chat(messages, **kw))  # type: ignore[no-any-return]
        call, sent = self._bind(messages, kwargs)
        try:
            response = super().chat(sent, **kwargs)
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._done(call, response)  # type: ignore[no-any-return]

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if self.router is not None:
            return await self._route(kwargs, lambda llm, kw: llm.achat(messages, **kw), run=self.router.acall)  # type: ignore[no-any-return]
        call, sent = self._bind(messages, kwargs)
        try:
            response = await super().achat(sent, **kwargs)
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._done(call, response)  # type: ignore[no-any-return]

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generator[ChatResponse, None, None]:
        if self.router is not None:  # routed; the stream is read whole so that failover can resend
            return iter(self._route(kwargs, lambda llm, kw: list(llm.stream_chat(messages, **kw))))  # type: ignore[return-value]
        call, sent = self._bind(messages, kwargs)  # now, in the caller's span: not when read
        try:
            stream = super().stream_chat(sent, **kwargs)
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._streamed(call, stream)

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> AsyncGenerator[ChatResponse, None]:
        if self.router is not None:

            async def whole(llm: SGLangLLM, kw: dict[str, Any]) -> list[ChatResponse]:
                return [chunk async for chunk in await llm.astream_chat(messages, **kw)]

            chunks = await self._route(kwargs, whole, run=self.router.acall)

            async def replay() -> AsyncGenerator[ChatResponse, None]:
                for chunk in chunks:
                    yield chunk

            return replay()
        call, sent = self._bind(messages, kwargs)
        try:
            stream = await super().astream_chat(sent, **kwargs)
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        return self._astreamed(call, stream)


def _is_openai(llm: Any) -> bool:
    try:
        from llama_index.llms.openai import OpenAI
    except ImportError:  # pragma: no cover - installed with this package
        return False
    return isinstance(llm, OpenAI)


_OPENAI_PARAMETERS = {
    name for name in inspect.signature(OpenAILike.__init__).parameters if name not in ("self", "kwargs")
}
"""What ``OpenAILike`` takes besides its fields (its clients)."""

_RID_KWARG = "_contextpilot_rid"
"""How a bound call hands its request id to ``_get_model_kwargs`` (never sent as a field)."""
