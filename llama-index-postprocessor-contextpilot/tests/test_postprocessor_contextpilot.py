"""The postprocessor with real LlamaIndex objects (VectorStoreIndex, query engines)."""

from __future__ import annotations

from typing import Any

from llama_index.core import VectorStoreIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.postprocessor.types import BaseNodePostprocessor

from contextpilot_integrations import ContextPilot
from llama_index.postprocessor.contextpilot import ContextPilotEvent, ContextPilotPostprocessor
from tests.support import QUESTION


def test_class() -> None:
    names_of_base_classes = [b.__name__ for b in ContextPilotPostprocessor.__mro__]
    assert BaseNodePostprocessor.__name__ in names_of_base_classes


class _Events(BaseEventHandler):
    events: list[Any] = []  # noqa: RUF012 - collected across the test

    @classmethod
    def class_name(cls) -> str:
        return "TestEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, ContextPilotEvent):
            self.events.append(event)


class _Reverse(BaseNodePostprocessor):
    """Another retriever's order: the same nodes, reversed."""

    def _postprocess_nodes(self, nodes: list[Any], query_bundle: Any = None) -> list[Any]:
        return nodes[::-1]


class _Rotate(BaseNodePostprocessor):
    """A third order: the first node last."""

    def _postprocess_nodes(self, nodes: list[Any], query_bundle: Any = None) -> list[Any]:
        return [*nodes[1:], nodes[0]]


def test_query_engine_with_the_postprocessor(index: VectorStoreIndex) -> None:
    handler = _Events()
    get_dispatcher().add_event_handler(handler)
    pilot = ContextPilot(annotate_order=True, keep_top=False)  # the annotation on, the top node anywhere
    engine = index.as_query_engine(similarity_top_k=5, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)])
    response = engine.query(QUESTION)
    assert "priority order" not in str(response)  # a fresh pilot keeps the retriever's order: nothing to restate
    assert "ref: " not in str(response)  # and shares nothing yet: the nodes as retrieved, unlabelled
    reversing = index.as_query_engine(
        similarity_top_k=5, node_postprocessors=[_Reverse(), ContextPilotPostprocessor(pilot=pilot)]
    )
    reversed_response = reversing.query(QUESTION)  # the nodes recur: in the order the first left cached
    text = str(reversed_response)  # MockLLM echoes the prompt
    assert "ref: " not in text and "priority order, by position" in text  # one text per node, ranked by position
    rotating = index.as_query_engine(
        similarity_top_k=5, node_postprocessors=[_Rotate(), ContextPilotPostprocessor(pilot=pilot)]
    )
    rotated = rotating.query(QUESTION)  # the same prefix again, the ranking restated
    assert "priority order" in str(rotated)
    ids = [n.node.node_id for n in rotated.source_nodes]
    assert (
        ids
        == [n.node.node_id for n in reversed_response.source_nodes]
        == [n.node.node_id for n in response.source_nodes]
    )
    assert len(response.source_nodes) == 5 and all(n.score is not None for n in response.source_nodes)
    assert all(n.node.metadata["title"] for n in response.source_nodes)
    original = index.docstore.get_node(response.source_nodes[0].node.node_id)
    assert "ref" not in original.metadata  # copies are labelled, the docstore is not
    assert handler.events and handler.events[-1].sent
    again = engine.query(QUESTION)
    assert [n.node.node_id for n in again.source_nodes] == [n.node.node_id for n in response.source_nodes]
    assert pilot.stats().predicted_cached_blocks >= 5


def test_postprocessor_on_its_own() -> None:
    postprocessor = ContextPilotPostprocessor()
    assert postprocessor.postprocess_nodes([], query_str="q") == []
    assert ContextPilotPostprocessor.class_name() == "ContextPilotPostprocessor"
