"""LlamaIndex components with real LlamaIndex objects (VectorStoreIndex, Memory, query and
chat engines) over the bundled MultiHop-RAG chunks; MockLLM / MockEmbedding stand in for
a model offline, and a real llama-server serves the end-to-end test."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core import Settings, VectorStoreIndex
from llama_index.core.embeddings import MockEmbedding
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.llms import MockLLM
from llama_index.core.llms.mock import MockLLMWithChatMemoryOfLastCall
from llama_index.core.memory import Memory
from llama_index.core.schema import TextNode

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.llamaindex import (
    ContextPilotChatEngine,
    ContextPilotEvent,
    ContextPilotPostprocessor,
    SGLangLLM,
)
from contextpilot_integrations.whatif.datasets import load_multihop_rag
from tests.engine_support import LlamaServer, start_llama_server


@pytest.fixture(scope="module")
def index() -> VectorStoreIndex:
    Settings.embed_model = MockEmbedding(embed_dim=8)
    Settings.llm = MockLLM()
    chunks = list(load_multihop_rag().chunks.values())[:40]
    nodes = [TextNode(id_=c.id, text=c.text[:500], metadata={"title": c.metadata["title"]}) for c in chunks]
    return VectorStoreIndex(nodes)


QUESTION = "Who is facing a criminal trial on fraud charges?"


class _Events(BaseEventHandler):
    events: list[Any] = []  # noqa: RUF012 - collected across the test

    @classmethod
    def class_name(cls) -> str:
        return "TestEvents"

    def handle(self, event: Any, **kwargs: Any) -> None:
        if isinstance(event, ContextPilotEvent):
            self.events.append(event)


def test_query_engine_with_the_postprocessor(index: VectorStoreIndex) -> None:
    handler = _Events()
    get_dispatcher().add_event_handler(handler)
    pilot = ContextPilot()
    engine = index.as_query_engine(similarity_top_k=5, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)])
    response = engine.query(QUESTION)
    text = str(response)  # MockLLM echoes the prompt
    assert "priority order" in text and text.index("contextpilot_label: Doc_") < text.index("priority order")
    assert len(response.source_nodes) == 5 and all(n.score is not None for n in response.source_nodes)
    assert all(n.node.metadata["title"] for n in response.source_nodes)
    original = index.docstore.get_node(response.source_nodes[0].node.node_id)
    assert "contextpilot_label" not in original.metadata  # copies are labelled, the docstore is not
    assert handler.events and handler.events[-1].sent
    again = engine.query(QUESTION)
    assert [n.node.node_id for n in again.source_nodes] == [n.node.node_id for n in response.source_nodes]
    assert pilot.stats().predicted_cached_blocks >= 5


def test_postprocessor_on_its_own() -> None:
    postprocessor = ContextPilotPostprocessor()
    assert postprocessor.postprocess_nodes([], query_str="q") == []
    assert ContextPilotPostprocessor.class_name() == "ContextPilotPostprocessor"


def _engine(
    index: VectorStoreIndex, pilot: ContextPilot, token_limit: int = 30_000
) -> tuple[ContextPilotChatEngine, Any]:
    llm = MockLLMWithChatMemoryOfLastCall(is_chat_model=True, max_tokens=5)
    memory = Memory.from_defaults(token_limit=token_limit, token_flush_size=1, chat_history_token_ratio=0.99)
    engine = ContextPilotChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=3), llm=llm, memory=memory, pilot=pilot
    )
    return engine, llm


def test_five_turns_reference_then_resend_after_memory_flush(index: VectorStoreIndex) -> None:
    pilot = ContextPilot()
    engine, llm = _engine(index, pilot)
    for turn in range(5):
        response = engine.chat(f"{QUESTION} (turn {turn})")
        assert len(response.source_nodes) == 3
    last = llm.last_chat_messages[-1].content
    assert last.count("Please refer to [Doc_") == 3  # same documents: references only
    assert len(engine.chat_history) == 10
    # a memory that keeps almost nothing: once the turn that showed them is flushed,
    # the documents are sent again
    small, small_llm = _engine(index, ContextPilot(), token_limit=40)
    small.chat(QUESTION)
    small.chat(QUESTION)  # turn 0 is still in memory here (it is flushed on the next put)
    assert "Please refer to" in small_llm.last_chat_messages[-1].content
    small.chat(QUESTION)
    sent = small_llm.last_chat_messages[-1].content
    assert "Please refer to" not in sent and sent.count("[Doc_") >= 3
    engine.reset()
    assert engine.chat_history == []
    assert "Please refer to" not in (engine.chat(QUESTION) and llm.last_chat_messages[-1].content)


def test_all_four_call_styles(index: VectorStoreIndex) -> None:
    engine, llm = _engine(index, ContextPilot())
    assert engine.chat(QUESTION).response
    streamed = engine.stream_chat(QUESTION)
    assert "".join(streamed.response_gen)
    assert "Please refer to" in llm.last_chat_messages[-1].content

    async def run() -> None:
        assert (await engine.achat(QUESTION)).response
        response = await engine.astream_chat(QUESTION)
        assert "".join([token async for token in response.async_response_gen()])

    asyncio.run(run())
    assert len(engine.chat_history) == 8


def test_concurrent_conversations_share_one_pilot(index: VectorStoreIndex) -> None:
    pilot = ContextPilot()
    engines = [_engine(index, pilot)[0] for _ in range(4)]
    errors: list[BaseException] = []

    def talk(engine: ContextPilotChatEngine) -> None:
        try:
            for turn in range(3):
                engine.chat(f"{QUESTION} {turn}")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=talk, args=(e,)) for e in engines]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and pilot.stats().conversations == 4 and pilot.stats().requests_prepared == 12
    pilot.check()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(Path(tmp_path_factory.mktemp("llama-li")))
    yield server
    server.stop()


def test_second_turn_reports_cached_tokens(index: VectorStoreIndex, llama: LlamaServer) -> None:
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", api_key="unused", max_tokens=2, context_window=8192)
    engine = ContextPilotChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=3), llm=llm)
    first = engine.chat(QUESTION)
    second = engine.chat(QUESTION + " Answer briefly.")
    assert first.metadata["request_id"] != second.metadata["request_id"]
    # the second turn starts with the first one, context included: served from the cache
    assert second.metadata["cached_tokens"] > 1_000


def test_the_request_id_reaches_the_server_in_every_call_style(index: VectorStoreIndex, llama: LlamaServer) -> None:
    seen: list[str] = []
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", api_key="unused", max_tokens=2, context_window=8192)
    original = llm._get_model_kwargs

    def spy(**kwargs: Any) -> dict[str, Any]:
        out = original(**kwargs)
        seen.append(out["extra_body"]["rid"])
        return out

    object.__setattr__(llm, "_get_model_kwargs", spy)
    pilot = ContextPilot()
    engine = ContextPilotChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=2), llm=llm, pilot=pilot
    )
    ids = [engine.chat(QUESTION).metadata["request_id"]]
    streamed = engine.stream_chat(QUESTION)
    "".join(streamed.response_gen)

    async def run() -> None:
        ids.append((await engine.achat(QUESTION)).metadata["request_id"])
        response = await engine.astream_chat(QUESTION)
        "".join([token async for token in response.async_response_gen()])

    asyncio.run(run())
    assert len(seen) == 4 and seen[0] == ids[0] and seen[2] == ids[1]
    prefix = ids[0].rsplit("-", 1)[0]
    assert len(set(seen)) == 4 and all(rid.rsplit("-", 1)[0] == prefix for rid in seen)  # the pilot's ids, streams too


def test_sglang_llm_needs_no_api_key(llama: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from llama_index.core.base.llms.types import ChatMessage

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", max_tokens=2, context_window=8192)  # as the README
    assert llm.chat([ChatMessage(role="user", content="hello")]).message.content is not None
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai-secret")
    assert SGLangLLM(model="tiny", api_base=llama.url + "/v1").api_key == "EMPTY"
