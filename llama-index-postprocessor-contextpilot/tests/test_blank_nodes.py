"""A retriever that returns an empty or blank node among six: the query goes on, the blank
node comes back untouched (last: it has no text, so its place changes nothing the LLM
reads), every other node reaches the LLM. A stock query engine and chat engine against a
real llama-server, every body recorded and audited."""

from __future__ import annotations

import pytest
from llama_index.core import QueryBundle, VectorStoreIndex
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, TextNode

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.bodies import Bodies
from contextpilot_integrations.testing.invariants import invariant_breaches, message_texts
from contextpilot_integrations.testing.llama_server import LlamaServer
from llama_index.postprocessor.contextpilot import ContextPilotChatEngine, ContextPilotPostprocessor, SGLangLLM
from tests.support import QUESTION


class WithABlank(BaseRetriever):
    """Five nodes of the index and one whose text is ``blank``, third."""

    def __init__(self, index: VectorStoreIndex, blank: str) -> None:
        super().__init__()
        self._inner = index.as_retriever(similarity_top_k=5)
        self._blank = blank

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = self._inner.retrieve(query_bundle)
        blank = NodeWithScore(node=TextNode(id_="empty-one", text=self._blank), score=0.5)
        return [*nodes[:2], blank, *nodes[2:]]


def llm(llama: LlamaServer, bodies: Bodies) -> SGLangLLM:
    return SGLangLLM(
        model="tiny",
        api_base=llama.url + "/v1",
        max_tokens=1,
        context_window=8192,
        timeout=600,
        http_client=bodies.client(),
    )


@pytest.mark.parametrize("blank", ["", " \n "])
def test_postprocessor_passes_a_blank_node_through(index: VectorStoreIndex, llama: LlamaServer, blank: str) -> None:
    pilot, bodies = ContextPilot(), Bodies()
    retriever = WithABlank(index, blank)
    postprocessor = ContextPilotPostprocessor(pilot=pilot)
    nodes = postprocessor.postprocess_nodes(retriever.retrieve(QUESTION), query_str=QUESTION)
    assert len(nodes) == 6 and nodes[-1].node.node_id == "empty-one" and "ref" not in nodes[-1].node.metadata
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm(llama, bodies), node_postprocessors=[postprocessor])
    response = engine.query(QUESTION)
    assert str(response) != "Empty Response" and len(bodies.sent) == 1  # the call went through
    sent = " ".join("\n".join(message_texts(bodies.sent[0])).split())  # the QA prompt repacks whitespace
    texts = [" ".join(n.node.get_content().split()) for n in retriever.retrieve(QUESTION)]
    assert len([text for text in texts if text]) == 5 and all(text in sent for text in texts)
    assert pilot.stats().engine_requests == 1 and invariant_breaches(bodies.sent) == []


def test_chat_engine_with_a_blank_node(index: VectorStoreIndex, llama: LlamaServer) -> None:
    bodies = Bodies()
    engine = ContextPilotChatEngine.from_defaults(
        retriever=WithABlank(index, ""), llm=llm(llama, bodies), pilot=ContextPilot()
    )
    engine.chat(QUESTION)
    engine.chat(QUESTION)
    assert len(bodies.sent) == 2 and invariant_breaches(bodies.sent) == []
