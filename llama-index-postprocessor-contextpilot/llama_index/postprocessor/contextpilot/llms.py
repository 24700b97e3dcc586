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
from llama_index.llms.openai_like import OpenAILike

__all__ = ["REQUEST_ID_KWARG", "SGLangLLM"]

REQUEST_ID_KWARG = "contextpilot_request_id"


class SGLangLLM(OpenAILike):
    """``OpenAILike`` chat model that sends a request id and reports cached tokens.

    The id is the one the chat engine passes for the call (``contextpilot_request_id=``),
    else a fresh one; it goes out as ``rid`` and ``session_id``.
    """

    is_chat_model: bool = True

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
        model_kwargs["extra_body"] = {**(model_kwargs.get("extra_body") or {}), "rid": rid, "session_id": rid}
        if model_kwargs.get("stream"):
            model_kwargs.setdefault("stream_options", {"include_usage": True})
        return model_kwargs

    @staticmethod
    def _with_cached_tokens(response: ChatResponse) -> ChatResponse:
        usage = getattr(response.raw, "usage", None) if response.raw is not None else None
        if isinstance(response.raw, dict):
            usage = response.raw.get("usage")
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else getattr(details, "cached_tokens", None)
        if cached is not None:
            response.additional_kwargs["cached_tokens"] = cached
        return response

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._with_cached_tokens(super().chat(messages, **kwargs))

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._with_cached_tokens(await super().achat(messages, **kwargs))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> Generator[ChatResponse, None, None]:
        for response in super().stream_chat(messages, **kwargs):
            yield self._with_cached_tokens(response)

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> AsyncGenerator[ChatResponse, None]:
        stream = await super().astream_chat(messages, **kwargs)

        async def gen() -> AsyncGenerator[ChatResponse, None]:
            async for response in stream:
                yield self._with_cached_tokens(response)

        return gen()
