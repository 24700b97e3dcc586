from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.conversations import ConversationStore, Repeats


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


# ---- a label or a reference only where it pays (issue 29) -------------------------------------------
def doc(name: str, tokens: int) -> Block:
    return Block(id=name, text=f"{name} " * 20, tokens=tokens)


def test_short_blocks_go_out_as_without_contextpilot_turn_after_turn() -> None:
    """A reference is about as long as a 15-token chunk: de-duplicating it saves nothing and
    its label and the order annotation cost more, so every turn is the plain prompt."""
    pilot = ContextPilot()
    turns = [["a", "b", "c"], ["b", "c", "d"], ["c", "d", "a"]]
    for number, ids in enumerate(turns):
        blocks = [doc(name, 15) for name in ids]
        prepared = pilot.prepare(blocks, f"q{number}", conversation_id="c")
        assert prepared.turn == number and prepared.references == () and not prepared.labels
        assert prepared.render() == "\n\n".join([*(b.text for b in blocks), f"Question: q{number}"])


def test_a_reference_replaces_only_a_block_longer_than_itself() -> None:
    pilot = ContextPilot()
    pilot.prepare([doc("long", 300), doc("short", 10)], "q", conversation_id="c")
    second = pilot.prepare([doc("long", 300), doc("short", 10), doc("new", 300)], "q", conversation_id="c")
    assert [r.block.id for r in second.references] == ["long"]
    assert [b.id for b in second.blocks] == ["short", "new"] and second.labels  # the annotation names them


def test_a_reference_that_costs_more_than_it_saves_is_not_made() -> None:
    """30 tokens of text against a 13-token reference, but moving it after the fresh blocks
    needs the order annotation, which costs more than the 17 tokens saved."""
    pilot = ContextPilot()
    ranking = ["r", *(f"f{n}" for n in range(12))]
    pilot.prepare([doc("r", 300)], "q", conversation_id="c")
    second = pilot.prepare([doc("r", 30), *(doc(name, 300) for name in ranking[1:])], "q", conversation_id="c")
    assert second.references == () and [b.id for b in second.blocks] == ranking


def test_labels_stop_where_conversations_never_come_back_to_a_block() -> None:
    """Traffic whose conversations have one turn each: the first ones are labelled for the
    references a multi-turn conversation brings, then, as they stay silent, the traffic
    shows none come."""
    pilot = ContextPilot()
    labelled = [
        pilot.prepare([doc(f"d{n}.{k}", 600) for k in range(15)], "q", conversation_id=f"c{n}").labels
        for n in range(300)
    ]
    assert labelled[0] and not any(labelled[-100:])
    assert sum(labelled) <= Repeats().max_wait  # the loss is bounded: they count as gone after the wait
    assert pilot._conversations.repeats.rate < 0.01


def test_a_block_first_sent_plain_is_sent_again_then_referred_to_once_labelled() -> None:
    """300 conversations start before any comes back: labels stop being bet on. Their second
    turns repeat 5 blocks each: referred to where the first turn was labelled, else sent
    again in full (labelled, now that the traffic shows repeats); the third turn refers to
    that copy."""
    pilot = ContextPilot()

    def turn(n: int, t: int) -> list[Block]:
        return [doc(f"c{n}.{k}", 600) for k in range(5)] + [doc(f"c{n}.t{t}.{k}", 600) for k in range(10)]

    firsts = [pilot.prepare(turn(n, 0), "q", conversation_id=f"c{n}") for n in range(300)]
    assert firsts[0].labels and not firsts[-1].labels
    seconds = [pilot.prepare(turn(n, 1), "q", conversation_id=f"c{n}") for n in range(300)]
    assert [(r.block.id, r.turn) for r in seconds[0].references] == [(f"c0.{k}", 0) for k in range(5)]
    assert seconds[-1].references == () and len(seconds[-1].blocks) == 15  # no label to point to: in full
    assert seconds[-1].labels  # the repeats are evidence: labels pay again
    third = pilot.prepare(turn(299, 2), "q", conversation_id="c299")
    assert [(r.block.id, r.turn) for r in third.references] == [(f"c299.{k}", 1) for k in range(5)]


def test_repeats_learn_from_the_traffic_and_forget_the_prior() -> None:
    repeats = Repeats(prior=1.0, weight=10.0, decay=1.0)
    assert repeats.rate == 1.0
    repeats.observe(sent=10, repeats=0)
    assert repeats.rate == 0.5
    repeats.observe(sent=0, repeats=20)
    assert repeats.rate == 1.5
    with pytest.raises(ValueError):
        Repeats(decay=0.0)


