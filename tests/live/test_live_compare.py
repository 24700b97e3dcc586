"""``demo --engine-cmd`` against live SGLang and live vLLM (CPU, tiny model): the comparison
runs end to end, A B B A, one server flushed before every pass, and the numbers it reports
are the engine's own and hang together; the simulator, given the same requests in the
engine's tokens, page size and KV pool, predicts the engine's computed tokens within 5%;
and the engine computes no more prompt tokens with ContextPilot than without (the small
version of ``benchmarks/bench_engine.py``'s runs at scale), the pilot set up with the
engine's tokenizer, KV pool and page size as a user who knows the engine would.

About 45 s per engine on 2 cores (start, warm-up, 3 modes x 4 passes x 4 requests).
Without the engines the tests skip, unless ``CONTEXTPILOT_REQUIRE_LIVE_ENGINES`` is set (CI).
"""

from __future__ import annotations

import json

import pytest

from contextpilot_integrations.testing.live_engines import live_engine_command, require_live_engine
from contextpilot_integrations.whatif.cli import main
from contextpilot_integrations.whatif.engine_compare import FLUSH_PATHS

pytestmark = pytest.mark.timeout(600)

REQUESTS = 4


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_engine_comparison_runs_on_the_live_engine(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    command = live_engine_command(engine, require_live_engine(engine, pytest.skip), kv_tokens=4096, context=4096)
    args = ["demo", "--modes", "offline", "--capacity", "0.25", "--strategies", "retrieval,trie", "--no-plot"]
    args += ["--json", "--engine-cmd", command, "--engine-requests", str(REQUESTS), "--engine-block-chars", "60"]
    args += ["--history-turns", "1", "--answer-tokens", "2"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)["engine"]
    assert report["engine"] == engine  # read from the engine's /v1/models, not from the command
    assert report["clean_cache"] == f"one server, POST {FLUSH_PATHS[engine]} before every pass"
    assert report["order"] == "A B B A"
    assert report["simulator_cache"] == {"page_size": 16 if engine == "sglang" else 32, "capacity_tokens": 4096}
    assert set(report["modes"]) == {"offline", "online", "chat"}
    computed = {}  # mode -> computed tokens without, with ContextPilot
    for mode, data in report["modes"].items():
        assert data["same_requests"], mode  # both arms served the same requests, every pass
        assert data["first_request_cached_tokens"] == [0, 0, 0, 0], mode  # each pass began on an empty cache
        cached_somewhere = 0
        for arm in ("retrieval_order", "contextpilot"):
            counts = data[arm]
            assert counts["requests_per_pass"] == REQUESTS, (mode, arm)
            assert counts["prompt_tokens"] > 0 and 0 <= counts["cached_tokens"] <= counts["prompt_tokens"]
            assert counts["computed_tokens"] == counts["prompt_tokens"] - counts["cached_tokens"]
            # the simulator on the very requests this arm sent: within 5% of what the engine computed
            assert counts["simulator_computed_tokens"] is not None, (mode, arm)
            assert abs(counts["simulator_gap"]) <= 0.05, (mode, arm, counts)
            cached_somewhere += counts["cached_tokens"]
        # every prompt starts with the same chat template and system prompt: a prefix cache
        # reuses at least that much after each pass's first request
        assert cached_somewhere > 0, mode
        ratio = data["computed_ratio"]
        expected = data["contextpilot"]["computed_tokens"] / data["retrieval_order"]["computed_tokens"]
        assert ratio == pytest.approx(expected)
        computed[mode] = (data["retrieval_order"]["computed_tokens"], data["contextpilot"]["computed_tokens"])
    # never worse: the engine computes no more prompt tokens with ContextPilot than without
    # (4 requests sharing 3 short blocks: reordering a pair would cost two annotations for less).
    # Known exception, left open at issue 38's stop: in chat, keeping the top block where the
    # real model reads it (keep_top, the default) costs these 4 turns of 60-character chunks
    # 2 pages a pass on vLLM (15,442 -> 15,570 computed tokens, +0.8%; the simulator agrees
    # exactly; keep_top=False computes 15,442), for +18.7 points of answers on facts-chat.
    # Allowed up to 1% here until the send decision weighs that placement too.
    tolerance = {"chat": 0.01}
    worse = {mode: pair for mode, pair in computed.items() if pair[1] > pair[0] * (1 + tolerance.get(mode, 0.0))}
    assert not worse, worse


def test_two_passes_run_a_then_b(capsys: pytest.CaptureFixture[str]) -> None:
    """``--engine-passes 2`` (long runs at scale): one pass without ContextPilot, then one with."""
    command = live_engine_command("vllm", require_live_engine("vllm", pytest.skip), kv_tokens=4096, context=4096)
    args = ["demo", "--modes", "offline", "--capacity", "0.25", "--strategies", "retrieval,trie", "--no-plot"]
    args += ["--json", "--engine-cmd", command, "--engine-requests", str(REQUESTS), "--engine-block-chars", "60"]
    args += ["--engine-modes", "offline", "--engine-passes", "2"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)["engine"]
    assert report["order"] == "A B"
    data = report["modes"]["offline"]
    assert data["same_requests"] and data["first_request_cached_tokens"] == [0, 0]
    baseline, ours = data["retrieval_order"], data["contextpilot"]
    assert baseline["requests_per_pass"] == ours["requests_per_pass"] == REQUESTS
    for arm in (baseline, ours):  # one pass an arm: the simulator replays that pass alone
        assert arm["simulator_computed_tokens"] is not None and abs(arm["simulator_gap"]) <= 0.05
