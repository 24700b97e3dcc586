"""A LangGraph node that de-duplicates safely, whatever later rewrites the graph's state.

A retriever cannot de-duplicate (it never sees the prompt). A graph whose state keeps the
conversation's messages can: :class:`ContextPilotRetrieveNode` turns the latest user
question into a message carrying the retrieved context. The state keeps every document in
full; those that an earlier user message carries are marked, and the chat model classes of
this package (``ChatSGLang``, ``ContextPilotChatModel``) send each as its location reference
only where the very messages sent carry its text before it. A node that trims the
messages, trims the model's input or summarizes never leaves a reference without its text;
a model not of this package sends every document in full::

    from langgraph.graph import START, MessagesState, StateGraph

    graph = StateGraph(MessagesState)
    graph.add_node("retrieve", ContextPilotRetrieveNode(retriever=retriever, pilot=pilot))
    graph.add_node("generate", lambda state: {"messages": [llm.invoke(state["messages"])]})
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "generate")
    app = graph.compile(checkpointer=InMemorySaver())
    app.invoke({"messages": [("user", "Who is on trial?")]}, {"configurable": {"thread_id": "u1"}})

The conversation is the run's ``thread_id`` (or ``conversation_id``/``session_id``). The
request it prepares travels with the graph run to the model call, like the retriever's.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.retrievers import RetrieverLike
from langchain_core.runnables import RunnableConfig, ensure_config
from pydantic import BaseModel, ConfigDict, Field, SkipValidation

from contextpilot_integrations import BlockTypeError
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.pilot.binding import Binding, aprepare_bound, prepare_bound
from contextpilot_integrations.pilot.ports import Preparer

from ._binding import deposit
from ._documents import conversation_id_from_config, partition_from_config, to_blocks
from ._written import REFERENCES_KEY, REQUEST_KEY, TURN_KEY, written_out

__all__ = ["TURN_KEY", "ContextPilotRetrieveNode"]


class ContextPilotRetrieveNode(BaseModel):
    """A graph node: retrieve for the latest user message and replace it by the prompt with
    the context (same message id, so ``add_messages`` replaces it in the state)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: RetrieverLike
    pilot: SkipValidation[Preparer[Any]] = Field(default_factory=lambda: own_pilot("ContextPilotRetrieveNode"))
    """A :class:`ContextPilot`, a router or a ``MicroBatcher``."""
    messages_key: str = "messages"

    def _question(self, state: dict[str, Any]) -> tuple[HumanMessage, set[int]]:
        messages: list[BaseMessage] = list(state.get(self.messages_key) or [])
        if not messages or not isinstance(messages[-1], HumanMessage) or not isinstance(messages[-1].content, str):
            raise BlockTypeError("the state's last message must be the user's question (a text HumanMessage)")
        kept = {
            message.additional_kwargs[TURN_KEY]
            for message in messages[:-1]
            if isinstance(message, HumanMessage) and isinstance(message.additional_kwargs.get(TURN_KEY), int)
        }
        return messages[-1], kept

    def _update(self, question: HumanMessage, binding: Binding, config: RunnableConfig) -> dict[str, Any]:
        callbacks = config.get("callbacks")
        deposit(callbacks, callbacks.parent_run_id if isinstance(callbacks, BaseCallbackManager) else None, binding)
        prepared = binding.prepared
        content, spans = written_out(prepared, include_question=True)
        extra: dict[str, Any] = {REQUEST_KEY: prepared.request_id}
        if prepared.turn is not None:
            extra[TURN_KEY] = prepared.turn
        if spans:
            extra[REFERENCES_KEY] = spans
        return {self.messages_key: [HumanMessage(content, id=question.id, additional_kwargs=extra)]}

    def __call__(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        config = ensure_config(config)
        question, kept = self._question(state)
        documents = self.retriever.invoke(str(question.content), config=config)
        binding = prepare_bound(
            self.pilot,
            to_blocks(documents),
            str(question.content),
            conversation_id_from_config(config),
            kept_turns=kept,
            partition=partition_from_config(config),
        )
        return self._update(question, binding, config)

    async def ainvoke(self, state: dict[str, Any], config: RunnableConfig) -> dict[str, Any]:
        """The node as a coroutine (``graph.add_node("retrieve", node.ainvoke)``)."""
        config = ensure_config(config)
        question, kept = self._question(state)
        documents = await self.retriever.ainvoke(str(question.content), config=config)
        binding = await aprepare_bound(
            self.pilot,
            to_blocks(documents),
            str(question.content),
            conversation_id_from_config(config),
            kept_turns=kept,
            partition=partition_from_config(config),
        )
        return self._update(question, binding, config)
