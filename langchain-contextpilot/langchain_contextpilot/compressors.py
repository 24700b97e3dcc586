"""ContextPilot as a LangChain document compressor (and an LCEL step)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.callbacks import Callbacks, adispatch_custom_event, dispatch_custom_event
from langchain_core.documents import BaseDocumentCompressor, Document
from langchain_core.runnables import RunnableConfig, RunnableLambda
from pydantic import ConfigDict, Field, SkipValidation

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import Binding, aprepare_bound, prepare_bound
from contextpilot_integrations.pilot.ports import Preparer

from ._binding import deposit
from ._documents import (
    CONVERSATION_KEYS,
    EVENT_NAME,
    conversation_id_from_config,
    event_data,
    in_send_order,
    partition_from_config,
    to_blocks,
)

__all__ = ["ContextPilotCompressor", "ContextPilotPostprocessor", "contextpilot_reorder"]


class ContextPilotCompressor(BaseDocumentCompressor):
    """Reorders retrieved documents for prefix-cache reuse; drops none.

    Use it in ``ContextualCompressionRetriever(base_compressor=..., base_retriever=...)``
    or, through :meth:`as_runnable`, after a retriever in LCEL: ``retriever | c.as_runnable()``.
    The prepared request travels with the run to the model call of the same invocation
    (``ContextPilotChatModel``, ``ChatSGLang``).

    A compressor never sees the prompt, so by default every document is sent in full. With
    ``deduplicate=True``, documents shown earlier in the conversation (:attr:`conversation_id`,
    the run's ``metadata``, or ``configurable.conversation_id`` / ``thread_id`` /
    ``session_id``) become location references: only for prompts that carry that history.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    pilot: SkipValidation[Preparer[Any]] = Field(default_factory=lambda: own_pilot("ContextPilotCompressor"))
    """A :class:`ContextPilot`, a router (``engines.Router``) or a ``MicroBatcher``."""
    conversation_id: str | None = None
    """A fixed conversation; otherwise it is read from the run's metadata/config."""
    deduplicate: bool = False
    """Replace documents shown earlier in the conversation by references (see above)."""

    def _conversation(self, callbacks: Callbacks) -> str | None:
        if not self.deduplicate:
            return None
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
        binding = prepare_bound(
            self.pilot, to_blocks(documents), query, self._conversation(callbacks), partition=partition_from_config()
        )
        return self._deliver(binding, documents, callbacks)

    async def acompress_documents(
        self, documents: Sequence[Document], query: str, callbacks: Callbacks | None = None
    ) -> Sequence[Document]:
        binding = await aprepare_bound(
            self.pilot, to_blocks(documents), query, self._conversation(callbacks), partition=partition_from_config()
        )
        deposit(callbacks, getattr(callbacks, "parent_run_id", None), binding)
        if callbacks is not None:
            await adispatch_custom_event(EVENT_NAME, event_data(binding.prepared), config={"callbacks": callbacks})
        return in_send_order(binding.prepared, documents)

    @staticmethod
    def _deliver(binding: Binding, documents: Sequence[Document], callbacks: Callbacks | None) -> list[Document]:
        """Leave the request with the run (the compressor has none of its own: its parent's)."""
        deposit(callbacks, getattr(callbacks, "parent_run_id", None), binding)
        if callbacks is not None:
            dispatch_custom_event(EVENT_NAME, event_data(binding.prepared), config={"callbacks": callbacks})
        return in_send_order(binding.prepared, documents)

    def as_runnable(self) -> RunnableLambda[Any, list[Document]]:
        """An LCEL step taking ``list[Document]`` or ``{"documents": [...], "question": str}``."""

        def conversation(config: RunnableConfig) -> str | None:
            return (self.conversation_id or conversation_id_from_config(config)) if self.deduplicate else None

        def reorder(value: Any, config: RunnableConfig) -> list[Document]:
            documents, query = _documents_and_query(value)
            binding = prepare_bound(
                self.pilot, to_blocks(documents), query, conversation(config), partition=partition_from_config(config)
            )
            return self._deliver(binding, documents, config.get("callbacks"))

        async def areorder(value: Any, config: RunnableConfig) -> list[Document]:
            documents, query = _documents_and_query(value)
            binding = await aprepare_bound(
                self.pilot, to_blocks(documents), query, conversation(config), partition=partition_from_config(config)
            )
            callbacks = config.get("callbacks")
            deposit(callbacks, getattr(callbacks, "parent_run_id", None), binding)
            await adispatch_custom_event(EVENT_NAME, event_data(binding.prepared), config=config)
            return in_send_order(binding.prepared, documents)

        return RunnableLambda(reorder, afunc=areorder, name="contextpilot_reorder")


ContextPilotPostprocessor = ContextPilotCompressor
"""The same compressor under the name the LlamaIndex adapter uses (kept for existing code)."""


def _documents_and_query(value: Any) -> tuple[list[Document], str]:
    if isinstance(value, dict):
        documents = value.get("documents") or value.get("docs") or []
        return list(documents), str(value.get("question") or value.get("query") or "")
    return list(value), ""


def contextpilot_reorder(
    pilot: ContextPilot | None = None, conversation_id: str | None = None, *, deduplicate: bool = False
) -> RunnableLambda[Any, list[Document]]:
    """The LCEL step ``retriever | contextpilot_reorder(pilot)``: documents in send order."""
    compressor = ContextPilotCompressor(
        pilot=pilot if pilot is not None else own_pilot("contextpilot_reorder"),
        conversation_id=conversation_id,
        deduplicate=deduplicate,
    )
    return compressor.as_runnable()
