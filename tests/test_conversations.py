from __future__ import annotations

import pytest

from contextpilot_integrations import Block
from contextpilot_integrations.core.conversations import ConversationStore


def blocks(*ids: int) -> list[Block]:
    return [Block(id=str(i), text=f"block {i}") for i in ids]


def test_paper_section_6_example() -> None:
    store = ConversationStore()
    first = store.deduplicate("c", blocks(1, 2, 4))
    assert [b.id for b in first.fresh] == ["1", "2", "4"] and first.repeated == []
    second = store.deduplicate("c", blocks(1, 5, 2))
    assert [b.id for b in second.fresh] == ["5"]
    assert [(b.id, turn) for b, turn in second.repeated] == [("1", 0), ("2", 0)]


def test_block_is_resent_when_its_turn_left_the_history() -> None:
    store = ConversationStore()
    store.deduplicate("c", blocks(1, 2))
    store.deduplicate("c", blocks(3))
    third = store.deduplicate("c", blocks(1, 3), kept_turns={1})
    assert [b.id for b in third.fresh] == ["1"] and [b.id for b, _ in third.repeated] == ["3"]
    # turn 2 now carries block 1
    fourth = store.deduplicate("c", blocks(1), kept_turns={2})
    assert [(b.id, t) for b, t in fourth.repeated] == [("1", 2)]


def test_conversations_are_independent_and_can_end() -> None:
    store = ConversationStore()
    store.deduplicate("a", blocks(1))
    assert store.deduplicate("b", blocks(1)).repeated == []
    assert store.end("a") and not store.end("a")
    assert store.deduplicate("a", blocks(1)).repeated == []


def test_memory_is_bounded_by_ttl_and_count() -> None:
    now = [0.0]
    store = ConversationStore(ttl=10, max_conversations=3, clock=lambda: now[0])
    for cid in "abcd":
        store.deduplicate(cid, blocks(1))
    assert len(store) == 3 and "a" not in store
    now[0] = 11.0
    assert len(store) == 0
    with pytest.raises(ValueError):
        ConversationStore(max_conversations=0)


def test_forgetting_a_failed_turn() -> None:
    store = ConversationStore()
    store.deduplicate("c", blocks(1, 2))
    assert store.forget_turn("c", 0) == 2 and store.forget_turn("nope", 0) == 0
    assert [b.id for b in store.deduplicate("c", blocks(1)).fresh] == ["1"]
