"""LangChain's own standard suite (langchain-tests ``ChatModelIntegrationTests``) for every chat
model class this package ships, against a real llama-server (tiny random-weight model: the
model-quality features, tool calling, structured output, JSON mode, multimodal inputs, are
declared off); and the event-loop regression behind its ``test_astream``: one model, three
``asyncio.run`` in a row, every request body recorded and audited."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_openai import ChatOpenAI
from langchain_tests.integration_tests import ChatModelIntegrationTests

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines.loop_local import loop_local_async_client
from contextpilot_integrations.testing.bodies import Bodies
from contextpilot_integrations.testing.invariants import invariant_breaches
from contextpilot_integrations.testing.llama_server import LlamaServer
from langchain_contextpilot import ChatSGLang, ContextPilotChatModel, ContextPilotRetriever, format_documents
from tests.support import QUERY, BM25ChunkRetriever

_SERVER: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _live_server(llama: LlamaServer) -> Iterator[None]:
    """The standard suite reads its model's settings from properties: the server's URL here."""
    _SERVER["url"] = llama.url + "/v1"
    yield


class _TinyModel:
    """What a tiny random-weight model cannot do, declared off (the suite skips those tests)."""

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class TestChatSGLangLive(_TinyModel, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatSGLang

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny", "base_url": _SERVER["url"], "max_retries": 0, "max_tokens": 8, "timeout": 600}


class TestWrappedChatOpenAILive(_TinyModel, ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ContextPilotChatModel

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {}  # the wrapper's own fields only: the model settings go to the wrapped model

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # each id sent once (max_retries=0), so each test's event loop needs its own connections
        llm = ChatOpenAI(
            model="tiny",
            base_url=_SERVER["url"],
            api_key="x",
            temperature=0,
            max_tokens=8,
            timeout=600,
            max_retries=0,
            http_async_client=loop_local_async_client(),
        )
        return {"llm": llm, "engine": "sglang"}


# ---- the event-loop regression -------------------------------------------------------------------


def test_chat_sglang_answers_from_three_event_loops_in_a_row(llama: LlamaServer) -> None:
    """Its own async client (none given): usable from every loop, as stock ChatOpenAI's is."""
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=2)
    bodies = Bodies()
    llm.http_async_client.event_hooks["request"].append(bodies.record)
    answers = [asyncio.run(llm.ainvoke("Hello")) for _ in range(3)]
    assert all(answer.usage_metadata for answer in answers)

    async def streamed() -> str:
        return "".join([str(chunk.content) async for chunk in llm.astream("Hello")])

    assert all(isinstance(asyncio.run(streamed()), str) for _ in range(3))
    assert len(bodies.sent) == 6 and invariant_breaches(bodies.sent) == []
    assert len({body["rid"] for body in bodies.sent}) == 6


def test_a_chain_on_chat_sglang_from_three_event_loops_reports_each_request(llama: LlamaServer) -> None:
    pilot = ContextPilot()
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=1)
    bodies = Bodies()
    llm.http_async_client.event_hooks["request"].append(bodies.record)
    prompt = ChatPromptTemplate.from_messages([("user", "{context}\n\nQuestion: {question}")])
    retriever = ContextPilotRetriever(base_retriever=BM25ChunkRetriever(k=3, max_chars=200), pilot=pilot)
    chain = {"context": retriever | RunnableLambda(format_documents), "question": RunnablePassthrough()} | prompt | llm
    for _ in range(3):
        asyncio.run(chain.ainvoke(QUERY))
    rids = [body["rid"] for body in bodies.sent]
    assert pilot.stats().engine_requests == 3 and len(rids) == 3 and set(rids) == set(pilot.live_request_ids())
    assert invariant_breaches(bodies.sent) == []
