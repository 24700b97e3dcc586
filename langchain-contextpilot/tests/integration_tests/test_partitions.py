"""Cache partitions through LangChain on a real llama-server: the retrieval step prepares in the
partition the invocation's config names (``configurable.cache_salt``), and a model call whose
body names another (a ``cache_salt`` bound to the model) moves the request there, so the index
never predicts one tenant's prefix for another. (llama-server keeps one cache; the engines
that partition theirs are in the core's ``tests/live/test_live_partitions.py``.)"""

from __future__ import annotations

import asyncio

import httpx
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

from contextpilot_integrations import Block, ContextPilot, cache_partition
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot import ChatSGLang, ContextPilotRetriever, format_documents, partition_from_config
from tests.support import QUERY, BM25ChunkRetriever

PROMPT = ChatPromptTemplate.from_messages([("system", "Answer from the context."), ("user", "{context}\n\n{question}")])


def test_each_tenant_is_indexed_in_its_own_partition(llama: LlamaServer) -> None:
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=4, max_chars=300), pilot=pilot)
    llm = ChatSGLang(
        model="tiny", base_url=llama.url + "/v1", max_tokens=2, temperature=0, http_async_client=httpx.AsyncClient()
    )
    context = retriever | RunnableLambda(format_documents)
    tenant_a = {"configurable": {"cache_salt": "salt-of-tenant-a"}}
    partition_a = cache_partition(salt="salt-of-tenant-a")
    assert partition_from_config(tenant_a) == partition_a
    chain_a = (
        {"context": context, "question": RunnableLambda(lambda q: q)}
        | PROMPT
        | llm.bind(extra_body={"cache_salt": "salt-of-tenant-a"})
    )
    chain_a.invoke(QUERY, config=tenant_a)
    blocks = [
        Block(id=str(document.id), text=document.page_content)
        for document in BM25ChunkRetriever(k=4, max_chars=300).invoke(QUERY)
    ]
    whole = sum(block.token_count for block in blocks)
    assert pilot.reusable_tokens(blocks, partition=partition_a) == whole  # prepared in tenant A's partition
    assert pilot.reusable_tokens(blocks) == 0

    # tenant B: nothing in the config, the salt only in the model's body: the call moves it there
    partition_b = cache_partition(salt="salt-of-tenant-b")
    chain_b = (
        {"context": context, "question": RunnableLambda(lambda q: q)}
        | PROMPT
        | llm.bind(extra_body={"cache_salt": "salt-of-tenant-b"})
    )
    answer = asyncio.run(chain_b.ainvoke(QUERY))
    assert answer.usage_metadata is not None
    assert pilot.reusable_tokens(blocks, partition=partition_b) == whole
    assert pilot.reusable_tokens(blocks) == 0  # nothing left in the default partition
    assert len(pilot.live_request_ids()) == 2
    pilot.check()
