"""An index that knows its engine (issue 41, part 3): given an engine, the pilot reads its page,
KV pool and tokenizer from it once, fills only what its user left unset, and weighs with them;
an engine that does not say (or is slow, or gone) leaves the estimates, logged once, and the
user's call goes on.

Against a real llama-server (``/props``, ``/tokenize``); SGLang and vLLM live in
``tests/live/test_live_engine_info.py``. The stand-ins here are named as such: stdlib HTTP
servers on 127.0.0.1 that answer what a real server cannot be made to on cue (nothing about
its cache, a drip, SGLang's and vLLM's answers without the engines).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, ClassVar

import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.gain import estimate_tokens
from contextpilot_integrations.engines import OpenAICompatClient, Router, RoutingClient, Target, engine_info
from contextpilot_integrations.engines.engine_info import (
    DISCOVER_ENV,
    EngineInfo,
    aread_engine_info,
    learn_engine,
    read_engine_info,
)
from contextpilot_integrations.engines.tokens import EngineTokenCounter, TokenizeEndpoint
from contextpilot_integrations.testing.llama_server import LlamaServer
from tests.engine_support import free_port, serve_quietly, start_llama_server

LOGGER = "contextpilot_integrations.engines.engine_info"
DOCS = [Block(id=f"d{n}", text=f"Document {n}: " + "amber harbour stone " * 6) for n in range(3)]
ANSWER = {
    "id": "x",
    "choices": [{"message": {"content": "ok"}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(Path(tmp_path_factory.mktemp("llama-engine-info")))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def discovery_on_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DISCOVER_ENV, raising=False)


def engine_tokens(llama: LlamaServer, text: str) -> int:
    """The server's own count, asked directly (llama-server's body)."""
    with TokenizeEndpoint(llama.url) as endpoint:
        return len(endpoint.text(text))


# ---- a real llama-server ------------------------------------------------------------------------
def test_llama_server_says_its_page_pool_and_tokenizer(llama: LlamaServer) -> None:
    named = read_engine_info(llama.url + "/v1", "llamacpp")
    found = read_engine_info(llama.url)  # not named: every engine's endpoints in turn
    asked = asyncio.run(aread_engine_info(llama.url, "llamacpp"))
    for info in (named, found, asked):
        assert (info.kind, info.page_tokens, info.cache_tokens) == ("llamacpp", 1, 8192)  # -c 8192, one slot
        assert info.source["page_tokens"].startswith("GET /props")
        assert "n_ctx x total_slots" in info.source["cache_tokens"]
        assert info.source["tokenizer"] == "POST /tokenize {content}"
        assert isinstance(info.tokenizer, EngineTokenCounter)
        assert info.tokenizer("amber harbour") == engine_tokens(llama, "amber harbour")


def test_a_pilot_given_the_engine_weighs_with_its_tokens(llama: LlamaServer) -> None:
    pilot = ContextPilot()
    assert pilot.page_tokens is None and pilot.token_counter is estimate_tokens
    estimated = pilot.prepare(DOCS, "Which document mentions a harbour?")
    with OpenAICompatClient(llama.url, pilot, model="tiny", engine="llamacpp") as client:
        client.chat(estimated, max_tokens=2, stream=False)  # the first request reads the engine
        assert (pilot.page_tokens, pilot.cache_tokens) == (1, 8192)
        assert isinstance(pilot.token_counter, EngineTokenCounter)
        weighed = pilot.prepare([Block(id="new", text="A new document about the amber harbour.")], "Which one?")
        client.chat(weighed, max_tokens=2, stream=False)
    # a block without a count is counted by the engine now, not at four characters a token
    (block,) = weighed.blocks
    assert block.token_count == engine_tokens(llama, block.text) != estimate_tokens(block.text)
    assert estimated.blocks[0].token_count == estimate_tokens(estimated.blocks[0].text)


def test_only_what_the_user_left_unset_is_filled(llama: LlamaServer) -> None:
    def mine(text: str) -> int:
        return len(text)

    full = ContextPilot(page_tokens=4, cache_tokens=100_000, token_counter=mine)
    with OpenAICompatClient(llama.url, full, engine="llamacpp") as client:
        assert client.learn_engine() is None  # nothing to learn: nothing asked
    assert (full.page_tokens, full.cache_tokens, full.token_counter) == (4, 100_000, mine)
    partly = ContextPilot(page_tokens=4)
    with OpenAICompatClient(llama.url, partly, engine="llamacpp") as client:
        info = client.learn_engine()
    assert info is not None and info.page_tokens == 1
    assert partly.page_tokens == 4 and partly.cache_tokens == 8192
    assert isinstance(partly.token_counter, EngineTokenCounter)


def test_discovery_can_be_turned_off(llama: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def untouched(pilot: ContextPilot) -> bool:
        return pilot.page_tokens is None and pilot.cache_tokens is None and pilot.token_counter is estimate_tokens

    pilot = ContextPilot()
    with OpenAICompatClient(llama.url, pilot, engine="llamacpp", discover=False) as client:
        client.chat(pilot.prepare(DOCS, "Which one?"), max_tokens=2, stream=False)
        assert client.learn_engine() is None
    assert untouched(pilot)
    hosted = ContextPilot()  # an OpenAI-compatible hosted API says nothing of its cache: not asked ...
    with OpenAICompatClient(llama.url, hosted, engine="openai") as client:
        client.chat(hosted.prepare(DOCS, "Which one?"), max_tokens=2, stream=False)
    assert untouched(hosted)
    with OpenAICompatClient(llama.url, hosted, engine="openai", discover=True) as client:  # ... unless told to
        assert client.learn_engine() is not None and hosted.page_tokens == 1
    monkeypatch.setenv(DISCOVER_ENV, "0")
    quiet = ContextPilot()
    with OpenAICompatClient(llama.url, quiet, engine="llamacpp") as client:
        client.chat(quiet.prepare(DOCS, "Which one?"), max_tokens=2, stream=False)
    assert untouched(quiet)
    with OpenAICompatClient(llama.url, quiet, engine="llamacpp", discover=True) as client:  # the call's word wins
        assert client.learn_engine() is not None and quiet.page_tokens == 1
    with (
        pytest.raises(TypeError, match="discover"),  # a setting of the client, never a body field
        OpenAICompatClient(llama.url, ContextPilot(), engine="llamacpp") as client,
    ):
        client.chat(quiet.prepare(DOCS, "Which one?"), discover=False)


def test_the_engine_is_read_once_per_pilot(llama: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = engine_info.read_engine_info

    def counted(url: str, *args: Any, **kwargs: Any) -> EngineInfo:
        reads.append(url)
        return real(url, *args, **kwargs)

    monkeypatch.setattr(engine_info, "read_engine_info", counted)
    pilot = ContextPilot()
    with OpenAICompatClient(llama.url, pilot, engine="llamacpp") as client:
        for n in range(3):
            client.chat(pilot.prepare(DOCS, f"question {n}"), max_tokens=2, stream=False)
    with OpenAICompatClient(llama.url + "/v1/", pilot, engine="llamacpp") as again:  # the same engine
        again.chat(pilot.prepare(DOCS, "question 3"), max_tokens=2, stream=False)
    assert reads == [llama.url]
    other = ContextPilot()  # another pilot reads for itself
    with OpenAICompatClient(llama.url, other, engine="llamacpp") as client:
        client.chat(other.prepare(DOCS, "question"), max_tokens=2, stream=False)
    assert reads == [llama.url, llama.url] and other.page_tokens == 1


def test_threads_and_tasks_at_once_read_the_engine_once(llama: LlamaServer, monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    real = engine_info.read_engine_info
    real_async = engine_info.aread_engine_info

    def counted(url: str, *args: Any, **kwargs: Any) -> EngineInfo:
        reads.append(url)
        return real(url, *args, **kwargs)

    async def acounted(url: str, *args: Any, **kwargs: Any) -> EngineInfo:
        reads.append(url)
        return await real_async(url, *args, **kwargs)

    monkeypatch.setattr(engine_info, "read_engine_info", counted)
    monkeypatch.setattr(engine_info, "aread_engine_info", acounted)
    pilot = ContextPilot()
    with OpenAICompatClient(llama.url, pilot, engine="llamacpp") as client:
        barrier = threading.Barrier(9)
        found: list[EngineInfo | None] = []

        def learn() -> None:
            barrier.wait()
            found.append(client.learn_engine())

        async def tasks() -> list[EngineInfo | None]:
            barrier.wait()
            return list(await asyncio.gather(*(client.alearn_engine() for _ in range(4))))

        threads = [threading.Thread(target=learn) for _ in range(8)]
        for thread in threads:
            thread.start()
        found += asyncio.run(tasks())
        for thread in threads:
            thread.join(30)
    assert len(reads) == 1 and sum(info is not None for info in found) == 1
    assert learned(pilot)


def test_a_routing_client_gives_each_target_its_engine(llama: LlamaServer) -> None:
    router = Router([Target("a", llama.url, engine="llamacpp"), Target("b", llama.url, engine="llamacpp")])
    with RoutingClient(router, model="tiny") as routing:
        served = routing.chat(DOCS, "Which document mentions a harbour?", max_tokens=2, stream=False)
        assert router.pilot(served.target).page_tokens == 1
        for target in router.targets:  # the other target's pilot reads its engine before its first request
            routing.client(target).learn_engine()
            assert isinstance(router.pilot(target).token_counter, EngineTokenCounter)
    off = Router([Target("a", llama.url, engine="llamacpp")])
    with RoutingClient(off, discover=False) as routing:
        routing.chat(DOCS, "Which one?", max_tokens=2, stream=False)
    assert off.pilot("a").page_tokens is None


# ---- engines that do not say ----------------------------------------------------------------------
class _Mute(BaseHTTPRequestHandler):
    """A stand-in for an OpenAI-compatible server that says nothing of its cache: every other
    path answers 404; chat completions are served."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path.endswith("/chat/completions"):
            self._send(200, ANSWER)
        else:
            self._send(404, {"detail": "Not Found"})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_engine_that_does_not_say_leaves_the_estimates_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with serve_quietly(_Mute) as url:
        for _ in range(2):  # two pilots: each reads, the log says it once
            pilot = ContextPilot()
            with OpenAICompatClient(url, pilot, engine="sglang") as client:
                served = client.chat(pilot.prepare(DOCS, "Which one?"), max_tokens=2, stream=False)
            assert served.text == "ok"  # the user's call went on
            assert pilot.page_tokens is None and pilot.cache_tokens is None
            assert pilot.token_counter is estimate_tokens
        info = read_engine_info(url, "sglang")
    assert (info.kind, info.page_tokens, info.cache_tokens, info.tokenizer) == ("unknown", None, None, None)
    assert "GET /server_info: 404" in info.source["page_tokens"] and "GET /props: 404" in info.source["page_tokens"]
    assert info.source["tokenizer"] == "not asked: the server did not say which engine it is"
    told = [record for record in caplog.records if record.name == LOGGER and record.levelno == logging.INFO]
    assert len(told) == 1, [record.getMessage() for record in told]
    message = told[0].getMessage()
    assert "does not say its page size, KV pool, tokenizer" in message and DISCOVER_ENV in message


