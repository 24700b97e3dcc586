"""The compressor and LCEL step with real LangChain objects and a real BM25 retriever."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda

from contextpilot_integrations import BlockTypeError, ContextPilot
from langchain_contextpilot import ContextPilotCompressor, contextpilot_reorder, format_documents_runnable
from tests.support import QUERY, BM25ChunkRetriever


def test_compressor_and_lcel_step_with_events() -> None:
    events: list[dict[str, Any]] = []

    class Collector(BaseCallbackHandler):
        def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
            events.append(data)

    compressor = ContextPilotCompressor(pilot=ContextPilot(), deduplicate=True)
    documents = BM25ChunkRetriever(k=4).invoke(QUERY)
    assert len(compressor.compress_documents(documents, QUERY)) == 4
    chain = BM25ChunkRetriever(k=4) | compressor.as_runnable()
    out = chain.invoke(QUERY, config={"callbacks": [Collector()], "configurable": {"thread_id": "x"}})
    assert len(out) == 4 and events and events[-1]["conversation_id"] == "x"
    assert len(asyncio.run(chain.ainvoke(QUERY))) == 4


def test_bad_input() -> None:
    compressor = ContextPilotCompressor()
    no_ids = [Document(page_content="alpha"), Document(page_content="beta")]
    assert [d.page_content for d in compressor.compress_documents(no_ids, "q")] == ["alpha", "beta"]
    assert compressor.compress_documents([], "q") == []
    broken = Document.model_construct(page_content=b"bytes", metadata={}, id=None)
    with pytest.raises(BlockTypeError, match="page_content must be str"):
        compressor.compress_documents([broken], "q")
    with pytest.raises(BlockTypeError, match="expected a Document"):
        compressor.compress_documents(["text"], "q")  # type: ignore[list-item]


def test_in_contextual_compression_retriever_with_metadata() -> None:
    from langchain_classic.retrievers import ContextualCompressionRetriever

    ccr = ContextualCompressionRetriever(
        base_compressor=ContextPilotCompressor(pilot=ContextPilot(), deduplicate=True),
        base_retriever=BM25ChunkRetriever(k=4),
    )
    config = {"metadata": {"conversation_id": "ccr"}}
    first = ccr.invoke(QUERY, config=config)
    second = asyncio.run(ccr.ainvoke(QUERY, config=config))
    assert len(first) == len(second) == 4
    assert all(d.metadata["contextpilot"]["reference"] for d in second[:-1])  # conversation read from metadata
    assert not second[-1].metadata["contextpilot"]["reference"]  # the top document last, in full


@pytest.mark.parametrize("use_async", [False, True])
def test_in_a_chain_the_compressor_reads_configurable(use_async: bool) -> None:
    """LangChain hands a compressor only callbacks; inside a chain (or a graph) the run's
    config is in context, and ``configurable`` names the conversation."""
    from langchain_classic.retrievers import ContextualCompressionRetriever

    ccr = ContextualCompressionRetriever(
        base_compressor=ContextPilotCompressor(pilot=ContextPilot(), deduplicate=True),
        base_retriever=BM25ChunkRetriever(k=4),
    )
    chain = ccr | RunnableLambda(lambda documents: documents)
    config = {"configurable": {"thread_id": f"ccr-{use_async}"}}

    def turn() -> list[Document]:
        return asyncio.run(chain.ainvoke(QUERY, config=config)) if use_async else chain.invoke(QUERY, config=config)

    first, second = turn(), turn()
    assert not any(d.metadata["contextpilot"]["reference"] for d in first)
    assert all(d.metadata["contextpilot"]["reference"] for d in second[:-1])
    assert not second[-1].metadata["contextpilot"]["reference"]  # the top document last, in full


def test_lcel_helpers() -> None:
    pilot = ContextPilot(annotate_order=True, keep_top=False)  # the annotation on, the top block anywhere
    chain = BM25ChunkRetriever(k=3) | contextpilot_reorder(pilot) | format_documents_runnable
    plain = chain.invoke(QUERY)  # shares nothing yet: sent as without ContextPilot
    assert plain == "\n\n".join(d.page_content for d in BM25ChunkRetriever(k=3).invoke(QUERY))
    reversed_docs = (BM25ChunkRetriever(k=3) | RunnableLambda(lambda d: d[::-1]) | contextpilot_reorder(pilot)).invoke(
        QUERY
    )
    text = format_documents_runnable.invoke(reversed_docs)  # they recur: in the order the first left cached
    assert not re.findall(r"(?m)^\[[^\]\s]+\] ", text) and pilot.stats().requests_prepared == 2  # one text a block
    assert text.startswith(plain) and "priority order, by position" in text  # reordered: the ranking restated
    rotated = (BM25ChunkRetriever(k=3) | RunnableLambda(lambda d: [*d[1:], d[0]]) | contextpilot_reorder(pilot)).invoke(
        QUERY
    )
    assert [d.id for d in rotated] == [d.id for d in reversed_docs]  # onto the same prefix
    assert "priority order" in format_documents_runnable.invoke(rotated)


def test_two_sources_of_one_chunk_both_come_back_and_the_text_goes_once() -> None:
    """The same id and text with different metadata (two sources of one chunk): every
    document is returned, the second marked ``duplicate_of``, and the prompt shows it once."""
    from langchain_contextpilot import ContextPilotRetriever, format_documents

    chunk = BM25ChunkRetriever(k=3).invoke(QUERY)
    twice = [
        chunk[0],
        Document(page_content=chunk[0].page_content, id=chunk[0].id, metadata={"source": "mirror"}),
        *chunk[1:],
    ]
    compressor = ContextPilotCompressor(pilot=ContextPilot())
    out = compressor.compress_documents(twice, QUERY)
    assert len(out) == 4 and sorted(d.metadata.get("source", "") for d in out) == ["", "", "", "mirror"]
    mirror = next(d for d in out if d.metadata.get("source") == "mirror")
    assert (
        mirror.metadata["contextpilot"]["duplicate_of"] == out[out.index(mirror) - 1].metadata["contextpilot"]["label"]
    )
    assert format_documents(out).count(chunk[0].page_content) == 1

    class Twice(BM25ChunkRetriever):
        def _get_relevant_documents(self, query: str, *, run_manager: Any) -> list[Document]:
            return twice

    retrieved = ContextPilotRetriever(base_retriever=Twice(), pilot=ContextPilot()).invoke(QUERY)
    assert len(retrieved) == 4 and format_documents(retrieved).count(chunk[0].page_content) == 1
