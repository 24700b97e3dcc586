from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.core.conversations import ConversationStore
from contextpilot_integrations.testing.invariants import dangling_references
from contextpilot_integrations.whatif.trace import estimate_tokens


def blocks(*ids: int) -> list[Block]:
    return [Block(id=str(i), text=f"block {i}") for i in ids]


def test_paper_section_6_example() -> None:
    store = ConversationStore()
    first = store.deduplicate("c", blocks(1, 2, 4))
    assert [b.id for b in first.fresh] == ["1", "2", "4"] and first.repeated == []
    second = store.deduplicate("c", blocks(1, 5, 2))
    assert [b.id for b in second.fresh] == ["5"]
    assert [(b.id, turn) for b, turn, _ in second.repeated] == [("1", 0), ("2", 0)]


def test_block_is_resent_when_its_turn_left_the_history() -> None:
    store = ConversationStore()
    store.deduplicate("c", blocks(1, 2))
    store.deduplicate("c", blocks(3))
    third = store.deduplicate("c", blocks(1, 3), kept_turns={1})
    assert [b.id for b in third.fresh] == ["1"] and [b.id for b, _, _ in third.repeated] == ["3"]
    # turn 2 now carries block 1
    fourth = store.deduplicate("c", blocks(1), kept_turns={2})
    assert [(b.id, t) for b, t, _ in fourth.repeated] == [("1", 2)]


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


# ---- a reference only where it costs less, and no label bet on later turns (issue 29) ----------------
def doc(name: str, tokens: int) -> Block:
    return Block(id=name, text=f"{name} " * 20, tokens=tokens)


def test_short_blocks_go_out_as_without_contextpilot_turn_after_turn() -> None:
    """A reference is about as long as a 12-token chunk: de-duplicating it saves nothing,
    so every turn is the plain prompt, in the retriever's order (a turn that refers to nothing
    moves nothing: in a history cut to a window it would one day lead a prompt itself)."""
    pilot = ContextPilot()
    turns = [["a", "b", "c"], ["b", "c", "d"], ["c", "d", "a"]]
    for number, ids in enumerate(turns):
        blocks = [doc(name, 12) for name in ids]
        prepared = pilot.prepare(blocks, f"q{number}", conversation_id="c")
        assert prepared.turn == number and prepared.references == () and not prepared.labels
        assert prepared.render() == "\n\n".join([*(b.text for b in blocks), f"Question: q{number}"])


def test_a_reference_quotes_the_plain_copy_in_its_blocks_place() -> None:
    """The first turn goes out as without ContextPilot (no label bet on later turns); the
    second refers to it by the block's opening words, in the block's own place, so the
    model reads the retriever's order (but for the top block, last after the history) and
    no annotation is needed. A block shorter than its reference is sent again."""
    pilot = ContextPilot()
    first = pilot.prepare([doc("long", 300), doc("short", 10)], "q", conversation_id="c")
    assert not first.labels and first.render() == "\n\n".join(
        [doc("long", 300).text, doc("short", 10).text, "Question: q"]
    )
    second = pilot.prepare([doc("short", 10), doc("long", 300), doc("new", 300)], "q2", conversation_id="c")
    assert [(r.block.id, r.turn, r.labelled) for r in second.references] == [("long", 0, False)]
    assert [b.id for b in second.blocks] == ["new", "short"] and not second.labels
    assert second.order_annotation == ""
    reference = 'Please refer to "long long long long…" in the previous conversation.'
    assert second.render() == "\n\n".join([reference, doc("new", 300).text, doc("short", 10).text, "Question: q2"])
    history = [{"role": "user", "content": first.render()}, {"role": "assistant", "content": "a"}]
    messages = second.to_messages(history=history)
    assert messages[-1]["content"] == second.render() and dangling_references([m["content"] for m in messages]) == []
    alone = second.to_messages()  # without the turn it points to: the block goes out in full
    assert alone[-1]["content"].startswith(doc("long", 300).text + "\n\n" + doc("new", 300).text)


def test_blocks_that_begin_alike_are_quoted_only_by_words_that_tell_them_apart() -> None:
    """Two blocks with the same first four words: a four-word quote could point at either,
    so the quote takes more words (issue 39); blocks alike beyond the longest quote are sent
    again in full; a labelled copy (the paper's form) is still referred to by label."""
    pilot = ContextPilot()
    twins = [Block(id=n, text=f"Table of Contents page {n} " + "x " * 400) for n in ("a", "b")]
    pilot.prepare(twins, "q", conversation_id="c")
    again = pilot.prepare(twins, "q", conversation_id="c")  # "a" tops: sent in full
    assert [(r.block.id, r.quoted) for r in again.references] == [("b", "Table of Contents page b x x x")]
    alike = [Block(id=n, text="Table of Contents " * 20 + n + " x" * 400) for n in ("a", "b")]
    pilot.prepare(alike, "q", conversation_id="d")
    again = pilot.prepare(alike, "q", conversation_id="d")
    assert again.references == () and [b.id for b in again.blocks] == ["a", "b"]  # nothing referred to: as sent
    paper = ContextPilot(plain_prompts=False, keep_top=False)  # any repeat referred to, the top one too
    paper.prepare(twins, "q", conversation_id="c")
    again = paper.prepare(twins, "q", conversation_id="c")
    assert [(r.text, r.labelled) for r in again.references] == [
        ("Please refer to [a] in the previous conversation.", True),
        ("Please refer to [b] in the previous conversation.", True),
    ]


