"""``deadline=`` bounds a whole call, sync and async (issue 31, item 6), and answers the
client cannot read are the library's errors (item 9).

``DrippingEngine`` is a stand-in, named as such: a stdlib HTTP server on 127.0.0.1 that
answers the way a slow or hostile server might (a header byte every half second, an error
page dripping its body, a ``/tokenize`` that drips after a good answer, a 5,000-digit
count, one 30 MB stream line). No real engine can be made to do these on cue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines import (
    EngineError,
    EngineTimeout,
    OpenAICompatClient,
    Router,
    RoutingClient,
    Target,
)
from contextpilot_integrations.engines.sink import KvEventSink
from tests.engine_support import serve_quietly

DRIP_S = 0.5
DRIP_FOR_S = 12.0  # long enough that a call the deadline does not end is caught
SLACK_S = 10.0
"""Far from the typical case (a loaded machine), and well under the 30 s timeouts a
deadline must beat: these tests check which bound ended a call, not how fast the machine is."""
ANSWER = {
    "id": "x",
    "choices": [{"message": {"content": "ok"}}],
    "usage": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
    "sglext": {"input_ids": list(range(40))},
}


class _Dripping(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = self.path.split("/v1/")[0] if "/v1/" in self.path else self.path.rsplit("/", 1)[0]
        try:
            if self.path.endswith("/tokenize"):
                self._drip_headers() if path == "/slow-tokenize" else self._json(200, {"tokens": [[1, 2]]})
            elif path == "/headers":
                self._drip_headers()
            elif path == "/error":
                self._drip_body(500)
            elif path == "/body":
                self._drip_body(200)
            elif path == "/huge-int":
                self._raw(200, b'{"choices": [], "usage": {"prompt_tokens": ' + b"9" * 5000 + b"}}")
            elif path == "/deep":
                self._raw(200, b"[" * 100_000 + b"]" * 100_000)
            elif path == "/long-line":
                line = b'data: {"choices": [{"delta": {"content": "' + b"x" * (30 * 1024 * 1024) + b'"}}]}\n\n'
                self._raw(200, line + b"data: [DONE]\n\n", "text/event-stream")
            elif path == "/cached-only":
                self._json(200, {"choices": [{"message": {"content": "ok"}}],
                                 "usage": {"prompt_tokens_details": {"cached_tokens": 10_000_000}}})  # fmt: skip
            else:  # "/good", "/slow-tokenize": a good answer (then the tokenizer drips)
                self._json(200, ANSWER)
        except OSError:
            pass  # the client gave up: what we want

    def _drip_headers(self) -> None:
        self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Drip: ")
        self._drip()

    def _drip_body(self, status: int) -> None:
        self.wfile.write(
            b"HTTP/1.1 %d Whatever\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" % status
        )
        self._drip()

    def _drip(self) -> None:
        ends = time.monotonic() + DRIP_FOR_S
        while time.monotonic() < ends:
            self.wfile.write(b"a")
            self.wfile.flush()
            time.sleep(DRIP_S)

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        self._raw(status, json.dumps(payload).encode())

    def _raw(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """DrippingEngine: a stand-in for a slow or hostile server, on 127.0.0.1."""
    with serve_quietly(_Dripping) as url:
        yield url


DOCS = [Block(id="a", text="alpha " * 30), Block(id="b", text="beta " * 30)]


def timed(call: Callable[[], Any]) -> tuple[float, BaseException | Any]:
    started = time.monotonic()
    try:
        outcome: Any = call()
    except Exception as exc:
        outcome = exc
    return time.monotonic() - started, outcome


def run(client: OpenAICompatClient, prepared: Any, use_async: bool, stream: bool) -> Any:
    if use_async:
        return asyncio.run(client.achat(prepared, stream=stream))
    return client.chat(prepared, stream=stream)


# ---- 6. the deadline bounds the whole call -------------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize(
    ("path", "stream"), [("/headers", True), ("/headers", False), ("/error", False), ("/body", True)]
)
def test_the_deadline_bounds_a_server_dripping_headers_or_an_error_page(
    engine: str, path: str, stream: bool, use_async: bool
) -> None:
    pilot = ContextPilot()
    with OpenAICompatClient(engine + path, pilot, timeout=30, deadline=2) as client:
        seconds, outcome = timed(lambda: run(client, pilot.prepare(DOCS, "q"), use_async, stream))
    assert isinstance(outcome, EngineTimeout), outcome
    assert "deadline" in str(outcome) or "timed out" in str(outcome)
    assert seconds < 2 + SLACK_S, f"held {seconds:.1f} s with deadline=2"
    assert pilot.stats().live_requests == 0  # forgotten: the engine may not hold it


@pytest.mark.parametrize("use_async", [False, True])
def test_a_dripping_tokenize_after_the_answer_stays_within_the_deadline(engine: str, use_async: bool) -> None:
    """SGLang with a listener: the answer is served, then ``/tokenize`` (where each block ends)
    drips. The call returns the served answer, without block ends, within the deadline."""
    pilot = ContextPilot()
    sink = KvEventSink(pilot)
    with OpenAICompatClient(engine + "/slow-tokenize", pilot, timeout=30, deadline=2, listener=sink) as client:
        seconds, outcome = timed(lambda: run(client, pilot.prepare(DOCS, "q"), use_async, False))
    assert not isinstance(outcome, BaseException), outcome
    assert outcome.text == "ok" and outcome.prompt_token_ids and outcome.block_ends is None
    assert seconds < 2 + SLACK_S, f"held {seconds:.1f} s with deadline=2"


def test_without_a_deadline_the_tokenizer_is_bounded_by_its_own_timeout(engine: str) -> None:
    pilot = ContextPilot()
    sink = KvEventSink(pilot)
    with OpenAICompatClient(engine + "/slow-tokenize", pilot, timeout=30, listener=sink) as client:
        client.block_tokenizer.timeout = 1.5
        seconds, outcome = timed(lambda: client.chat(pilot.prepare(DOCS, "q"), stream=False))
    assert outcome.text == "ok" and outcome.block_ends is None
    assert seconds < 1.5 + SLACK_S, f"held {seconds:.1f} s with a 1.5 s tokenizer timeout"


@pytest.mark.parametrize("use_async", [False, True])
def test_the_routing_client_deadline_bounds_the_whole_call(engine: str, use_async: bool) -> None:
    router = Router([Target("drip", engine + "/headers")])
    with RoutingClient(router, timeout=30, deadline=1.5) as client:

        def call() -> Any:
            if use_async:
                return asyncio.run(client.achat(DOCS, "q"))
            return client.chat(DOCS, "q")

        seconds, outcome = timed(call)
    assert isinstance(outcome, EngineTimeout), outcome
    assert seconds < 1.5 + SLACK_S, f"held {seconds:.1f} s with deadline=1.5"
    assert not router.is_down("drip") and router.loads() == {"drip": 0}  # slow, not down


def test_an_outer_deadline_is_shared_by_the_calls_within_it(engine: str) -> None:
    """Two sends under one routing deadline: the second gets only what the first left."""
    from contextpilot_integrations.engines.deadline import deadline

    pilot = ContextPilot()
    with OpenAICompatClient(engine + "/headers", pilot, timeout=30, deadline=25) as client, deadline(1.0):
        seconds, outcome = timed(lambda: client.chat(pilot.prepare(DOCS, "q")))
    assert isinstance(outcome, EngineTimeout) and seconds < 1.0 + SLACK_S


# ---- 9. answers the client cannot read --------------------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize(("path", "stream"), [("/huge-int", False), ("/deep", False)])
def test_unreadable_numbers_and_nesting_are_engine_errors(
    engine: str, path: str, stream: bool, use_async: bool
) -> None:
    pilot = ContextPilot()
    with OpenAICompatClient(engine + path, pilot) as client, pytest.raises(EngineError, match="malformed JSON"):
        run(client, pilot.prepare(DOCS, "q"), use_async, stream)
    assert pilot.stats().live_requests == 0


@pytest.mark.parametrize("use_async", [False, True])
def test_one_huge_stream_line_is_refused_in_linear_time(engine: str, use_async: bool) -> None:
    pilot = ContextPilot()
    with OpenAICompatClient(engine + "/long-line", pilot) as client:
        started = time.process_time()
        with pytest.raises(EngineError, match="stream line longer than"):
            run(client, pilot.prepare(DOCS, "q"), use_async, True)
        cpu = time.process_time() - started
    assert cpu < 1.5, f"{cpu:.1f} s of CPU for one 30 MB line"
    assert pilot.stats().live_requests == 0


def test_cached_tokens_without_prompt_tokens_are_not_counted(engine: str, caplog: pytest.LogCaptureFixture) -> None:
    pilot = ContextPilot()
    with OpenAICompatClient(engine + "/good", pilot) as good:  # 10 prompt tokens, none cached
        good.chat(pilot.prepare(DOCS, "q"), stream=False)
    with OpenAICompatClient(engine + "/cached-only", pilot) as client, caplog.at_level(logging.WARNING):
        served = client.chat(pilot.prepare(DOCS, "q"), stream=False)
    assert served.text == "ok"  # the answer is fine; its accounting is not
    stats = pilot.stats()
    assert 0.0 <= stats.engine_hit_ratio <= 1.0, stats.engine_hit_ratio  # it was 1,000,000
    assert (stats.engine_prompt_tokens, stats.engine_cached_tokens) == (10, 0)
    assert "without prompt_tokens" in caplog.text
