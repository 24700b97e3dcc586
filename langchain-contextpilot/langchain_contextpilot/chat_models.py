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
from contextpilot_integrations.engines.loop_local import loop_local_async_client
from contextpilot_integrations.errors import EngineError
from contextpilot_integrations.integration.call_plan import callers_cache_key, mark_bound_call
from contextpilot_integrations.integration.model_call import EngineAccess, ModelCall, reraise
from contextpilot_integrations.pilot.binding import Binding
from contextpilot_integrations.providers.cache_key import ConversationKeys

from . import _binding, _model_calls, cache_markers
from ._model_calls import BINDING_KWARG, BLOCK_ENDS_KEY, PROMPT_IDS_KEY

__all__ = ["ChatSGLang", "ContextPilotChatModel"]

_log = logging.getLogger(__name__)

_SENDING: ContextVar[bool] = ContextVar("contextpilot_sending", default=False)
"""Inside a call already bound (a provider's ``_generate`` that streams through ``_stream``)."""


class _SendsPreparedRequests:
    """The calls of a chat model that sends the invocation's prepared request (the core's
    :class:`~contextpilot_integrations.integration.model_call.ModelCall` around each).

    Subclasses name the model that talks to the provider (:meth:`_provider_model`) and send
    through it (:meth:`_send`); a hosted API's cache markers are :meth:`_hosted` and :meth:`_marked`."""

    engine: str | None
    event_sink: Any
    usage_feedback: bool | None
    discover: bool | None

    # provided by the subclass -------------------------------------------------------------
    def _provider_model(self) -> Any:
        """The model that talks to the provider (its ``extra_body``, ``model_kwargs``, base URL and key)."""
        raise NotImplementedError

    def _send(
        self, method: str, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> Any:
        """The provider's own ``method`` (``_generate``, ``_agenerate``, ``_stream``, ``_astream``)."""
        raise NotImplementedError

    def _hosted(self) -> str | None:
        """The hosted API whose cache markers this model writes (``None``: none)."""
        return None

    def _marked(
        self, call: ModelCall, messages: list[BaseMessage], kwargs: dict[str, Any], provider: str
    ) -> tuple[list[BaseMessage], dict[str, Any]]:
        """The messages and arguments with ``provider``'s cache markers."""
        return messages, kwargs

    # the calls ------------------------------------------------------------------------------
    def _before(
        self, messages: Sequence[BaseMessage], run_manager: Any, kwargs: dict[str, Any]
    ) -> tuple[ModelCall, list[BaseMessage], dict[str, Any]]:
        call = _model_calls.start(run_manager, kwargs, self.event_sink)
        model = self._provider_model()
        extra_body = getattr(model, "extra_body", None)
        # the request body's own fields beside its messages (a cache_salt, an extra_key, a lora_path)
        fields = {
            **(getattr(model, "model_kwargs", None) or {}),
            **(extra_body or {}),
            **(kwargs.get("extra_body") or {}),
        }
        sent = _model_calls.sent(call, messages, {**fields, **kwargs})
        kwargs = _model_calls.with_ids(self.engine, call.binding, kwargs, extra_body, self.event_sink is not None)
        provider = self._hosted()
        if call.binding is not None and provider is not None:
            sent, kwargs = self._marked(call, sent, kwargs, provider)
        return call, sent, kwargs

    def _after(self, call: ModelCall, message: Any) -> None:
        provider = self._hosted()
        if provider is not None:
            if message is not None:  # a hosted API's short read is no eviction: off by default
                call.served_hosted(
                    cache_markers.raw_usage(message, provider), provider, usage_feedback=bool(self.usage_feedback)
                )
            return
        model = self._provider_model()
        call.learn_engine(self.engine, _engine_access(model), self.discover)  # once, for the next requests
        if call.binding is None or message is None:
            return
        feedback = self.event_sink is None if self.usage_feedback is None else self.usage_feedback
        ends = call.served(_model_calls.usage_of(message, model), usage_feedback=feedback, tokenizer=self._tokenizer())
        metadata = getattr(message, "response_metadata", None)
        if ends is not None and isinstance(metadata, dict):
            metadata[BLOCK_ENDS_KEY] = ends

    async def _aafter(self, call: ModelCall, message: Any) -> None:
        """:meth:`_after`, its ``/tokenize`` calls (new blocks only) off the event loop."""
        if self._tokenizer() is None or call.binding is None:
            self._after(call, message)
        else:
            await asyncio.to_thread(self._after, call, message)

    def _tokenizer(self) -> BlockTokenizer | None:
        """With an event sink and an engine that tokenizes (SGLang, vLLM): the core client's
        tokenizer of blocks, one per model, so block ends reach the sink (exact mapping)."""
        if self.event_sink is None or self.engine not in ("sglang", "vllm"):
            return None
        access = _engine_access(self._provider_model())
        if access is None:
            return None
        tokenizers: dict[tuple[str, str], BlockTokenizer] = self.__dict__.setdefault("_contextpilot_tokenizers", {})
        cached = tokenizers.get((access.url, self.engine))
        if cached is None:
            cached = BlockTokenizer(access.url, self.engine, model=access.model, headers=dict(access.headers))
            cached = tokenizers.setdefault((access.url, self.engine), cached)
        return cached

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call, messages, kwargs = self._before(messages, run_manager, kwargs)
        sending = _SENDING.set(True)
        try:
            result: ChatResult = self._send("_generate", messages, stop, run_manager, **kwargs)
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        finally:
            _SENDING.reset(sending)
        self._after(call, result.generations[0].message if result.generations else None)
        return result

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        call, messages, kwargs = self._before(messages, run_manager, kwargs)
        sending = _SENDING.set(True)
        try:
            result: ChatResult = await self._send("_agenerate", messages, stop, run_manager, **kwargs)
        except BaseException as exc:  # cancelled too: the request may never have left
            reraise(call.failed(exc, type(self).__name__), exc)
        finally:
            _SENDING.reset(sending)
        await self._aafter(call, result.generations[0].message if result.generations else None)
        return result

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        if _SENDING.get():  # streamed by our own _generate: bound there
            yield from self._send("_stream", messages, stop, run_manager, **kwargs)
            return
        call, messages, kwargs = self._before(messages, run_manager, kwargs)
        merged = None
        try:
            for chunk in self._send("_stream", messages, stop, run_manager, **kwargs):
                merged = chunk.message if merged is None else merged + chunk.message
                yield chunk
        except GeneratorExit:  # the reader stopped early: the request was served
            raise
        except Exception as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        self._after(call, merged)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        if _SENDING.get():
            async for chunk in self._send("_astream", messages, stop, run_manager, **kwargs):
                yield chunk
            return
        call, messages, kwargs = self._before(messages, run_manager, kwargs)
        merged = None
        try:
            async for chunk in self._send("_astream", messages, stop, run_manager, **kwargs):
                merged = chunk.message if merged is None else merged + chunk.message
                yield chunk
        except GeneratorExit:
            raise
        except BaseException as exc:
            reraise(call.failed(exc, type(self).__name__), exc)
        await self._aafter(call, merged)


def _engine_access(model: Any) -> EngineAccess | None:
    """Where the OpenAI-compatible engine behind ``model`` answers (``None``: no base URL)."""
    base_url = getattr(model, "openai_api_base", None)
    if not isinstance(base_url, str) or not base_url:
        return None
    key = getattr(model, "openai_api_key", None)
    secret = key.get_secret_value() if key is not None else ""
    headers = {"Authorization": f"Bearer {secret}"} if secret else {}
    return EngineAccess(base_url, getattr(model, "model_name", None) or "default", headers)


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

    def _provider_model(self) -> Any:
        return self.llm

    def _hosted(self) -> str | None:
        if self.engine is not None or self.provider is None:
            return None
        return cache_markers.provider_of(self.llm) if self.provider == "auto" else self.provider

    def _marked(
        self, call: ModelCall, messages: list[BaseMessage], kwargs: dict[str, Any], provider: str
    ) -> tuple[list[BaseMessage], dict[str, Any]]:
        binding = call.binding
        assert binding is not None
        return mark_bound_call(
            binding,
            messages,
            kwargs,
            lambda: cache_markers.mark_messages(
                provider,
                cache_markers.model_name(self.llm),
                binding,
                messages,
                kwargs,
                settings=[getattr(self.llm, "model_kwargs", None) or {}],
                callers_key=callers_cache_key(kwargs, self.llm),
                keys=self._keys,
            ),
            _log,
        )

    def _send(
        self, method: str, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> Any:
        if method in ("_stream", "_astream"):
            kwargs = _with_stream_usage(self.llm, kwargs)
        return getattr(self.llm, method)(
            messages, stop=self.stop if stop is None else stop, run_manager=run_manager, **kwargs
        )


def _with_stream_usage(llm: BaseChatModel, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Ask for usage in streams where the model takes ``stream_usage`` (somewhere along its
    classes: ``ChatOpenAI._stream`` passes ``**kwargs`` on to ``BaseChatOpenAI._stream``)."""
    streams = [vars(cls)["_stream"] for cls in type(llm).__mro__ if "_stream" in vars(cls)]
    if any("stream_usage" in inspect.signature(stream).parameters for stream in streams):
        return {"stream_usage": True, **kwargs}
    return kwargs


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

    def _provider_model(self) -> Any:
        return self

    def _send(
        self, method: str, messages: list[BaseMessage], stop: list[str] | None, run_manager: Any, **kwargs: Any
    ) -> Any:
        return getattr(ChatOpenAI, method)(self, messages, stop=stop, run_manager=run_manager, **kwargs)

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
