"""LangChain components with real LangChain objects, a real BM25 retriever over the bundled
MultiHop-RAG chunks, LangChain's standard test suites, and a real llama-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from langchain_core.callbacks import BaseCallbackHandler, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableLambda
from langchain_tests.integration_tests import RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import ConfigDict
from rank_bm25 import BM25Okapi

from contextpilot_integrations import BlockTypeError, ContextPilot
from contextpilot_integrations.langchain import (
    ChatSGLang,
    ContextPilotPostprocessor,
    ContextPilotRetriever,
    ConversationalRAG,
    conversation_id_from_config,
    format_documents,
)
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from tests.engine_support import LlamaServer, start_llama_server

CHUNKS = [chunk for _, chunk in zip(range(400), load_multihop_rag().chunks.values(), strict=False)]
_INDEX = BM25Okapi([chunk.text.lower().split() for chunk in CHUNKS])


class BM25ChunkRetriever(BaseRetriever):
    """BM25 over the first 400 bundled MultiHop-RAG chunks (real data, real ranking)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    k: int = 10
    max_chars: int | None = None

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        scores = _INDEX.get_scores(query.lower().split())
        best = sorted(range(len(CHUNKS)), key=lambda i: -scores[i])[: self.k]
        return [
            Document(
                id=CHUNKS[i].id,
                page_content=CHUNKS[i].text[: self.max_chars],
                metadata={"title": CHUNKS[i].metadata["title"]},
            )
            for i in best
        ]


QUERY = "Who is the individual associated with the cryptocurrency industry facing a criminal trial?"


class TestContextPilotRetrieverStandard(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[ContextPilotRetriever]:
        return ContextPilotRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"base_retriever": BM25ChunkRetriever(k=10), "pilot": ContextPilot()}

    @property
    def retriever_query_example(self) -> str:
        return QUERY


class TestChatSGLangStandard(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSGLang]:
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny", "base_url": "http://127.0.0.1:9/v1"}


def test_retriever_reorders_and_annotates_without_extra_documents() -> None:
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=8), pilot=pilot)
    first = retriever.invoke(QUERY)
    again = retriever.invoke("Which crypto executive was accused of fraud?")
    assert len(first) == len(again) == 8
    info = first[0].metadata["contextpilot"]
    assert info["order_annotation"].startswith("Please read the context") and info["request_id"]
    assert first[0].metadata["title"]  # the retriever's metadata is kept
    # the same documents retrieved in another order are sent in the first request's order
    reversed_docs = ContextPilotPostprocessor(pilot=pilot).compress_documents(list(reversed(first)), QUERY)
    assert [d.id for d in reversed_docs] == [d.id for d in first]
    text = format_documents(again)
    assert text.index("[Doc_") < text.index("priority order")


def test_conversation_id_from_config_and_references() -> None:
    assert conversation_id_from_config({"configurable": {"thread_id": "t1"}}) == "t1"
    assert conversation_id_from_config({"configurable": {"session_id": "s"}}) == "s"
    assert conversation_id_from_config({"metadata": {"conversation_id": "m"}}) == "m"
    assert conversation_id_from_config({}) is None
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5), pilot=ContextPilot())
    config = {"configurable": {"thread_id": "chat-1"}}
    retriever.invoke(QUERY, config=config)
    second = retriever.invoke(QUERY, config=config)
    assert len(second) == 5 and all(d.metadata["contextpilot"]["reference"] for d in second)
    assert "Please refer to [Doc_" in format_documents(second)


def test_batch_with_mixed_conversations_and_async_parity() -> None:
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5), pilot=pilot)
    configs = [{"configurable": {"thread_id": "a"}}, {"configurable": {"thread_id": "b"}}]
    retriever.batch([QUERY, QUERY], config=configs)
    again = retriever.batch([QUERY, "a different question about sports"], config=configs)
    assert all(d.metadata["contextpilot"]["reference"] for d in again[0])  # "a" saw them already
    assert pilot.stats().conversations == 2
    sync_ids = [d.id for d in ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6)).invoke(QUERY)]
    async_ids = [
        d.id for d in asyncio.run(ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6)).ainvoke(QUERY))
    ]
    assert sync_ids == async_ids


