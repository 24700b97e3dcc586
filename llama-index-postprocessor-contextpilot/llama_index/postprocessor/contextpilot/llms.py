"""An LLM for SGLang and other OpenAI-compatible servers with a prefix cache.

``llama-index-llms-sglang`` talks to ``/v1/completions`` with its own prompt formatting and
returns no usage, so the server's cached tokens cannot be read back; the maintained
``OpenAILike`` (chat completions, usage included) is the base, plus two hooks: the request
id of the prepared request goes out as ``rid``/``session_id``, and the cached tokens come
back in ``additional_kwargs["cached_tokens"]``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, ChatResponse
from llama_index.core.bridge.pydantic import Field
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations import ContextPilot, PreparedRequest
from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.feedback import Binding, bind_prompt, report_failed, report_served
from contextpilot_integrations.errors import EngineError

__all__ = ["REQUEST_ID_KWARG", "SGLangLLM"]

REQUEST_ID_KWARG = "contextpilot_request_id"


class SGLangLLM(OpenAILike):
    """``OpenAILike`` chat model that sends ContextPilot's request id and reports back.

    The id is the one the chat engine passes for the call (``contextpilot_request_id=``),
    else that of the most recent prepared request whose order annotation the messages
    contain (the query engine path: :class:`ContextPilotPostprocessor` puts it in the
    query), else a fresh one; it goes out as ``rid`` and ``session_id`` (``engine="vllm"``:
    ``request_id``). The server's cached tokens come back in
    ``response.additional_kwargs["cached_tokens"]`` and, with the token counts, to the
    request's pilot: its statistics, the prompt's token ids for ``event_sink`` (KV-event
    mapping), or without one ``usage_feedback`` (cached-token shortfalls drop what the
    engine no longer has). A call that fails makes the pilot forget the request. A local
    server needs no API key (``SGLANG_API_KEY`` or ``"EMPTY"``, never ``OPENAI_API_KEY``).
    """

    is_chat_model: bool = True
    pilot: ContextPilot | None = Field(default=None, exclude=True)
    """The pilot to search first (default: every pilot in the process)."""
    event_sink: Any = Field(default=None, exclude=True)
    """Where prompt token ids go for KV-event mapping (``listener.sink``)."""
    usage_feedback: bool | None = None
    """Report cached-token shortfalls to the index (default: on without ``event_sink``)."""
    server: str = "sglang"
    """``sglang``, ``vllm``, ``llamacpp`` or ``openai``: which body fields carry the id."""
    slot: int | None = None
    """llama-server slot to pin (``id_slot``)."""
    router: Any = Field(default=None, exclude=True)
    """An ``engines.Router``: each call goes to the target whose cache the prepared request
    was ordered for (``api_base`` is then unused); an unreachable target is routed around."""

    def __init__(self, **kwargs: Any) -> None:
        # a local engine takes any key: "EMPTY" unless one is given (never OPENAI_API_KEY)
        if kwargs.get("api_key") is None:
            kwargs["api_key"] = os.environ.get("SGLANG_API_KEY") or "EMPTY"
        super().__init__(**kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "SGLangLLM"

    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        rid = kwargs.pop(REQUEST_ID_KWARG, None) or f"cp-{uuid.uuid4().hex}"
        model_kwargs = super()._get_model_kwargs(**kwargs)
        extra = dict(model_kwargs.get("extra_body") or {})
        for name in wire.REQUEST_ID_FIELDS.get(self.server, ()):
            extra[name] = rid
        if self.event_sink is not None:
            extra.update(wire.PROMPT_IDS_REQUEST.get(self.server, {}))
        if self.slot is not None:
            extra["id_slot"] = self.slot
        model_kwargs["extra_body"] = extra
        if model_kwargs.get("stream"):
            model_kwargs.setdefault("stream_options", {"include_usage": True})
        return model_kwargs

    # ---- the prepared request behind a call, and the report --------------------------------
    def _bind(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Binding | None:
        text = "\n".join(m.content for m in messages if isinstance(m.content, str))
        binding = bind_prompt(text, kwargs.get(REQUEST_ID_KWARG), self.pilot)
        if binding is not None:
            kwargs[REQUEST_ID_KWARG] = binding.prepared.request_id
        return binding

    def _report(self, binding: Binding | None, response: ChatResponse | None) -> ChatResponse | None:
        if response is None:
            return None
        usage, ids = _usage_and_ids(response.raw)
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if cached is not None:
            response.additional_kwargs["cached_tokens"] = cached
        if binding is not None and usage:
            report_served(
                binding.pilot,
                binding.prepared,
                usage.get("prompt_tokens"),
                cached,
                before_tokens=binding.before_tokens,
                usage_feedback=self.event_sink is None if self.usage_feedback is None else self.usage_feedback,
                tracker=self.event_sink,
                input_ids=ids,
            )
        return response

    def _failed(self, binding: Binding | None) -> None:
        if binding is not None:
            report_failed(binding.pilot, binding.prepared, self.event_sink)

    # ---- routing across targets ----------------------------------------------------------------
    def _delegate(self, target: Any) -> SGLangLLM:
        """An LLM for one target (cached): this one's settings, that target's server."""
        delegates: dict[str, SGLangLLM] = self.__dict__.setdefault("_delegates", {})
        if target.name not in delegates:
            skip = {"router", "api_base", "slot", "server", "callback_manager", "pilot"}
            settings = {name: getattr(self, name) for name in type(self).model_fields if name not in skip}
            settings["pilot"] = self.router.pilot(target)  # it reports to that target's state
            delegates[target.name] = type(self)(
                **settings, api_base=target.base_url.rstrip("/") + "/v1", slot=target.slot, server=target.engine
            )
        return delegates[target.name]

    def _route(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], call: Any) -> Any:
        return self.router.call(self._bind(messages, kwargs), self._sender(kwargs, call))

    async def _aroute(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], call: Any) -> Any:
        return await self.router.acall(self._bind(messages, kwargs), self._sender(kwargs, call))

    def _sender(self, kwargs: dict[str, Any], call: Any) -> Any:
        """Send through the target's delegate, naming the request as that target's state knows it."""

        def send(target: Any, prepared: PreparedRequest | None) -> Any:
            if prepared is not None:
                kwargs[REQUEST_ID_KWARG] = prepared.request_id
            return call(self._delegate(target))

        return send

    # ---- every call style ----------------------------------------------------------------------
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if self.router is not None:
            return self._route(messages, kwargs, lambda llm: llm.chat(messages, **kwargs))  # type: ignore[no-any-return]
        binding = self._bind(messages, kwargs)
        try:
            response = super().chat(messages, **kwargs)
        except BaseException:
            self._failed(binding)
            raise
        return self._report(binding, response) or response

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        if self.router is not None:
            return await self._aroute(messages, kwargs, lambda llm: llm.achat(messages, **kwargs))  # type: ignore[no-any-return]
        binding = self._bind(messages, kwargs)
        try:
            response = await super().achat(messages, **kwargs)
        except BaseException:
            self._failed(binding)
            raise
        return self._report(binding, response) or response

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generator[ChatResponse, None, None]:
        if self.router is not None:  # routed; the stream is read whole so that failover can resend
            yield from self._route(messages, kwargs, lambda llm: list(llm.stream_chat(messages, **kwargs)))
            return
        binding = self._bind(messages, kwargs)
        last: ChatResponse | None = None
        ids: list[int] | None = None
        try:
            for response in super().stream_chat(messages, **kwargs):
                ids = ids or _usage_and_ids(response.raw)[1]
                last = response
                yield response
        except BaseException:
            self._failed(binding)
            raise
        self._report(binding, _with_ids(last, ids))

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> AsyncGenerator[ChatResponse, None]:
        if self.router is not None:

            async def whole(llm: SGLangLLM) -> list[ChatResponse]:
                return [chunk async for chunk in await llm.astream_chat(messages, **kwargs)]

            chunks = await self._aroute(messages, kwargs, whole)

            async def replay() -> AsyncGenerator[ChatResponse, None]:
                for chunk in chunks:
                    yield chunk

            return replay()
        binding = self._bind(messages, kwargs)
        try:
            stream = await super().astream_chat(messages, **kwargs)
        except BaseException:
            self._failed(binding)
            raise

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            last: ChatResponse | None = None
            ids: list[int] | None = None
            try:
                async for response in stream:
                    ids = ids or _usage_and_ids(response.raw)[1]
                    last = response
                    yield response
            except BaseException:
                self._failed(binding)
                raise
            self._report(binding, _with_ids(last, ids))

        return gen()


def _usage_and_ids(raw: Any) -> tuple[dict[str, Any], list[int] | None]:
    """The usage object and prompt token ids of a raw OpenAI answer (or stream chunk)."""
    if raw is None:
        return {}, None
    data = raw if isinstance(raw, dict) else raw.model_dump() if hasattr(raw, "model_dump") else {}
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    try:
        ids = wire.input_ids(data, "the server")
    except EngineError:
        ids = None
    return usage or {}, ids


def _with_ids(response: ChatResponse | None, ids: list[int] | None) -> ChatResponse | None:
    """The stream's last chunk (it carries the usage), with the first chunk's prompt ids."""
    if response is None or not ids:
        return response
    data = response.raw if isinstance(response.raw, dict) else response.raw.model_dump() if response.raw else {}
    response.raw = {**data, "prompt_token_ids": ids}
    return response
