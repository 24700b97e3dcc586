"""Token counts from outside are checked before they count (issue 20, item 13).

An engine that reports ``true``, 10**30 or more cached than prompt tokens must not put a
hit ratio above 100% (or a thousand-digit number) into the statistics; the pilot refuses
such a report whole, while a user's LLM call that succeeded still succeeds.

``UsageEngine`` is a stand-in, named as such: a stdlib HTTP server on 127.0.0.1 that
answers with the usage a broken OpenAI-compatible server might send (no real engine can
be made to).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot, InvalidBlockError
from contextpilot_integrations.core.usage import MAX_TOKENS
from contextpilot_integrations.engines import EngineError, OpenAICompatClient
from contextpilot_integrations.engines.feedback import report_served
from contextpilot_integrations.whatif.cli import main

BAD_USAGE = [
    (10**30, 0),
    (True, 0),
    (10, True),
    (10.0, 0),
    (-1, 0),
    (MAX_TOKENS + 1, 0),
    (10, 11),  # more cached than prompt: a hit ratio above 100%
]


@pytest.mark.parametrize(("prompt", "cached"), BAD_USAGE)
def test_record_usage_refuses_nonsense_and_records_nothing(prompt: object, cached: object) -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare(["a"], "q", conversation_id="c")
    with pytest.raises((TypeError, ValueError)):
        pilot.record_usage(prepared, prompt, cached)  # type: ignore[arg-type]
    stats = pilot.stats()
    assert (stats.engine_requests, stats.engine_prompt_tokens, stats.engine_cached_tokens) == (0, 0, 0)
    assert pilot.conversation_usage("c") == (0, 0, 0)
    pilot.record_usage(prepared, MAX_TOKENS, MAX_TOKENS)  # the bound itself is a count
    assert pilot.stats().engine_hit_ratio == 1.0


counts = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**40), st.floats(allow_nan=True))


@settings(max_examples=200, deadline=None)
@given(reports=st.lists(st.tuples(counts, counts), max_size=8))
def test_recorded_usage_is_always_a_ratio_of_whole_counts(reports: list[tuple[object, object]]) -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare(["a"], "q")
    accepted = 0
    for prompt, cached in reports:
        before = pilot.stats()
        try:
            pilot.record_usage(prepared, prompt, cached)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            assert pilot.stats() == before  # nothing recorded
            continue
        accepted += 1
        for value in (prompt, cached):
            assert value is None or (type(value) is int and 0 <= value <= MAX_TOKENS)
        assert prompt is None or cached is None or cached <= prompt  # type: ignore[operator]
    stats = pilot.stats()
    assert stats.engine_requests == accepted and type(stats.engine_prompt_tokens) is int


def test_report_served_skips_a_bad_report_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A framework adapter's successful call must not fail because its engine's counts are wrong."""
    pilot = ContextPilot("retrieval")
    pilot.prepare([Block(id="a", text="alpha", tokens=10)], "q")
    prepared = pilot.prepare([Block(id="a", text="alpha", tokens=10), Block(id="b", text="beta", tokens=10)], "q")
    assert prepared.cached_blocks == 1
    caplog.set_level(logging.DEBUG, logger="contextpilot_integrations.engines.feedback")
    for prompt, cached in BAD_USAGE:
        assert report_served(pilot, prepared, prompt, cached) == 0  # type: ignore[arg-type]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not reported to the pilot" in warnings[0].getMessage()
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == len(BAD_USAGE) - 1
    stats = pilot.stats()
    assert stats.engine_requests == 0 and stats.feedback_shortened == 0
    assert pilot.predicted_cached_blocks(["a", "b"]) == 2  # no feedback from a bad report
    report_served(pilot, prepared, 30, 10)  # a good one still counts
    assert pilot.stats().engine_requests == 1
    other = ContextPilot()  # another pilot's first bad report is a warning again
    report_served(other, other.prepare(["x"], "q"), 1, 2)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_a_block_cannot_count_more_tokens_than_a_prompt() -> None:
    assert Block(id="a", text="x", tokens=MAX_TOKENS).token_count == MAX_TOKENS
    for tokens in (MAX_TOKENS + 1, 10**30, True, 1.0):
        with pytest.raises(InvalidBlockError, match="tokens"):
            Block(id="a", text="x", tokens=tokens)


# ---- a served call through the client and the engine comparison ----------------------------------------
ANSWERS = {  # path prefix -> usage the stand-in reports
    "/over": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 11}},
    "/huge": {"prompt_tokens": 10**30, "completion_tokens": 1},
    "/bool": {"prompt_tokens": 10, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": True}},
}


class _UsageEngine(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        usage = ANSWERS["/" + self.path.split("/")[1]]
        if self.path.endswith("/flush_cache"):
            body = b"{}"
        elif request.get("stream"):
            chunks = [{"choices": [{"delta": {"content": "ok"}}]}, {"choices": [], "usage": usage}]
            body = b"".join(b"data: %s\n\n" % json.dumps(chunk).encode() for chunk in chunks) + b"data: [DONE]\n\n"
        else:
            body = json.dumps({"choices": [{"message": {"content": "ok"}}], "usage": usage}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream" if request.get("stream") else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    """UsageEngine: a stand-in for a server with broken usage counts, on 127.0.0.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _UsageEngine)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_call_whose_engine_reports_more_cached_than_prompt_still_succeeds(
    engine: str, caplog: pytest.LogCaptureFixture
) -> None:
    pilot = ContextPilot()
    with caplog.at_level(logging.WARNING, logger="contextpilot_integrations.engines.feedback"):
        result = OpenAICompatClient(engine + "/over", pilot).chat(pilot.prepare(["x"], "q"), stream=False)
    assert (result.text, result.prompt_tokens, result.cached_tokens) == ("ok", 10, 11)
    assert pilot.stats().engine_requests == 0 and pilot.stats().live_requests == 1
    assert "cached_tokens (11) exceed prompt_tokens (10)" in caplog.text


@pytest.mark.parametrize("path", ["/huge", "/bool"])
def test_counts_no_engine_can_mean_are_a_malformed_answer(engine: str, path: str) -> None:
    """Like every other malformed answer (a negative count, a string): the call fails, the
    request is forgotten."""
    pilot = ContextPilot()
    with pytest.raises(EngineError, match=r"127\.0\.0\.1.*malformed"):
        OpenAICompatClient(engine + path, pilot).chat(pilot.prepare(["x"], "q"), stream=False)
    assert pilot.stats().live_requests == 0 and pilot.stats().engine_requests == 0


def test_the_engine_comparison_refuses_a_hit_ratio_above_one(
    engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"id": n, "blocks": ["a", f"b{n}"], "texts": ["alpha " * 9, "beta " * 9]} for n in range(2)]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    args = [
        "simulate",
        "--trace",
        str(trace),
        "--modes",
        "offline",
        "--no-plot",
        "--quiet",
        "--engine",
        engine + "/over",
    ]
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "cached_tokens (11) exceed prompt_tokens (10)" in err and "Traceback" not in err
