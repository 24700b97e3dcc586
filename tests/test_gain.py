"""Never worse than retrieval order (issue 21, item 4): labels and reordering only where the
reuse pays for the tokens they add."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot, MicroBatcher
from contextpilot_integrations.gain import Retention, choose_order, label_tokens, plain_keys
from contextpilot_integrations.pilot import BatchRequest


def doc(name: str, words: int = 100) -> Block:
    """``words // 2`` tokens (four characters a token)."""
    return Block(id=name, text=f"{name} " * words)


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


def test_blocks_that_recur_are_labelled_and_follow_the_shared_prefix() -> None:
    pilot = ContextPilot()
    assert not pilot.prepare([doc("a"), doc("b")], "q").labels
    again = pilot.prepare([doc("b"), doc("a"), doc("c")], "q")  # a and b recur: labelled for later requests
    assert again.labels and [b.id for b in again.blocks] == ["b", "a", "c"] and again.order_annotation == ""
    third = pilot.prepare([doc("a"), doc("b"), doc("d")], "q")  # reordered onto the labelled prefix left cached
    assert third.labels and [b.id for b in third.blocks] == ["b", "a", "d"] and third.cached_blocks == 2
    assert third.order_annotation == "Context in priority order: [a] > [b] > [d]."


def test_plain_and_labelled_blocks_are_different_prefixes_in_the_index() -> None:
    pilot = ContextPilot()
    first = pilot.prepare([doc("a"), doc("b")], "q")
    assert not first.labels
    assert pilot.predicted_cached_blocks(["a", "b"]) == 0  # the engine holds "a b", not "[a] a [b] b"
    assert pilot.predicted_cached_blocks(plain_keys(["a", "b"])) == 2
    again = pilot.prepare([doc("a"), doc("b")], "q")  # the same two blocks in the same order
    assert again.cached_blocks == 2 and again.render() == first.render()  # sent plain: it reuses the plain prefix
    assert pilot.reusable_tokens([doc("a"), doc("b")]) == again.block_tokens


def test_a_reorder_that_buys_less_than_its_annotation_is_not_made() -> None:
    pilot = ContextPilot()
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


def test_a_conversation_keeps_its_labels() -> None:
    """Later turns refer to its blocks by label, so turn 0 is labelled even when nothing recurs."""
    pilot = ContextPilot()
    first = pilot.prepare([doc("a"), doc("b")], "q", conversation_id="c")
    assert first.labels and "[a] " in first.render()
    second = pilot.prepare([doc("a"), doc("c")], "q2", conversation_id="c")
    assert [r.text for r in second.references] == ["Please refer to [a] in the previous conversation."]


def test_label_tokens_count_the_label_only() -> None:
    assert label_tokens([doc("545", 1000)], ContextPilot().templates) == 2  # "[545] " rounded up


KEYS = st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True)


@settings(max_examples=200, deadline=None)
@given(
    retrieval=KEYS,
    shuffle=st.randoms(use_true_random=False),
    cached=st.integers(0, 6),
    plain_cached=st.integers(0, 6),
    popular=st.sets(st.sampled_from("abcdefgh")),
    annotation=st.integers(0, 300),
    labels=st.integers(0, 100),
    recur=st.floats(0, 1),
    plain_ok=st.booleans(),
)
def test_the_choice_pays_at_least_as_well_as_the_prompt_without_contextpilot(
    retrieval: list[str],
    shuffle: object,
    cached: int,
    plain_cached: int,
    popular: set[str],
    annotation: int,
    labels: int,
    recur: float,
    plain_ok: bool,
) -> None:
    proposed = list(retrieval)
    shuffle.shuffle(proposed)  # type: ignore[attr-defined]
    tokens = {key: 10 * (ord(key) - 96) for key in retrieval}

    def matched(order: list[str], labelled: bool) -> int:
        return min(cached if labelled else plain_cached, len(order))

    choice = choose_order(
        proposed,
        retrieval,
        tokens,
        matched=matched,  # type: ignore[arg-type]
        shared=popular.__contains__,
        annotation_cost=annotation,
        label_cost=labels,
        plain_ok=plain_ok,
        recur=recur,
    )
    assert sorted(choice.order) == sorted(retrieval)
    assert choice.order in (proposed, retrieval)
    assert choice.labels or plain_ok
    if not choice.labels:
        assert choice.order == retrieval  # plain: exactly the user's prompt
    plain_reuse = sum(tokens[k] for k in retrieval[: min(plain_cached, len(retrieval))])
    if plain_ok and choice.labels:  # labelled only when the labels (and annotation) are paid back, now or later
        run = 0
        for position, key in enumerate(choice.order):
            if position >= min(cached, len(choice.order)) and key not in popular:
                break
            run += tokens[key]
        bonus = max(tokens.values())  # at most one more block, weighed by recur
        extra = annotation if choice.order != retrieval else 0
        assert run + bonus - labels - extra >= plain_reuse


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


