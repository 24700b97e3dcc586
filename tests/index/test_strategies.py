"""Micro-batches after earlier traffic follow what the engine holds (issue 42, item 3)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.index import PrefixTrie
from contextpilot_integrations.index.strategies import TrieStrategy, plan_under_first
from contextpilot_integrations.pilot import BatchRequest


def doc(name: str) -> Block:
    return Block(id=name, text=f"{name} " * 200)  # 100 tokens


def test_a_micro_batch_follows_the_head_the_engine_holds() -> None:
    """A request whose blocks the engine holds in one order goes out in that order, though
    the batch alone would have put another block first (one it shares within the batch)."""
    pilot = ContextPilot(keep_top=False)
    pilot.prepare([doc(n) for n in "abcd"], "earlier")  # the engine now holds a, b, c, d
    planned = pilot.plan(
        [
            BatchRequest(blocks=[doc(n) for n in "xdcba"], query="q1"),  # holds a..d, shares x with the next
            BatchRequest(blocks=[doc(n) for n in "xy"], query="q2"),
        ]
    )
    first = next(p for p in planned if p.query == "q1")
    assert [b.id for b in first.blocks][:4] == list("abcd")
    assert first.cached_blocks == 4
    assert planned[0].query == "q1"  # a request with a head goes first, before new blocks evict it


def test_a_first_batch_is_planned_as_before() -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    strategy = TrieStrategy(trie)
    batch = [("r0", ["a", "b", "c"]), ("r1", ["c", "b", "d"]), ("r2", ["e"])]
    assert strategy.live_view(batch, keep_first=False) is None
    assert strategy.plan_live(batch, None, None) == strategy.plan(batch, None)


def test_a_head_lighter_than_what_the_batch_shares_is_not_followed() -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    strategy = TrieStrategy(trie)
    trie.insert("old", ["a"])
    batch = [("r0", ["a", "b", "c"]), ("r1", ["b", "c", "d"])]
    view = strategy.live_view(batch, keep_first=False)
    assert view is not None and view.heads == [("a",), ()]
    tokens = {"a": 10, "b": 100, "c": 100, "d": 5}
    planned = strategy.plan_live(batch, tokens, view)
    assert set(planned.orders[0][:2]) == {"b", "c"} and set(planned.orders[1][:2]) == {"b", "c"}


@settings(max_examples=60, deadline=None)
@given(
    live=st.lists(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True), max_size=6),
    batch=st.lists(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True), min_size=1, max_size=8),
    keep_first=st.booleans(),
)
def test_plans_after_traffic_are_permutations_with_a_whole_schedule(
    live: list[list[str]], batch: list[list[str]], keep_first: bool
) -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    strategy = TrieStrategy(trie)
    for n, order in enumerate(live):
        trie.insert(f"old{n}", order)
        strategy.order(f"old{n}", order)
    requests = [(f"r{n}", keys) for n, keys in enumerate(batch)]
    view = strategy.live_view(requests, keep_first)
    if keep_first:
        planned, _ = plan_under_first(strategy, requests, None, view)
    else:
        planned = strategy.plan_live(requests, None, view)
    assert sorted(planned.schedule) == list(range(len(batch)))
    for keys, order in zip(batch, planned.orders, strict=True):
        assert sorted(order) == sorted(keys)
        if keep_first:
            assert order[0] == keys[0]
    if view is not None:  # a head is a path through the request's own blocks
        assert all(set(head) <= set(keys) for head, keys in zip(view.heads, batch, strict=True))
