"""Hosted APIs through LlamaIndex's own LLM classes (llama_index.llms.anthropic.Anthropic,
llama_index.llms.openai.OpenAI), wrapped by ContextPilotLLM in a stock query engine, against
local fakes of the hosted APIs (which cannot be reached from here;
contextpilot_integrations.testing.fake_*) over real HTTP. The request bodies carry the
provider's marker (Anthropic: LlamaIndex's CachePoint, sent as cache_control) right where
the shared prefix ends, at most 4; OpenAI gets one prompt_cache_key for requests sharing
their leading documents; cache reads and writes come back to the pilot."""

from __future__ import annotations

import json
from typing import Any

from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.llms.anthropic import Anthropic
from llama_index.llms.openai import OpenAI

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.fake_providers import fake_anthropic
from contextpilot_integrations.testing.invariants import dangling_references
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from llama_index.postprocessor.contextpilot import ContextPilotLLM, ContextPilotPostprocessor
from llama_index.postprocessor.contextpilot.cache_points import provider_of

CHUNKS = list(load_multihop_rag().chunks.values())[:400]
QUERY = "Who is the individual associated with the cryptocurrency industry facing a criminal trial?"
RELATED = "Which cryptocurrency founder was convicted of fraud by a jury?"
QUERIES = [QUERY, RELATED, QUERY, RELATED + " Briefly."]


class WordRetriever(BaseRetriever):
    """The six bundled MultiHop-RAG chunks sharing most words with the query (full texts)."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        words = set(query_bundle.query_str.lower().split())
        best = sorted(CHUNKS, key=lambda chunk: -sum(word in words for word in chunk.text.lower().split()))[:6]
        return [NodeWithScore(node=TextNode(id_=chunk.id, text=chunk.text), score=1.0) for chunk in best]


def engine(pilot: ContextPilot, llm: Any) -> RetrieverQueryEngine:
    return RetrieverQueryEngine.from_args(
        WordRetriever(), llm=llm, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )


def anthropic_parts(body: dict[str, Any]) -> list[tuple[str, bool]]:
    system = body.get("system") or []
    parts = [(system, False)] if isinstance(system, str) else [(b["text"], "cache_control" in b) for b in system]
    for message in body["messages"]:
        content = message["content"]
        parts += (
            [(content, False)]
            if isinstance(content, str)
            else [(b.get("text", ""), "cache_control" in b) for b in content]
        )
    return parts


def test_anthropic_gets_cache_points_after_shared_documents_and_reports_reads_and_writes() -> None:
    with fake_anthropic() as fake:
        pilot = ContextPilot()
        anthropic = Anthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x", max_retries=0)
        assert provider_of(anthropic) == "anthropic"
        query_engine = engine(pilot, ContextPilotLLM(llm=anthropic))
        for query in QUERIES:
            query_engine.query(query)
        texts = {chunk.text for chunk in CHUNKS}
        for body in fake.requests:
            parts = anthropic_parts(body)
            marked = [text for text, is_marked in parts if is_marked]
            assert 0 < len(marked) <= 4
            assert all(any(part.endswith(chunk) for chunk in texts) for part in marked)  # right after a document
            assert not dangling_references([text for text, _ in parts])
        usage = pilot.stats().provider_usage["anthropic"]
        assert usage.requests == len(QUERIES) and usage.cache_read_tokens > 0 and usage.cache_write_tokens > 0


def test_anthropic_below_the_minimum_gets_no_cache_point() -> None:
    class Short(WordRetriever):
        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            nodes = super()._retrieve(query_bundle)[:2]
            return [NodeWithScore(node=TextNode(id_=n.node.node_id, text=n.node.get_content()[:300])) for n in nodes]

    with fake_anthropic() as fake:
        pilot = ContextPilot()
        llm = ContextPilotLLM(llm=Anthropic(model="claude-sonnet-4-6", base_url=fake.url, api_key="x"))
        RetrieverQueryEngine.from_args(
            Short(), llm=llm, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
        ).query(QUERY)
        assert "cache_control" not in json.dumps(fake.requests)
        assert list(pilot.stats().cache_plans_skipped) == ["below minimum 1024 tokens for claude-sonnet-4-6"]


def test_openai_gets_one_prompt_cache_key_for_shared_leading_documents() -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        openai = OpenAI(model="gpt-4o", api_base=fake.base_url, api_key="x", max_retries=0)
        assert provider_of(openai) is None  # not OpenAI's own URL: no key unless asked for
        query_engine = engine(pilot, ContextPilotLLM(llm=openai, provider="openai"))
        for query in QUERIES:
            query_engine.query(query)
        keys = [body["prompt_cache_key"] for body in fake.requests]
        assert all(keys) and keys[0] == keys[2] and keys[1] == keys[3]  # same documents first, same key
        usage = pilot.stats().provider_usage["openai"]
        assert usage.requests == len(QUERIES) and usage.cache_read_tokens > 0
