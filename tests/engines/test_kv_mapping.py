from __future__ import annotations

from contextpilot_integrations.engines.kv_mapping import EngineBlockMap


def test_requests_follow_the_stored_chain_even_when_tracked_first() -> None:
    blocks = EngineBlockMap(page_size=2)
    blocks.track("r", [1, 2, 3, 4, 5, 6, 7], block_ends=[4, 7])
    assert blocks.cached_tokens("r") == 0
    blocks.stored([11, 12], None, [1, 2, 3, 4], 2)
    assert blocks.cached_tokens("r") == 4
    blocks.stored([13], 12, [5, 6], 2)
    assert blocks.cached_tokens("r") == 6  # the trailing partial page is never a block


def test_removal_shortens_holders_and_restoring_extends_again() -> None:
    blocks = EngineBlockMap(page_size=2)
    blocks.stored([11, 12, 13], None, [1, 2, 3, 4, 5, 6], 2)
    blocks.track("a", [1, 2, 3, 4, 5, 6], block_ends=[2, 6])
    blocks.track("b", [1, 2, 9, 9], block_ends=[2, 4])
    assert blocks.removed([13]) == {"a": 4}
    assert blocks.blocks_within("a", 4) == 1 and blocks.blocks_within("b", 4) is None
    assert blocks.removed([12]) == {"a": 2}
    blocks.stored([12], 11, [3, 4], 2)  # the engine computes it again
    assert blocks.cached_tokens("a") == 4


def test_demotion_to_host_memory_is_still_a_hit() -> None:
    blocks = EngineBlockMap(page_size=1)
    blocks.stored([1, 2], None, [7, 8], 1)
    blocks.track("r", [7, 8], block_ends=[2])
    blocks.stored([2], 1, [8], 1, medium="CPU_PINNED")
    assert blocks.removed([2], medium="GPU") == {}
    assert blocks.removed([2], medium="CPU_PINNED") == {"r": 1}


def test_without_block_ends_only_whole_or_nothing() -> None:
    blocks = EngineBlockMap(page_size=1)
    blocks.stored([1, 2, 3], None, [5, 6, 7], 1)
    blocks.track("r", [5, 6, 7])
    assert blocks.blocks_within("r", 3) is None and blocks.blocks_within("r", 2) == 0


def test_page_size_is_learned_and_clear_forgets_chains() -> None:
    blocks = EngineBlockMap()
    blocks.track("r", [1, 2, 3, 4], block_ends=[4])
    blocks.stored([5, 6], None, [1, 2, 3, 4], 2)
    assert blocks.page_size == 2 and blocks.cached_tokens("r") == 4
    assert blocks.cleared() == ["r"] and blocks.cached_tokens("r") == 0
    blocks.stored([5], None, [1, 2], 2)
    assert blocks.cached_tokens("r") == 2
    blocks.forget("r")
    assert len(blocks) == 0
