"""Drop-in without loss, against a real llama-server: no dangling reference in any wiring, and
every LLM call sends its own request id and reports to its own prepared request.

Every request body that leaves for the server is recorded (httpx request hooks).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
from llama_index.core import VectorStoreIndex
from llama_index.core.chat_engine import ContextChatEngine
from llama_index.llms.openai_like import OpenAILike

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines import Router, Target
from contextpilot_integrations.testing.invariants import dangling_references, invariant_breaches, message_texts
from contextpilot_integrations.testing.llama_server import LlamaServer, tiny_llama_server
from llama_index.postprocessor.contextpilot import (
    ContextPilotBindingWarning,
    ContextPilotChatEngine,
    ContextPilotLLM,
    ContextPilotPostprocessor,
    SGLangLLM,
)
from tests.support import QUESTION


class Recorder:
    """The JSON bodies of every request sent, through real httpx clients. Every recorder a
    test makes is checked after it (:func:`every_body_keeps_both_invariants`)."""

    made: ClassVar[list[Recorder]] = []

    def __init__(self, time_out_first: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        Recorder.made.append(self)
        self.time_out_first = time_out_first
        self._lock = threading.Lock()

    def _record(self, request: httpx.Request) -> None:
        with self._lock:
            self.bodies.append(json.loads(request.content))
            if self.time_out_first > 0:  # as if the engine took the request and answered too late
                self.time_out_first -= 1
                raise httpx.ReadTimeout("recorder: the first attempt times out", request=request)

    def clients(self) -> dict[str, Any]:
        async def record(request: httpx.Request) -> None:
            self._record(request)

        return {
            "http_client": httpx.Client(event_hooks={"request": [self._record]}),
            "async_http_client": httpx.AsyncClient(event_hooks={"request": [record]}),
        }

    def dangling(self) -> int:
        return sum(len(dangling_references(message_texts(body))) for body in self.bodies)

    def references(self) -> int:
        return sum("\n".join(message_texts(body)).count("Please refer to ") for body in self.bodies)

    def ids(self) -> list[str]:
        return [body["rid"] for body in self.bodies]


@pytest.fixture(autouse=True)
def every_body_keeps_both_invariants() -> Iterator[None]:
    """In every wiring of this file: no reference without its text in the same messages,
    and no request id sent twice (bodies without an id field carry none)."""
    Recorder.made.clear()
    yield
    assert invariant_breaches(body for recorder in Recorder.made for body in recorder.bodies) == []


def sglang(llama: LlamaServer, recorder: Recorder, **options: Any) -> SGLangLLM:
    settings = {"model": "tiny", "api_base": llama.url + "/v1", "max_tokens": 1, "context_window": 8192, "timeout": 600}
    return SGLangLLM(**{**settings, **options}, **recorder.clients())


def _served_by_each(pilot: ContextPilot, calls: int, recorder: Recorder) -> None:
    ids = recorder.ids()
    assert len(ids) == calls and len(set(ids)) == calls  # every id sent is unique
    stats = pilot.stats()
    assert stats.requests_prepared == calls and stats.engine_requests == calls  # each report on its own request
    assert set(ids) == set(pilot.live_request_ids())


def test_stock_context_chat_engine_with_the_postprocessor(index: VectorStoreIndex, llama: LlamaServer) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    engine = ContextChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=3),
        llm=sglang(llama, recorder),
        node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)],
    )
    for _ in range(3):
        engine.chat(QUESTION)
    assert recorder.references() == 0 and recorder.dangling() == 0
    assert pilot.stats().blocks_referenced == 0  # the stats say what was sent
    assert pilot.stats().engine_requests == 3 and len(set(recorder.ids())) == 3


def test_query_engine_fifty_threads_and_fifty_tasks(index: VectorStoreIndex, llama: LlamaServer) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    engine = index.as_query_engine(
        llm=sglang(llama, recorder), similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: engine.query(QUESTION), range(50)))
    _served_by_each(pilot, 50, recorder)

    pilot2, recorder2 = ContextPilot(), Recorder()
    engine2 = index.as_query_engine(
        llm=sglang(llama, recorder2), similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot2)]
    )

    async def fifty() -> None:
        await asyncio.gather(*(engine2.aquery(QUESTION) for _ in range(50)))

    asyncio.run(fifty())
    _served_by_each(pilot2, 50, recorder2)


def test_a_timed_out_call_is_not_resent_under_its_id(index: VectorStoreIndex, llama: LlamaServer) -> None:
    """A timed-out request may still run in the engine, and SGLang refuses a second request
    with its id ("Duplicate request ID"): SGLangLLM does not retry inside the call, the
    failure reaches the caller and the pilot forgets the request."""
    pilot, recorder = ContextPilot(), Recorder(time_out_first=1)
    engine = index.as_query_engine(
        llm=sglang(llama, recorder), similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )
    with pytest.raises(Exception, match=r"(?i)timed? ?out"):
        engine.query(QUESTION)
    assert len(recorder.ids()) == 1 and pilot.live_request_ids() == []
    engine.query(QUESTION)  # the caller's retry prepares afresh, under a new id
    assert len(set(recorder.ids())) == 2 and pilot.stats().engine_requests == 1


def test_a_wrapped_llm_that_retries_inside_a_call_is_refused_where_it_would_resend_the_id() -> None:
    """OpenAILike retries a failed call (max_retries=3 by default) with the same body, request
    id and all, and an engine still running the first attempt refuses it."""
    retrying = OpenAILike(model="tiny", api_base="http://127.0.0.1:9/v1", api_key="x", is_chat_model=True)
    with pytest.raises(ValueError, match=r"OpenAILike retries inside a call \(max_retries=3\).* max_retries=0"):
        ContextPilotLLM(llm=retrying, engine="sglang")
    assert ContextPilotLLM(llm=retrying).engine is None  # no id in the body: its retries are its own
    once = OpenAILike(model="tiny", api_base="http://127.0.0.1:9/v1", api_key="x", is_chat_model=True, max_retries=0)
    assert ContextPilotLLM(llm=once, engine="vllm").llm is once


def test_router_path_under_fifty_threads(index: VectorStoreIndex, replicas: list[LlamaServer]) -> None:
    router = Router([Target(f"r{n}", server.url, engine="sglang") for n, server in enumerate(replicas)])
    recorder = Recorder()
    llm = SGLangLLM(model="tiny", max_tokens=1, context_window=8192, router=router, **recorder.clients())
    engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=router)]
    )
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda _: engine.query(QUESTION), range(50)))
    ids = recorder.ids()
    assert len(ids) == 50 and len(set(ids)) == 50
    reported = sum(router.pilot(target).stats().engine_requests for target in router.targets)
    live = {rid for target in router.targets for rid in router.pilot(target).live_request_ids()}
    assert reported == 50 and live == set(ids)


def test_two_pilots_one_llm(index: VectorStoreIndex, llama: LlamaServer) -> None:
    recorder = Recorder()
    llm = sglang(llama, recorder)
    pilots = [ContextPilot(), ContextPilot()]
    engines = [
        index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[ContextPilotPostprocessor(pilot=p)])
        for p in pilots
    ]
    for engine in (engines[0], engines[1], engines[1]):
        engine.query(QUESTION)
    assert [p.stats().engine_requests for p in pilots] == [1, 2]
    assert recorder.ids() == [*pilots[0].live_request_ids(), *pilots[1].live_request_ids()]


def test_wrapped_openai_like_reports_cached_tokens(index: VectorStoreIndex, llama: LlamaServer) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    inner = OpenAILike(
        model="tiny",
        api_base=llama.url + "/v1",
        api_key="x",
        max_tokens=1,
        is_chat_model=True,
        max_retries=0,
        **recorder.clients(),
    )
    llm = ContextPilotLLM(llm=inner, engine="sglang")
    engine = index.as_query_engine(
        llm=llm, similarity_top_k=3, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    )
    engine.query(QUESTION)
    engine.query(QUESTION)
    stats = pilot.stats()
    assert stats.engine_requests == 2 and stats.engine_cached_tokens > 0
    _served_by_each(pilot, 2, recorder)
    streamed = index.as_query_engine(
        llm=llm, similarity_top_k=3, streaming=True, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
    ).query(QUESTION)
    "".join(streamed.response_gen)
    assert pilot.stats().engine_requests == 3  # the stream's usage reported too


def test_an_unbindable_llm_is_named(index: VectorStoreIndex, llama: LlamaServer) -> None:
    plain = OpenAILike(model="tiny", api_base=llama.url + "/v1", api_key="x", max_tokens=1, is_chat_model=True)
    with pytest.warns(ContextPilotBindingWarning, match="OpenAILike"):
        ContextPilotChatEngine.from_defaults(retriever=index.as_retriever(similarity_top_k=2), llm=plain)


def test_our_chat_engine_still_references_only_what_it_sends(index: VectorStoreIndex, llama: LlamaServer) -> None:
    pilot, recorder = ContextPilot(), Recorder()
    engine = ContextPilotChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=3), llm=sglang(llama, recorder), pilot=pilot
    )
    for turn in range(4):
        engine.chat(f"{QUESTION} ({turn})")
    assert recorder.references() > 0 and recorder.dangling() == 0
    assert pilot.stats().engine_requests == 4 and len(set(recorder.ids())) == 4


def test_memory_fits_the_model_context_window(index: VectorStoreIndex, tmp_path: Path) -> None:
    """A 2,048-token model: the stock memory default (30,000 tokens) would overflow by turn 3;
    the history sent is sized to the window, whole turns left out, their documents resent."""
    server = tiny_llama_server(tmp_path, pytest.skip, context=2048)
    try:
        pilot, recorder = ContextPilot(), Recorder()
        llm = sglang(server, recorder, context_window=2048, max_tokens=8)
        engine = ContextPilotChatEngine.from_defaults(
            retriever=index.as_retriever(similarity_top_k=3), llm=llm, pilot=pilot
        )
        for turn in range(10):
            response = engine.chat(f"{QUESTION} Turn {turn}: please answer in detail.")
            assert response.metadata["request_id"]
        assert len(recorder.bodies) == 10 and recorder.dangling() == 0
        assert len(recorder.bodies[-1]["messages"]) < len(engine.chat_history) + 2  # older turns left out
    finally:
        server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_dying_mid_answer_raises_the_cores_error(stream: bool, index: VectorStoreIndex) -> None:
    from contextpilot_integrations.errors import EngineUnavailable
    from contextpilot_integrations.testing.fake_providers import broken_stream_server

    with broken_stream_server() as url:
        pilot = ContextPilot()
        llm = SGLangLLM(model="tiny", api_base=url + "/v1", max_retries=0, context_window=8192)
        engine = index.as_query_engine(
            llm=llm, similarity_top_k=2, streaming=stream, node_postprocessors=[ContextPilotPostprocessor(pilot=pilot)]
        )
        with pytest.raises(EngineUnavailable, match="connection"):
            response = engine.query(QUESTION)
            "".join(response.response_gen) if stream else None
        assert pilot.stats().live_requests == 0  # the failed request is forgotten