def test_one_turn_conversations_are_never_labelled() -> None:
    """Conversations that never come back cost nothing: no first turn carries labels for
    references that never come (the bet the old rule made before any evidence)."""
    pilot = ContextPilot()
    for n in range(50):
        blocks = [doc(f"d{n}.{k}", 600) for k in range(15)]
        prepared = pilot.prepare(blocks, "q", conversation_id=f"c{n}")
        assert not prepared.labels and prepared.render() == "\n\n".join([*(b.text for b in blocks), "Question: q"])


WORDS = ["Table", "of", "Contents", "The", "jury", "said", "on", "Monday", "FTX"]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 11), st.integers(1, 400)), min_size=1, max_size=8),
            st.integers(0, 4),
        ),
        min_size=1,
        max_size=8,
    ),
    st.randoms(use_true_random=False),
)
def test_a_turn_never_costs_more_than_without_contextpilot_and_never_dangles(
    turns: list[tuple[list[tuple[int, int]], int]], rng: object
) -> None:
    """Any conversation (blocks of 1-400 tokens, openings that collide, texts updated under
    the same id, histories cut to a window): each turn sent with history is never longer
    than the same blocks sent as without ContextPilot, and every reference it makes has its
    copy in the history sent with it."""
    pilot = ContextPilot()
    history: list[dict[str, str]] = []
    texts: dict[int, str] = {}
    for number, (picks, window) in enumerate(turns):
        blocks, seen = [], set()
        for key, tokens in picks:
            if key in seen:
                continue
            seen.add(key)
            if key not in texts or key % 5 == 0:  # some ids change their text
                texts[key] = " ".join(rng.choice(WORDS) for _ in range(6)) + f" {key}.{number}"  # type: ignore[attr-defined]
            blocks.append(Block(id=str(key), text=texts[key], tokens=tokens))
        kept = list(range(max(0, number - window), number))
        prepared = pilot.prepare(blocks, f"q{number}", conversation_id="c", kept_turns=kept)
        assert not prepared.labels
        if kept:  # a turn without history starts like any request: reordered where that pays now
            size = sum(b.token_count for b in prepared.blocks) + sum(
                estimate_tokens(r.text) for r in prepared.references
            )
            assert size <= sum(b.token_count for b in blocks)
            # a turn that refers to nothing is the prompt without ContextPilot (the top moves
            # last only in a turn that refers back, after a whole history)
            assert prepared.references or prepared.render() == "\n\n".join(
                [*(b.text for b in blocks), f"Question: q{number}"]
            )
        sent = history[2 * kept[0] :] if kept else []
        messages = prepared.to_messages(history=sent)
        assert messages[-1]["content"] == prepared.render()  # nothing had to be restored
        stale = dangling_references([m["content"] for m in sent])  # the caller's history, cut short
        assert dangling_references([m["content"] for m in messages]) == stale
        history += [{"role": "user", "content": prepared.render()}, {"role": "assistant", "content": "ok"}]


def test_one_conversation_that_never_ends_is_bounded_and_refers_only_to_what_it_remembers() -> None:
    """A conversation of 2,000 turns, three new blocks and one recurring block a turn: the
    store remembers its last ``turn_memory`` turns only; a turn keeping recent turns still
    refers to them, and one whose history holds a forgotten turn refers to nothing."""
    from contextpilot_integrations.core.conversations import ConversationStore

    store = ConversationStore(turn_memory=8)
    recurring = Block(id="r", text="The recurring passage about the harbour.")
    sizes = []
    for turn in range(2_000):
        blocks = [Block(id=f"t{turn}-{n}", text=f"Passage {n} of turn {turn} about the harbour.") for n in range(3)]
        dedup = store.split("c", [*blocks, recurring], kept_turns={turn - 1, turn - 2} if turn > 1 else None)
        store.record(dedup)
        conversation = store._conversations["c"]
        sizes.append((len(conversation.carrier), len(conversation.texts), len(conversation.holding)))
        if turn > 20 and turn % 7 == 0:  # the recurring block is carried by a kept turn: referred to
            assert [block.id for block, _, _ in dedup.repeated] == ["r"] or dedup.repeated == []
    assert max(carried for carried, _, _ in sizes) <= 4 * 11 and max(texts for _, texts, _ in sizes) <= 4 * 11
    assert sizes[-1][0] < 50  # not 6,000
    assert store.split("c", [recurring], kept_turns=None).repeated == []  # the whole history: holds forgotten turns
    assert store.split("c", [recurring], kept_turns={0, 1999}).repeated == []
    recent = store.split(
        "c", [Block(id="t1999-0", text="Passage 0 of turn 1999 about the harbour.")], kept_turns={1999}
    )
    assert [block.id for block, _, _ in recent.repeated] == ["t1999-0"]


def test_a_pilot_with_one_endless_conversation_stays_bounded_in_memory() -> None:
    import tracemalloc

    pilot = ContextPilot(max_live_requests=1)
    texts = [f"Note {n}: the shipment left the harbour at dawn." for n in range(4)]

    def turns(start: int, count: int) -> None:
        for turn in range(start, start + count):
            blocks = [f"{texts[turn % 4]} (turn {turn})", texts[(turn + 1) % 4]]
            pilot.discard(pilot.prepare(blocks, "where is it?", "endless", kept_turns={turn - 1} if turn else None))

    turns(0, 1_000)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    turns(1_000, 4_000)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 400_000, f"{grown:,} bytes for 4,000 more turns"  # bounded: was ~0.6 KB a turn
