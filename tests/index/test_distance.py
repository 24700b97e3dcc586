from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import squareform

from contextpilot_integrations.index import condensed_distances, context_distance


def test_eq1_by_hand() -> None:
    # share {1, 2}; positions differ by 1 and 1; max length 3
    assert context_distance([1, 2, 3], [2, 1, 4]) == 1 - 2 / 3 + 0.001 * 1.0
    assert context_distance([1], [2]) == 1.0 and context_distance([], [1]) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=8, unique=True), min_size=2, max_size=12))
def test_vectorised_equals_scalar(contexts: list[list[int]]) -> None:
    matrix = squareform(condensed_distances(contexts))
    for i in range(len(contexts)):
        for j in range(i + 1, len(contexts)):
            assert np.isclose(matrix[i, j], context_distance(contexts[i], contexts[j]))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 20), min_size=0, max_size=8, unique=True), min_size=2, max_size=12))
def test_overlap_only_distances_equal_scalar(contexts: list[list[int]]) -> None:
    matrix = squareform(condensed_distances(contexts, alpha=0.0))
    for i in range(len(contexts)):
        for j in range(i + 1, len(contexts)):
            assert np.isclose(matrix[i, j], context_distance(contexts[i], contexts[j], alpha=0.0))
