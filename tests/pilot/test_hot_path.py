"""The fast paths of ``prepare`` keep every check (issue 20, item 14).

``prepare`` was made cheaper (C-level checks for the common inputs, a trie search without
per-node Python closures); each shortcut must refuse exactly what the general path refuses
and return exactly what it returned.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Hashable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, BlockTypeError, ContextPilot, DuplicateBlockError, InvalidBlockError
from contextpilot_integrations.core.blocks import normalize_blocks
from contextpilot_integrations.index.prefix_trie import PrefixTrie
from contextpilot_integrations.index.strategies import make_strategy


class Turn(enum.IntEnum):
    FIRST = 0


@pytest.mark.parametrize(
    "kept",
    [[1, True], [True], [-1], (0, -2), {0, -1}, range(-1, 2), [0.0], ["0"], "01", {0: 1}, 3, [None]],
)
def test_bad_kept_turns_are_refused_whatever_the_container(kept: Any) -> None:
    pilot = ContextPilot()
    pilot.prepare(["a"], "q", conversation_id="c")
    with pytest.raises(TypeError, match="kept_turns"):
        pilot.prepare(["b"], "q", conversation_id="c", kept_turns=kept)
    assert pilot.stats().requests_prepared == 1  # nothing recorded


@pytest.mark.parametrize("kept", [[0], (0,), {0}, frozenset({0}), range(1), [Turn.FIRST], iter([0]), [0, 0]])
def test_good_kept_turns_keep_the_first_turn(kept: Collection[int]) -> None:
    first = "a" * 400  # longer than a reference to it: worth referring to (issue 29)
    pilot = ContextPilot()
    pilot.prepare([first], "q", conversation_id="c")
    again = pilot.prepare(["b", first], "q", conversation_id="c", kept_turns=kept)  # "b" tops: sent in full
    assert [r.block.text for r in again.references] == [first] and [b.text for b in again.blocks] == ["b"]
    nothing_kept = pilot.prepare(["a"], "q", conversation_id="c", kept_turns=[])
    assert [b.text for b in nothing_kept.blocks] == ["a"]


class _Sub(Block):
    pass


@pytest.mark.parametrize(
    ("items", "error"),
    [
        ("abc", BlockTypeError),
        (b"abc", BlockTypeError),
        ({"text": "a"}, BlockTypeError),
        (Block(text="a"), BlockTypeError),
        (42, BlockTypeError),
        ([Block(id="x", text="a"), Block(id="x", text="b")], DuplicateBlockError),
        ((Block(id="x", text="a"), Block(id="x", text="b")), DuplicateBlockError),
        ([Block(id="x", text="a"), 7], BlockTypeError),
        ([Block(id="x", text="a"), "  "], InvalidBlockError),
    ],
)
def test_normalize_blocks_refuses_what_it_refused(items: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        normalize_blocks(items)


def test_normalize_blocks_shortcut_returns_what_the_general_path_returns() -> None:
    a, b, c = Block(id="a", text="A"), Block(id="b", text="B"), Block(id="c", text="C")
    assert normalize_blocks([a, b, c]) == ([a, b, c], [])
    assert normalize_blocks((a, b)) == ([a, b], [])
    assert normalize_blocks(iter([a, b])) == ([a, b], [])
    assert normalize_blocks([]) == ([], [])
    assert normalize_blocks([a, b, a]) == ([a, b], ["a"])  # merged, not the shortcut
    ranked = [Block(id="a", text="A", rank=1), Block(id="b", text="B", rank=0)]
    assert [x.id for x in normalize_blocks(ranked)[0]] == ["b", "a"]
    sub = _Sub(id="s", text="S")
    assert normalize_blocks([a, sub]) == ([a, sub], [])
    given_list = [a, b]
    out, _ = normalize_blocks(given_list)
    assert out is not given_list  # a copy: the caller's list may change later


def reference_best_prefix(trie: PrefixTrie[Hashable], keys: Collection[Hashable]) -> list[Hashable]:
    """The search as written before it was made cheaper (issue 20): children as (key, node)
    pairs, sorted by (live requests, key) with a key function."""
    best: tuple[Hashable, ...] = ()
    budget = trie.max_search_nodes
    wanted = frozenset(keys)
    size = len(wanted)
    stack: list[tuple[Any, tuple[Hashable, ...], Hashable | None]] = [(trie.root, (), None)]
    while stack and budget > 0:
        node, path, key = stack.pop()
        if key is not None:
            path += (key,)
        budget -= 1
        while True:
            children = node.children
            if len(children) < size:
                found = [(k, child) for k, child in children.items() if k in wanted]
            else:
                found = [(k, child) for k in wanted if (child := children.get(k)) is not None]
            if len(found) != 1:
                break
            key, node = found[0]
            path += (key,)
        if len(path) > len(best):
            best = path
            if len(path) == size:
                break
        if found:
            found.sort(key=lambda item: (item[1].count, item[0]))
            stack.extend((child, path, k) for k, child in found)
    return list(best)


operations = st.lists(
    st.tuples(st.booleans(), st.lists(st.integers(0, 12), min_size=1, max_size=8, unique=True)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=operations, budget=st.integers(1, 8))
def test_best_prefix_finds_what_the_reference_search_finds(ops: list[tuple[bool, list[int]]], budget: int) -> None:
    trie: PrefixTrie[Hashable] = PrefixTrie(max_search_nodes=budget)
    live: list[str] = []
    for step, (evict, blocks) in enumerate(ops):
        keys: Sequence[Hashable] = [f"k{b}" for b in blocks]
        found = trie.best_prefix(keys)
        assert found == reference_best_prefix(trie, keys)
        if evict and live:
            trie.evict(live.pop(len(live) // 2))
        order = found + [k for k in keys if k not in set(found)]
        trie.insert(f"r{step}", order)
        live.append(f"r{step}")
    trie.check()


def test_popular_blocks_go_first_and_ties_keep_retrieval_order() -> None:
    """The trie strategy's order (a pilot sends it where the reuse pays, :mod:`.gain`)."""
    strategy = make_strategy("trie", PrefixTrie())
    for step, names in enumerate((["hot"], ["hot"], ["hot", "warm"])):
        strategy.order(f"r{step}", names)  # counted; nothing of them is cached
    sent = strategy.order("new", ["n1", "warm", "n2", "hot", "n3"])
    assert sent == ["hot", "warm", "n1", "n2", "n3"]
