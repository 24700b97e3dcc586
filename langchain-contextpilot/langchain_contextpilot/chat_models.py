"""A chat model for SGLang and other OpenAI-compatible servers with a prefix cache."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.runnables import RunnableConfig, ensure_config
from langchain_openai import ChatOpenAI
from pydantic import model_validator

__all__ = ["ChatSGLang"]


class ChatSGLang(ChatOpenAI):
    """``ChatOpenAI`` for SGLang (and other OpenAI-compatible servers with a prefix cache).

    Each call sends a request id (``rid`` and ``session_id`` in the body): the one in the
    run config (``metadata["contextpilot_request_id"]``, e.g. from a document's
    ``metadata["contextpilot"]["request_id"]``) or a fresh one. Streaming reports usage,
    so ``usage_metadata["input_token_details"]["cache_read"]`` carries the server's cached
    tokens for invoke, ainvoke, stream, astream and batch alike.
    """

    stream_usage: bool | None = True

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

    def _with_rid(self, config: RunnableConfig | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        config = ensure_config(config)
        rid = (config.get("metadata") or {}).get("contextpilot_request_id") or (config.get("configurable") or {}).get(
            "contextpilot_request_id"
        )
        rid = str(rid) if rid else f"cp-{uuid.uuid4().hex}"
        extra = {**(self.extra_body or {}), **(kwargs.get("extra_body") or {}), "rid": rid, "session_id": rid}
        return {**kwargs, "extra_body": extra}

    def invoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        return super().invoke(input, config, stop=stop, **self._with_rid(config, kwargs))

    async def ainvoke(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Any:
        return await super().ainvoke(input, config, stop=stop, **self._with_rid(config, kwargs))

    def stream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> Iterator[Any]:
        yield from super().stream(input, config, stop=stop, **self._with_rid(config, kwargs))

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, *, stop: list[str] | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        async for chunk in super().astream(input, config, stop=stop, **self._with_rid(config, kwargs)):
            yield chunk
