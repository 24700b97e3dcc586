"""Never worse than retrieval order (issue 21, item 4): labels and reordering only where the
reuse pays for the tokens they add."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot, MicroBatcher
from contextpilot_integrations.core.gain import (
    Balance,
    Cooccurrence,
    Retention,
    choose_order,
    label_tokens,
    leading_reuse,
)
from contextpilot_integrations.pilot import BatchRequest


def doc(name: str, words: int = 100) -> Block:
    """``words // 2`` tokens (four characters a token)."""
    return Block(id=name, text=f"{name} " * words)


def annotated(*args: Any, **options: Any) -> ContextPilot:
    """A pilot that prices the order annotation into its sends and may put the top block
    anywhere: the send decision these tests weigh (the defaults leave the annotation out and
    keep the top block at an edge: tests/core/test_reading.py)."""
    return ContextPilot(*args, **{"annotate_order": True, "keep_top": False, **options})


def plain_prompt(blocks: list[Block], query: str) -> str:
    """What a user sends without ContextPilot: the texts in the retriever's order, then the question."""
    return "\n\n".join([*(b.text for b in blocks), f"Question: {query}"])


def test_a_request_that_shares_nothing_is_the_prompt_without_contextpilot() -> None:
    pilot = ContextPilot()
    for names in (["a", "b", "c"], ["d", "e"], ["f"]):  # nothing recurs: labels would buy nothing
        blocks = [doc(n) for n in names]
        prepared = pilot.prepare(blocks, "q")
        assert not prepared.labels and prepared.order_annotation == ""
        assert prepared.render() == plain_prompt(blocks, "q")


def test_a_reorder_that_buys_less_than_its_annotation_is_not_made() -> None:
    pilot = annotated()
    tiny = [Block(id=n, text=n) for n in "xyz"]  # one token each: the annotation costs more
    pilot.prepare(tiny, "q")
    reordered = pilot.prepare(list(reversed(tiny)), "q")
    assert [b.id for b in reordered.blocks] == ["z", "y", "x"] and reordered.order_annotation == ""


def test_a_request_larger_than_the_cache_is_not_indexed() -> None:
    pilot = ContextPilot(cache_tokens=80)
    big = pilot.prepare([doc("a"), doc("b")], "q")  # 100 tokens: the engine cannot keep it
    assert pilot.stats().live_requests == 0 and big.cached_blocks == 0
    small = pilot.prepare([doc("a")], "q")
    assert pilot.stats().live_requests == 1 and small.cached_blocks == 0


def test_a_conversation_in_the_papers_form_keeps_its_labels() -> None:
    """Later turns refer to its blocks by label (the default sends turn 0 as its text alone
    and quotes it instead: tests/core/test_conversations.py)."""
    pilot = annotated(plain_prompts=False)
    first = pilot.prepare([doc("a"), doc("b")], "q", conversation_id="c")
    assert first.labels and "[a] " in first.render()
    second = pilot.prepare([doc("a"), doc("c")], "q2", conversation_id="c")
    assert [r.text for r in second.references] == ["Please refer to [a] in the previous conversation."]


def test_label_tokens_count_the_label_only() -> None:
    assert label_tokens([doc("545", 1000)], ContextPilot().templates) == 2  # "[545] " rounded up


# ---- what the engine keeps, what recurs, and bursts (the reuse a bet is paid from) -----------------
def test_retention_trusts_the_index_until_the_engine_reports_and_weighs_recent_reports_most() -> None:
    retention = Retention(decay=0.5)
    assert not retention.tested and retention.share_or(1.0) == 1.0 and retention.share_or(0.0) == 0.0
    retention.observe(0, 0)  # a report on a request the index predicted nothing for: no evidence
    assert not retention.tested
    retention.observe(100, 100)
    assert retention.tested and retention.share_or(0.0) == 1.0
    retention.observe(100, 0)  # the engine had nothing of it: weighs twice the older report
    assert retention.share_or(1.0) == (0.5 * 100) / (0.5 * 100 + 100)
    retention.observe(100, 500)  # more than predicted counts as all of it
    assert retention.share_or(1.0) == (0.25 * 100 + 100) / (0.25 * 100 + 0.5 * 100 + 100)
    with pytest.raises(ValueError, match="decay"):
        Retention(decay=0.0)


