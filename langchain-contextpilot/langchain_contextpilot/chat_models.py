"""Chat models that send ContextPilot's prepared request and report what the engine cached.

:class:`ContextPilotChatModel` wraps the chat model you already use (``ChatOpenAI``,
``ChatAnthropic``, ``ChatBedrockConverse``, ``ChatGoogleGenerativeAI``, ...);
:class:`ChatSGLang` is ``ChatOpenAI`` preset for SGLang and other OpenAI-compatible engines
(request id, prompt token ids for KV events, routing across replicas).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, ensure_config
from langchain_openai import ChatOpenAI
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from contextpilot_integrations.core.validation import refuse_unknown, retries_resend_ids
from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.block_tokenizer import BlockTokenizer
from contextpilot_integrations.engines.engine_info import learn_engine_in_background
from contextpilot_integrations.engines.loop_local import loop_local_async_client
from contextpilot_integrations.errors import EngineError
from contextpilot_integrations.integration.call_plan import callers_cache_key, mark_bound_call
from contextpilot_integrations.integration.hosted_feedback import report_provider_served
from contextpilot_integrations.pilot.binding import Binding, partitioned
from contextpilot_integrations.providers.cache_key import ConversationKeys

from . import _binding, _model_calls, cache_markers
from ._model_calls import BINDING_KWARG, PROMPT_IDS_KEY

__all__ = ["ChatSGLang", "ContextPilotChatModel"]

_log = logging.getLogger(__name__)

_SENDING: ContextVar[bool] = ContextVar("contextpilot_sending", default=False)
"""Inside a call already bound (a provider's ``_generate`` that streams through ``_stream``)."""


class _SendsPreparedRequests:
    """The calls of a chat model that sends the invocation's prepared request.

    Subclasses say how to reach the provider (:meth:`_send` and its stream/async forms)."""

    engine: str | None
    event_sink: Any
    usage_feedback: bool | None
    discover: bool | None

    # provided by the subclass -------------------------------------------------------------
    def _send(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any) -> ChatResult:
        raise NotImplementedError

    async def _asend(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> ChatResult:
        raise NotImplementedError

    def _send_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> Iterator[ChatGenerationChunk]:
        raise NotImplementedError

    def _asend_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> AsyncIterator[ChatGenerationChunk]:
        raise NotImplementedError

    def _provider_extra_body(self) -> dict[str, Any] | None:
        return None

    def _engine_base_url(self) -> str | None:
        """The OpenAI-compatible engine's URL, where its ``/tokenize`` is (``None``: none)."""
        return None

    def _block_tokenizer(self) -> BlockTokenizer | None:
        """With an event sink and an engine that tokenizes (SGLang, vLLM): the core client's
        tokenizer of blocks, one per model, so block ends reach the sink (exact mapping)."""
        if self.event_sink is None or self.engine not in ("sglang", "vllm"):
            return None
        base_url = self._engine_base_url()
        if not base_url:
            return None
        tokenizers: dict[tuple[str, str], BlockTokenizer] = self.__dict__.setdefault("_contextpilot_tokenizers", {})
        cached = tokenizers.get((base_url, self.engine))
        if cached is None:
            key = getattr(self, "openai_api_key", None) or getattr(self._wrapped_llm(), "openai_api_key", None)
            secret = key.get_secret_value() if key is not None else ""
            headers = {"Authorization": f"Bearer {secret}"} if secret else {}
            model = getattr(self, "model_name", None) or getattr(self._wrapped_llm(), "model_name", None) or "default"
            cached = BlockTokenizer(base_url, self.engine, model=model, headers=headers)
            cached = tokenizers.setdefault((base_url, self.engine), cached)
        return cached

    def _wrapped_llm(self) -> Any:
        return None

    def _learn_engine(self, binding: Binding | None) -> None:
        """Once per pilot and engine, on a thread of its own: the engine's page size, KV pool
        and tokenizer for the request's pilot, where its user left them unset (see
        :mod:`contextpilot_integrations.engines.engine_info`; ``discover=False``: never)."""
        base_url = self._engine_base_url() if binding is not None and self.engine is not None else None
        if binding is None or not base_url or self.discover is False:
            return
        key = getattr(self, "openai_api_key", None) or getattr(self._wrapped_llm(), "openai_api_key", None)
        secret = key.get_secret_value() if key is not None else ""
        model = getattr(self, "model_name", None) or getattr(self._wrapped_llm(), "model_name", None) or "default"
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        learn_engine_in_background(
            binding.pilot, base_url, engine=self.engine, model=model, headers=headers, discover=self.discover
        )

    def _body_fields(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request body's own fields this call sends beside its messages (where a
        ``cache_salt``, an ``extra_key`` or a ``lora_path`` would be)."""
        model_kwargs = getattr(self._wrapped_llm() or self, "model_kwargs", None) or {}
        extra = {**(self._provider_extra_body() or {}), **(kwargs.get("extra_body") or {})}
        return {**model_kwargs, **extra, **kwargs}

    # the calls ------------------------------------------------------------------------------
    def _before(
        self, messages: Sequence[BaseMessage], run_manager: Any, kwargs: dict[str, Any]
    ) -> tuple[Binding | None, list[BaseMessage], dict[str, Any]]:
        binding, sent = _model_calls.bind(run_manager, kwargs, messages)
        binding = partitioned(binding, self._body_fields(kwargs))  # the engine's cache partition it goes to
        kwargs = _model_calls.with_ids(
            self.engine, binding, kwargs, self._provider_extra_body(), self.event_sink is not None
        )
        return binding, sent, kwargs

    def _after(self, binding: Binding | None, message: Any) -> None:
        self._learn_engine(binding)  # once: the engine's page and tokenizer, for the next requests
        ends = _model_calls.block_ends(self._block_tokenizer(), binding, message)
        feedback = self.event_sink is None if self.usage_feedback is None else self.usage_feedback
        _model_calls.report(
            binding,
            message,
            usage_feedback=feedback,
            tracker=self.event_sink,
            block_ends=ends,
            chat_model=self._wrapped_llm() or self,
        )

    async def _aafter(self, binding: Binding | None, message: Any) -> None:
        """:meth:`_after`, its ``/tokenize`` calls (new blocks only) off the event loop."""
        if self._block_tokenizer() is None or binding is None:
            self._after(binding, message)
        else:
            await asyncio.to_thread(self._after, binding, message)

    def _failure(self, run_manager: Any, binding: Binding | None, exc: BaseException) -> BaseException:
        _model_calls.failed(run_manager, binding, self.event_sink)
        return _model_calls.typed(exc, type(self).__name__)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        binding, messages, kwargs = self._before(messages, run_manager, kwargs)
        sending = _SENDING.set(True)
        try:
            result = self._send(messages, stop, run_manager, **kwargs)
        except Exception as exc:
            _reraise(self._failure(run_manager, binding, exc), exc)
        finally:
            _SENDING.reset(sending)
        self._after(binding, result.generations[0].message if result.generations else None)
        return result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        binding, messages, kwargs = self._before(messages, run_manager, kwargs)
        sending = _SENDING.set(True)
        try:
            result = await self._asend(messages, stop, run_manager, **kwargs)
        except BaseException as exc:  # cancelled too: the request may never have left
            _reraise(self._failure(run_manager, binding, exc), exc)
        finally:
            _SENDING.reset(sending)
        await self._aafter(binding, result.generations[0].message if result.generations else None)
        return result

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if _SENDING.get():  # streamed by our own _generate: bound there
            yield from self._send_stream(messages, stop, run_manager, **kwargs)
            return
        binding, messages, kwargs = self._before(messages, run_manager, kwargs)
        merged = None
        try:
            for chunk in self._send_stream(messages, stop, run_manager, **kwargs):
                merged = chunk.message if merged is None else merged + chunk.message
                yield chunk
        except GeneratorExit:  # the reader stopped early: the request was served
            raise
        except Exception as exc:
            _reraise(self._failure(run_manager, binding, exc), exc)
        self._after(binding, merged)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        if _SENDING.get():
            async for chunk in self._asend_stream(messages, stop, run_manager, **kwargs):
                yield chunk
            return
        binding, messages, kwargs = self._before(messages, run_manager, kwargs)
        merged = None
        try:
            async for chunk in self._asend_stream(messages, stop, run_manager, **kwargs):
                merged = chunk.message if merged is None else merged + chunk.message
                yield chunk
        except GeneratorExit:
            raise
        except BaseException as exc:
            _reraise(self._failure(run_manager, binding, exc), exc)
        await self._aafter(binding, merged)


def _reraise(error: BaseException, original: BaseException) -> Any:
    if error is original:
        raise original
    raise error from original


class ContextPilotChatModel(_SendsPreparedRequests, BaseChatModel):
    """Any LangChain chat model, sending the prepared request of its invocation.

    ``ContextPilotChatModel(llm=ChatOpenAI(...))`` (or ``ChatAnthropic``,
    ``ChatBedrockConverse``, ``ChatGoogleGenerativeAI``, ...) in the place of the model:

    - it takes the request that ContextPilot prepared earlier in the same invocation (the
      retriever, compressor or LCEL step of this package), through LangChain's run tree;
    - a location reference whose text is not in the messages sent is replaced by that text
      (counted in ``pilot.stats().references_restored``): a dangling reference never leaves;
    - with ``engine="sglang"`` / ``"vllm"`` (an OpenAI-compatible ``llm`` built with
      ``max_retries=0``: an SDK retry would send the id again) the request id goes out in
      the body (``rid`` / ``request_id``);
    - the provider's cached-token report (``usage_metadata["input_token_details"]
      ["cache_read"]``) goes back to the request's pilot, and a failed call makes the
      pilot forget the request (a retry takes it again, under a new id).

    Tools and structured output work as on the wrapped model (``bind_tools``). An argument
    it does not know (a misspelt ``provder=``, or ``pilot=``, which belongs to the
    retriever or compressor) is refused, as LangChain's own models refuse misspelt fields.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    llm: BaseChatModel
    """The chat model that talks to the provider."""
    engine: str | None = None
    """``sglang``, ``vllm``: which body fields carry the request id (``None``: none, e.g. a
    hosted API)."""
    event_sink: Any = Field(default=None, exclude=True)
    usage_feedback: bool | None = None
    """Report cached-token shortfalls to the index (default: on for an engine, off for a
    hosted API, whose short reads are no evictions)."""
    discover: bool | None = None
    """With ``engine=``: after the first answer, the request's pilot reads the engine's page
    size, KV pool and tokenizer (at the ``llm``'s base URL), once, where its user left them
    unset (default: on unless ``CONTEXTPILOT_DISCOVER_ENGINE=0``; ``False``: never)."""
    provider: str | None = "auto"
    """The hosted API whose prompt cache to mark: ``openai``, ``anthropic``, ``bedrock``,
    ``gemini``; ``"auto"``: from the wrapped class (``ChatOpenAI`` only at OpenAI's own
    URL); ``None``: no markers. See :mod:`.cache_markers`."""
    stop: list[str] | None = None
    """Stop sequences for every call that passes none (LangChain's standard ``stop``
    parameter, as on the wrapped model)."""
    _keys: ConversationKeys = PrivateAttr(default_factory=ConversationKeys)
    """The OpenAI key each conversation was first sent under (its later turns keep it)."""

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, values: Any) -> Any:
        return _known_only(cls, values)

    @model_validator(mode="after")
    def _engine_needs_a_body(self) -> ContextPilotChatModel:
        if self.provider not in (None, "auto", *cache_markers.PROVIDERS):
            raise ValueError(
                f"provider must be one of {[*cache_markers.PROVIDERS, 'auto']} or None, got {self.provider!r}"
            )
        if wire.REQUEST_ID_FIELDS.get(self.engine or "") and not hasattr(self.llm, "extra_body"):
            raise ValueError(f"engine={self.engine!r} sends the request id in the body: llm must be OpenAI-compatible")
        resent = wire.REQUEST_ID_FIELDS.get(self.engine or "") and retries_resend_ids(
            type(self).__name__, str(self.engine), self.llm, "retry with .with_retry()"
        )
        if resent:
            raise ValueError(resent)
        if self.engine is not None and self.engine not in wire.REQUEST_ID_FIELDS:
            raise ValueError(f"engine must be one of {sorted(wire.REQUEST_ID_FIELDS)} or None, got {self.engine!r}")
        return self

    @property
    def _llm_type(self) -> str:
        return f"contextpilot-{self.llm._llm_type}"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"llm": self.llm._identifying_params, "engine": self.engine}

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Runnable[Any, Any]:
        """The wrapped model's tool binding, kept on this model (it passes them through)."""
        bound = self.llm.bind_tools(tools, **kwargs)
        return self.bind(**getattr(bound, "kwargs", {}))

    def _provider_extra_body(self) -> dict[str, Any] | None:
        return getattr(self.llm, "extra_body", None)

    def _hosted(self) -> str | None:
        """The hosted API whose cache markers this model writes (``None``: none)."""
        if self.engine is not None or self.provider is None:
            return None
        return cache_markers.provider_of(self.llm) if self.provider == "auto" else self.provider

    def _before(
        self, messages: Sequence[BaseMessage], run_manager: Any, kwargs: dict[str, Any]
    ) -> tuple[Binding | None, list[BaseMessage], dict[str, Any]]:
        binding, sent, kwargs = super()._before(messages, run_manager, kwargs)
        provider = self._hosted()
        if binding is None or provider is None:
            return binding, sent, kwargs
        sent, kwargs = mark_bound_call(
            binding,
            sent,
            kwargs,
            lambda: cache_markers.mark_messages(
                provider,
                cache_markers.model_name(self.llm),
                binding,
                sent,
                kwargs,
                settings=[getattr(self.llm, "model_kwargs", None) or {}],
                callers_key=callers_cache_key(kwargs, self.llm),
                keys=self._keys,
            ),
            _log,
        )
        return binding, sent, kwargs

    def _after(self, binding: Binding | None, message: Any) -> None:
        provider = self._hosted()
        if provider is None:
            super()._after(binding, message)
        elif binding is not None and message is not None:
            # a hosted API's short read is no eviction (it reads only at its entries, in steps): off by default
            feedback = bool(self.usage_feedback)
            report_provider_served(
                binding.pilot,
                binding.prepared,
                cache_markers.raw_usage(message, provider),
                provider,
                before_tokens=binding.before_tokens,
                usage_feedback=feedback,
            )

    def _engine_base_url(self) -> str | None:
        base_url = getattr(self.llm, "openai_api_base", None)
        return base_url if isinstance(base_url, str) else None

    def _wrapped_llm(self) -> Any:
        return self.llm

    def _stream_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Ask for usage in streams where the model takes ``stream_usage`` (somewhere along its
        classes: ``ChatOpenAI._stream`` passes ``**kwargs`` on to ``BaseChatOpenAI._stream``)."""
        streams = [vars(cls)["_stream"] for cls in type(self.llm).__mro__ if "_stream" in vars(cls)]
        if any("stream_usage" in inspect.signature(stream).parameters for stream in streams):
            return {"stream_usage": True, **kwargs}
        return kwargs

    def _send(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any) -> ChatResult:
        return self.llm._generate(messages, stop=self.stop if stop is None else stop, run_manager=run_manager, **kwargs)

    async def _asend(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> ChatResult:
        return await self.llm._agenerate(
            messages, stop=self.stop if stop is None else stop, run_manager=run_manager, **kwargs
        )

    def _send_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> Iterator[ChatGenerationChunk]:
        return self.llm._stream(
            messages, stop=self.stop if stop is None else stop, run_manager=run_manager, **self._stream_kwargs(kwargs)
        )

    def _asend_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> AsyncIterator[ChatGenerationChunk]:
        return self.llm._astream(
            messages, stop=self.stop if stop is None else stop, run_manager=run_manager, **self._stream_kwargs(kwargs)
        )


_PILOT_HINT = (
    "the component that prepares the request (ContextPilotRetriever, ContextPilotCompressor, "
    "ConversationalRAG, ContextPilotMiddleware); the model takes that request from its invocation"
)


def _known_only(cls: Any, values: Any) -> Any:
    """``values`` when every name is a field of ``cls`` (or its alias); else a clear refusal."""
    if isinstance(values, dict):
        refuse_unknown(cls, values, _PILOT_HINT)
    return values


class ChatSGLang(_SendsPreparedRequests, ChatOpenAI):
    """``ChatOpenAI`` preset for SGLang (and other OpenAI-compatible servers with a prefix cache).

    Each call sends the request that ContextPilot prepared earlier in the same invocation
    (taken through LangChain's run tree, as :class:`ContextPilotChatModel` does), as ``rid``
    and ``session_id`` (``engine="vllm"``: ``request_id``; a call with none gets a fresh
    id). After the answer, the server's token counts go back to that request's pilot, and:

    - with ``event_sink`` (a listener's ``.sink``, or the sink a ZMQ subscriber feeds), the
      prompt's token ids, so the engine's KV events can be mapped to the request, and where
      each block ends in them (each distinct block tokenized once through the engine's
      ``/tokenize``; also in ``response_metadata["block_ends"]``), so a lost tail page
      keeps the leading blocks predicted;
    - without one, ``usage_feedback``: cached tokens below the prediction drop what the
      engine no longer has from the index.

    A call that fails makes the pilot forget the request. Streaming reports usage, so
    ``usage_metadata["input_token_details"]["cache_read"]`` carries the server's cached
    tokens for invoke, ainvoke, stream, astream and batch alike, from any number of event
    loops (its async connections belong to the loop using them). A local server needs no
    API key (``SGLANG_API_KEY`` or ``"EMPTY"``; ``OPENAI_API_KEY`` is never sent to it).
    """

    stream_usage: bool | None = True
    max_retries: int | None = 0
    """No retries inside the OpenAI client: a timed-out request may still run in the engine,
    and a retry with its id is refused (SGLang: "Duplicate request ID"). Retry with
    LangChain's ``.with_retry()``: the retry takes the request again under a new id."""
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
    router: Any = Field(default=None, exclude=True)
    """An ``engines.Router``: each call goes to the target whose cache the prepared request
    was ordered for (``base_url`` is then unused); an unreachable target is routed around."""

    @model_validator(mode="before")
    @classmethod
    def _known_arguments(cls, values: Any) -> Any:
        """An unknown name is refused, not moved into ``model_kwargs`` and sent in the body
        (``ChatOpenAI``'s habit): ``ChatSGLang(server=...)`` would reach the engine."""
        return _known_only(cls, values)

    @model_validator(mode="before")
    @classmethod
    def _local_server_needs_no_key(cls, values: Any) -> Any:
        """A local engine takes any key: use ``SGLANG_API_KEY`` or ``"EMPTY"``, never
        ``OPENAI_API_KEY`` (which would send an OpenAI key to another server)."""
        if isinstance(values, dict) and values.get("api_key") is None and values.get("openai_api_key") is None:
            values = {**values, "api_key": os.environ.get("SGLANG_API_KEY") or "EMPTY"}
        return values

    @model_validator(mode="before")
    @classmethod
    def _async_client_for_every_event_loop(cls, values: Any) -> Any:
        """Unless given a client (or a proxy): an async client whose connections belong to
        the event loop using them, so the model answers from one ``asyncio.run`` after
        another (stock ``ChatOpenAI`` shares one client bound to the first loop and gets by
        on retries; this model does not retry)."""
        if not isinstance(values, dict) or values.get("http_async_client") is not None:
            return values
        if values.get("async_client") is not None or values.get("openai_proxy") or os.environ.get("OPENAI_PROXY"):
            return values
        return {**values, "http_async_client": loop_local_async_client()}

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    def _provider_extra_body(self) -> dict[str, Any] | None:
        return dict(self.extra_body or {})

    def _engine_base_url(self) -> str | None:
        return self.openai_api_base

    def _send(self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any) -> ChatResult:
        return ChatOpenAI._generate(self, messages, stop=stop, run_manager=run_manager, **kwargs)

    async def _asend(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> ChatResult:
        return await ChatOpenAI._agenerate(self, messages, stop=stop, run_manager=run_manager, **kwargs)

    def _send_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> Iterator[ChatGenerationChunk]:
        return ChatOpenAI._stream(self, messages, stop=stop, run_manager=run_manager, **kwargs)

    def _asend_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> AsyncIterator[ChatGenerationChunk]:
        return ChatOpenAI._astream(self, messages, stop=stop, run_manager=run_manager, **kwargs)

    # ---- the prompt's token ids (for KV-event mapping) ------------------------------------------
    def _create_chat_result(self, response: Any, generation_info: dict[str, Any] | None = None) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        ids = _prompt_ids(response if isinstance(response, dict) else response.model_dump())
        if ids and result.generations:
            result.generations[0].message.response_metadata[PROMPT_IDS_KEY] = ids
        return result

    def _convert_chunk_to_generation_chunk(
        self, chunk: dict[str, Any], default_chunk_class: type, base_generation_info: dict[str, Any] | None
    ) -> ChatGenerationChunk | None:
        generation = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
        ids = _prompt_ids(chunk)
        if ids and generation is not None:
            generation.message.response_metadata[PROMPT_IDS_KEY] = ids
        return generation

    # ---- routing across targets ----------------------------------------------------------------
    def _delegate(self, target: Any) -> ChatSGLang:
        """A chat model for one target (cached): this one's settings, that target's server."""
        delegates: dict[str, ChatSGLang] = self.__dict__.setdefault("_delegates", {})
        if target.name not in delegates:
            skip = {"client", "async_client", "root_client", "root_async_client", "router", "openai_api_base"}
            settings = {name: getattr(self, name) for name in type(self).model_fields if name not in skip}
            extra = dict(settings.get("extra_body") or {})
            if target.slot is not None:
                extra["id_slot"] = target.slot
            settings.update(extra_body=extra, engine=target.engine, base_url=target.base_url.rstrip("/") + "/v1")
            delegates[target.name] = type(self)(**settings)
        return delegates[target.name]

    def _routed(
        self, config: RunnableConfig | None, call: Callable[[ChatSGLang, dict[str, Any]], Any]
    ) -> tuple[Binding | None, Callable[[Any, Any], Any]]:
        """The invocation's request, and a sender that hands it to the target's delegate as
        that target's state knows it (adopted there after a failover)."""
        binding = _binding.take(ensure_config(config).get("callbacks"))

        def send(target: Any, prepared: Any) -> Any:
            named = {BINDING_KWARG: Binding(self.router.pilot(target), prepared)} if prepared is not None else {}
            return call(self._delegate(target), named)

        return binding, send

    def invoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        if self.router is None:
            return super().invoke(input, config, stop=stop, **kwargs)
        binding, send = self._routed(
            config, lambda model, named: model.invoke(input, config, stop=stop, **kwargs, **named)
        )
        return self.router.call(binding, send)

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        if self.router is None:
            return await super().ainvoke(input, config, stop=stop, **kwargs)
        binding, send = self._routed(
            config, lambda model, named: model.ainvoke(input, config, stop=stop, **kwargs, **named)
        )
        return await self.router.acall(binding, send)

    def stream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        if self.router is None:
            yield from super().stream(input, config, stop=stop, **kwargs)
            return
        # routed: the stream is read whole, so that a failover can send it again
        binding, send = self._routed(
            config, lambda model, named: list(model.stream(input, config, stop=stop, **kwargs, **named))
        )
        yield from self.router.call(binding, send)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        if self.router is None:
            async for chunk in super().astream(input, config, stop=stop, **kwargs):
                yield chunk
            return

        async def whole(model: ChatSGLang, named: dict[str, Any]) -> list[Any]:
            return [chunk async for chunk in model.astream(input, config, stop=stop, **kwargs, **named)]

        binding, send = self._routed(config, whole)
        for chunk in await self.router.acall(binding, send):
            yield chunk


def _prompt_ids(data: dict[str, Any]) -> list[int] | None:
    try:
        return wire.input_ids(data, "the server")
    except EngineError:
        return None
