from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from contextpilot_integrations.index import PrefixTrie

orders = st.lists(st.lists(st.integers(0, 12), min_size=0, max_size=6, unique=True), min_size=1, max_size=25)


def nodes(trie: PrefixTrie[int]) -> set[tuple[int, ...]]:
    return {path for path, _, _ in trie.iter_nodes()}


@settings(max_examples=150, deadline=None)
@given(orders, st.data())
def test_eviction_removes_exactly_the_unshared_parts(requests: list[list[int]], data: st.DataObject) -> None:
    trie: PrefixTrie[int] = PrefixTrie()
    for i, order in enumerate(requests):
        trie.insert(f"r{i}", order)
    trie.check()
    evicted = data.draw(st.sets(st.integers(0, len(requests) - 1)))
    for i in evicted:
        assert trie.evict(f"r{i}")
    trie.check()
    survivors: PrefixTrie[int] = PrefixTrie()
    for i, order in enumerate(requests):
        if i not in evicted:
            survivors.insert(f"r{i}", order)
    assert nodes(trie) == nodes(survivors)
    # no predicted hit is left behind: every path still matches only what survivors sent
    for order in requests:
        assert trie.match_length(order) == survivors.match_length(order)


@settings(max_examples=100, deadline=None)
@given(orders)
@example([[0, 1], [0, 2], [1, 0], [1, 2], [2, 0, 1], [0, 1, 2]])  # found by CI with the default budget of 6
def test_best_prefix_is_a_live_path_within_the_request(requests: list[list[int]]) -> None:
    """With room to search, the longest path is found. (The default budget, 6 branches,
    bounds the cost of a lookup at the price of sometimes missing a longer path: a shorter
    one is then reused, never a path the engine does not hold.)"""
    trie: PrefixTrie[int] = PrefixTrie(max_search_nodes=10_000)
    for i, order in enumerate(requests[:-1]):
        trie.insert(f"r{i}", order)
    query = requests[-1]
    head = trie.best_prefix(query)
    assert set(head) <= set(query) and trie.match_length(head) == len(head)
    # it is at least as long as the reusable prefix of any single order sent before
    for order in requests[:-1]:
        reusable = 0
        while reusable < len(order) and order[reusable] in set(query):
            reusable += 1
        assert len(head) >= reusable


def test_insert_reports_reuse_and_truncate_shortens() -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    assert trie.insert("a", ["1", "2", "3"]) == 0
    assert trie.insert("b", ["1", "2", "4"]) == 2
    assert trie.node_count == 4
    assert trie.truncate("a", 1) and trie.order_of("a") == ["1"]
    assert trie.match_length(["1", "2", "3"]) == 2  # "b" still holds 1, 2
    trie.evict("b")
    assert trie.match_length(["1", "2", "4"]) == 1
    trie.check()
    assert trie.truncate("a", 0) and len(trie) == 0 and trie.node_count == 0
    assert not trie.truncate("zz", 1) and not trie.evict("zz")


def test_many_non_overlapping_requests() -> None:
    trie: PrefixTrie[int] = PrefixTrie()
    for i in range(5_000):
        trie.insert(str(i), [i * 15 + j for j in range(15)])
    assert len(trie) == 5_000 and trie.node_count == 75_000
    assert trie.best_prefix([4_999 * 15 + j for j in range(15)]) == [4_999 * 15 + j for j in range(15)]
    for i in range(0, 5_000, 2):
        trie.evict(str(i))
    trie.check()
    assert trie.node_count == 2_500 * 15
