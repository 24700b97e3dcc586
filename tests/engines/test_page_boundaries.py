"""Issue 24: a block counts as cached when its whole pages are.

The engine caches whole pages only. A block that does not end on a page boundary shares
its last page with the next block, so when the next block differs the engine serves the
block up to its last whole page and no further. Counting such a block as missing put the
prediction a whole block below the engine (the live tests' "partly evicted" cases).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.prepared import PreparedRequest
from contextpilot_integrations.engines.feedback import report_served
from contextpilot_integrations.engines.kv_mapping import EngineBlockMap, blocks_held
from contextpilot_integrations.engines.sink import KvEventSink


def test_a_block_whose_last_page_is_shared_counts_when_its_whole_pages_are_stored() -> None:
    blocks = EngineBlockMap(page_size=4)
    # head [0:4], block A [4:10], block B [10:16]: page [8:12] holds A's tail and B's head
    prompt = [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3]
    blocks.stored([11, 12], None, prompt[:8], 4)  # another request had A, then something else
    blocks.track("r", prompt, block_ends=[10, 16])
    assert blocks.cached_tokens("r") == 8
    assert blocks.blocks_within("r", 8) == 1  # A is served but for the page it shares with B


A, B, C = (Block(id=name, text=name * 40) for name in "abc")


def shared_head(pilot: ContextPilot) -> PreparedRequest:
    """[a, c] served, then [a, b]: predicted to reuse block a."""
    pilot.prepare([A, C], "q1")
    second = pilot.prepare([A, B], "q2")
    assert second.cached_blocks == 1
    return second


def test_the_engines_report_keeps_a_block_served_to_its_last_whole_page() -> None:
    pilot = ContextPilot(plain_prompts=False)  # every block labelled: the index of the event-mapping tests
    second = shared_head(pilot)
    # the engine served 8 of 16 tokens: a ends at 10, so all of a's whole pages: as predicted
    assert report_served(pilot, second, 16, 8, block_ends=[10, 16], page_size=4) == 0
    assert pilot.prepare([A, C], "again").cached_blocks == 2  # [a, c] was not cut


def test_the_page_size_comes_from_the_tracker_when_not_given() -> None:
    pilot = ContextPilot(plain_prompts=False)  # every block labelled: the index of the event-mapping tests
    second = shared_head(pilot)
    report_served(pilot, second, 16, 8, block_ends=[10, 16])  # no page size: held to its last token
    assert pilot.prepare([A, C], "again").cached_blocks == 1
    pilot = ContextPilot(plain_prompts=False)  # every block labelled: the index of the event-mapping tests
    sink = KvEventSink(pilot, EngineBlockMap(4))
    second = shared_head(pilot)
    assert report_served(pilot, second, 16, 8, block_ends=[10, 16], tracker=sink) == 0
    assert pilot.prepare([A, C], "again").cached_blocks == 2


@given(
    st.integers(1, 64),
    st.lists(st.integers(1, 200), min_size=1, max_size=8),
    st.integers(0, 2_000),
)
def test_a_held_block_is_never_more_than_a_page_beyond_the_engine(
    page: int, sizes: list[int], cached_pages: int
) -> None:
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    cached = cached_pages * page  # the engine reports whole pages
    held = blocks_held(ends, cached, page)
    if held:
        assert ends[held - 1] < cached + page  # within one page of the engine
    if held < len(ends):
        assert ends[held] - ends[held] % page > cached  # the next one really is not served
