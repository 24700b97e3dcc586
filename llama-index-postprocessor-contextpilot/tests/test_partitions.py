"""Cache partitions through LlamaIndex on a real llama-server: the postprocessor prepares in
the partition it is given, and an LLM whose body names another (``cache_salt`` in its
``additional_kwargs``) moves the query's request there before it is sent."""

from __future__ import annotations

from llama_index.core import VectorStoreIndex

from contextpilot_integrations import Block, ContextPilot, cache_partition
from contextpilot_integrations.testing.llama_server import LlamaServer
from llama_index.postprocessor.contextpilot import ContextPilotPostprocessor, SGLangLLM
from tests.support import QUESTION


def test_each_tenants_queries_are_indexed_in_its_own_partition(index: VectorStoreIndex, llama: LlamaServer) -> None:
    pilot = ContextPilot()
    partition_a, partition_b = cache_partition(salt="salt-of-tenant-a"), cache_partition(salt="salt-of-tenant-b")
    nodes = index.as_retriever(similarity_top_k=3).retrieve(QUESTION)
    blocks = [Block(id=n.node.node_id, text=n.node.get_content()) for n in nodes]
    whole = sum(block.token_count for block in blocks)

    def engine(partition: str | None, salt: str) -> object:
        llm = SGLangLLM(
            model="tiny",
            api_base=llama.url + "/v1",
            max_tokens=2,
            context_window=8192,
            additional_kwargs={"extra_body": {"cache_salt": salt}},
        )
        postprocessor = ContextPilotPostprocessor(pilot=pilot, partition=partition)
        return index.as_query_engine(llm=llm, similarity_top_k=3, node_postprocessors=[postprocessor])

    engine(partition_a, "salt-of-tenant-a").query(QUESTION)  # type: ignore[attr-defined]
    assert pilot.reusable_tokens(blocks, partition=partition_a) == whole
    assert pilot.reusable_tokens(blocks) == 0 and pilot.reusable_tokens(blocks, partition=partition_b) == 0
    engine(None, "salt-of-tenant-b").query(QUESTION)  # type: ignore[attr-defined]  # the LLM's body names B
    assert pilot.reusable_tokens(blocks, partition=partition_b) == whole
    assert pilot.reusable_tokens(blocks) == 0
    assert pilot.stats().engine_requests == 2
    pilot.check()
