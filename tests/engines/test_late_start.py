"""Issue 24 item 1: a late start (or a reset) must not leave the index over-predicting.

The engine announces a page once, when it stores it. Pages stored before our listener was
up can never be walked through the block map: a request through them is confirmed only
as far as we know, until the engine's own cached-tokens report anchors those pages.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines.kv_mapping import EngineBlockMap, block_token_ends
from contextpilot_integrations.engines.sink import KvEventSink
from contextpilot_integrations.engines.wire import KvEventBatch


def batch(seq: int, *events: dict[str, Any]) -> KvEventBatch:
    return KvEventBatch.model_validate({"seq": seq, "publisher": "e", "events": list(events)})


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
    }


def test_a_request_through_pages_stored_before_we_listened_is_not_predicted_cached() -> None:
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot, EngineBlockMap(4))
    doc = Block(id="x", text="t")
    sink.apply(batch(5, stored([99], None, [9, 9, 9, 9])))
    first = pilot.prepare([doc], "q1")
    sink.apply(batch(6, stored([11], 10, [5, 6, 7, 8])))
    sink.track(first.request_id, [1, 2, 3, 4, 5, 6, 7, 8])  # page 0 (hash 10) was stored before we listened
    sink.apply(batch(7, {"type": "BlockRemoved", "block_hashes": [11]}))
    assert pilot.prepare([doc], "q2").cached_blocks == 0  # the engine holds nothing of it
    assert sink.stats().requests_unconfirmed == 1


def test_the_engines_cached_tokens_anchor_unseen_pages_and_removals_map_again() -> None:
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot, EngineBlockMap(4))
    docs = [Block(id="a", text="a" * 40), Block(id="b", text="b" * 40)]
    sink.apply(batch(5, stored([11], 10, [5, 6, 7, 8])))  # the request's own new page, below unseen page 0
    first = pilot.prepare(docs, "q1")
    sink.track(first.request_id, [1, 2, 3, 4, 5, 6, 7, 8], block_ends=[4, 8], cached_tokens=4)
    second = pilot.prepare(docs, "q2")
    assert second.cached_blocks == 2  # page 0 anchored by the engine's report, page 1 seen stored
    sink.track(second.request_id, [1, 2, 3, 4, 5, 6, 7, 8], block_ends=[4, 8], cached_tokens=8)
    stats = sink.stats()
    assert (stats.anchored_pages, stats.anchors_resolved) == (1, 1)
    sink.apply(batch(6, {"type": "BlockRemoved", "block_hashes": [11]}))  # maps: page 0 took hash 10
    assert pilot.predicted_cached_blocks(["a", "b"]) == 1
    sink.apply(batch(7, {"type": "BlockRemoved", "block_hashes": [10]}))
    assert pilot.predicted_cached_blocks(["a", "b"]) == 0


def test_an_anchored_page_learns_its_hash_from_a_block_stored_after_the_report() -> None:
    blocks = EngineBlockMap(4)
    blocks.stored([50], None, [0, 0, 0, 0], 4)  # page size learned; unrelated
    blocks.track("r", [1, 2, 3, 4, 5, 6, 7, 8, 9], block_ends=[4, 9], engine_cached=4)
    assert blocks.cached_tokens("r") == 4
    grown, _ = blocks.stored([11], 10, [5, 6, 7, 8], 4)
    assert grown == {"r": 8}
    assert blocks.removed([10]) == {"r": 0}


def test_requests_waiting_on_an_anchored_page_grow_with_it() -> None:
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot, EngineBlockMap(4))
    doc = Block(id="x", text="t" * 20)
    sink.apply(batch(0, stored([50], None, [0, 0, 0, 0])))
    first = pilot.prepare([doc], "q1")
    sink.track(first.request_id, [1, 2, 3, 4, 5], block_ends=[4])
    assert pilot.prepare([doc], "q2").cached_blocks == 0  # unconfirmed
    later = pilot.prepare([doc], "q3")
    sink.track(later.request_id, [1, 2, 3, 4, 6], block_ends=[4], cached_tokens=4)
    assert pilot.predicted_cached_blocks(["x"]) == 1


def test_block_ends_are_found_in_the_prompt() -> None:
    prompt = [1, 7, 7, 10, 11, 12, 20, 21, 22, 23, 5]
    assert block_token_ends(prompt, [[10, 11, 12], [20, 21, 22, 23]]) == [6, 10]
    # first and last tokens merged with the neighbours: the interior is found, the end is late by at most one
    assert block_token_ends(prompt, [[99, 11, 98], [97, 21, 22, 96]]) == [6, 10]
    assert block_token_ends(prompt, [[20, 21], [10, 11]]) is None  # out of order
    assert block_token_ends(prompt, [[42, 43]]) is None


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=6), st.data())
def test_block_ends_match_a_prompt_built_from_the_blocks(blocks: list[list[int]], data: st.DataObject) -> None:
    prompt: list[int] = []
    truth = []
    for block in blocks:
        prompt += data.draw(st.lists(st.integers(6, 9), max_size=3))  # separators, never block tokens
        prompt += block
        truth.append(len(prompt))
    ends = block_token_ends(prompt, blocks)
    assert ends is not None and len(ends) == len(blocks)
    # located in order, never before the true end of the block (never an early hit)
    for end, true_end in zip(ends, truth, strict=True):
        assert end <= true_end or end == true_end
    assert ends == sorted(ends)


def test_subscribing_to_a_running_engine_keeps_the_requests_in_flight() -> None:
    """The first batch a late subscriber hears is not number 0: that is a late start, not
    lost knowledge, so the request sent meanwhile stays predicted once the events confirm it."""
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot, EngineBlockMap(4))
    doc = Block(id="x", text="t" * 20)
    first = pilot.prepare([doc], "q1")
    sink.apply(batch(7, stored([20, 21], None, [1, 2, 3, 4, 5, 6, 7, 8])))
    sink.track(first.request_id, [1, 2, 3, 4, 5, 6, 7, 8, 9], block_ends=[8])
    assert pilot.predicted_cached_blocks(["x"]) == 1
    assert sink.stats().index_resets == 0
