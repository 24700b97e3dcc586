"""Intersection agglomeration: valid plans whose saving equals the greedy tree's."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations.index import agglomerate
from contextpilot_integrations.whatif.simulate import RadixCacheSimulator


def served_hit(requests: list[list[str]], tokens: dict[str, float], penalty: float = 0.0) -> float:
    """Tokens an unbounded radix cache reuses when the plan is sent as planned."""
    plan = agglomerate(requests, tokens, penalty)
    assert sorted(plan.schedule) == list(range(len(requests)))
    cache = RadixCacheSimulator(None)
    hit = 0.0
    for index in plan.schedule:
        order = [requests[index][i] for i in plan.orders[index]]
        assert sorted(order) == sorted(requests[index])
        hit += cache.request(str(index), [(key, tokens[key]) for key in order]).hit_tokens
    return hit


def brute_force_greedy(requests: list[list[str]], tokens: dict[str, float]) -> float:
    """Merge the two clusters whose shared blocks weigh most, until none share anything."""
    clusters = [frozenset(r) for r in requests]
    saved = 0.0
    while True:
        pairs = itertools.combinations(enumerate(clusters), 2)
        best = max(((sum(tokens[k] for k in a & b), i, j) for (i, a), (j, b) in pairs), default=(0.0, 0, 0))
        if best[0] <= 0:
            return saved
        weight, i, j = best
        saved += weight
        merged = clusters[i] & clusters[j]
        clusters = [c for k, c in enumerate(clusters) if k not in (i, j)] + [merged]


def random_batch(rng: random.Random, n: int, universe: int, k: int) -> tuple[list[list[str]], dict[str, float]]:
    tokens = {f"b{i}": rng.uniform(1, 100) for i in range(universe)}  # real weights: no accidental ties
    return [rng.sample(sorted(tokens), k) for _ in range(n)], tokens


@pytest.mark.parametrize("seed", range(30))
def test_saving_equals_the_greedy_tree(seed: int) -> None:
    rng = random.Random(seed)
    requests, tokens = random_batch(rng, n=rng.randint(2, 14), universe=rng.randint(4, 12), k=rng.randint(1, 4))
    assert served_hit(requests, tokens) == pytest.approx(brute_force_greedy(requests, tokens))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sets(st.integers(0, 15), max_size=6), min_size=1, max_size=25),
    st.sampled_from([0.0, 0.05, 0.5]),
)
def test_any_batch_gives_permutations_and_a_consistent_schedule(sets: list[set[int]], penalty: float) -> None:
    requests = [[f"b{i}" for i in sorted(s)] for s in sets]
    tokens = {f"b{i}": 1 + i % 5 for i in range(16)}
    assert served_hit(requests, tokens, penalty) >= 0


def test_heavy_shared_blocks_pair_first() -> None:
    # r0 and r1 share the heavy block; r1 and r2 share two light ones
    requests = [["heavy", "a"], ["heavy", "x", "y"], ["x", "y", "b"]]
    tokens = {"heavy": 1000, "a": 1, "x": 10, "y": 10, "b": 1}
    plan = agglomerate(requests, tokens)
    first = [requests[i][plan.orders[i][0]] for i in range(3)]
    assert first[0] == first[1] == "heavy"
    assert served_hit(requests, tokens) == 1000


def test_unweighted_by_default_and_edge_cases() -> None:
    assert agglomerate([]).schedule == []
    assert agglomerate([["a", "b"]]).orders == [[0, 1]]
    assert agglomerate([[], ["a"], ["a", "b"], []]).orders == [[], [0], [0, 1], []]
    disjoint = agglomerate([["a"], ["b"], ["c"]])
    assert sorted(disjoint.schedule) == [0, 1, 2]
    same = [["a", "b", "c"], ["c", "b", "a"]]
    plan = agglomerate(same)
    assert [same[0][p] for p in plan.orders[0]] == [same[1][p] for p in plan.orders[1]]
