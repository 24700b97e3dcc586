"""Where other live requests' shared parts end: what the index tells a cache plan."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.index.prefix_trie import PrefixTrie
from contextpilot_integrations.whatif.trace import TraceRequest

orders = st.lists(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True), min_size=1, max_size=12)


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(orders)
def test_shared_depths_are_the_common_prefixes_with_every_other_live_request(paths: list[list[str]]) -> None:
    trie: PrefixTrie[str] = PrefixTrie()
    for index, path in enumerate(paths):
        trie.insert(f"r{index}", path)
    for index, path in enumerate(paths):
        expected = {_common(path, other) for j, other in enumerate(paths) if j != index} - {0}
        assert trie.shared_depths(path) == sorted(expected)


def test_pilot_shared_depths_after_a_batch_plan() -> None:
    pilot = ContextPilot()
    blocks = {name: Block(id=name, text=f"text {name}", tokens=500) for name in "abcdefg"}
    planned = pilot.plan([([blocks[n] for n in "abcd"], "q1"), ([blocks[n] for n in "abce"], "q2"),
                          ([blocks[n] for n in "abfg"], "q3")])  # fmt: skip
    depths = {tuple(b.id for b in p.blocks): pilot.shared_depths(p) for p in planned}
    for order, shared in depths.items():
        assert shared and all(0 < depth <= len(order) for depth in shared)
    # the batch is known in full: the first request sent is told what later ones share
    assert max(pilot.shared_depths(planned[0])) >= 2
    turn = ContextPilot().prepare([blocks["a"]], "q", "chat-1")
    assert ContextPilot().shared_depths(turn) == ()  # not indexed by this pilot: nothing known


def test_trace_times_are_checked() -> None:
    assert TraceRequest(id="a", blocks=["x"], time=12.5).time == 12.5
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            TraceRequest(id="a", blocks=["x"], time=bad)
