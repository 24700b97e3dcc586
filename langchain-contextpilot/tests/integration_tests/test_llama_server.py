"""End to end against a real llama-server: LCEL chains, the chat model, conversational RAG."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot import ChatSGLang, ContextPilotRetriever, ConversationalRAG, format_documents
from tests.support import QUERY, BM25ChunkRetriever


def test_lcel_chain_against_a_real_server(llama: LlamaServer) -> None:
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5, max_chars=400), pilot=ContextPilot())
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=2, temperature=0)
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
    assert "priority order" not in seen[-1]  # the same documents in the same order: nothing to restate
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
        model="tiny", base_url=llama.url + "/v1", max_tokens=2, temperature=0, http_async_client=httpx.AsyncClient()
    )
    rag = ConversationalRAG(BM25ChunkRetriever(k=3, max_chars=300), llm, pilot, max_turns=1)  # positional too
    config = {"configurable": {"thread_id": "chat"}}
    rag.invoke(QUERY, config=config)
    second = rag.invoke(QUERY.upper(), config=config)  # same documents: references but for the top one
    kept = rag.history("chat")
    assert len(kept) == 1 and kept[0][1].count("Please refer to ") == 2
    assert second.usage_metadata["input_token_details"]["cache_read"] > 300  # the history prefix
    rag.invoke(QUERY, config=config)  # turn 0 (which showed them) left the window: sent again
    assert "Please refer to" not in rag.history("chat")[-1][1]
    answer = asyncio.run(rag.ainvoke("Another question about crypto", config={"configurable": {"thread_id": "other"}}))
    assert answer.usage_metadata is not None and len(rag.history("other")) == 1
    rag.reset("chat")
    assert rag.history("chat") == []


def test_chat_model_sends_the_request_id_in_batch_and_stream(llama: LlamaServer) -> None:
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=2, temperature=0)
    results = llm.batch(["hello there", "hello there again"])
    assert len(results) == 2 and all(r.usage_metadata for r in results)
    chunks = list(llm.stream("hello there", config={"metadata": {"contextpilot_request_id": "cp-fixed"}}))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert merged.usage_metadata and "cache_read" in merged.usage_metadata["input_token_details"]


def test_chat_sglang_needs_no_api_key(llama: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=2, temperature=0)  # as the README shows
    assert llm.invoke("hello").usage_metadata is not None


def test_the_chat_model_sends_the_pilots_request_id_and_reports_back(llama: LlamaServer) -> None:
    """In an LCEL chain the chat model takes the request its retriever prepared (through the
    run tree), sends that id, and reports the server's counts to its pilot."""
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=4, max_chars=300), pilot=pilot)
    sent: list[str] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content)["rid"])

    llm = ChatSGLang(
        model="tiny",
        base_url=llama.url + "/v1",
        max_tokens=2,
        temperature=0,
        http_client=httpx.Client(event_hooks={"request": [record]}),
    )
    prompt = ChatPromptTemplate.from_messages([("system", "Answer."), ("user", "{context}\n\nQuestion: {question}")])
    documents: list[Any] = []

    def keep(docs: Any) -> Any:
        documents.append(docs)
        return docs

    chain = (
        {"context": retriever | RunnableLambda(keep) | RunnableLambda(format_documents), "question": lambda q: q}
        | prompt
        | llm
    )
    chain.invoke(QUERY)
    "".join(chunk.content for chunk in chain.stream(QUERY.upper()))
    ids = [docs[0].metadata["contextpilot"]["request_id"] for docs in documents]
    assert sent == ids  # the pilot's ids, not fresh ones
    stats = pilot.stats()
    assert stats.engine_requests == 2 and stats.engine_prompt_tokens > 0 and stats.engine_cached_tokens > 0


def test_a_failed_call_makes_the_pilot_forget_the_request() -> None:
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=3, max_chars=200), pilot=pilot)
    llm = ChatSGLang(model="tiny", base_url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    chain = (
        {"context": retriever | RunnableLambda(format_documents), "question": lambda q: q}
        | ChatPromptTemplate([("user", "{context}\n\n{question}")])
        | llm
    )
    with pytest.raises(Exception):  # noqa: B017 - the openai client's connection error
        chain.invoke(QUERY)
    assert pilot.stats().live_requests == 0
