"""ContextPilotRetrieveNode in a StateGraph with a checkpointer whose state or model input
something else rewrites: a node that removes old messages (``RemoveMessage``), a model node
that trims what it sends (``trim_messages``), a node that summarizes the older turns. Five
turns whose searches overlap, through ChatSGLang against a real llama-server and through a
plain ChatOpenAI; every body is audited (no reference without its text, no id twice)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, RemoveMessage, SystemMessage, trim_messages
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot.graph import ContextPilotRetrieveNode
from tests.integration_tests.test_drop_in import Recorder, chat_sglang
from tests.support import QUERY, BM25ChunkRetriever

RELATED = "Which cryptocurrency founder was convicted of fraud by a jury?"
TURNS = [QUERY, RELATED, QUERY + " Who else?", RELATED + " When?", QUERY + " Briefly."]  # the searches overlap


def _questions(messages: list[BaseMessage]) -> list[int]:
    return [index for index, message in enumerate(messages) if isinstance(message, HumanMessage)]


def remove_old_turns(state: MessagesState) -> dict[str, Any]:
    """Keeps the state from the second-to-last question on."""
    messages = state["messages"]
    questions = _questions(messages)
    if len(questions) <= 2:
        return {"messages": []}
    return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), *messages[questions[-2] :]]}


def summarize_old_turns(state: MessagesState) -> dict[str, Any]:
    """Replaces every turn before the last two by a short summary."""
    messages = state["messages"]
    questions = _questions(messages)
    if len(questions) <= 2:
        return {"messages": []}
    summary = SystemMessage(f"Summary of {questions[-2]} earlier messages: the user asked about a trial.")
    return {"messages": [RemoveMessage(id=REMOVE_ALL_MESSAGES), summary, *messages[questions[-2] :]]}


def build(llm: Any, pilot: ContextPilot, wiring: str) -> Any:
    def generate(state: MessagesState) -> dict[str, Any]:
        messages = state["messages"]
        if wiring == "trim-input":  # the model's input only: the state keeps everything
            messages = trim_messages(
                messages,
                max_tokens=2,
                token_counter=lambda m: sum(isinstance(x, HumanMessage) for x in m),
                strategy="last",
                start_on="human",
            )
        return {"messages": [llm.invoke(messages)]}

    graph = StateGraph(MessagesState)
    graph.add_node("retrieve", ContextPilotRetrieveNode(retriever=BM25ChunkRetriever(k=6, max_chars=200), pilot=pilot))
    graph.add_node("generate", generate)
    graph.add_edge(START, "retrieve")
    if wiring in ("remove", "summarize"):
        graph.add_node("rewrite", remove_old_turns if wiring == "remove" else summarize_old_turns)
        graph.add_edge("retrieve", "rewrite")
        graph.add_edge("rewrite", "generate")
    else:
        graph.add_edge("retrieve", "generate")
    return graph.compile(checkpointer=InMemorySaver())


@pytest.mark.parametrize("wiring", ["whole", "remove", "trim-input", "summarize"])
def test_five_turns_send_no_reference_without_its_text(llama: LlamaServer, wiring: str) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    app = build(chat_sglang(llama, recorder), pilot, wiring)
    config: Any = {"configurable": {"thread_id": f"g-{wiring}"}}
    for turn in TURNS:
        app.invoke({"messages": [HumanMessage(turn)]}, config)
    assert len(recorder.bodies) == len(TURNS) and recorder.dangling() == 0
    assert recorder.references() > 0  # the turns the messages still carry are referred to
    assert len(set(recorder.ids())) == len(TURNS) and pilot.stats().engine_requests == len(TURNS)
    state = app.get_state(config).values["messages"]
    assert "Please refer to" not in "".join(str(message.content) for message in state)  # the state keeps full text


def test_async_graph_and_a_plain_model(llama: LlamaServer) -> None:
    """A model not of this package sends every document in full (nothing it could lose)."""
    pilot, recorder = ContextPilot(), Recorder()
    plain = ChatOpenAI(
        model="tiny",
        base_url=llama.url + "/v1",
        api_key="x",
        max_tokens=1,
        max_retries=0,
        http_async_client=recorder.async_client(),
    )

    async def generate(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await plain.ainvoke(state["messages"])]}

    import asyncio

    node = ContextPilotRetrieveNode(retriever=BM25ChunkRetriever(k=6, max_chars=200), pilot=pilot)
    graph = StateGraph(MessagesState)
    graph.add_node("retrieve", node.ainvoke)
    graph.add_node("generate", generate)
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "generate")
    app = graph.compile(checkpointer=InMemorySaver())

    async def run() -> None:
        for turn in TURNS[:3]:
            await app.ainvoke({"messages": [HumanMessage(turn)]}, {"configurable": {"thread_id": "plain"}})

    asyncio.run(run())
    assert len(recorder.bodies) == 3 and recorder.references() == 0 and recorder.dangling() == 0
    assert isinstance(app.get_state({"configurable": {"thread_id": "plain"}}).values["messages"][-1], AIMessage)