def test_an_unreachable_engine_is_asked_again_later(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pilot = ContextPilot()
    info = learn_engine(pilot, url, engine="vllm")
    assert info is not None and info.kind == "unreachable" and info.tokenizer is None
    assert info.source["page_tokens"] == "not said: the engine did not answer"
    assert learn_engine(pilot, url, engine="vllm") is None  # not again at once ...
    monkeypatch.setattr(engine_info, "RETRY_UNREACHABLE_S", 0.0)
    engine_info.forget_engines(pilot)
    assert learn_engine(pilot, url, engine="vllm") is not None  # ... but later
    assert learn_engine(pilot, url, engine="vllm") is not None
    told = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert len(told) == 1 and "could not be reached" in told[0]


class _Dripping(BaseHTTPRequestHandler):
    """A stand-in for a server too slow to say anything: every GET drips its headers, a byte
    every half second; chat completions are served at once."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        try:
            self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
            ends = time.monotonic() + 12.0
            while time.monotonic() < ends:
                self.wfile.write(b"a")
                self.wfile.flush()
                time.sleep(0.5)
        except OSError:
            pass  # the client gave up: what we want

    do_POST = _Mute.do_POST
    _send = _Mute._send

    def log_message(self, *args: object) -> None:
        pass


def test_a_slow_engine_costs_the_first_call_at_most_the_discovery_timeout() -> None:
    with serve_quietly(_Dripping) as url:
        started = time.monotonic()
        info = read_engine_info(url, "sglang", timeout=1.0)
        assert time.monotonic() - started < 1.0 + 5.0  # slack for a loaded machine
        assert info.kind == "unreachable" and info.page_tokens is None
        pilot = ContextPilot()
        with OpenAICompatClient(url, pilot, engine="sglang") as client:
            started = time.monotonic()
            served = client.chat(pilot.prepare(DOCS, "Which one?"), max_tokens=2, stream=False)
            took = time.monotonic() - started
        assert served.text == "ok" and took < engine_info.DISCOVERY_TIMEOUT + 5.0
        assert served.total_s < 5.0  # its own timing starts when it is sent
        assert pilot.page_tokens is None


def test_the_learned_tokenizer_estimates_when_the_engine_stops_answering(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="contextpilot_integrations.engines.tokens")
    counter = EngineTokenCounter(f"http://127.0.0.1:{free_port()}", fallback=estimate_tokens, quiet_s=60.0)
    text = "amber harbour " * 10
    assert counter(text) == estimate_tokens(text)
    started = time.monotonic()
    assert [counter(text + str(n)) for n in range(50)] == [estimate_tokens(text + str(n)) for n in range(50)]
    assert time.monotonic() - started < 1.0  # not asked again meanwhile
    told = [r for r in caplog.records if r.name == "contextpilot_integrations.engines.tokens"]
    assert len(told) == 1 and "counting with the estimate" in told[0].getMessage()
    pilot = ContextPilot(token_counter=counter)  # a pilot with it prepares on, in estimates
    assert pilot.prepare(DOCS, "Which one?").blocks[0].token_count == estimate_tokens(DOCS[0].text)
    counter.close()


# ---- what SGLang and vLLM answer, without the engines ------------------------------------------------
SGLANG_SERVER_INFO = {  # a subset of SGLang 0.5.23's GET /server_info (tests/live reads the real one)
    "model_path": "tiny-llama",
    "served_model_name": "tiny",
    "page_size": 16,
    "max_total_tokens": 2048,
    "max_total_num_tokens": 2048,
    "context_length": 1536,
    "internal_states": [{"last_gen_throughput": 0.0}],
    "version": "0.5.23",
}
VLLM_METRICS = "\n".join(  # vLLM 0.32's cache_config_info gauge, one line per engine of a data-parallel server
    [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        'vllm:cache_config_info{block_size="32",cache_hit_alignment_tokens="None",engine="0",'
        'kv_cache_size_tokens="1920",num_gpu_blocks="60",prefix_caching_hash_algo="sha256"} 1.0',
        'vllm:cache_config_info{block_size="32",cache_hit_alignment_tokens="None",engine="1",'
        'kv_cache_size_tokens="4096",num_gpu_blocks="128",prefix_caching_hash_algo="sha256"} 1.0',
        "vllm:num_requests_running 0.0",
    ]
)


def stand_in(gets: dict[str, tuple[str, bytes]], model: str | None = None) -> type[BaseHTTPRequestHandler]:
    """A stand-in answering ``gets`` (path -> content type, body) and an OpenAI-style
    ``/tokenize`` (one token a character; ``model``: the only model it serves)."""

    class _StandIn(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        seen: ClassVar[list[str]] = []

        def do_GET(self) -> None:
            self.seen.append(f"GET {self.path}")
            kind, body = gets.get(self.path, ("application/json", b'{"detail": "Not Found"}'))
            self._raw(200 if self.path in gets else 404, kind, body)

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            self.seen.append(f"POST {self.path} {payload.get('model')}")
            if self.path == "/tokenize" and "prompt" in payload and model in (None, payload.get("model")):
                body = json.dumps({"tokens": [ord(c) for c in payload["prompt"]]}).encode()
                self._raw(200, "application/json", body)
            else:
                self._raw(404, "application/json", b'{"detail": "Not Found"}')

        def _raw(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return _StandIn


@pytest.mark.parametrize("use_async", [False, True])
def test_what_sglang_and_vllm_answer_is_read(use_async: bool) -> None:
    def read(url: str, engine: str | None, model: str = "default") -> EngineInfo:
        if use_async:
            return asyncio.run(aread_engine_info(url, engine, model=model))
        return read_engine_info(url, engine, model=model)

    sglang = stand_in({"/server_info": ("application/json", json.dumps(SGLANG_SERVER_INFO).encode())})
    with serve_quietly(sglang) as url:
        info = read(url, "sglang")
        assert info.tokenizer is not None and info.tokenizer.text("abc") == (97, 98, 99)
    assert (info.kind, info.page_tokens, info.cache_tokens) == ("sglang", 16, 2048)
    assert info.source["page_tokens"] == "GET /server_info: page_size"
    assert info.source["cache_tokens"] == "GET /server_info: max_total_num_tokens"
    assert sglang.seen[0] == "GET /server_info"  # the named engine's endpoint first
    vllm = stand_in({"/metrics": ("text/plain", VLLM_METRICS.encode())}, model="tiny")
    with serve_quietly(vllm) as url:
        info = read(url, None, model="tiny")  # not named: found after SGLang's endpoints 404
        wrong_model = read(url, "vllm")  # vLLM refuses a model it does not serve: no tokenizer
    # the coarsest page; the smallest pool, one block of it vLLM's null block
    assert (info.kind, info.page_tokens, info.cache_tokens) == ("vllm", 32, min(1920, 59 * 32))
    assert info.source["page_tokens"] == "GET /metrics: vllm:cache_config_info block_size"
    assert info.tokenizer is not None and wrong_model.tokenizer is None
    assert wrong_model.page_tokens == 32 and "answered no tokens" in wrong_model.source["tokenizer"]
    assert vllm.seen[:3] == ["GET /server_info", "GET /get_server_info", "GET /metrics"]


@pytest.mark.parametrize(
    "metrics",
    [
        'vllm:cache_config_info{block_size="0",num_gpu_blocks="60"} 1.0',
        'vllm:cache_config_info{block_size="99999999999999999999999999",num_gpu_blocks="60"} 1.0',
        'vllm:cache_config_info{block_size="true"} 1.0',
        "vllm:cache_config_info 1.0",
        "x" * 10,
    ],
)
def test_what_an_engine_cannot_mean_is_not_taken(metrics: str) -> None:
    odd = stand_in({"/metrics": ("text/plain", metrics.encode()), "/server_info": ("application/json", b"[" * 5000)})
    with serve_quietly(odd) as url:
        info = read_engine_info(url, "vllm")
    assert info.page_tokens is None and info.cache_tokens is None
    assert info.kind == ("vllm" if metrics.startswith("vllm:") else "unknown")  # its metrics say which it is


# ---- the adapters' engine= ---------------------------------------------------------------------------
def settled(pilot: ContextPilot, check: Callable[[ContextPilot], bool], seconds: float = 20.0) -> bool:
    """Whether ``check(pilot)`` holds within ``seconds`` (the adapters read on a thread of their own)."""
    ends = time.monotonic() + seconds
    while not check(pilot):
        if time.monotonic() > ends:
            return False
        time.sleep(0.05)
    return True


def learned(pilot: ContextPilot) -> bool:
    return pilot.page_tokens == 1 and isinstance(pilot.token_counter, EngineTokenCounter)


@pytest.mark.parametrize("discover", [None, False])
def test_langchain_chat_models_read_their_engine(llama: LlamaServer, discover: bool | None) -> None:
    pytest.importorskip("langchain_contextpilot")
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda

    from langchain_contextpilot import ChatSGLang, contextpilot_reorder, format_documents

    pilot = ContextPilot()
    docs = [Document(page_content=block.text, metadata={"id": block.id}) for block in DOCS]
    llm = ChatSGLang(model="tiny", base_url=llama.url + "/v1", max_tokens=2, discover=discover)
    prompt = ChatPromptTemplate.from_messages([("user", "{context}\n\nQuestion: {question}")])
    chain = (
        {
            "context": RunnableLambda(lambda _: docs) | contextpilot_reorder(pilot) | RunnableLambda(format_documents),
            "question": RunnableLambda(lambda q: q),
        }
        | prompt
        | llm
    )
    chain.invoke("Which document mentions a harbour?")
    if discover is None:
        assert settled(pilot, learned)  # engine="sglang" by default: found to be a llama-server
    else:
        time.sleep(0.5)
        assert pilot.page_tokens is None and pilot.token_counter is estimate_tokens


@pytest.mark.parametrize("discover", [None, False])
def test_llama_index_llms_read_their_engine(llama: LlamaServer, discover: bool | None) -> None:
    pytest.importorskip("llama_index.postprocessor.contextpilot")
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    from llama_index.postprocessor.contextpilot import ContextPilotChatEngine, SGLangLLM

    index = VectorStoreIndex(
        [TextNode(id_=block.id, text=block.text) for block in DOCS], embed_model=MockEmbedding(embed_dim=8)
    )
    pilot = ContextPilot()
    llm = SGLangLLM(
        model="tiny",
        api_base=llama.url + "/v1",
        max_tokens=2,
        context_window=8192,
        engine="llamacpp",
        discover=discover,
    )
    engine = ContextPilotChatEngine.from_defaults(
        retriever=index.as_retriever(similarity_top_k=2), llm=llm, pilot=pilot
    )
    engine.chat("Which document mentions a harbour?")
    if discover is None:
        assert settled(pilot, learned)
    else:
        time.sleep(0.5)
        assert pilot.page_tokens is None and pilot.token_counter is estimate_tokens


def test_reading_never_holds_the_pilots_lock(llama: LlamaServer) -> None:
    """The pilot prepares while its engine is being read (the reading takes its lock only to
    set what it found)."""
    pilot = ContextPilot()
    started = threading.Event()
    real = engine_info.read_engine_info

    def slow(*args: Any, **kwargs: Any) -> EngineInfo:
        started.set()
        time.sleep(1.0)
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_info, "read_engine_info", slow)
        thread = engine_info.learn_engine_in_background(pilot, llama.url, engine="llamacpp")
        assert thread is not None and started.wait(10)
        begun = time.monotonic()
        pilot.prepare(DOCS, "Meanwhile?")
        assert time.monotonic() - begun < 0.5
        thread.join(20)
    assert learned(pilot)
