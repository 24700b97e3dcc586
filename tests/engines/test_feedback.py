"""Engine feedback without events: cached-token reports shorten the index."""

from __future__ import annotations

import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines.feedback import cached_blocks_from_usage, report_served


def blocks(*ids: str, tokens: int = 100) -> list[Block]:
    return [Block(id=i, text=f"text {i}", tokens=tokens) for i in ids]


def test_observe_cached_cuts_the_lost_branch_and_keeps_what_this_request_sent_again() -> None:
    pilot = ContextPilot("retrieval")
    old = pilot.prepare(blocks("a", "b", "c"), "q")
    sibling = pilot.prepare(blocks("a", "b", "x"), "q")
    other = pilot.prepare(blocks("z"), "q")  # entered after the lost path: kept
    served = pilot.prepare(blocks("a", "b", "d"), "q")
    assert served.cached_blocks == 2
    # the engine had only "a": "b" and everything below it was gone
    assert pilot.observe_cached(served, 1) == 2
    assert pilot.predicted_cached_blocks(["a", "b", "c"]) == 2  # a, b: served again just now
    assert pilot.predicted_cached_blocks(["a", "b", "x"]) == 2
    assert other.request_id in pilot.live_request_ids() and pilot.stats().feedback_shortened == 2
    assert pilot.observe_cached(served, 2) == 0  # as predicted: nothing to do
    with pytest.raises(TypeError):
        pilot.observe_cached(served, 1.0)  # type: ignore[arg-type]
    pilot.check()
    del old, sibling


def test_older_requests_than_a_lost_path_go_too() -> None:
    """An LRU engine that evicted a path evicted what is older still."""
    pilot = ContextPilot("retrieval")
    oldest = pilot.prepare(blocks("p", "q"), "q")
    lost = pilot.prepare(blocks("a", "b"), "q")
    newer = pilot.prepare(blocks("n", "m"), "q")
    served = pilot.prepare(blocks("a", "c"), "q")
    pilot.observe_cached(served, 0)
    live = pilot.live_request_ids()
    assert oldest.request_id not in live and newer.request_id in live and served.request_id in live
    assert pilot.predicted_cached_blocks(["a", "b"]) == 1  # "a" through the served request only
    del lost


def test_cached_tokens_map_onto_blocks_with_the_engines_tokenizer_scale() -> None:
    pilot = ContextPilot("retrieval")
    earlier = pilot.prepare(blocks("a", "b", "c", "x"), "q")
    served = pilot.prepare(blocks("a", "b", "c", "d"), "q")
    assert served.cached_blocks == 3
    # the engine's tokens are 2x our estimate; 50 tokens of system prompt before the blocks,
    # then the four blocks and the question (no order annotation: retrieval order)
    assert served.order_annotation == ""
    prompt = 2 * (50 + 400 + len("q") // 4)
    assert cached_blocks_from_usage(served, prompt, 2 * (50 + 300), 50) == 3  # as predicted
    assert cached_blocks_from_usage(served, prompt, 2 * (50 + 280), 50) == 3  # within the estimate's error
    assert cached_blocks_from_usage(served, prompt, 2 * (50 + 150), 50) == 1  # clearly fewer: one block
    assert cached_blocks_from_usage(served, prompt, 60, 50) == 0
    assert report_served(pilot, served, prompt, 60, before_tokens=50) == 1  # "x" is gone with its path
    assert pilot.stats().engine_requests == 1 and pilot.predicted_cached_blocks([b.id for b in earlier.blocks]) == 3