def test_later_reuse_counts_only_as_much_as_blocks_recur() -> None:
    retrieval = ["a", "b", "c", "d"]
    tokens = dict.fromkeys(retrieval, 100)

    def choose(recur: float, kept: float = 1.0) -> bool:
        def chance(key: str) -> float:
            return recur if key != "d" else 0.0  # a, b and c were carried before

        return choose_order(
            retrieval,
            retrieval,
            tokens,
            matched=lambda order, labelled: 0,
            shared=chance,
            annotation_cost=0,
            label_cost=6,
            recur=recur,
            kept=kept,
        ).labels

    # a later request reuses a, then a b, then a b c: 0.1 x 100 + 0.01 x 100 + 0.001 x 100 (+ d)
    assert choose(recur=0.1)  # about 11 tokens expected back for 6 of labels
    assert not choose(recur=0.04)  # about 4.2 < 6: little recurs yet, the labels would not pay
    assert not choose(recur=0.1, kept=0.4)  # the engine kept 40% of what was predicted: 4.4 < 6


def test_an_engine_that_keeps_nothing_of_the_predictions_gets_plain_prompts() -> None:
    pilot = ContextPilot()
    pilot.prepare([doc("a"), doc("b")], "q")
    labelled = pilot.prepare([doc("b"), doc("a"), doc("c")], "q")  # a and b recur: labelled for later
    assert labelled.labels and pilot.stats().predicted_kept == 1.0
    reused = pilot.prepare([doc("a"), doc("b"), doc("e")], "q")
    assert reused.cached_blocks == 2
    pilot.observe_cached(reused, 0)  # one slot: the engine had moved on to another prompt
    assert pilot.stats().predicted_kept == 0.0
    later = pilot.prepare([doc("a"), doc("b"), doc("f")], "q")  # would follow the labelled prefix
    assert not later.labels and later.order_annotation == ""
    assert later.render() == plain_prompt([doc("a"), doc("b"), doc("f")], "q")


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


def test_a_batch_sent_in_order_pays_for_its_partners_a_concurrent_burst_does_not_bet() -> None:
    in_order = ContextPilot().plan(burst())
    partners = [p for p in in_order if {"a", "b"} <= {b.id for b in p.blocks}]
    assert all(p.labels for p in partners) and sorted(p.cached_blocks for p in partners) == [0, 2]
    concurrent = ContextPilot().plan(burst(), in_order=False)  # their order at the engine is nobody's
    assert not any(p.labels or p.order_annotation or p.cached_blocks for p in concurrent)


def test_a_micro_batcher_plans_its_bursts_as_concurrent() -> None:
    seen: list[bool] = []

    class Recording:
        def __init__(self) -> None:
            self.pilot = ContextPilot()

        def plan(self, requests: Sequence[BatchRequest], *, in_order: bool = True) -> Any:
            seen.append(in_order)
            return self.pilot.plan(requests, in_order=in_order)

    batcher = MicroBatcher(Recording())
    prepared = batcher.prepare([doc("a"), doc("b")], "q")
    assert seen == [False] and not prepared.labels
