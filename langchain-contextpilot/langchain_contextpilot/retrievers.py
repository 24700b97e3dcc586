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
from pydantic import ConfigDict, Field, SkipValidation

from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import aprepare_bound, prepare_bound
from contextpilot_integrations.pilot.ports import Preparer

from ._binding import deposit
from ._documents import (
    EVENT_NAME,
    conversation_id_from_config,
    event_data,
    in_send_order,
    partition_from_config,
    to_blocks,
)

__all__ = ["ContextPilotRetriever"]


class ContextPilotRetriever(BaseRetriever):
    """Wraps a retriever: the same documents (the first ``k``), in send order.

    Each document's ``metadata["contextpilot"]`` carries the request id, its rendered text
    and the order annotation. The prepared request travels with the run: a model call later
    in the same invocation (``ContextPilotChatModel``, ``ChatSGLang``) sends its id and
    reports the engine's cached tokens to it.

    A retriever never sees the prompt, so by default it sends every document in full. With
    ``deduplicate=True`` and a conversation id in the run config (``configurable.
    conversation_id``, ``thread_id`` or ``session_id``), documents an earlier turn showed
    become location references: only for prompts that carry that history; the chat model
    classes of this package put back the text of any reference whose turn is not in the
    messages they send.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    base_retriever: RetrieverLike
    pilot: SkipValidation[Preparer[Any]] = Field(default_factory=lambda: own_pilot("ContextPilotRetriever"))
    """A :class:`ContextPilot`, a router (``engines.Router``) or a ``MicroBatcher``."""
    k: int | None = None
    """Keep at most this many of the base retriever's documents (``None``: all)."""
    deduplicate: bool = False
    """Replace documents shown earlier in the conversation by references (see above)."""

    def invoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        kwargs.setdefault("_cp_conversation", conversation_id_from_config(config) if self.deduplicate else None)
        kwargs.setdefault("_cp_partition", partition_from_config(config))
        return super().invoke(input, config, **kwargs)

    async def ainvoke(self, input: str, config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        kwargs.setdefault("_cp_conversation", conversation_id_from_config(config) if self.deduplicate else None)
        kwargs.setdefault("_cp_partition", partition_from_config(config))
        return await super().ainvoke(input, config, **kwargs)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        _cp_conversation: str | None = None,
        _cp_partition: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = self.base_retriever.invoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        documents = documents[: k or self.k or len(documents)]
        binding = prepare_bound(self.pilot, to_blocks(documents), query, _cp_conversation, partition=_cp_partition)
        deposit(run_manager, run_manager.run_id, binding)
        dispatch_custom_event(EVENT_NAME, event_data(binding.prepared), config={"callbacks": run_manager.get_child()})
        return in_send_order(binding.prepared, documents)

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        _cp_conversation: str | None = None,
        _cp_partition: str | None = None,
        k: int | None = None,
        **kwargs: Any,
    ) -> list[Document]:
        documents = await self.base_retriever.ainvoke(query, config={"callbacks": run_manager.get_child()}, **kwargs)
        documents = documents[: k or self.k or len(documents)]
        binding = await aprepare_bound(
            self.pilot, to_blocks(documents), query, _cp_conversation, partition=_cp_partition
        )
        deposit(run_manager, run_manager.run_id, binding)
        await adispatch_custom_event(
            EVENT_NAME, event_data(binding.prepared), config={"callbacks": run_manager.get_child()}
        )
        return in_send_order(binding.prepared, documents)