def test_an_engine_that_served_the_prediction_keeps_the_bets_on() -> None:
    pilot = ContextPilot()
    pilot.prepare([doc("a"), doc("b")], "q")
    pilot.prepare([doc("b"), doc("a"), doc("c")], "q")
    reused = pilot.prepare([doc("a"), doc("b"), doc("e")], "q")
    pilot.observe_cached(reused, reused.cached_blocks)  # served as predicted
    assert pilot.stats().predicted_kept == 1.0
    assert pilot.prepare([doc("a"), doc("b"), doc("f")], "q").cached_blocks == 2


def burst() -> list[tuple[list[Block], str]]:
    """Two requests that share a and b, one that shares nothing."""
    return [
        ([doc("x"), doc("a"), doc("b")], "q1"),
        ([doc("y"), doc("z")], "q2"),
        ([doc("b"), doc("a"), doc("w")], "q3"),
    ]


def test_a_micro_batcher_plans_its_bursts_as_concurrent() -> None:
    seen: list[bool] = []

    class Recording:
        def __init__(self) -> None:
            self.pilot = ContextPilot()

        def plan(self, requests: Sequence[BatchRequest], *, in_order: bool = True) -> Any:
            seen.append(in_order)
            return self.pilot.plan(requests, in_order=in_order)

        def bound(self, prepared: Any) -> Any:
            return self.pilot.bound(prepared)

    batcher = MicroBatcher(Recording())
    prepared = batcher.prepare([doc("a"), doc("b")], "q")
    assert seen == [False] and not prepared.labels


# ---- issue 29: decisions that hold on any traffic ---------------------------------------------------
def test_one_text_per_block_a_reordered_request_follows_a_plain_one() -> None:
    """Blocks are their text alone whether reordered or not; the ranking restated by position."""
    pilot = annotated()
    first = pilot.prepare([doc("a"), doc("b")], "q")
    assert not first.labels and first.render() == plain_prompt([doc("a"), doc("b")], "q")
    again = pilot.prepare([doc("c"), doc("b"), doc("a")], "q")  # reordered onto the prefix the plain one left
    assert [b.id for b in again.blocks][:2] == ["a", "b"] and again.cached_blocks == 2 and not again.labels
    assert again.order_annotation == "Context in priority order, by position: #3 > #2 > #1."
    assert all(block.text in again.render() for block in again.blocks) and "[a]" not in again.render()


def test_predicted_cached_blocks_sees_plain_sends() -> None:
    pilot = ContextPilot()
    sent = pilot.prepare([doc(n) for n in "abcdefgh"], "q")
    assert not sent.labels
    assert pilot.predicted_cached_blocks([b.id for b in sent.blocks]) == 8  # the exact order it just sent


def test_user_ids_never_collide_with_internal_keys() -> None:
    """Issue 31 item 4: a block id starting with the old internal prefix is a user id like any other."""
    pilot = ContextPilot()
    odd = [Block(id=f"\x00plain:{n}", text=f"{n} " * 100) for n in "ab"]
    pilot.prepare(odd, "q", conversation_id="c")  # labelled (a conversation)
    assert pilot.predicted_cached_blocks(["a", "b"]) == 0 and pilot.reusable_tokens([doc("a"), doc("b")]) == 0
    unrelated = pilot.prepare([doc("a"), doc("b")], "q")  # plain "a b": nothing of it was ever sent
    assert unrelated.cached_blocks == 0
    assert pilot.predicted_cached_blocks([b.id for b in odd]) == 2


