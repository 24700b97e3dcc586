"""ConversationalRAG as a Runnable: bounded memory, no shared default conversation, and the
caller's own history (RunnableWithMessageHistory); a stand-in model records what it is sent."""

from __future__ import annotations

import warnings
from typing import Any

from langchain_core.chat_history import InMemoryChatMessageHistory
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.runnables import RunnableLambda

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.invariants import dangling_references
from langchain_contextpilot import ConversationalRAG
from tests.support import QUERY, BM25ChunkRetriever


class Recorded:
    """Stands in for a chat model: keeps every message list it is sent, answers "ok"."""

    def __init__(self) -> None:
        self.sent: list[list[BaseMessage]] = []
        self.model = RunnableLambda(self._answer)

    def _answer(self, messages: list[BaseMessage]) -> AIMessage:
        self.sent.append(list(messages))
        return AIMessage("ok")

    def texts(self, n: int = -1) -> list[str]:
        return [str(m.content) for m in self.sent[n]]


def test_conversations_are_bounded_and_none_is_shared() -> None:
    model = Recorded()
    rag = ConversationalRAG(retriever=BM25ChunkRetriever(k=3), llm=model.model, max_conversations=5, max_turns=2)
    for n in range(40):
        rag.invoke(QUERY, config={"configurable": {"thread_id": f"user-{n}"}})
    assert len(rag._turns) == 5 and rag.history("user-0") == [] and len(rag.history("user-39")) == 1
    for _ in range(6):
        rag.invoke(QUERY, config={"configurable": {"thread_id": "long"}})
    assert [turn for turn, _, _ in rag.history("long")] == [4, 5]  # the last max_turns turns
    before = len(rag._turns)
    rag.invoke(QUERY)
    rag.invoke(QUERY)  # no thread id: no conversation, no history, nothing shared
    assert len(model.sent[-1]) == 2 and "Please refer to" not in model.texts()[-1]
    assert len(rag._turns) == before


def test_inside_runnable_with_message_history() -> None:
    from langchain_core.runnables.history import RunnableWithMessageHistory

    model, histories = Recorded(), {}
    rag = ConversationalRAG(retriever=BM25ChunkRetriever(k=3), llm=model.model, pilot=ContextPilot())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # deprecated in langchain-core 1.3, still shipped
        chat = RunnableWithMessageHistory(
            rag,
            lambda session: histories.setdefault(session, InMemoryChatMessageHistory()),
            input_messages_key="question",
            history_messages_key="history",
        )
    config: Any = {"configurable": {"session_id": "s"}}
    chat.invoke({"question": QUERY}, config=config)
    answer = chat.invoke({"question": QUERY}, config=config)
    assert answer.content == "ok" and len(histories["s"].messages) == 4
    second = model.texts()
    assert len(second) == 4  # system, the caller's history (question, answer), this turn
    # the caller's history holds the question, not the context: nothing may refer to it
    assert "Please refer to" not in second[-1] and dangling_references(second) == []


def test_stream_and_batch_parity() -> None:
    model = Recorded()
    rag = ConversationalRAG(retriever=BM25ChunkRetriever(k=3), llm=model.model, pilot=ContextPilot())
    config: Any = {"configurable": {"thread_id": "t"}}
    assert [chunk.content for chunk in rag.stream(QUERY, config=config)] == ["ok"]
    rag.invoke(QUERY, config=config)
    assert model.texts()[-1].count("Please refer to ") == 2  # turn 0, in the history sent (the top in full)
    assert dangling_references(model.texts()) == []
    assert [a.content for a in rag.batch([QUERY, QUERY])] == ["ok", "ok"]


def test_history_keeps_the_order_asked_when_the_pilot_starts_the_conversation_afresh() -> None:
    """The pilot numbers a conversation it ended (``end_conversation``, its TTL or its bound)
    from 0 again: the kept history stays in the order asked, and the turns the pilot forgot
    are never referred to."""
    model = Recorded()
    pilot = ContextPilot(max_conversations=1)
    rag = ConversationalRAG(retriever=BM25ChunkRetriever(k=3), llm=model.model, pilot=pilot, max_turns=3)
    config: Any = {"configurable": {"thread_id": "t"}}
    for question in ["first " + QUERY, "second " + QUERY, "third " + QUERY]:
        rag.invoke(question, config=config)
    pilot.end_conversation("t")
    rag.invoke("fourth " + QUERY, config=config)
    assert [user.split("Question: ")[-1].split()[0] for _, user, _ in rag.history("t")] == ["second", "third", "fourth"]
    assert [number for number, _, _ in rag.history("t")] == [1, 2, 3]
    assert "Please refer to" not in model.texts()[-1]  # the pilot forgot what the kept turns showed
    rag.invoke(QUERY, config={"configurable": {"thread_id": "other"}})  # the pilot's bound drops "t"
    rag.invoke("fifth " + QUERY, config=config)
    assert [user.split("Question: ")[-1].split()[0] for _, user, _ in rag.history("t")] == ["third", "fourth", "fifth"]
    rag.invoke("sixth " + QUERY, config=config)
    sent = model.texts()
    assert sent[-1].count("Please refer to") > 0 and dangling_references(sent) == []  # the fifth, known again
