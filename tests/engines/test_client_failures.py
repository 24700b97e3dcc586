"""The client when an answer is not what it should be (issue 11, items 13-16).

``MisbehavingEngine`` is a stand-in, named as such: a stdlib HTTP server on 127.0.0.1 that
answers the way a broken or hostile OpenAI-compatible server might (no real engine can be
made to send these). Cancellation is tested against the real llama-server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines import EngineError, EngineHTTPError, EngineUnavailable, OpenAICompatClient
from tests.engine_support import LlamaServer, serve_quietly, start_llama_server

GOOD_USAGE = b'"usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 4}}'
CHUNK = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
ANSWERS: dict[str, tuple[int, list[bytes], float]] = {  # path -> (status, chunks, delay between chunks)
    "/cut/v1/chat/completions": (200, [CHUNK], 0.0),
    "/error-mid-stream/v1/chat/completions": (200, [CHUNK, b'data: {"error": {"message": "out of memory"}}\n\n'], 0.0),
    "/list/v1/chat/completions": (200, [b"[]"], 0.0),
    "/null-chunk/v1/chat/completions": (200, [CHUNK, b"data: null\n\n", b"data: [DONE]\n\n"], 0.0),
    "/bad-cached/v1/chat/completions": (
        200,
        [
            b'{"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": 5, '
            b'"prompt_tokens_details": {"cached_tokens": "x"}}}'
        ],
        0.0,
    ),
    "/bad-choices/v1/chat/completions": (200, [b'{"choices": "nope", ' + GOOD_USAGE + b"}"], 0.0),
    "/good/v1/chat/completions": (200, [b'{"choices": [{"message": {"content": "ok"}}], ' + GOOD_USAGE + b"}"], 0.0),
    "/huge-error/v1/chat/completions": (500, [b"E" * 65536] * 800, 0.0),  # 50 MB
    "/drip/v1/chat/completions": (200, [b"d"] * 100, 0.5),  # a byte every half second
}


class _Misbehaving(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    sent_bytes: ClassVar[dict[str, int]] = {}

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, chunks, delay = ANSWERS[self.path]
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if len(chunks) > 1 else "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        sent = 0
        try:
            for chunk in chunks:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                sent += len(chunk)
                if delay:
                    time.sleep(delay)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client gave up: what we want
        finally:
            _Misbehaving.sent_bytes[self.path] = sent

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """MisbehavingEngine: a stand-in for a broken server, on 127.0.0.1."""
    with serve_quietly(_Misbehaving) as url:
        yield url


def prepared_in_conversation(pilot: ContextPilot) -> object:
    return pilot.prepare([Block(id="a", text="alpha"), Block(id="b", text="beta")], "q", conversation_id="c")


def assert_forgotten(pilot: ContextPilot) -> None:
    assert pilot.stats().live_requests == 0 and pilot.stats().engine_requests == 0
    again = pilot.prepare([Block(id="a", text="alpha")], "q", conversation_id="c")
    assert [b.id for b in again.blocks] == ["a"]  # the failed turn showed nothing


# ---- 13. a stream cut short or carrying an error is a failure -------------------------------------
@pytest.mark.parametrize(("path", "message"), [("/cut", "before \\[DONE\\]"), ("/error-mid-stream", "out of memory")])
@pytest.mark.parametrize("use_async", [False, True])
def test_streams_that_do_not_finish_raise(engine: str, path: str, message: str, use_async: bool) -> None:
    pilot = ContextPilot()
    prepared = prepared_in_conversation(pilot)
    client = OpenAICompatClient(engine + path, pilot)
    with pytest.raises(EngineError, match=message):
        if use_async:
            asyncio.run(client.achat(prepared))  # type: ignore[arg-type]
        else:
            client.chat(prepared)  # type: ignore[arg-type]
    assert_forgotten(pilot)


# ---- 15. malformed 200 answers ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "stream"), [("/list", False), ("/null-chunk", True), ("/bad-cached", False), ("/bad-choices", False)]
)
def test_malformed_answers_raise_engine_error_and_count_nothing(engine: str, path: str, stream: bool) -> None:
    pilot = ContextPilot()
    prepared = prepared_in_conversation(pilot)
    with pytest.raises(EngineError, match=r"127\.0\.0\.1"):
        OpenAICompatClient(engine + path, pilot).chat(prepared, stream=stream)  # type: ignore[arg-type]
    assert_forgotten(pilot)


def test_a_good_answer_still_counts(engine: str) -> None:
    pilot = ContextPilot()
    result = OpenAICompatClient(engine + "/good", pilot).chat(pilot.prepare(["x"], "q"), stream=False)
    assert (result.text, result.prompt_tokens, result.cached_tokens) == ("ok", 10, 4)
    assert pilot.stats().engine_cached_tokens == 4


# ---- 16. credentials, huge error pages, dripping servers ---------------------------------------------------
def test_credentials_never_appear_in_messages(engine: str) -> None:
    pilot = ContextPilot()
    with_secret = engine.replace("http://", "http://user:hunter2@") + "/huge-error?api-key=sk-secret"
    client = OpenAICompatClient(with_secret.replace("?api-key=sk-secret", ""), pilot)
    with pytest.raises(EngineHTTPError) as info:
        client.chat(pilot.prepare(["x"], "q"))
    assert "hunter2" not in str(info.value) and "user" not in str(info.value)
    unreachable = OpenAICompatClient("http://admin:s3cret@127.0.0.1:1/v1", pilot, timeout=2)
    with pytest.raises(EngineUnavailable) as down:
        unreachable.chat(pilot.prepare(["x"], "q"))
    assert "s3cret" not in str(down.value) and "admin" not in str(down.value)


def test_a_huge_error_body_is_not_read_whole(engine: str) -> None:
    pilot = ContextPilot()
    started = time.monotonic()
    with pytest.raises(EngineHTTPError, match="HTTP 500"):
        OpenAICompatClient(engine + "/huge-error", pilot).chat(pilot.prepare(["x"], "q"))
    assert time.monotonic() - started < 60  # far from the typical case; the bytes sent below are the point
    time.sleep(0.2)
    assert _Misbehaving.sent_bytes["/huge-error/v1/chat/completions"] < 50 * 1024 * 1024


@pytest.mark.parametrize("use_async", [False, True])
def test_a_deadline_bounds_a_dripping_server(engine: str, use_async: bool) -> None:
    pilot = ContextPilot()
    prepared = prepared_in_conversation(pilot)
    client = OpenAICompatClient(engine + "/drip", pilot, timeout=5, deadline=1.5)
    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="timed out"):
        if use_async:
            asyncio.run(client.achat(prepared, stream=False))  # type: ignore[arg-type]
        else:
            client.chat(prepared, stream=False)  # type: ignore[arg-type]
    assert time.monotonic() - started < 25  # the 1.5 s deadline, not the 50 s drip, ended it
    assert_forgotten(pilot)
    with pytest.raises(ValueError):
        OpenAICompatClient(engine, pilot, deadline=0)


# ---- 14. cancellation forgets the request (real llama-server) ----------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(tmp_path_factory.mktemp("llama-cancel"))
    yield server
    server.stop()


def test_cancelling_achat_forgets_the_request(llama: LlamaServer) -> None:
    pilot = ContextPilot()
    long_docs = [Block(id=f"d{i}", text=(f"document {i} " * 200)[:1_500]) for i in range(4)]  # 6k tokens: slow on CPU
    prepared = pilot.prepare(long_docs, "q", conversation_id="c")
    client = OpenAICompatClient(llama.url, pilot)

    async def run() -> None:
        await asyncio.wait_for(client.achat(prepared, max_tokens=200), 0.05)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(run())
    assert pilot.stats().live_requests == 0
    again = pilot.prepare(long_docs[:1], "q", conversation_id="c")
    assert [b.id for b in again.blocks] == ["d0"] and again.references == ()


@pytest.mark.parametrize("setting", ["deadline", "timeout", "api_key", "extra_body"])
def test_a_client_setting_given_to_a_call_is_refused_before_anything_is_sent(setting: str) -> None:
    """Keyword arguments of a call are body fields; the client's own settings there would
    be sent to the engine: refused (no connection is tried: the URL is unreachable)."""
    pilot = ContextPilot()
    prepared = pilot.prepare([Block(id="a", text="alpha beta")], "q")
    with OpenAICompatClient("http://127.0.0.1:9", pilot) as client:
        with pytest.raises(TypeError, match=f"{setting}: a setting of OpenAICompatClient"):
            client.chat(prepared, **{setting: 2})
        with pytest.raises(TypeError, match=setting):
            asyncio.run(client.achat(prepared, **{setting: 2}))
        with pytest.raises(TypeError, match=setting):
            client.send_messages([{"role": "user", "content": "q"}], **{setting: 2})
    assert pilot.live_request_ids() == [prepared.request_id]  # the call that raised changed nothing
