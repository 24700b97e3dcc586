"""Two sources of one chunk (the same node id and text, different metadata): every node comes
back, n in and n out, and the text is sent once. A stock query engine whose earlier
postprocessor adds the second source (a retriever's own ``retrieve`` keeps one node per id),
SGLangLLM against a local fake of the OpenAI API over real HTTP (it records every body)."""

from __future__ import annotations

import pytest
from llama_index.core import QueryBundle, VectorStoreIndex
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_openai import fake_openai
from contextpilot_integrations.testing.invariants import message_texts
from llama_index.postprocessor.contextpilot import ContextPilotPostprocessor, SGLangLLM
from tests.support import QUESTION

SECOND_SOURCE = "Second source of the same chunk"


class AnotherSource(BaseNodePostprocessor):
    """Gives the second node again, fourth, as it came from another source."""

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        shared = nodes[1].node
        assert isinstance(shared, TextNode)
        again = TextNode(id_=shared.node_id, text=shared.text, metadata={"title": SECOND_SOURCE})
        return [*nodes[:3], NodeWithScore(node=again, score=0.1), *nodes[3:]]


def sources(nodes: list[NodeWithScore]) -> list[tuple[str, str]]:
    return sorted((item.node.node_id, item.node.metadata["title"]) for item in nodes)


def flat(text: str) -> str:
    return " ".join(text.split())  # the QA prompt repacks whitespace


@pytest.mark.parametrize("options", [{}, {"plain_prompts": False}], ids=["plain", "labelled"])
def test_two_sources_of_one_chunk_both_come_back_and_the_text_is_sent_once(
    index: VectorStoreIndex, options: dict[str, bool]
) -> None:
    retriever = index.as_retriever(similarity_top_k=4)
    retrieved = AnotherSource().postprocess_nodes(retriever.retrieve(QUESTION), query_str=QUESTION)
    shared = retrieved[1].node.get_content()
    with fake_openai() as fake:
        pilot = ContextPilot(**options)  # type: ignore[arg-type]
        postprocessor = ContextPilotPostprocessor(pilot=pilot)
        out = postprocessor.postprocess_nodes(retrieved, query_str=QUESTION)
        assert len(out) == len(retrieved) == 5 and sources(out) == sources(retrieved)
        assert [item.node.get_content() for item in out].count(shared) == 2  # the text stays in both nodes
        labelled = any("ref" in item.node.metadata for item in out)
        assert labelled == ("plain_prompts" in options)

        llm = SGLangLLM(model="tiny", api_base=fake.base_url, context_window=8192)
        engine = RetrieverQueryEngine.from_args(
            retriever, llm=llm, node_postprocessors=[AnotherSource(), ContextPilotPostprocessor(pilot=pilot)]
        )
        response = engine.query(QUESTION)
        assert sources(response.source_nodes) == sources(retrieved)
        prompt = flat("\n".join(message_texts(fake.requests[-1])))
        assert prompt.count(flat(shared)) == 1 and SECOND_SOURCE in prompt  # sent once, both sources named
        assert all(flat(item.node.get_content()) in prompt for item in retrieved)
        assert pilot.stats().engine_requests == 1
