from __future__ import annotations

import pytest

from contextpilot_integrations.index.ordering import reorder, schedule_by_paths


def test_reorder_is_alg2() -> None:
    assert reorder(["1", "2"], ["2", "1", "4"]) == ["1", "2", "4"]
    assert reorder([], ["3", "1"]) == ["3", "1"]
    with pytest.raises(ValueError, match="does not carry"):
        reorder(["9"], ["1"])


def test_schedule_is_alg5_fig7() -> None:
    # C7, C3, C8, C6 with their paths after insertion (see the paper's Fig. 7)
    paths = [(1,), (0, 1), (0, 0, 3), (0, 0, 2)]
    names = ["C7", "C3", "C8", "C6"]
    assert [names[i] for i in schedule_by_paths(paths)] == ["C6", "C8", "C3", "C7"]
