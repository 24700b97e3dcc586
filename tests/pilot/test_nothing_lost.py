"""Regression tests for the defects found under stress and bad input (issue 11, core).

The rule they pin: the model always sees every retrieved document (in full, or as a
reference to a copy it really saw), and a call that raises changes nothing.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import STRATEGIES, BatchRequest, Block, BlockTypeError, ContextPilot
from contextpilot_integrations.index.strategies import TrieStrategy

ALL = sorted(STRATEGIES)


def snapshot(pilot: ContextPilot) -> tuple[object, ...]:
    """Everything a failed call must leave untouched."""
    stats = pilot.stats()
    conversations = {cid: (c.turns, dict(c.carrier)) for cid, c in pilot._conversations._conversations.items()}
    return stats, tuple(pilot.live_request_ids()), conversations, sorted(pilot._trie.iter_nodes())


# ---- 1. an updated document is never a reference to its old text ------------------------------
def test_updated_document_under_the_same_id_is_sent_again() -> None:
    pilot = ContextPilot()

    def doc(block_id: str, text: str) -> dict[str, object]:  # long enough for a reference to pay
        return {"id": block_id, "text": text, "tokens": 300}

    pilot.prepare([doc("doc1", "price 10")], "q", conversation_id="c")
    second = pilot.prepare([doc("doc1", "price 99")], "q", conversation_id="c")
    assert [b.text for b in second.blocks] == ["price 99"] and second.references == ()
    # the history now holds two texts labelled doc1: never refer to either
    third = pilot.prepare([doc("doc1", "price 99")], "q", conversation_id="c")
    assert [b.text for b in third.blocks] == ["price 99"] and third.references == ()
    # other documents are still de-duplicated (below the top one, which always goes out in full)
    pilot.prepare([doc("doc1", "price 99"), doc("doc2", "stable")], "q", conversation_id="c")
    again = pilot.prepare([doc("doc1", "price 99"), doc("doc2", "stable")], "q", "c")
    assert [r.block.id for r in again.references] == ["doc2"]


@settings(max_examples=60, deadline=None)
@given(
    turns=st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2)), min_size=1, max_size=5),
            st.one_of(st.none(), st.sets(st.integers(0, 8))),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_every_reference_points_at_the_same_text_in_a_kept_turn(
    turns: list[tuple[list[tuple[int, int]], set[int] | None]],
) -> None:
    """Property: a reference names a turn the caller keeps, which sent exactly this text,
    with the label the reference names or as the text its quote begins; blocks are short or long (a reference pays only
    for the long ones)."""
    pilot = ContextPilot()
    sent: dict[int, dict[str, tuple[str, bool]]] = {}  # turn -> block id -> (text sent in full, labelled)
    for docs, kept in turns:
        blocks = list(
            {i: Block(id=f"d{i}", text=f"version {v} of {i}", tokens=1 + 150 * (i % 3)) for i, v in docs}.values()
        )
        prepared = pilot.prepare(blocks, "q", conversation_id="c", kept_turns=kept)
        assert sorted([b.id for b in prepared.blocks] + [r.block.id for r in prepared.references]) == sorted(
            b.id for b in blocks
        )
        for reference in prepared.references:
            assert kept is None or reference.turn in kept
            assert sent[reference.turn][reference.block.id] == (reference.block.text, reference.labelled)
            assert reference.block.token_count > 1  # never for a block shorter than its reference
        sent[prepared.turn] = {b.id: (b.text, prepared.labels) for b in prepared.blocks}  # type: ignore[index]


# ---- 2. a rejected call leaves nothing behind ---------------------------------------------------
@pytest.mark.parametrize("kept_turns", [5, "01", [0, -1], [0.5], {True}])
def test_bad_kept_turns_are_refused_before_anything_is_recorded(kept_turns: object) -> None:
    pilot = ContextPilot()
    pilot.prepare(["alpha"], "q", conversation_id="c")
    before = snapshot(pilot)
    with pytest.raises(TypeError, match="kept_turns"):
        pilot.prepare(["gamma", "alpha"], "q", conversation_id="c", kept_turns=kept_turns)  # type: ignore[arg-type]
    assert snapshot(pilot) == before
    nxt = pilot.prepare(["gamma"], "q", conversation_id="c")
    assert [b.text for b in nxt.blocks] == ["gamma"]  # never a reference to a turn that was not sent


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda p: p.prepare(["x"], "q", conversation_id=7), TypeError),
        (lambda p: p.prepare(["x"], "q", request_id=""), ValueError),
        (lambda p: p.prepare(["x", ""], "q", conversation_id="c"), ValueError),
        (lambda p: p.prepare(["x"], None, conversation_id="c"), TypeError),
    ],
)
def test_any_rejected_prepare_changes_nothing(call: object, error: type[Exception]) -> None:
    pilot = ContextPilot()
    pilot.prepare(["x", "y"], "q", conversation_id="c")
    before = snapshot(pilot)
    with pytest.raises(error):
        call(pilot)  # type: ignore[operator]
    assert snapshot(pilot) == before


# ---- 3. plan() is all or nothing ----------------------------------------------------------------
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize(
    "bad",
    [
        {"blocks": ["z"], "query": "q", "conversation_id": "c", "kept_turns": 0},
        {"blocks": ["z", ""], "query": "q"},
        {"blocks": ["z"], "query": "q", "request_id": "taken"},
        {"blocks": ["z"], "query": 3},
    ],
)
def test_plan_with_one_bad_request_records_nothing(strategy: str, bad: dict[str, object]) -> None:
    pilot = ContextPilot(strategy)
    pilot.prepare(["a"], "q", conversation_id="c", request_id="taken")
    before = snapshot(pilot)
    good = [
        BatchRequest(blocks=["a", "b"], query="q1"),
        BatchRequest(blocks=["b", "c"], query="q2", conversation_id="c"),
    ]
    with pytest.raises((TypeError, ValueError), match="request #2"):
        pilot.plan([*good, bad])
    assert snapshot(pilot) == before
    pilot.check()
    assert len(pilot.plan(good)) == 2  # the same good items then go through


# ---- 4. counts from the engine are checked --------------------------------------------------------
@pytest.mark.parametrize("count", [math.nan, 1.5, -1, True, "2", None])
def test_truncate_and_restore_refuse_bad_counts(count: object) -> None:
    pilot = ContextPilot("retrieval")
    rid = pilot.prepare([{"id": k, "text": f"text {k} " * 20} for k in "abc"], "q").request_id
    before = snapshot(pilot)
    with pytest.raises((TypeError, ValueError)):
        pilot.truncate(rid, count)  # type: ignore[arg-type]
    if count is not None:
        with pytest.raises((TypeError, ValueError)):
            pilot.restore(rid, count)  # type: ignore[arg-type]
    assert snapshot(pilot) == before
    pilot.check()
    assert pilot.truncate(rid, 1) and pilot.predicted_cached_blocks(["a", "b"]) == 1


def test_record_usage_is_checked_before_it_counts() -> None:
    pilot = ContextPilot()
    prepared = pilot.prepare(["a"], "q", conversation_id="c")
    with pytest.raises(TypeError):
        pilot.record_usage(prepared, 10, "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        pilot.record_usage(prepared, -1, 0)
    assert pilot.stats().engine_requests == 0 and pilot.conversation_usage("c") == (0, 0, 0)


# ---- 17. the trie strategy's popularity map is bounded and cleared by reset ----------------------
def test_popularity_map_is_bounded_and_reset() -> None:
    pilot = ContextPilot(max_tracked_blocks=1_000)
    strategy = pilot._strategy
    assert isinstance(strategy, TrieStrategy)
    for i in range(3_000):
        pilot.prepare([{"id": f"{i}a", "text": "a"}, {"id": f"{i}b", "text": "b"}, {"id": "hot", "text": "c"}], "q")
    assert strategy.tracked_blocks <= 1_000
    assert strategy._requested["hot"] > 1  # the popular block survives every decay
    pilot.reset()
    assert strategy.tracked_blocks == 0


# ---- 18. a long plan does not hold up concurrent prepares ----------------------------------------
def test_prepare_runs_while_a_plan_is_being_computed() -> None:
    """Before, a plan held the lock throughout: every prepare waited for the whole plan.

    (The paper strategy plans outside the lock too, but most of its plan is one scipy call
    that holds the GIL, so a test of it measures the interpreter, not the lock;
    ``benchmarks/bench_core.py`` reports its prepare latency during a plan.)"""
    strategy = "trie"
    pilot = ContextPilot(strategy)
    blocks = [Block(id=f"b{i}", text=f"block {i}") for i in range(400)]
    rows = [[blocks[(i * j * 7 + j) % 400] for j in range(1, 9)] for i in range(3_000)]
    batch = [(list({b.id: b for b in row}.values()), f"q{i}") for i, row in enumerate(rows)]
    probe = [Block(id="x", text="x"), Block(id="y", text="y")]
    planned: list[object] = []
    thread = threading.Thread(target=lambda: planned.extend(pilot.plan(batch)))
    started = time.perf_counter()
    thread.start()
    latencies = []
    while thread.is_alive():
        begin = time.perf_counter()
        pilot.prepare(probe, "q")
        latencies.append(time.perf_counter() - begin)
        time.sleep(0.001)
    thread.join()
    plan_seconds = time.perf_counter() - started
    latencies.sort()
    blocked = sum(latencies) / plan_seconds
    print(f"{strategy}: {len(latencies)} prepares, blocked {blocked:.0%} of a {plan_seconds:.2f} s plan")
    assert len(planned) == 3_000
    # before: about 5 (those before the plan took the lock; the next waited for the whole plan)
    assert len(latencies) >= 50
    pilot.check()


def test_paper_online_search_does_not_read_every_child_sharing_a_popular_block() -> None:
    pilot = ContextPilot("paper")
    for i in range(2_000):
        pilot.prepare([{"id": "hot", "text": "popular"}, {"id": f"own {i}", "text": f"own {i}"}], "q")
    tree = pilot._strategy.tree  # type: ignore[attr-defined]
    (hub,) = tree.root.children.values()  # the shared block became an inner node (split)
    assert len(hub.children) == 2_000 and len(hub.by_key["hot"]) == 2_000
    import contextpilot_integrations.index.cluster as cluster

    calls = 0
    original = cluster.context_distance

    def counted(*args: object) -> float:
        nonlocal calls
        calls += 1
        return original(*args)  # type: ignore[arg-type]

    cluster.context_distance = counted  # type: ignore[assignment]
    try:
        order = pilot.prepare(
            [{"id": "hot", "text": "popular"}, {"id": "own 5", "text": "own 5"}, {"id": "new", "text": "new"}], "q"
        )
    finally:
        cluster.context_distance = original
    assert [b.id for b in order.blocks][:2] == ["hot", "own 5"] and order.cached_blocks == 2
    assert calls <= 4  # two per level of the tree, not one per child sharing "hot"


# ---- 20. clear errors for what is not a list of blocks ---------------------------------------------
@pytest.mark.parametrize("value", [None, 42, Block(text="one block")])
def test_prepare_names_what_it_expected(value: object) -> None:
    with pytest.raises(BlockTypeError, match="blocks must be a sequence of blocks"):
        ContextPilot().prepare(value, "q")  # type: ignore[arg-type]
