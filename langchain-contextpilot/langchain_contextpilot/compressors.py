"""ContextPilot as a LangChain document compressor (and an LCEL step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks, adispatch_custom_event, dispatch_custom_event
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.runnables import RunnableConfig, RunnableLambda
from pydantic import ConfigDict, Field

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.batching import aprepare_with, prepare_with

from ._documents import CONVERSATION_KEYS, EVENT_NAME, conversation_id_from_config, event_data, in_send_order, to_blocks

__all__ = ["ContextPilotCompressor", "ContextPilotPostprocessor", "contextpilot_reorder"]


class ContextPilotCompressor(BaseDocumentCompressor):
    """Reorders retrieved documents for prefix-cache reuse; drops none.

    Use it in ``ContextualCompressionRetriever(base_compressor=..., base_retriever=...)``
    or, through :meth:`as_runnable`, after a retriever in LCEL: ``retriever | c.as_runnable()``.

    The conversation id comes from :attr:`conversation_id`, the run's ``metadata``, or the
    run's config in context (chains, graphs): ``configurable.conversation_id``,
    ``thread_id`` or ``session_id``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    pilot: Any = Field(default_factory=ContextPilot)
    """A :class:`ContextPilot`, a router (``engines.Router``) or a ``MicroBatcher``."""
    conversation_id: str | None = None
    """A fixed conversation; otherwise it is read from the run's metadata/config."""

    def _conversation(self, callbacks: Callbacks) -> str | None:
        if self.conversation_id:
            return self.conversation_id
        metadata = getattr(callbacks, "metadata", None) or {}
        for key in CONVERSATION_KEYS:
            if metadata.get(key):
                return str(metadata[key])
        return conversation_id_from_config()

    def compress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        prepared = prepare_with(self.pilot, to_blocks(documents), query, self._conversation(callbacks))
        if callbacks is not None:
            dispatch_custom_event(EVENT_NAME, event_data(prepared), config={"callbacks": callbacks})
        return in_send_order(prepared, documents)

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        prepared = await aprepare_with(self.pilot, to_blocks(documents), query, self._conversation(callbacks))
        if callbacks is not None:
            await adispatch_custom_event(EVENT_NAME, event_data(prepared), config={"callbacks": callbacks})
        return in_send_order(prepared, documents)

    def as_runnable(self) -> RunnableLambda[Any, list[Document]]:
        """An LCEL step taking ``list[Document]`` or ``{"documents": [...], "question": str}``."""

        def reorder(value: Any, config: RunnableConfig) -> list[Document]:
            documents, query = _documents_and_query(value)
            conversation = self.conversation_id or conversation_id_from_config(config)
            prepared = prepare_with(self.pilot, to_blocks(documents), query, conversation)
            dispatch_custom_event(EVENT_NAME, event_data(prepared), config=config)
            return in_send_order(prepared, documents)

        async def areorder(value: Any, config: RunnableConfig) -> list[Document]:
            documents, query = _documents_and_query(value)
            conversation = self.conversation_id or conversation_id_from_config(config)
            prepared = await aprepare_with(self.pilot, to_blocks(documents), query, conversation)
            await adispatch_custom_event(EVENT_NAME, event_data(prepared), config=config)
            return in_send_order(prepared, documents)

        return RunnableLambda(reorder, afunc=areorder, name="contextpilot_reorder")


ContextPilotPostprocessor = ContextPilotCompressor
"""The same compressor under the name the LlamaIndex adapter uses (kept for existing code)."""


def _documents_and_query(value: Any) -> tuple[list[Document], str]:
    if isinstance(value, dict):
        documents = value.get("documents") or value.get("docs") or []
        return list(documents), str(value.get("question") or value.get("query") or "")
    return list(value), ""


def contextpilot_reorder(
    pilot: ContextPilot | None = None, conversation_id: str | None = None
) -> RunnableLambda[Any, list[Document]]:
    """The LCEL step ``retriever | contextpilot_reorder(pilot)``: documents in send order."""
    return ContextPilotCompressor(pilot=pilot or ContextPilot(), conversation_id=conversation_id).as_runnable()
