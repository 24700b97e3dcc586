"""Drop-in without loss, against a real llama-server: no dangling reference in any wiring, and
every call sends its own request id and reports to its own prepared request.

Every request body that leaves for the server is recorded (httpx request hooks) and
checked: references only after the text they point to, ids never repeated.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import httpx
import pytest
from langchain_classic.retrievers import ContextualCompressionRetriever
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines import Router, Target
from contextpilot_integrations.testing.invariants import dangling_references, invariant_breaches, message_texts
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot import (
    ChatSGLang,
    ContextPilotBindingWarning,
    ContextPilotChatModel,
    ContextPilotCompressor,
    ContextPilotRetriever,
    ConversationalRAG,
    format_documents,
)
from langchain_contextpilot.graph import ContextPilotRetrieveNode
from tests.support import QUERY, BM25ChunkRetriever

PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from the context."), ("user", "{context}\n\nQuestion: {question}")]
)


class Recorder:
    """The JSON bodies of every request sent, through real httpx clients. Every recorder a
    test makes is checked after it (:func:`every_body_keeps_both_invariants`)."""

    made: ClassVar[list[Recorder]] = []

    def __init__(self, fail_first: int = 0, time_out_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.attempts: list[dict[str, Any]] = []
        Recorder.made.append(self)
        self.fail_first = fail_first
        self.time_out_first = time_out_first
        self._lock = threading.Lock()

    def _record(self, request: httpx.Request) -> None:
        with self._lock:
            self.attempts.append(json.loads(request.content))
            if self.fail_first > 0:
                self.fail_first -= 1
                raise httpx.ConnectError("recorder: the first attempt fails", request=request)
            if self.time_out_first > 0:  # as if the engine took the request and answered too late
                self.time_out_first -= 1
                raise httpx.ReadTimeout("recorder: the first attempt times out", request=request)
            self.bodies.append(json.loads(request.content))

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self._record]})

    def async_client(self) -> httpx.AsyncClient:
        async def record(request: httpx.Request) -> None:
            self._record(request)

        return httpx.AsyncClient(event_hooks={"request": [record]})

    def dangling(self) -> int:
        return sum(len(dangling_references(message_texts(body))) for body in self.bodies)

    def references(self) -> int:
        return sum("\n".join(message_texts(body)).count("Please refer to ") for body in self.bodies)

    def ids(self, field: str = "rid") -> list[str]:
        return [body[field] for body in self.bodies]


@pytest.fixture(autouse=True)
def every_body_keeps_both_invariants() -> Iterator[None]:
    """In every wiring of this file: no reference without its text in the same messages,
    and no request id sent twice (bodies without an id field carry none)."""
    Recorder.made.clear()
    yield
    assert invariant_breaches(body for recorder in Recorder.made for body in recorder.bodies) == []


def chat_sglang(llama: LlamaServer, recorder: Recorder, **options: Any) -> ChatSGLang:
    return ChatSGLang(
        model="tiny",
        base_url=llama.url + "/v1",
        max_tokens=1,
        temperature=0,
        max_retries=0,
        http_client=recorder.client(),
        http_async_client=recorder.async_client(),
        **options,
    )


def readme_chain(retriever: Any, llm: Any) -> Any:
    return {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | PROMPT | llm


@pytest.fixture
def documents() -> BM25ChunkRetriever:
    return BM25ChunkRetriever(k=4, max_chars=120)


# ---- 1. no dangling reference where the prompt carries no history -----------------------------
def test_readme_chain_with_a_thread_id_sends_every_document(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    chain = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=pilot), chat_sglang(llama, recorder))
    config = {"configurable": {"thread_id": "user-42"}}
    for _ in range(2):
        chain.invoke(QUERY, config=config)
    assert len(recorder.bodies) == 2 and recorder.references() == 0 and recorder.dangling() == 0
    assert pilot.stats().blocks_referenced == 0 and pilot.stats().engine_requests == 2
    assert len(set(recorder.ids())) == 2


def test_contextual_compression_retriever_with_a_thread_id(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    retriever = ContextualCompressionRetriever(
        base_compressor=ContextPilotCompressor(pilot=pilot), base_retriever=documents
    )
    chain = readme_chain(retriever, chat_sglang(llama, recorder))
    for _ in range(2):
        chain.invoke(QUERY, config={"configurable": {"thread_id": "t"}})
    assert recorder.references() == 0 and recorder.dangling() == 0
    assert pilot.stats().engine_requests == 2  # bound through the compression retriever's run


def test_langgraph_with_the_context_in_the_system_message(llama: LlamaServer, documents: Any) -> None:
    """The usual tutorial shape: the context goes into the system message, history aside."""
    pilot, recorder = ContextPilot(), Recorder()
    retriever = ContextPilotRetriever(base_retriever=documents, pilot=pilot)
    llm = chat_sglang(llama, recorder)

    def answer(state: MessagesState) -> dict[str, Any]:
        question = str(state["messages"][-1].content)
        context = format_documents(retriever.invoke(question))
        return {"messages": [llm.invoke([SystemMessage(f"Context:\n{context}"), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("answer", answer)
    graph.add_edge(START, "answer")
    app = graph.compile(checkpointer=InMemorySaver())
    for _ in range(2):
        app.invoke({"messages": [HumanMessage(QUERY)]}, {"configurable": {"thread_id": "g"}})
    assert recorder.references() == 0 and recorder.dangling() == 0
    assert pilot.stats().engine_requests == 2


def test_plain_chat_openai_retry_after_a_failed_call(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder(fail_first=1)
    plain = ChatOpenAI(
        model="tiny",
        base_url=llama.url + "/v1",
        api_key="x",
        max_tokens=1,
        max_retries=0,
        http_client=recorder.client(),
    )
    chain = readme_chain(
        ContextPilotRetriever(base_retriever=documents, pilot=pilot), plain.with_retry(stop_after_attempt=2)
    )
    with pytest.warns(ContextPilotBindingWarning, match="ChatOpenAI"):
        chain.invoke(QUERY, config={"configurable": {"thread_id": "r"}})
    assert len(recorder.bodies) == 1 and recorder.references() == 0
    sent = "\n".join(message_texts(recorder.bodies[0]))
    assert all(document.page_content in sent for document in documents.invoke(QUERY))  # all 4, in full


def test_wrapped_chat_openai_retry_takes_the_request_again_under_a_new_id(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder(fail_first=1)
    inner = ChatOpenAI(
        model="tiny",
        base_url=llama.url + "/v1",
        api_key="x",
        max_tokens=1,
        max_retries=0,
        http_client=recorder.client(),
    )
    wrapped = ContextPilotChatModel(llm=inner, engine="sglang")
    chain = readme_chain(
        ContextPilotRetriever(base_retriever=documents, pilot=pilot), wrapped.with_retry(stop_after_attempt=2)
    )
    message = chain.invoke(QUERY)
    assert message.usage_metadata is not None
    stats = pilot.stats()
    assert stats.engine_requests == 1 and stats.live_requests == 1  # the retry, adopted under a new id
    assert recorder.ids() == pilot.live_request_ids()


def test_chat_sglang_retries_a_timed_out_call_under_a_fresh_id(llama: LlamaServer, documents: Any) -> None:
    """A timed-out request may still run in the engine, and SGLang refuses a second request
    with its id ("Duplicate request ID"): ChatSGLang leaves retries to LangChain's
    ``with_retry`` (max_retries 0), whose retry takes the request again under a new id."""
    pilot, recorder = ContextPilot(), Recorder(time_out_first=1)
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=1, http_client=recorder.client())
    chain = readme_chain(
        ContextPilotRetriever(base_retriever=documents, pilot=pilot), llm.with_retry(stop_after_attempt=2)
    )
    chain.invoke(QUERY)
    rids = [body["rid"] for body in recorder.attempts]
    assert len(rids) == 2 and len(set(rids)) == 2  # the retry's id is a new one
    assert recorder.ids() == pilot.live_request_ids() and pilot.stats().engine_requests == 1


# ---- 2. exact binding under concurrency -----------------------------------------------------------
def _served_by_each(pilot: ContextPilot, calls: int, recorder: Recorder, field: str = "rid") -> None:
    ids = recorder.ids(field)
    assert len(ids) == calls and len(set(ids)) == calls  # every id sent is unique
    stats = pilot.stats()
    assert stats.requests_prepared == calls and stats.engine_requests == calls  # each report on its own request
    assert set(ids) == set(pilot.live_request_ids())


def test_fifty_threads_and_fifty_tasks_one_pilot(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    chain = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=pilot), chat_sglang(llama, recorder))
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: chain.invoke(QUERY, config={"configurable": {"thread_id": f"u{i}"}}), range(50)))
    _served_by_each(pilot, 50, recorder)

    pilot2, recorder2 = ContextPilot(), Recorder()
    chain2 = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=pilot2), chat_sglang(llama, recorder2))

    async def fifty() -> None:
        await asyncio.gather(
            *(chain2.ainvoke(QUERY, config={"configurable": {"thread_id": f"a{i}"}}) for i in range(50))
        )

    asyncio.run(fifty())
    _served_by_each(pilot2, 50, recorder2)


def test_batch_of_identical_inputs_sends_distinct_ids(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    chain = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=pilot), chat_sglang(llama, recorder))
    chain.batch([QUERY] * 8)
    _served_by_each(pilot, 8, recorder)


def test_two_pilots_one_chat_model(llama: LlamaServer, documents: Any) -> None:
    recorder = Recorder()
    llm = chat_sglang(llama, recorder)
    pilots = [ContextPilot(), ContextPilot()]
    chains = [readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=p), llm) for p in pilots]
    for chain in (chains[0], chains[1], chains[1]):
        chain.invoke(QUERY)
    assert [p.stats().engine_requests for p in pilots] == [1, 2]
    assert recorder.ids() == [*pilots[0].live_request_ids(), *pilots[1].live_request_ids()]


def test_router_path_under_fifty_threads(replicas: list[LlamaServer], documents: Any) -> None:
    router = Router([Target(f"r{i}", server.url, engine="sglang") for i, server in enumerate(replicas)])
    recorder = Recorder()
    llm = ChatSGLang(
        model="tiny",
        base_url="http://unused",
        max_tokens=1,
        router=router,
        engine="sglang",
        http_client=recorder.client(),
    )
    chain = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=router), llm)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: chain.invoke(QUERY, config={"configurable": {"thread_id": f"u{i}"}}), range(50)))
    ids = recorder.ids()
    assert len(ids) == 50 and len(set(ids)) == 50
    reported = sum(router.pilot(target).stats().engine_requests for target in router.targets)
    live = {rid for target in router.targets for rid in router.pilot(target).live_request_ids()}
    assert reported == 50 and live == set(ids)


# ---- 3. any chat model, bound ------------------------------------------------------------------------
def test_wrapped_chat_openai_reports_cached_tokens(llama: LlamaServer, documents: Any) -> None:
    pilot = ContextPilot()
    wrapped = ContextPilotChatModel(llm=ChatOpenAI(model="tiny", base_url=llama.url + "/v1", api_key="x", max_tokens=1))
    chain = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=pilot), wrapped)
    chain.invoke(QUERY)
    second = chain.invoke(QUERY)
    stats = pilot.stats()
    assert (
        stats.engine_requests == 2
        and stats.engine_cached_tokens >= second.usage_metadata["input_token_details"]["cache_read"] > 0
    )
    streamed = list(chain.stream(QUERY))
    assert streamed and pilot.stats().engine_requests == 3  # streams report usage too


# ---- 4. chat components still de-duplicate, and only against what they send -------------------
def test_conversational_rag_references_only_turns_it_sends(llama: LlamaServer) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    rag = ConversationalRAG(
        retriever=BM25ChunkRetriever(k=3, max_chars=120), llm=chat_sglang(llama, recorder), pilot=pilot, max_turns=1
    )
    config = {"configurable": {"thread_id": "chat"}}
    rag.invoke(QUERY, config=config)
    rag.invoke(QUERY.upper(), config=config)  # the same documents: references to turn 0 (the top in full)
    assert recorder.references() == 2 and recorder.dangling() == 0
    rag.invoke(QUERY, config=config)  # turn 0 left the window; turn 1 carries only references
    assert recorder.dangling() == 0
    chunks = list(rag.stream(QUERY, config=config))
    assert chunks and recorder.dangling() == 0
    assert pilot.stats().engine_requests == 4 and len(set(recorder.ids())) == 4
    rag.batch([QUERY, QUERY])  # no thread id: each call its own conversation, nothing shared
    assert recorder.references() > 0 and recorder.dangling() == 0 and len(rag._turns) == 1


def test_langgraph_messages_state_deduplicates_safely(llama: LlamaServer, documents: Any) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    llm = chat_sglang(llama, recorder)
    graph = StateGraph(MessagesState)
    graph.add_node("retrieve", ContextPilotRetrieveNode(retriever=documents, pilot=pilot))
    graph.add_node("generate", lambda state: {"messages": [llm.invoke(state["messages"])]})
    graph.add_edge(START, "retrieve")
    graph.add_edge("retrieve", "generate")
    app = graph.compile(checkpointer=InMemorySaver())
    for _ in range(3):
        app.invoke({"messages": [HumanMessage(QUERY)]}, {"configurable": {"thread_id": "lg"}})
    assert recorder.references() > 0 and recorder.dangling() == 0
    assert pilot.stats().engine_requests == 3 and len(set(recorder.ids())) == 3
    assert all("contextpilot_turn" not in json.dumps(body) for body in recorder.bodies)


def test_a_reference_whose_turn_is_not_sent_goes_out_as_text(llama: LlamaServer, documents: Any) -> None:
    """A history trimmed after preparing: the chat model puts the text back."""
    pilot, recorder = ContextPilot(), Recorder()
    retriever = ContextPilotRetriever(base_retriever=documents, pilot=pilot, deduplicate=True)
    chain = readme_chain(retriever, chat_sglang(llama, recorder))  # one-shot prompts: no history
    config = {"configurable": {"thread_id": "d"}}
    chain.invoke(QUERY, config=config)
    chain.invoke(QUERY, config=config)  # prepared with references, sent with their texts
    assert recorder.references() == 0 and recorder.dangling() == 0
    assert pilot.stats().references_restored == 3 and pilot.stats().blocks_referenced == 3  # the top in full


def test_wrapped_chat_anthropic_reports_cache_reads() -> None:
    """ChatAnthropic against a local fake of Anthropic's Messages API (the hosted API cannot be
    reached here): the fake caches up to the prompt's cache_control breakpoint."""
    from langchain_anthropic import ChatAnthropic

    from contextpilot_integrations.testing.fake_providers import fake_anthropic

    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "Answer from the context."),
            (
                "user",
                [
                    {"type": "text", "text": "{context}", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "Question: {question}"},
                ],
            ),
        ]
    )
    with fake_anthropic(min_tokens=256) as fake:  # short documents: a lower minimum
        pilot = ContextPilot()
        llm = ContextPilotChatModel(
            llm=ChatAnthropic(model="claude-fake", base_url=fake.url, api_key="x", max_tokens=5)
        )
        retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=4, max_chars=300), pilot=pilot)
        chain = (
            {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | prompt | llm
        )
        first, second = chain.invoke(QUERY), chain.invoke(QUERY + " Briefly.")
        assert first.usage_metadata["input_token_details"]["cache_read"] == 0
        read = second.usage_metadata["input_token_details"]["cache_read"]
        assert read == fake.usage(fake.requests[-1])["cache_read_input_tokens"] > 0  # the fake's own count
        stats = pilot.stats()
        assert stats.engine_requests == 2 and stats.engine_cached_tokens == read
        assert "".join(str(chunk.content) for chunk in chain.stream(QUERY)) and pilot.stats().engine_requests == 3


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_dying_mid_answer_raises_the_cores_error(stream: bool, documents: Any) -> None:
    from contextpilot_integrations.errors import EngineUnavailable
    from contextpilot_integrations.testing.fake_providers import broken_stream_server

    with broken_stream_server() as url:
        pilot = ContextPilot()
        llm = ChatSGLang(model="tiny", base_url=url + "/v1", max_retries=0, streaming=stream)
        chain = readme_chain(ContextPilotRetriever(base_retriever=documents, pilot=pilot), llm)
        with pytest.raises(EngineUnavailable, match="connection"):
            list(chain.stream(QUERY)) if stream else chain.invoke(QUERY)
        assert pilot.stats().live_requests == 0  # the failed request is forgotten
