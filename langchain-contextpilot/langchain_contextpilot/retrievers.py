"""ContextPilot as a LangChain retriever wrapper."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
    adispatch_custom_event,
    dispatch_custom_event,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever, RetrieverLike
from langchain_core.runnables import RunnableConfig
from pydantic import ConfigDict, Field

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.batching import aprepare_with, prepare_with

from ._documents import EVENT_NAME, conversation_id_from_config, event_data, in_send_order, to_blocks

__all__ = ["ContextPilotRetriever"]


class ContextPilotRetriever(BaseRetriever):
    """Wraps a retriever: the same documents (the first ``k``), in send order.

    The conversation id is read from the run config: ``configurable.conversation_id``,
    ``thread_id`` or ``session_id`` (LangGraph, ``RunnableWithMessageHistory``), else
    ``metadata``. Each document's ``metadata["contextpilot"]`` carries the request id, its
    rendered text or location reference, and the order annotation.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_retriever: RetrieverLike
    pilot: Any = Field(default_factory=ContextPilot)
    """A :class:`ContextPilot`, a router (``engines.Router``) or a ``MicroBatcher``."""
    k: int | None = None
    """Keep at most this many of the base retriever's documents (``None``: all)."""

    def invoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        kwargs.setdefault("_cp_conversation", conversation_id_from_config(config))
        return super().invoke(input, config, **kwargs)

    async def ainvoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        kwargs.setdefault("_cp_conversation", conversation_id_from_config(config))
        return await super().ainvoke(input, config, **kwargs)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        _cp_conversation: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = self.base_retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        documents = documents[: k or self.k or len(documents)]
        prepared = prepare_with(self.pilot, to_blocks(documents), query, _cp_conversation)
        dispatch_custom_event(EVENT_NAME, event_data(prepared), config={"callbacks": run_manager.get_child()})
        return in_send_order(prepared, documents)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        _cp_conversation: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = await self.base_retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        documents = documents[: k or self.k or len(documents)]
        prepared = await aprepare_with(self.pilot, to_blocks(documents), query, _cp_conversation)
        await adispatch_custom_event(EVENT_NAME, event_data(prepared), config={"callbacks": run_manager.get_child()})
        return in_send_order(prepared, documents)
