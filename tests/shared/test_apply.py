"""Shared-log entries applied to a real pilot: idempotent, in order, robust to bad input."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.validation import MAX_BLOCKS
from contextpilot_integrations.shared.apply import Applier
from contextpilot_integrations.shared.entries import Batch, decode_batch, encode_batch, seal, unseal

IDS = [f"r{n}" for n in range(6)]
BLOCKS = [f"b{n}" for n in range(8)]

entries = st.one_of(
    st.tuples(
        st.just("sent"),
        st.sampled_from(IDS),
        st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=5, unique=True),
        st.just([]),
        st.just(0.0),
    ),
    st.tuples(st.just("evicted"), st.lists(st.sampled_from(IDS), max_size=3), st.just(0.0)),
    st.tuples(st.just("truncated"), st.sampled_from(IDS), st.integers(0, 5), st.just(0.0)),
    st.tuples(st.just("restored"), st.sampled_from(IDS), st.one_of(st.none(), st.integers(0, 5)), st.just(0.0)),
    st.tuples(st.just("reset"), st.just(0.0)),
)


def applied(sequence: list[tuple[object, ...]], times: int = 1, replay: int = 1) -> dict[str, tuple[str, ...]]:
    pilot = ContextPilot()
    applier = Applier(pilot)
    for _ in range(replay):
        for entry in sequence:
            for _ in range(times):
                applier.apply(entry, own=False)
    pilot.check()
    return dict(pilot.live_orders())


@settings(max_examples=150, deadline=None)
@given(st.lists(entries, max_size=25))
def test_an_entry_applied_twice_changes_nothing(sequence: list[tuple[object, ...]]) -> None:
    assert applied(sequence, times=2) == applied(sequence)


def causal(sequence: list[tuple[object, ...]]) -> list[tuple[object, ...]]:
    """What one stream can hold: one "sent" per request id (ids are unique), and a
    truncation or restore of a request only after its "sent" (an eviction may come first:
    another worker's engine event can overtake the "sent")."""
    sent: set[object] = set()
    kept = []
    for entry in sequence:
        if entry[0] == "sent":
            if entry[1] in sent:
                continue
            sent.add(entry[1])
        elif entry[0] in ("truncated", "restored") and entry[1] not in sent:
            continue
        kept.append(entry)
    return kept


@settings(max_examples=150, deadline=None)
@given(st.lists(entries, max_size=25).map(causal))
def test_replaying_any_tail_of_the_log_changes_nothing(sequence: list[tuple[object, ...]]) -> None:
    """A worker restored from a snapshot replays entries the snapshot may already reflect."""
    pilot = ContextPilot()
    applier = Applier(pilot)
    for entry in sequence:
        applier.apply(entry, own=False)
    final = dict(pilot.live_orders())
    for start in range(len(sequence)):
        for entry in sequence[start:]:
            applier.apply(entry, own=False)
        assert dict(pilot.live_orders()) == final, f"replaying from entry {start} changed the index"


@settings(max_examples=100, deadline=None)
@given(st.lists(entries, max_size=25))
def test_a_snapshot_plus_nothing_equals_the_log(sequence: list[tuple[object, ...]]) -> None:
    pilot = ContextPilot()
    applier = Applier(pilot)
    for entry in sequence:
        applier.apply(entry, own=False)
    restored = ContextPilot()
    seq = Applier(restored).load(applier.snapshot("stream-1", seq=len(sequence) + 1), "stream-1", len(sequence) + 1)
    assert seq == len(sequence) + 1
    assert dict(restored.live_orders()) == dict(pilot.live_orders())


def test_a_sent_entry_after_its_eviction_is_ignored() -> None:
    pilot = ContextPilot()
    applier = Applier(pilot)
    applier.apply(("evicted", ["r1"], 0.0), own=False)  # worker B's engine event came first
    applier.apply(("sent", "r1", ["a", "b"], [1, 1], 0.0), own=False)
    assert pilot.live_request_ids() == []


def test_own_entries_are_not_applied_twice() -> None:
    pilot = ContextPilot()
    applier = Applier(pilot)
    prepared = pilot.prepare([{"id": "a", "text": "a"}, {"id": "b", "text": "b"}], "q")
    order = list(dict(pilot.live_orders())[prepared.request_id])  # the index's keys (plain or labelled)
    pilot.truncate(prepared.request_id, 1)
    applier.apply(("sent", prepared.request_id, order, [1, 1], 0.0), own=True)  # still live: nothing
    applier.apply(("truncated", prepared.request_id, 1, 0.0), own=True)
    assert dict(pilot.live_orders()) == {prepared.request_id: (order[0],)}
    assert pilot.stats().requests_prepared == 1


def test_own_sent_comes_back_after_a_reset_another_worker_reported_first() -> None:
    pilot = ContextPilot()
    applier = Applier(pilot)
    prepared = pilot.prepare([{"id": "a", "text": "a"}], "q")
    applier.apply(("reset", 0.0), own=False)  # earlier in the stream than our "sent"
    applier.apply(("sent", prepared.request_id, ["a"], [1], 0.0), own=True)
    assert pilot.live_request_ids() == [prepared.request_id]


def test_bad_entries_are_skipped_and_bad_messages_rejected() -> None:
    pilot = ContextPilot()
    applier = Applier(pilot)
    applier.apply(("sent", "", ["a"], [1], 0.0), own=False)
    applier.apply(("sent", "r1", [], [], 0.0), own=False)
    applier.apply(("truncated", "r1", -1, 0.0), own=False)
    applier.apply(("sent", "r2", ["a"], [1], 0.0), own=False)
    assert pilot.live_request_ids() == ["r2"]
    assert applier.skipped == 3
    for data in (b"", b"[]", b'{"v":2}', b'{"v":1,"o":"x","n":0,"e":[["sent","r"]]}', b"\xff" * 10):
        assert decode_batch(data) is None
    batch = Batch("x", 7, [("evicted", ["r1"], 1.5)])
    assert decode_batch(encode_batch(batch)) == batch


def test_a_block_another_worker_sent_plain_counts_as_recurring() -> None:
    """Blocks another worker sent without labels are the same blocks: a worker that sees
    them again sends them as it would had it sent them itself (here: plain, onto the plain
    prefix the engine holds), and counts them as recurring."""
    docs = [{"id": f"d{n}", "text": f"text {n}", "tokens": 300} for n in range(3)]
    alone, other = ContextPilot(), ContextPilot()
    first = other.prepare(docs[:2], "q1")
    assert not first.labels  # a first sight goes out as without ContextPilot
    sent = list(dict(other.live_orders())[first.request_id])
    Applier(alone).apply(("sent", first.request_id, sent, [300, 300], 0.0), own=False)
    mine, theirs = alone.prepare(docs, "q2"), other.prepare(docs, "q2")
    assert (mine.labels, mine.cached_blocks) == (theirs.labels, theirs.cached_blocks) == (False, 2)
    assert [b.id for b in mine.blocks] == [b.id for b in theirs.blocks]
    assert alone.stats().predicted_cached_tokens == 600
    reordered = [docs[2], docs[1], docs[0]]  # d0 and d1 recur, d2 too now: the same send either way
    mine, theirs = alone.prepare(reordered, "q3"), other.prepare(reordered, "q3")
    assert (mine.labels, [b.id for b in mine.blocks]) == (theirs.labels, [b.id for b in theirs.blocks])


def entry_batch(*entries: list[object]) -> bytes:
    return json.dumps({"v": 2, "o": "w", "n": 0, "t": 1.0, "e": list(entries)}).encode()


def test_a_batch_is_checked_whole_before_any_entry_is_applied() -> None:
    good = ["sent", "r1", ["a"], [1], 1.0]
    bad = [
        ["sent", "r2", ["b"], [1], 10**400],  # a time no float holds (OverflowError once applied)
        ["sent", "r2", ["b"], [1], "1.0"],
        ["evicted", "abc", 1.0],  # a str is not a list of ids ("a", "b", "c")
        ["evicted", ["r1", 7], 1.0],
        ["truncated", "r1", True, 1.0],
        ["restored", "r1", -1, 1.0],
        ["sent", "r2", ["b", "c"], [1], 1.0],  # token counts that are not one per block
        ["sent", "r2", ["b"], [-1], 1.0],
        ["sent", "r2", ["b", 3], [1, 1], 1.0],
        ["sent", "r2", [f"k{n}" for n in range(MAX_BLOCKS + 1)], [], 1.0],
        ["reset", "extra", 1.0],
        ["stick", "c", 5, 1.0],
    ]
    for entry in bad:
        assert decode_batch(entry_batch(good, entry)) is None, entry
    half = [f"k{n}" for n in range(MAX_BLOCKS // 2 + 1)]
    assert decode_batch(entry_batch(["sent", "x", half, [], 1.0], ["sent", "y", half, [], 1.0])) is None
    batch = decode_batch(entry_batch(good, ["evicted", ["r1"], 2]))
    assert batch is not None and batch.entries == [("sent", "r1", ["a"], [1], 1.0), ("evicted", ["r1"], 2.0)]


def test_token_counts_are_honoured_a_request_over_the_cache_is_not_indexed() -> None:
    pilot = ContextPilot(cache_tokens=1_000)
    applier = Applier(pilot)
    applier.apply(("sent", "big", ["a", "b"], [800, 800], 0.0), own=False)  # as prepare would not index it
    applier.apply(("sent", "small", ["a"], [800], 0.0), own=False)
    assert pilot.live_request_ids() == ["small"]


def test_a_message_is_applied_only_under_the_deployment_secret() -> None:
    body = encode_batch(Batch("x", 0, [("reset", 1.0)]))
    sealed = seal(b"secret", "subject.a", body)
    assert unseal(b"secret", "subject.a", sealed) == body
    assert unseal(b"other", "subject.a", sealed) is None
    assert unseal(b"secret", "subject.b", sealed) is None  # another scope's message, replayed here
    assert unseal(b"secret", "subject.a", sealed[:-1] + b"x") is None
    assert unseal(b"secret", "subject.a", body) is None
