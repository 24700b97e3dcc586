"""A router stands where a base URL stands: the retriever prepares for the target whose cache
holds the prefix, the chat model sends there; real llama-server replicas (and a dead one)."""

from __future__ import annotations

import asyncio

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from contextpilot_integrations import MicroBatcher
from contextpilot_integrations.engines import Router, Target
from contextpilot_integrations.testing.llama_server import LlamaServer, free_port
from langchain_contextpilot import ChatSGLang, ContextPilotRetriever, format_documents
from tests.support import QUERY, BM25ChunkRetriever


def test_chain_routes_to_the_replica_holding_the_prefix(replicas: list[LlamaServer]) -> None:
    dead = Target("dead", f"http://127.0.0.1:{free_port()}", engine="llamacpp")
    router = Router([dead, *(Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas))])
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=4, max_chars=300), pilot=router)
    llm = ChatSGLang(model="tiny", router=router, max_tokens=2, temperature=0, max_retries=0, timeout=10)
    prompt = ChatPromptTemplate.from_messages([("user", "{context}\n\nQuestion: {question}")])
    chain = {"context": retriever | RunnableLambda(format_documents), "question": lambda q: q} | prompt | llm
    answers = [chain.invoke(QUERY), chain.invoke(QUERY.upper()), chain.invoke(QUERY.lower())]
    assert all(a.usage_metadata for a in answers)  # none lost, the dead target included
    served = {t.name: router.pilot(t).stats().engine_requests for t in router.targets}
    assert served["dead"] == 0 and sum(served.values()) == 3
    assert max(served.values()) == 3  # the same documents: the same replica, every time
    assert answers[2].usage_metadata["input_token_details"]["cache_read"] > 1_000


def test_a_batch_is_micro_batched_and_routed(replicas: list[LlamaServer]) -> None:
    router = Router([Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas)])
    batcher = MicroBatcher(router, window=0.05)
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=4, max_chars=300), pilot=batcher)
    llm = ChatSGLang(model="tiny", router=router, max_tokens=2, temperature=0)
    prompt = ChatPromptTemplate.from_messages([("user", "{context}")])
    chain = {"context": retriever | RunnableLambda(format_documents)} | prompt | llm
    questions = [QUERY, QUERY.upper(), "Which crypto executive was accused of fraud?"]
    answers = chain.batch(questions)  # the retrievals arrive together: planned as one batch
    assert len(answers) == 3 and batcher.batches >= 1 and batcher.requests == 3
    assert sum(router.pilot(t).stats().engine_requests for t in router.targets) == 3  # each bound to its own

    async def ask() -> list[object]:
        return await asyncio.gather(*(chain.ainvoke(q) for q in questions))

    assert len(asyncio.run(ask())) == 3 and batcher.requests == 6
    assert sum(router.pilot(t).stats().engine_requests for t in router.targets) == 6