def test_the_paper_form_stays_available() -> None:
    pilot = annotated(order_form="labels")
    pilot.prepare([doc("a"), doc("b")], "q")
    reordered = pilot.plan([([doc("c"), doc("b"), doc("a")], "q"), ([doc("a"), doc("b")], "q2")])
    assert any(p.labels and "[" in p.render() for p in reordered)
    with pytest.raises(ValueError, match="order_form"):
        ContextPilot(order_form="shuffled")  # type: ignore[arg-type]


def test_the_moved_form_names_only_blocks_out_of_place() -> None:
    pilot = annotated(order_form="moved")
    pilot.prepare([doc("a"), doc("b")], "q")
    again = pilot.prepare([doc("c"), doc("b"), doc("a"), doc("d")], "q")
    assert [b.id for b in again.blocks] == ["a", "b", "c", "d"]
    assert again.order_annotation == "Context out of priority order: #3 ranks 1, #1 ranks 3; the rest as shown."


def test_label_tokens_count_each_label_in_the_blocks_units() -> None:
    """Each labelled block is a piece of the prompt: its label rounds up on its own (as the
    simulator and an engine count), and a given tokenizer is used as it is."""
    blocks = [doc(n, 10) for n in ("1", "2", "3", "4")]  # "[1] " is 4 characters: one token each
    templates = ContextPilot().templates
    assert label_tokens(blocks, templates) == 4
    blocks = [doc(n, 10) for n in ("545", "546")]  # "[545] " is 6 characters: two tokens each, not 3 for both
    assert label_tokens(blocks, templates) == 4
    assert label_tokens(blocks, templates, lambda text: len(text)) == 12  # the engine's tokenizer


def test_cooccurrence_learns_which_block_follows_which() -> None:
    seen = Cooccurrence()
    assert seen.chance(None, "a") == 0.0  # a first sight: nothing shown yet
    for _ in range(3):
        seen.record(["a", "b", "c"])
    seen.record(["a", "x"])
    assert seen.chance(None, "a") == 4 / 5
    assert seen.chance("a", "b") == 3 / 4 and seen.chance("a", "x") == 1 / 4 and seen.chance("b", "a") == 0.0
    bounded = Cooccurrence(max_pairs=4)
    for n in range(20):
        bounded.record([f"k{n}", f"k{n + 1}"])
    assert len(bounded) <= 4


def test_later_reuse_counts_the_chance_that_blocks_follow_each_other() -> None:
    """Scattered recurrence: a, b, c each recur, but never together: a prefix of them pays nothing later."""
    together, scattered = Cooccurrence(), Cooccurrence()
    for n in range(8):
        together.record(["a", "b", "c", f"t{n}"])
        scattered.record([("a", "b", "c")[n % 3], f"s{n}"])
    tokens = dict.fromkeys("abcd", 30)

    def reorders(seen: Cooccurrence) -> bool:
        choice = choose_order(
            ["a", "b", "c", "d"],
            ["d", "a", "b", "c"],
            tokens,
            matched=lambda order, labelled: 0,
            chance=seen.chance,
            annotation_cost=30,
            label_cost=0,
        )
        return choice.order[0] == "a"

    assert reorders(together)  # a b c go out together: their prefix is worth the annotation
    assert not reorders(scattered)  # each recurs alone: 30 tokens of annotation would buy less


