"""Streaming queries send the request prepared for them, whenever and wherever their streams
are read: a stock streaming query engine (the compact synthesizer calls the LLM only when the
stream is read, after the query's spans have ended) with both LLM classes, against a local
fake of the OpenAI API over real HTTP (it records every body; the ids ride in the body as
for SGLang). Nothing outlives the stream: read, stopped, cancelled or never read."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.base.response.schema import AsyncStreamingResponse
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.query_engine import BaseQueryEngine
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.testing.fake_openai import FakeOpenAI, fake_openai
from llama_index.postprocessor.contextpilot import ContextPilotLLM, ContextPilotPostprocessor, SGLangLLM
from llama_index.postprocessor.contextpilot._binding import span_binder
from tests.support import QUESTION

OTHER = "Which company announced new products this week?"
dispatcher = get_dispatcher(__name__)


def llm(kind: str, fake: FakeOpenAI) -> Any:
    if kind == "sglang":
        return SGLangLLM(model="tiny", api_base=fake.base_url, context_window=8192)
    inner = OpenAILike(
        model="tiny", api_base=fake.base_url, api_key="x", is_chat_model=True, max_retries=0, context_window=8192
    )
    return ContextPilotLLM(llm=inner, engine="sglang")


def streaming(index: VectorStoreIndex, pilot: ContextPilot, model: Any) -> BaseQueryEngine:
    return index.as_query_engine(
        llm=model, similarity_top_k=3, streaming=True, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )


def sent(fake: FakeOpenAI) -> list[str]:
    return [body["rid"] for body in fake.requests]


def held() -> set[str]:
    """The request ids a query's tree still holds for a model call."""
    return {binding.prepared.request_id for binding in span_binder().runs.untaken()}


async def read(response: AsyncStreamingResponse) -> str:
    return "".join([token async for token in response.async_response_gen()])


@pytest.mark.parametrize("kind", ["sglang", "wrapped"])
def test_two_streams_started_before_either_is_read_send_their_own_requests(index: VectorStoreIndex, kind: str) -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        engine = streaming(index, pilot, llm(kind, fake))
        first, second = engine.query(QUESTION), engine.query(OTHER)
        prepared = pilot.live_request_ids()
        assert len(prepared) == 2 and fake.requests == []  # nothing sent before a stream is read
        "".join(second.response_gen)
        "".join(first.response_gen)
        assert sent(fake) == [prepared[1], prepared[0]]
        assert OTHER in str(fake.requests[0]["messages"]) and QUESTION in str(fake.requests[1]["messages"])
        assert pilot.stats().engine_requests == 2  # each stream's usage reported to its request


@pytest.mark.parametrize("kind", ["sglang", "wrapped"])
def test_streams_read_inside_one_outer_span_keep_their_own_requests(index: VectorStoreIndex, kind: str) -> None:
    """Both queries under one span of the caller's (a workflow step, a request handler): the
    streams are read there, oldest first; each sends its own query's request."""
    with fake_openai() as fake:
        pilot = ContextPilot()
        engine = streaming(index, pilot, llm(kind, fake))

        @dispatcher.span
        def handle() -> list[str]:
            first, second = engine.query(QUESTION), engine.query(OTHER)
            prepared = pilot.live_request_ids()
            "".join(first.response_gen)
            "".join(second.response_gen)
            return prepared

        prepared = handle()
        assert sent(fake) == prepared and len(set(prepared)) == 2
        assert pilot.stats().engine_requests == 2


@pytest.mark.parametrize("kind", ["sglang", "wrapped"])
async def test_every_streaming_aquery_sends_its_own_request_and_reports_back(
    index: VectorStoreIndex, kind: str
) -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        engine = streaming(index, pilot, llm(kind, fake))
        first, second = await engine.aquery(QUESTION), await engine.aquery(OTHER)
        prepared = pilot.live_request_ids()
        await read(second)  # type: ignore[arg-type]
        await read(first)  # type: ignore[arg-type]
        assert sent(fake) == [prepared[1], prepared[0]]

        responses = await asyncio.gather(*(engine.aquery(f"{QUESTION} ({n})") for n in range(12)))
        prepared = pilot.live_request_ids()[2:]
        await asyncio.gather(*(read(response) for response in reversed(responses)))  # type: ignore[arg-type]
        ids = sent(fake)[2:]
        assert len(ids) == 12 and sorted(ids) == sorted(prepared)  # 12 of 12 bound, none twice
        assert pilot.stats().engine_requests == 14  # and every usage reported back


def test_a_stream_stopped_early_or_never_read_lets_its_query_go(index: VectorStoreIndex) -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        engine = streaming(index, pilot, llm("sglang", fake))
        unread = engine.query(QUESTION)
        waiting = pilot.live_request_ids()[0]
        assert waiting in held()  # kept for the stream after the query's spans ended
        del unread
        gc.collect()
        assert waiting not in held() and fake.requests == []

        stopped = engine.query(OTHER)
        rid = pilot.live_request_ids()[-1]
        next(iter(stopped.response_gen))
        stopped.response_gen.close()  # type: ignore[attr-defined]
        assert sent(fake) == [rid] and rid not in held()


async def test_a_cancelled_read_forgets_its_request_and_the_next_query_binds(index: VectorStoreIndex) -> None:
    with fake_openai() as fake:
        pilot = ContextPilot()
        engine = streaming(index, pilot, llm("sglang", fake))
        response = await engine.aquery(QUESTION)
        rid = pilot.live_request_ids()[0]
        task = asyncio.create_task(read(response))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the read starts: the model call is made, its request on the way out
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert pilot.live_request_ids() == [] and rid not in held()  # forgotten, nothing left behind
        await read(await engine.aquery(OTHER))  # type: ignore[arg-type]
        assert sent(fake)[-1] == pilot.live_request_ids()[-1] and pilot.stats().engine_requests == 1
