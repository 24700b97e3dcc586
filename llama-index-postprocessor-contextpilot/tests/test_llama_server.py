"""End to end against a real llama-server: cached tokens and request ids in every call style."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core import VectorStoreIndex

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.llama_server import LlamaServer
from llama_index.postprocessor.contextpilot import ContextPilotChatEngine, SGLangLLM
from tests.support import QUESTION


def spied_llm(llama: LlamaServer) -> tuple[SGLangLLM, list[str]]:
    """An SGLangLLM on the server, and the request ids its calls send (appended as sent)."""
    seen: list[str] = []
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", max_tokens=2, context_window=8192)
    original = llm._get_model_kwargs

    def spy(**kwargs: Any) -> dict[str, Any]:
        out = original(**kwargs)
        seen.append(out["extra_body"]["rid"])
        return out

    object.__setattr__(llm, "_get_model_kwargs", spy)
    return llm, seen


def test_second_turn_reports_cached_tokens(index: VectorStoreIndex, llama: LlamaServer) -> None:
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", max_tokens=2, context_window=8192)
    engine = ContextPilotChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=3), llm=llm)
    first = engine.chat(QUESTION)
    second = engine.chat(QUESTION + " Answer briefly.")
    assert first.metadata["request_id"] != second.metadata["request_id"]
    # the second turn starts with the first one, context included: served from the cache
    assert second.metadata["cached_tokens"] > 1_000


def test_the_request_id_reaches_the_server_in_every_call_style(index: VectorStoreIndex, llama: LlamaServer) -> None:
    llm, seen = spied_llm(llama)
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


def test_the_query_engine_path_sends_the_pilots_id_and_reports_back(
    index: VectorStoreIndex, llama: LlamaServer
) -> None:
    """The LLM sees only the QA prompt: it finds the prepared request by the order annotation
    the postprocessor put in the query, sends its id, and reports the counts to the pilot."""
    from llama_index.postprocessor.contextpilot import ContextPilotEvent, ContextPilotPostprocessor

    events: list[str] = []
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    class Ids(BaseEventHandler):
        @classmethod
        def class_name(cls) -> str:
            return "Ids"

        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, ContextPilotEvent):
                events.append(event.request_id)

    get_dispatcher().add_event_handler(Ids())
    llm, seen = spied_llm(llama)
    pilot = ContextPilot()
    engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )
    engine.query(QUESTION)
    assert seen and seen[-1] == events[-1]  # the postprocessor's request, not a fresh id
    assert pilot.stats().engine_requests == 1 and pilot.stats().engine_prompt_tokens > 0
    chat = ContextPilotChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=2), llm=llm, pilot=pilot)
    chat.chat(QUESTION)
    assert pilot.stats().engine_requests == 2