def test_bets_are_paid_only_from_what_the_sends_bought() -> None:
    tokens = dict.fromkeys("abcd", 30)
    seen = Cooccurrence()
    for _ in range(9):
        seen.record(["a", "b", "c"])

    def choose(budget: float) -> list[str]:
        return choose_order(
            ["a", "b", "c", "d"],
            ["d", "a", "b", "c"],
            tokens,
            matched=lambda order, labelled: 0,
            chance=seen.chance,
            annotation_cost=10,
            label_cost=0,
            budget=budget,
        ).order

    assert choose(budget=0.0) == ["d", "a", "b", "c"]  # nothing bought yet: no bet
    assert choose(budget=10.0) == ["a", "b", "c", "d"]  # the bet costs 10 now, paid from the balance
    balance = Balance(decay=0.5)
    balance.add(-10)  # a bet
    assert balance.budget == 0.0
    balance.add(40)  # a later request reused its prefix beyond its own retriever's order
    assert balance.budget == 35.0
    balance.correct(-50)  # the engine served less than predicted
    assert balance.budget == 0.0 and balance.value == -15.0


def test_a_bet_that_never_pays_is_not_repeated() -> None:
    """Scattered short blocks online: a pilot does not keep betting tokens it never gets back."""
    pilot = annotated()
    blocks = [Block(id=f"m{n}", text="memory snippet text " * 7) for n in range(40)]  # ~35 tokens each
    restated = 0
    for step in range(200):
        picked = [blocks[(step * 7 + k * 3) % 40] for k in range(20)]
        prepared = pilot.prepare(picked, "q")
        restated += bool(prepared.order_annotation)
        pilot.evict([prepared.request_id])  # a cache too small to keep anything
    assert restated == 0 and pilot.stats().send_balance == 0.0


def test_two_overlapping_questions_share_the_prefix_the_first_left() -> None:
    """The issue's q1/q2: q2 lines up with q1's plain prefix (d3 d1), though q1 went out plain."""
    pilot = annotated()
    docs = {n: doc(f"d{n}", 200) for n in range(1, 10)}  # about 100 tokens each
    q1 = pilot.prepare([docs[n] for n in (3, 1, 7, 5, 9)], "q1")
    assert not q1.labels and [b.id for b in q1.blocks] == ["d3", "d1", "d7", "d5", "d9"]
    q2 = pilot.prepare([docs[n] for n in (9, 2, 5, 3, 1)], "q2")
    assert [b.id for b in q2.blocks][:2] == ["d3", "d1"] and q2.cached_blocks == 2
    assert q2.render().startswith(q1.render_context().split("\n\n")[0])
    assert [b.id for b in q2.blocks] == ["d3", "d1", "d9", "d5", "d2"]  # then the blocks q1 carried too
    assert q2.order_annotation == "Context in priority order, by position: #3 > #5 > #4 > #1 > #2."


def test_engine_that_keeps_nothing_gets_plain_prompts() -> None:
    pilot = annotated()
    pilot.prepare([doc("a"), doc("b")], "q")
    reused = pilot.prepare([doc("c"), doc("a"), doc("b")], "q")  # reordered onto a b
    assert reused.cached_blocks == 2 and reused.order_annotation
    pilot.observe_cached(reused, 0)  # one slot: the engine had moved on to another prompt
    assert pilot.stats().predicted_kept == 0.0 and pilot.stats().send_balance < 0
    later = pilot.prepare([doc("f"), doc("a"), doc("b")], "q")
    assert later.render() == plain_prompt([doc("f"), doc("a"), doc("b")], "q")


def test_a_batch_sent_in_order_pays_for_its_partners_a_concurrent_burst_does_not_bet() -> None:
    in_order = annotated().plan(burst())
    partners = [p for p in in_order if {"a", "b"} <= {b.id for b in p.blocks}]
    assert sorted(p.cached_blocks for p in partners) == [0, 2]
    concurrent = annotated().plan(burst(), in_order=False)  # their order at the engine is nobody's
    assert not any(p.labels or p.order_annotation or p.cached_blocks for p in concurrent)


def test_a_batch_partner_the_cache_cannot_keep_until_it_comes_is_not_sure() -> None:
    def batch() -> list[tuple[list[Block], str]]:
        return [([doc("x"), doc("a"), doc("b")], "q1"), ([doc("f")], "q2"), ([doc("b"), doc("a"), doc("w")], "q3")]

    roomy = annotated().plan(batch())
    assert any(p.cached_blocks == 2 for p in roomy)
    tiny = annotated(cache_tokens=160).plan(batch())  # one request at a time: nothing survives to a partner
    assert not any(p.order_annotation for p in tiny)