def test_postprocessor_as_compressor_and_lcel_step_with_events() -> None:
    events: list[dict[str, Any]] = []

    class Collector(BaseCallbackHandler):
        def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
            events.append(data)

    postprocessor = ContextPilotPostprocessor(pilot=ContextPilot())
    documents = BM25ChunkRetriever(k=4).invoke(QUERY)
    assert len(postprocessor.compress_documents(documents, QUERY)) == 4
    chain = BM25ChunkRetriever(k=4) | postprocessor.as_runnable()
    out = chain.invoke(QUERY, config={"callbacks": [Collector()], "configurable": {"thread_id": "x"}})
    assert len(out) == 4 and events and events[-1]["conversation_id"] == "x"
    assert len(asyncio.run(chain.ainvoke(QUERY))) == 4


def test_bad_input() -> None:
    postprocessor = ContextPilotPostprocessor()
    no_ids = [Document(page_content="alpha"), Document(page_content="beta")]
    assert [d.page_content for d in postprocessor.compress_documents(no_ids, "q")] == ["alpha", "beta"]
    assert postprocessor.compress_documents([], "q") == []
    broken = Document.model_construct(page_content=b"bytes", metadata={}, id=None)
    with pytest.raises(BlockTypeError, match="page_content must be str"):
        postprocessor.compress_documents([broken], "q")
    with pytest.raises(BlockTypeError, match="expected a Document"):
        postprocessor.compress_documents(["text"], "q")  # type: ignore[list-item]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(Path(tmp_path_factory.mktemp("llama-lc")))
    yield server
    server.stop()


def test_lcel_chain_against_a_real_server(llama: LlamaServer) -> None:
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5, max_chars=400), pilot=ContextPilot())
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", api_key="unused", max_tokens=2, temperature=0)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("user", "{context}\n\nQuestion: {question}")]
    )
    seen: list[str] = []

    def remember(value: Any) -> Any:
        seen.append(value.to_string())
        return value

    chain = (
        {"context": retriever | RunnableLambda(format_documents), "question": RunnableLambda(lambda q: q)}
        | prompt
        | RunnableLambda(remember)
        | llm
    )
    first = chain.invoke(QUERY)
    second = chain.invoke(QUERY.upper())  # related: same retrieval (BM25 lower-cases), new question
    assert "priority order" in seen[-1]
    assert first.usage_metadata and second.usage_metadata
    assert second.usage_metadata["input_token_details"]["cache_read"] > 1_000
    streamed = list((chain | StrOutputParser()).stream(QUERY))
    assert isinstance("".join(streamed), str)
    assert asyncio.run(chain.ainvoke(QUERY)).usage_metadata["input_token_details"]["cache_read"] > 0


def test_conversational_rag_references_and_resends(llama: LlamaServer) -> None:
    pilot = ContextPilot()
    # langchain-openai caches one async HTTP client per URL, bound to the first event loop
    # that used it; this test runs its own loop, so it brings its own client
    llm = ChatSGLang(
        model="tiny",
        base_url=llama.url + "/v1",
        api_key="unused",
        max_tokens=2,
        temperature=0,
        http_async_client=httpx.AsyncClient(),
    )
    rag = ConversationalRAG(BM25ChunkRetriever(k=3, max_chars=300), llm, pilot, max_turns=1)
    config = {"configurable": {"thread_id": "chat"}}
    rag.invoke(QUERY, config=config)
    second = rag.invoke(QUERY.upper(), config=config)  # same documents: all references now
    kept = rag.history("chat")
    assert len(kept) == 1 and kept[0][1].count("Please refer to [Doc_") == 3
    assert second.usage_metadata["input_token_details"]["cache_read"] > 300  # the history prefix
    rag.invoke(QUERY, config=config)  # turn 0 (which showed them) left the window: sent again
    assert "Please refer to" not in rag.history("chat")[-1][1]
    answer = asyncio.run(rag.ainvoke("Another question about crypto", config={"configurable": {"thread_id": "other"}}))
    assert answer.usage_metadata is not None and len(rag.history("other")) == 1
    rag.reset("chat")
    assert rag.history("chat") == []


