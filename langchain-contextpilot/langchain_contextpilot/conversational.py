"""Multi-turn RAG with memory: documents already shown become location references."""

from __future__ import annotations

import threading
from typing import Any

from langchain_core.documents import Document
from langchain_core.retrievers import RetrieverLike
from langchain_core.runnables import RunnableConfig, ensure_config

from contextpilot_integrations import ContextPilot, PreparedRequest

from ._documents import conversation_id_from_config, to_blocks

__all__ = ["ConversationalRAG"]


class ConversationalRAG:
    """Multi-turn RAG with memory: documents already shown in the conversation become
    location references, as long as the turn that showed them is still in the history.

    Each turn's user message (its context and question) and the answer stay in the
    conversation's history, which is a prefix the engine caches; the last ``max_turns``
    turns are sent, and a document whose turn fell out of that window is sent again.

    Args:
        retriever: any LangChain retriever (its documents, best first).
        llm: a chat model (``ChatSGLang`` reports cached tokens and sends the request id).
        pilot: the shared :class:`ContextPilot`.
        system_prompt: the first message of every call.
        max_turns: earlier turns kept in the messages sent.
    """

    def __init__(
        self,
        retriever: RetrieverLike,
        llm: Any,
        pilot: ContextPilot | None = None,
        *,
        system_prompt: str = "Answer the question using the context documents.",
        max_turns: int = 8,
    ) -> None:
        self.retriever = retriever
        self.llm = llm
        self.pilot = pilot or ContextPilot()
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self._turns: dict[str, list[tuple[int, str, str]]] = {}  # conversation -> (turn, user text, answer)
        self._lock = threading.Lock()

    def history(self, conversation_id: str) -> list[tuple[int, str, str]]:
        """(turn, user message, answer) of the turns kept for this conversation."""
        with self._lock:
            return list(self._turns.get(conversation_id, []))

    def reset(self, conversation_id: str) -> None:
        with self._lock:
            self._turns.pop(conversation_id, None)
        self.pilot.end_conversation(conversation_id)

    def _messages(self, conversation_id: str, prepared: PreparedRequest, kept: list[tuple[int, str, str]]) -> list[Any]:
        from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

        messages: list[Any] = [SystemMessage(self.system_prompt)]
        for _, user, answer in kept:
            messages += [HumanMessage(user), AIMessage(answer)]
        messages.append(HumanMessage(prepared.render()))
        return messages

    def _prepare(
        self, question: str, config: RunnableConfig | None, documents: list[Document]
    ) -> tuple[str, PreparedRequest, list[Any]]:
        conversation_id = conversation_id_from_config(config) or "default"
        kept = self.history(conversation_id)[-self.max_turns :]
        prepared = self.pilot.prepare(
            to_blocks(documents), question, conversation_id, kept_turns={turn for turn, _, _ in kept}
        )
        return conversation_id, prepared, self._messages(conversation_id, prepared, kept)

    def _record(self, conversation_id: str, prepared: PreparedRequest, answer: Any) -> None:
        with self._lock:
            turns = self._turns.setdefault(conversation_id, [])
            turns.append((prepared.turn or 0, prepared.render(), str(answer.content)))
            del turns[: -self.max_turns]

    def _llm_config(self, config: RunnableConfig | None, prepared: PreparedRequest) -> RunnableConfig:
        config = ensure_config(config)
        return {
            **config,
            "metadata": {**(config.get("metadata") or {}), "contextpilot_request_id": prepared.request_id},
        }

    def invoke(self, question: str, config: RunnableConfig | None = None) -> Any:
        """One turn: retrieve, de-duplicate against the kept history, ask, remember."""
        documents = self.retriever.invoke(question, config=config)
        conversation_id, prepared, messages = self._prepare(question, config, documents)
        answer = self.llm.invoke(messages, config=self._llm_config(config, prepared))
        self._record(conversation_id, prepared, answer)
        return answer

    async def ainvoke(self, question: str, config: RunnableConfig | None = None) -> Any:
        """Async variant of :meth:`invoke`."""
        documents = await self.retriever.ainvoke(question, config=config)
        conversation_id, prepared, messages = self._prepare(question, config, documents)
        answer = await self.llm.ainvoke(messages, config=self._llm_config(config, prepared))
        self._record(conversation_id, prepared, answer)
        return answer