# ---- censoring: a turn's blocks count once its conversation moved on or is gone (issue 29) ----------
def test_first_turns_of_many_interleaved_conversations_stay_labelled_until_they_could_come_back() -> None:
    """120 conversations start before any comes back (conversations interleaved by turn, as
    in the demo's chat): none could have come back yet, so their first turns are not read as
    conversations that never do; every second turn refers to the 5 blocks its first turn sent."""
    pilot = ContextPilot()

    def turn(n: int, t: int) -> list[Block]:
        return [doc(f"c{n}.{k}", 600) for k in range(5)] + [doc(f"c{n}.t{t}.{k}", 600) for k in range(10)]

    firsts = [pilot.prepare(turn(n, 0), "q", conversation_id=f"c{n}") for n in range(120)]
    assert all(first.labels for first in firsts)
    for n in range(120):
        second = pilot.prepare(turn(n, 1), "q", conversation_id=f"c{n}")
        assert [(r.block.id, r.turn) for r in second.references] == [(f"c{n}.{k}", 0) for k in range(5)]


def test_a_turn_counts_once_its_conversation_moves_on_or_ends() -> None:
    store = ConversationStore()
    store.repeats = Repeats(prior=1.0, weight=10.0, decay=1.0)
    store.deduplicate("a", blocks(1, 2, 3, 4))
    assert store.repeats.rate == 1.0  # it could not have come back yet: nothing is known
    store.deduplicate("a", blocks(1, 2, 5, 6))  # two came back
    assert store.repeats.rate == 12 / 14  # the first turn's four, with the two this turn repeated
    store.end("a")
    assert store.repeats.rate == 12 / 16  # ended: this turn's two fresh blocks never came back


def test_a_silent_conversation_counts_as_gone_by_degrees_then_in_full() -> None:
    repeats = Repeats(prior=1.0, weight=10.0, decay=1.0, min_wait=1, max_wait=8)
    assert repeats.wait == 8  # no gap seen yet
    repeats.turn("a", sent=10, repeats=0)
    for n in range(4):
        repeats.turn(f"other{n}", sent=0, repeats=0)
    assert repeats.rate == 10 / 15  # silent for 4 turns of a wait of 8: half its blocks count
    for n in range(4, 8):
        repeats.turn(f"other{n}", sent=0, repeats=0)
    assert repeats.rate == 10 / 20  # past the wait: gone
    repeats.turn("a", sent=0, repeats=5)  # back after all: its repeats count, its blocks not twice
    assert repeats.rate == 15 / 20
    with pytest.raises(ValueError):
        Repeats(min_wait=10, max_wait=5)


def test_the_wait_is_learnt_from_how_far_apart_a_conversations_turns_come() -> None:
    repeats = Repeats(decay=1.0, patience=4.0, min_wait=2, max_wait=100)
    for _ in range(3):
        for name in "abc":  # three conversations, round-robin: a turn every 3 turns
            repeats.turn(name, sent=1, repeats=0)
    assert repeats.wait == 12
    repeats.turn("z", sent=1, repeats=0)
    for n in range(60):  # z is counted gone after 12 turns, then comes back after 61
        repeats.turn(f"one-off{n}", sent=1, repeats=0)
    repeats.turn("z", sent=1, repeats=0)
    assert repeats.wait == int(4 * (6 * 3 + 61) / 7)  # a late return lengthens the wait


def test_conversations_that_never_come_back_are_held_a_bounded_time() -> None:
    repeats = Repeats(max_wait=64)
    for n in range(5000):
        repeats.turn(f"c{n}", sent=15, repeats=0)
    assert len(repeats._pending) <= 64 and len(repeats._gone) <= 4 * 64
    assert repeats.rate < 0.01


def test_dropped_expired_and_failed_turns_settle_what_they_sent() -> None:
    now = [0.0]
    store = ConversationStore(ttl=10, max_conversations=2, clock=lambda: now[0])
    store.repeats = Repeats(prior=1.0, weight=10.0, decay=1.0, min_wait=1000, max_wait=1000)
    store.deduplicate("a", blocks(1, 2))
    store.deduplicate("b", blocks(3, 4))
    store.deduplicate("c", blocks(5, 6))  # "a" is dropped (two at most): gone
    assert store.repeats.rate == pytest.approx(10 / 12, abs=1e-3)
    store.forget_turn("c", 0)  # never reached the model: its blocks count for nothing
    now[0] = 11.0
    assert len(store) == 0  # "b" and "c" expired: "b" is gone
    assert store.repeats.rate == 10 / 14


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["turn", "turn", "turn", "gone", "withdraw"]), st.integers(0, 40), st.integers(0, 20)
        ),
        max_size=300,
    )
)
def test_the_censored_counts_stay_bounded_and_add_up(steps: list[tuple[str, int, int]]) -> None:
    """Whatever the turns, ends and failed turns: the maps stay within their bounds and the
    running sums behind the silent share match the conversations still waiting."""
    repeats = Repeats(min_wait=2, max_wait=16)
    for action, who, sent in steps:
        name = f"c{who}"
        if action == "turn":
            repeats.turn(name, sent, sent // 2)
        elif action == "gone":
            repeats.gone(name)
        else:
            repeats.withdraw(name)
        pending = repeats._pending.values()
        assert len(repeats._pending) <= repeats.wait <= repeats.max_wait
        assert len(repeats._gone) <= repeats.patience * repeats.max_wait + 1
        assert repeats._silent == sum(s for _, s in pending) and repeats._at == sum(s * at for at, s in pending)
        assert repeats.rate >= 0
