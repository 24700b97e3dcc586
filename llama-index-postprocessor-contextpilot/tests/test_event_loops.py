"""One SGLangLLM, three ``asyncio.run`` in a row, against a real llama-server: its own async
client keeps a connection pool per event loop, so no run meets a connection that died with
the previous loop (it does not retry: an engine refuses a retried request id). Every body
is recorded and audited. LlamaIndex ships no standard LLM test suite to run here (LangChain's
runs in langchain-contextpilot's tests)."""

from __future__ import annotations

import asyncio

import httpx
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import ChatMessage

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.bodies import Bodies
from contextpilot_integrations.testing.invariants import invariant_breaches
from contextpilot_integrations.testing.llama_server import LlamaServer
from llama_index.postprocessor.contextpilot import ContextPilotPostprocessor, SGLangLLM
from tests.support import QUESTION


def recorded(llm: SGLangLLM) -> Bodies:
    client = llm._async_http_client  # the LLM's own async client (none was given)
    assert isinstance(client, httpx.AsyncClient)
    bodies = Bodies()
    client.event_hooks["request"].append(bodies.record)
    return bodies


def test_sglang_llm_answers_from_three_event_loops_in_a_row(llama: LlamaServer) -> None:
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", max_tokens=2, context_window=8192, timeout=600)
    bodies = recorded(llm)
    answers = [asyncio.run(llm.achat([ChatMessage(role="user", content="Hello")])) for _ in range(3)]
    assert all(answer.raw is not None for answer in answers)

    async def streamed() -> str:
        return "".join([chunk.delta or "" async for chunk in await llm.astream_chat([ChatMessage(content="Hi")])])

    assert all(isinstance(asyncio.run(streamed()), str) for _ in range(3))
    assert len(bodies.sent) == 6 and len({body["rid"] for body in bodies.sent}) == 6
    assert invariant_breaches(bodies.sent) == []


def test_a_query_engine_from_three_event_loops_reports_each_request(
    index: VectorStoreIndex, llama: LlamaServer
) -> None:
    pilot = ContextPilot()
    llm = SGLangLLM(model="tiny", api_base=llama.url + "/v1", max_tokens=1, context_window=8192, timeout=600)
    bodies = recorded(llm)
    engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )
    for _ in range(3):
        asyncio.run(engine.aquery(QUESTION))
    rids = [body["rid"] for body in bodies.sent]
    assert len(rids) == 3 and set(rids) == set(pilot.live_request_ids()) and pilot.stats().engine_requests == 3
    assert invariant_breaches(bodies.sent) == []
