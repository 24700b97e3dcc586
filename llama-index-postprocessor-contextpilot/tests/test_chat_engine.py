"""The memory-aware chat engine with real LlamaIndex Memory and a MockLLM that records prompts."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from llama_index.core import VectorStoreIndex
from llama_index.core.llms.mock import MockLLMWithChatMemoryOfLastCall
from llama_index.core.memory import Memory

from contextpilot_integrations import ContextPilot
from llama_index.postprocessor.contextpilot import ContextPilotChatEngine
from tests.support import QUESTION


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
    assert last.count("Please refer to ") == 2  # same documents: references, but the top one in full
    assert len(engine.chat_history) == 10
    # a memory that keeps almost nothing: once the turn that showed them is flushed,
    # the documents are sent again
    small, small_llm = _engine(index, ContextPilot(), token_limit=40)
    small.chat(QUESTION)
    small.chat(QUESTION)  # turn 0 is still in memory here (it is flushed on the next put)
    assert "Please refer to" in small_llm.last_chat_messages[-1].content
    third = small.chat(QUESTION)
    sent = small_llm.last_chat_messages[-1].content
    assert "Please refer to" not in sent and all(item.node.get_content() in sent for item in third.source_nodes)
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


def test_a_kept_turn_that_refers_to_a_flushed_one_is_sent_with_the_documents() -> None:
    """Turn 1 refers to turn 0's documents; once the memory keeps turn 1 but has flushed
    turn 0, turn 1's message goes out with those documents written out: the model never
    reads a reference to a message it is not sent."""
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    from contextpilot_integrations.testing.invariants import dangling_references

    long = [TextNode(id_=f"doc{n}", text=f"Document {n} opens here, " + "words " * 150) for n in range(3)]
    index = VectorStoreIndex(long, embed_model=MockEmbedding(embed_dim=8))
    engine, llm = _engine(index, ContextPilot(), token_limit=400)
    engine.chat("first question")
    engine.chat("second question")
    assert "Please refer to" in llm.last_chat_messages[-1].content  # turn 1 refers to turn 0
    third = engine.chat("third question")
    texts = [str(m.content or "") for m in llm.last_chat_messages]
    assert "first question" not in "\n".join(texts) and "second question" in "\n".join(texts)  # turn 0 flushed
    assert any("Please refer to" in str(m.content) for m in engine.chat_history)  # the memory keeps what was sent
    assert dangling_references(texts) == []
    assert all(item.node.get_content() in "\n".join(texts) for item in third.source_nodes)
