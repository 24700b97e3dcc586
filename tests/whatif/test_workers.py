"""Several workers on one engine: independent indexes lose reuse, the shared view keeps it."""

from __future__ import annotations

import json

import pytest

from contextpilot_integrations.whatif.cli import main
from contextpilot_integrations.whatif.replay import replay
from contextpilot_integrations.whatif.trace import TraceRequest, multihop_trace, working_set_tokens
from contextpilot_integrations.whatif.workers import replay_workers


@pytest.fixture(scope="module")
def multihop() -> tuple[list[TraceRequest], int]:
    trace = multihop_trace()
    return trace, int(working_set_tokens(trace) * 0.25)


def test_one_worker_is_the_ordinary_online_replay(multihop: tuple[list[TraceRequest], int]) -> None:
    trace, capacity = multihop
    alone = replay(trace, "trie", "online", capacity)
    one = replay_workers(trace, "trie", capacity, workers=1)
    assert (one.cached_tokens, one.prompt_tokens) == (alone.cached_tokens, alone.prompt_tokens)


def test_independent_workers_lose_reuse_and_the_shared_view_keeps_it(
    multihop: tuple[list[TraceRequest], int],
) -> None:
    trace, capacity = multihop
    one = replay_workers(trace, "trie", capacity, workers=1).hit_ratio
    independent = [replay_workers(trace, "trie", capacity, workers=n).hit_ratio for n in (2, 4, 8)]
    assert one > independent[0] > independent[1] > independent[2], "each worker predicts less of the cache"
    for workers in (4, 8):
        shared = replay_workers(trace, "trie", capacity, workers=workers, shared=True).hit_ratio
        assert shared >= 0.95 * one, f"{workers} workers sharing: {shared:.3f} vs one worker {one:.3f}"


def test_entries_that_arrive_late_still_help(multihop: tuple[list[TraceRequest], int]) -> None:
    trace, capacity = multihop
    trace = trace[:800]
    independent = replay_workers(trace, "trie", capacity, workers=4).hit_ratio
    lagged = replay_workers(trace, "trie", capacity, workers=4, shared=True, lag=8).hit_ratio
    assert lagged > independent


def test_cli_workers_shared_prints_both_views(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--modes", "online", "--capacity", "0.25", "--strategies", "trie", "--workers", "4", "--shared"]
    assert main([*argv, "--json", "--no-plot"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    labels = [row["label"] for row in results]
    assert labels == ["trie (default), 4 workers, independent", "trie (default), 4 workers, shared view"]
    assert results[1]["hit_ratio"] > results[0]["hit_ratio"]
    assert main(["demo", "--modes", "online", "--workers", "2", "--targets", "2", "--no-plot"]) == 2
    with pytest.raises(ValueError):
        replay_workers([], "trie", 10, workers=0)
