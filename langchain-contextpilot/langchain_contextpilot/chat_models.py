"""A chat model for SGLang and other OpenAI-compatible servers with a prefix cache."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import RunnableConfig, ensure_config
from langchain_core.runnables.config import merge_configs
from langchain_openai import ChatOpenAI
from pydantic import Field, model_validator

from contextpilot_integrations import ContextPilot, PreparedRequest
from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.feedback import Binding, bind_prompt, report_failed, report_served
from contextpilot_integrations.errors import EngineError

__all__ = ["ChatSGLang"]

REQUEST_ID_KEY = "contextpilot_request_id"
PROMPT_IDS_KEY = "prompt_token_ids"


class ChatSGLang(ChatOpenAI):
    """``ChatOpenAI`` for SGLang (and other OpenAI-compatible servers with a prefix cache).

    Each call sends the request id of the ContextPilot request that produced its context:
    the one named in the run config (``metadata["contextpilot_request_id"]``), else the
    most recent prepared request whose order annotation the prompt contains (what
    ``format_documents`` renders), else a fresh one. The id goes out as ``rid`` and
    ``session_id`` (``engine="vllm"``: ``request_id``). After the answer, the server's token
    counts go back to that request's pilot (``pilot.stats()``, per conversation), and:

    - with ``event_sink`` (a listener's ``.sink``, or the sink a ZMQ subscriber feeds), the
      prompt's token ids, so the engine's KV events can be mapped to the request;
    - without one, ``usage_feedback``: cached tokens below the prediction drop what the
      engine no longer has from the index.

    A call that fails makes the pilot forget the request. Streaming reports usage, so
    ``usage_metadata["input_token_details"]["cache_read"]`` carries the server's cached
    tokens for invoke, ainvoke, stream, astream and batch alike. A local server needs no
    API key (``SGLANG_API_KEY`` or ``"EMPTY"``; ``OPENAI_API_KEY`` is never sent to it).
    """

    stream_usage: bool | None = True
    pilot: ContextPilot | None = Field(default=None, exclude=True)
    """The pilot to search first (default: every pilot in the process)."""
    event_sink: Any = Field(default=None, exclude=True)
    """Where prompt token ids go for KV-event mapping (``listener.sink``)."""
    usage_feedback: bool | None = None
    """Report cached-token shortfalls to the index (default: on without ``event_sink``)."""
    engine: str = "sglang"
    """``sglang``, ``vllm``, ``llamacpp`` or ``openai``: which body fields carry the id."""
    router: Any = Field(default=None, exclude=True)
    """An ``engines.Router``: each call goes to the target whose cache the prepared request
    was ordered for (``base_url`` is then unused); an unreachable target is routed around."""

    @model_validator(mode="before")
    @classmethod
    def _local_server_needs_no_key(cls, values: Any) -> Any:
        """A local engine takes any key: use ``SGLANG_API_KEY`` or ``"EMPTY"``, never
        ``OPENAI_API_KEY`` (which would send an OpenAI key to another server)."""
        if isinstance(values, dict) and values.get("api_key") is None and values.get("openai_api_key") is None:
            values = {**values, "api_key": os.environ.get("SGLANG_API_KEY") or "EMPTY"}
        return values

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    # ---- the request id and the prepared request behind a call ---------------------------
    def _bind(self, input: Any, config: RunnableConfig | None) -> Binding | None:
        config = ensure_config(config)
        rid = (config.get("metadata") or {}).get(REQUEST_ID_KEY) or (config.get("configurable") or {}).get(
            REQUEST_ID_KEY
        )
        text = "\n".join(m.content for m in self._messages(input) if isinstance(m.content, str))
        return bind_prompt(text, str(rid) if rid else None, self.pilot)

    def _messages(self, input: Any) -> list[BaseMessage]:
        try:
            return self._convert_input(input).to_messages()
        except (TypeError, ValueError):
            return []

    def _with_rid(
        self, config: RunnableConfig | None, kwargs: dict[str, Any], binding: Binding | None = None
    ) -> dict[str, Any]:
        config = ensure_config(config)
        rid = binding.prepared.request_id if binding else None
        rid = rid or (config.get("metadata") or {}).get(REQUEST_ID_KEY) or f"cp-{uuid.uuid4().hex}"
        extra = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {})}
        for name in wire.REQUEST_ID_FIELDS.get(self.engine, ()):
            extra[name] = str(rid)
        if self.event_sink is not None:
            extra.update(wire.PROMPT_IDS_REQUEST.get(self.engine, {}))
        return {**kwargs, "extra_body": extra}

    # ---- the engine's report -----------------------------------------------------------------
    def _report(self, binding: Binding | None, message: Any) -> None:
        if binding is None:
            return
        usage = getattr(message, "usage_metadata", None) or {}
        cached = (usage.get("input_token_details") or {}).get("cache_read")
        ids = (getattr(message, "response_metadata", None) or {}).get(PROMPT_IDS_KEY)
        report_served(
            binding.pilot,
            binding.prepared,
            usage.get("input_tokens"),
            cached,
            before_tokens=binding.before_tokens,
            usage_feedback=self.event_sink is None if self.usage_feedback is None else self.usage_feedback,
            tracker=self.event_sink,
            input_ids=ids,
        )

    def _failed(self, binding: Binding | None) -> None:
        if binding is not None:
            report_failed(binding.pilot, binding.prepared, self.event_sink)

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
            settings["pilot"] = self.router.pilot(target)  # it reports to that target's state
            delegates[target.name] = type(self)(**settings)
        return delegates[target.name]

    def _route(self, input: Any, config: RunnableConfig | None, call: Any) -> Any:
        return self.router.call(self._bind(input, config), self._sender(config, call))

    async def _aroute(self, input: Any, config: RunnableConfig | None, call: Any) -> Any:
        return await self.router.acall(self._bind(input, config), self._sender(config, call))

    def _sender(self, config: RunnableConfig | None, call: Any) -> Any:
        """Send through the target's delegate, naming the request (in the run's metadata) as
        that target's state knows it, so the delegate binds it by id."""

        def send(target: Any, prepared: PreparedRequest | None) -> Any:
            named = RunnableConfig(metadata={REQUEST_ID_KEY: prepared.request_id}) if prepared is not None else None
            return call(self._delegate(target), merge_configs(config, named))

        return send

    # ---- every call style -------------------------------------------------------------------
    def invoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        if self.router is not None:
            return self._route(
                input, config, lambda model, run_config: model.invoke(input, run_config, stop=stop, **kwargs)
            )
        binding = self._bind(input, config)
        try:
            message = super().invoke(input, config, stop=stop, **self._with_rid(config, kwargs, binding))
        except BaseException:
            self._failed(binding)
            raise
        self._report(binding, message)
        return message

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        if self.router is not None:
            return await self._aroute(
                input, config, lambda model, run_config: model.ainvoke(input, run_config, stop=stop, **kwargs)
            )
        binding = self._bind(input, config)
        try:
            message = await super().ainvoke(input, config, stop=stop, **self._with_rid(config, kwargs, binding))
        except BaseException:
            self._failed(binding)
            raise
        self._report(binding, message)
        return message

    def stream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        if self.router is not None:  # routed; the stream is read whole so that failover can resend
            yield from self._route(
                input, config, lambda model, run_config: list(model.stream(input, run_config, stop=stop, **kwargs))
            )
            return
        binding = self._bind(input, config)
        merged = None
        try:
            for chunk in super().stream(input, config, stop=stop, **self._with_rid(config, kwargs, binding)):
                merged = chunk if merged is None else merged + chunk
                yield chunk
        except BaseException:
            self._failed(binding)
            raise
        self._report(binding, merged)

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        if self.router is not None:

            async def whole(model: ChatSGLang, run_config: RunnableConfig | None) -> list[Any]:
                return [chunk async for chunk in model.astream(input, run_config, stop=stop, **kwargs)]

            for chunk in await self._aroute(input, config, whole):
                yield chunk
            return
        binding = self._bind(input, config)
        merged = None
        try:
            async for chunk in super().astream(input, config, stop=stop, **self._with_rid(config, kwargs, binding)):
                merged = chunk if merged is None else merged + chunk
                yield chunk
        except BaseException:
            self._failed(binding)
            raise
        self._report(binding, merged)


def _prompt_ids(data: dict[str, Any]) -> list[int] | None:
    try:
        return wire.input_ids(data, "the server")
    except EngineError:
        return None
