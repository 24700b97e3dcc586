"""The retriever's best block stays where a model reads it best (core/reading.py): first in a
prompt of its own, last after a conversation's history, always in full, never a reference."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.reading import top_first, top_last


def blocks(*ids: str) -> list[Block]:
    return [Block(id=i, text=f"Document {i} says something about {i}.", tokens=100) for i in ids]


def test_top_first_and_last_move_one_block_and_keep_the_others_in_order() -> None:
    assert top_first(["b", "a", "c"], "a") == ["a", "b", "c"] == top_first(["a", "b", "c"], "a")
    assert top_last(["b", "a", "c"], "a") == ["b", "c", "a"]
    assert top_first([], "a") == [] and top_last(["b"], "a") == ["b"]


def test_a_request_shares_the_prefix_that_starts_with_its_top_block() -> None:
    pilot = ContextPilot()
    pilot.prepare(blocks("t", "s1", "s2", "x"), "first")
    second = pilot.prepare(blocks("t", "y", "s2", "s1"), "second")  # the same top block: its prefix follows
    assert [b.id for b in second.blocks] == ["t", "s1", "s2", "y"] and second.cached_blocks == 3
    assert second.order_annotation == ""  # no annotation by default
    other = pilot.prepare(blocks("z", "s1", "s2", "t"), "third")  # another top block: it stays first
    assert other.blocks[0].id == "z" and other.cached_blocks == 0


def test_with_keep_top_off_the_top_block_goes_wherever_the_reuse_puts_it() -> None:
    anywhere = ContextPilot(keep_top=False, annotate_order=True)
    anywhere.prepare(blocks("s1", "s2", "x"), "first")
    reordered = anywhere.prepare(blocks("y", "s2", "s1"), "second")
    assert [b.id for b in reordered.blocks] == ["s1", "s2", "y"] and reordered.cached_blocks == 2
    assert reordered.order_annotation  # and the ranking is restated


def test_a_later_turn_sends_the_top_block_in_full_last_and_refers_to_the_other_repeats() -> None:
    pilot = ContextPilot()
    pilot.prepare(blocks("a", "b", "c"), "q1", conversation_id="c1")
    second = pilot.prepare(blocks("b", "c", "d"), "q2", conversation_id="c1")
    assert [b.id for b in second.blocks] == ["d", "b"]  # b: the top block, again in full, last
    assert [r.block.id for r in second.references] == ["c"]
    text = second.render()
    assert text.index("refer to") < text.index("Document d") < text.index("Document b") < text.index("Question")
    anywhere = ContextPilot(keep_top=False)
    anywhere.prepare(blocks("a", "b", "c"), "q1", conversation_id="c1")
    again = anywhere.prepare(blocks("b", "c", "d"), "q2", conversation_id="c1")
    assert [r.block.id for r in again.references] == ["b", "c"]


def test_a_batch_sends_every_top_block_first() -> None:
    requests = [(blocks(*[f"p{(i + j) % 6}" for j in range(4)]), f"q{i}") for i in range(12)]
    planned = ContextPilot().plan(requests)
    for prepared in planned:
        assert prepared.blocks[0].id == requests[prepared.batch_index or 0][0][0].id
    assert any(p.cached_blocks for p in planned)  # requests with the same top block still share


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=8, unique=True), min_size=1, max_size=25),
    st.booleans(),
)
def test_whatever_the_traffic_the_top_block_is_read_where_it_reads_best_and_nothing_is_lost(
    requests: list[list[int]], conversation: bool
) -> None:
    pilot = ContextPilot()
    for number, ids in enumerate(requests):
        ranked = blocks(*[f"b{i}" for i in ids])
        prepared = pilot.prepare(ranked, f"q{number}", conversation_id="c" if conversation else None)
        sent = [b.id for b in prepared.blocks]
        referred = [r.block.id for r in prepared.references]
        assert sorted(sent + referred) == sorted(b.id for b in ranked)  # a permutation, references included
        assert ranked[0].id not in referred
        read = [p.block.id if hasattr(p, "block") else p.id for p in prepared.sequence]
        # last after a whole history in a turn that refers back; else first, as without ContextPilot
        assert read[-1 if prepared.turn and referred else 0] == ranked[0].id