def test_chat_model_sends_the_request_id_in_batch_and_stream(llama: LlamaServer) -> None:
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", api_key="unused", max_tokens=2, temperature=0)
    results = llm.batch(["hello there", "hello there again"])
    assert len(results) == 2 and all(r.usage_metadata for r in results)
    chunks = list(llm.stream("hello there", config={"metadata": {"contextpilot_request_id": "cp-fixed"}}))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.usage_metadata and "cache_read" in merged.usage_metadata["input_token_details"]
    payload = llm._with_rid({"metadata": {"contextpilot_request_id": "cp-7"}}, {"extra_body": {"top_k": 1}})
    assert payload["extra_body"] == {"top_k": 1, "rid": "cp-7", "session_id": "cp-7"}


def test_postprocessor_in_contextual_compression_retriever() -> None:
    from langchain_classic.retrievers import ContextualCompressionRetriever

    pilot = ContextPilot()
    ccr = ContextualCompressionRetriever(
        base_compressor=ContextPilotPostprocessor(pilot=pilot), base_retriever=BM25ChunkRetriever(k=4)
    )
    config = {"metadata": {"conversation_id": "ccr"}}
    first = ccr.invoke(QUERY, config=config)
    second = asyncio.run(ccr.ainvoke(QUERY, config=config))
    assert len(first) == len(second) == 4
    assert all(d.metadata["contextpilot"]["reference"] for d in second)  # conversation read from metadata


def test_lcel_helpers() -> None:
    from contextpilot_integrations.langchain import contextpilot_reorder, format_documents_runnable

    pilot = ContextPilot()
    chain = BM25ChunkRetriever(k=3) | contextpilot_reorder(pilot) | format_documents_runnable
    text = chain.invoke(QUERY)
    assert text.count("[Doc_") >= 3 and "priority order" in text and pilot.stats().requests_prepared == 1


def test_chat_sglang_needs_no_api_key(llama: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=2, temperature=0)  # as the README shows
    assert llm.invoke("hello").usage_metadata is not None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")  # never sent to another server
    assert ChatSGLang(model="tiny", base_url=llama.url + "/v1").openai_api_key.get_secret_value() == "EMPTY"
    explicit = ChatSGLang(model="tiny", base_url=llama.url + "/v1", api_key="mine")
    assert explicit.openai_api_key.get_secret_value() == "mine"


@pytest.mark.parametrize("use_async", [False, True])
def test_compressor_in_a_chain_reads_configurable(use_async: bool) -> None:
    """LangChain hands a compressor only callbacks; inside a chain (or a graph) the run's
    config is in context, and ``configurable`` names the conversation."""
    from langchain_classic.retrievers import ContextualCompressionRetriever

    pilot = ContextPilot()
    ccr = ContextualCompressionRetriever(
        base_compressor=ContextPilotPostprocessor(pilot=pilot), base_retriever=BM25ChunkRetriever(k=4)
    )
    chain = ccr | RunnableLambda(lambda documents: documents)
    config = {"configurable": {"thread_id": f"ccr-{use_async}"}}
    turns = [asyncio.run(chain.ainvoke(QUERY, config=config)) if use_async else chain.invoke(QUERY, config=config)]
    turns.append(asyncio.run(chain.ainvoke(QUERY, config=config)) if use_async else chain.invoke(QUERY, config=config))
    assert not any(d.metadata["contextpilot"]["reference"] for d in turns[0])
    assert all(d.metadata["contextpilot"]["reference"] for d in turns[1])