KEYS = st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True)


@settings(max_examples=200, deadline=None)
@given(
    retrieval=KEYS,
    shuffle=st.randoms(use_true_random=False),
    cached=st.integers(0, 6),
    plain_cached=st.integers(0, 6),
    recurring=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 1)),
    annotation=st.integers(0, 300),
    labels=st.integers(0, 100),
    budget=st.sampled_from([0.0, 25.0, 1e9]),
    plain_ok=st.booleans(),
    form=st.sampled_from(["positions", "moved", "labels"]),
)
def test_a_send_loses_now_at_most_the_budget_against_the_prompt_without_contextpilot(
    retrieval: list[str],
    shuffle: Any,
    cached: int,
    plain_cached: int,
    recurring: dict[str, float],
    annotation: int,
    labels: int,
    budget: float,
    plain_ok: bool,
    form: Any,
) -> None:
    proposed = list(retrieval)
    shuffle.shuffle(proposed)
    tokens = {key: 10 * (ord(key) - 96) for key in retrieval}

    def matched(order: Sequence[str], labelled: bool) -> int:
        return min(cached if labelled else plain_cached, len(order))

    choice = choose_order(
        proposed,
        retrieval,
        tokens,
        matched=matched,
        chance=lambda previous, key: recurring.get(key, 0.0),
        annotation_cost=annotation,
        label_cost=labels,
        form=form,
        plain_ok=plain_ok,
        budget=budget,
    )
    assert choice.order in (proposed, retrieval)
    assert choice.labels or plain_ok
    if not choice.labels and form == "labels":
        assert choice.order == retrieval  # the paper's form: unlabelled is exactly the user's prompt
    if plain_ok:
        now = sum(tokens[k] for k in choice.order[: matched(choice.order, choice.labels)])
        cost = (labels if choice.labels else 0) + (annotation if choice.order != retrieval else 0)
        plain_now = sum(tokens[k] for k in retrieval[: matched(retrieval, False)])
        assert now - cost >= plain_now - budget  # a bet is paid from what earlier sends bought
        assert choice.bought == now - cost - plain_now


def test_a_request_outside_a_conversation_follows_the_prefix_a_conversation_left() -> None:
    """A conversation's first turn goes out as its text alone: another user's request with
    those blocks follows that very text (one text per block), restating its ranking by position."""
    pilot = annotated()
    pilot.prepare([doc("a"), doc("b"), doc("c")], "q", conversation_id="user")
    other = pilot.prepare([doc("b"), doc("a"), doc("d")], "q")
    assert not other.labels and [b.id for b in other.blocks] == ["a", "b", "d"] and other.cached_blocks == 2
    assert other.order_annotation == "Context in priority order, by position: #2 > #1 > #3."


@given(
    st.lists(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True), min_size=1, max_size=30),
    st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True),
    st.integers(0, 8),
)
@settings(max_examples=60, deadline=None)
def test_the_inlined_later_reuse_weighs_as_the_chance_it_inlines(
    sent: list[list[str]], order: list[str], cached: int
) -> None:
    """:meth:`Cooccurrence.carry` (the hot path) and the loop over any :data:`Chance` agree."""
    seen = Cooccurrence(max_pairs=8)  # small: halving takes part too
    for send in sent:
        seen.record(send)
    tokens = {key: 10 + ord(key) for key in order}
    cached = min(cached, len(order))
    inlined = leading_reuse(order, tokens, cached, seen)
    called = leading_reuse(order, tokens, cached, seen.chance)  # a bound method: not a Cooccurrence
    assert inlined == pytest.approx(called)
    assert inlined >= sum(tokens[key] for key in order[:cached])
