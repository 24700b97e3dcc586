"""The paper's worked examples (§4.1, Alg. 1, 2, 5) on the clustering index."""

from __future__ import annotations

import random

from contextpilot_integrations.index import ClusterTree
from contextpilot_integrations.index.ordering import schedule_by_paths


def paper_tree() -> ClusterTree:
    tree = ClusterTree()
    tree.build([("C1", ["3", "2", "1"]), ("C2", ["6", "1", "2"]), ("C3", ["5", "1"])])
    return tree


def test_build_c1_c3_gives_c4_and_c5() -> None:
    tree = paper_tree()
    internal = {path: blocks for path, blocks, rids in tree.iter_nodes() if not rids}
    assert internal == {(0,): ("1",), (0, 0): ("1", "2")}  # C5 {1}, C4 {1, 2}
    tree.check()


def test_search_and_insert_c6() -> None:
    tree = paper_tree()
    _, path = tree.search(["2", "1", "4"])
    assert path == (0, 0)
    order, search_path, leaf_path = tree.insert("C6", ["2", "1", "4"])
    assert (order, search_path, leaf_path) == (["1", "2", "4"], (0, 0), (0, 0, 2))


def test_alg2_outputs_and_fig7_schedule() -> None:
    tree = paper_tree()
    orders = {rid: list(blocks) for _, blocks, rids in tree.iter_nodes() for rid in rids}
    assert orders["C1"] == ["1", "2", "3"] and orders["C2"] == ["1", "2", "6"]
    assert tree.insert("C6", ["2", "1", "4"])[0] == ["1", "2", "4"]
    assert tree.insert("C8", ["1", "9", "2"])[0] == ["1", "2", "9"]
    assert tree.insert("C7", ["7", "8"])[0] == ["7", "8"]  # unchanged
    names = ["C7", "C3", "C8", "C6"]
    schedule = schedule_by_paths([tree.path_of(n) for n in names])
    assert [names[i] for i in schedule] == ["C6", "C8", "C3", "C7"]


def test_online_insert_reuses_the_leading_blocks_of_a_partly_held_node() -> None:
    tree = ClusterTree()
    assert tree.insert("a", ["1", "2", "3", "4"])[0] == ["1", "2", "3", "4"]
    # holds 1, 2 and 4 of "a" but not 3: the run 1, 2 is reused, "a" is split after it
    order, _, leaf_path = tree.insert("b", ["4", "2", "1", "5"])
    assert order == ["1", "2", "4", "5"]
    internal = {path: blocks for path, blocks, rids in tree.iter_nodes() if not rids}
    assert list(internal.values()) == [("1", "2")] and leaf_path[:-1] in internal
    assert tree.insert("c", ["9", "1"])[0] == ["1", "9"]  # splits again, after "1"
    tree.check()
    for rid in ("a", "b", "c"):
        tree.evict(rid)
        tree.check()
    assert list(tree.iter_nodes()) == []


def test_identical_sets_collapse_and_eviction_prunes() -> None:
    tree = ClusterTree()
    tree.build([("a", ["1", "2"]), ("b", ["2", "1"]), ("c", ["1", "3"])])
    assert tree.path_of("a") == tree.path_of("b")
    tree.evict("a")
    tree.check()
    tree.evict("b")
    tree.evict("c")
    tree.check()
    assert list(tree.iter_nodes()) == []


def test_random_batches_stay_a_tree(multihop) -> None:
    rng = random.Random(7)
    queries = rng.sample(multihop.queries, 400)
    tree = ClusterTree()
    built = tree.build([(str(q.qid), list(q.retrieved)) for q in queries[:300]])
    for (order, _), q in zip(built, queries[:300], strict=True):
        assert sorted(order) == sorted(q.retrieved)
    for q in queries[300:]:
        order, _, _ = tree.insert(str(q.qid), list(q.retrieved))
        assert sorted(order) == sorted(q.retrieved)
    tree.check()
    for q in rng.sample(queries, 200):
        tree.evict(str(q.qid))
    tree.check()
    assert len(tree) == 200


def test_chunked_build_matches_sizes() -> None:
    tree = ClusterTree(max_cluster_size=3)
    built = tree.build([(str(i), [str(i % 4), str(10 + i % 3)]) for i in range(10)])
    assert len(built) == 10 and len(tree) == 10
    tree.check()


def test_closest_child_equals_the_full_scan_of_alg1() -> None:
    """The pruned search reads postings rarest first, yet picks Alg. 1's child exactly."""
    from contextpilot_integrations.index.distance import context_distance

    rng = random.Random(3)
    weights = [1 / (b + 1) for b in range(40)]
    tree = ClusterTree()
    for n in range(400):
        tree.insert(f"r{n}", list(dict.fromkeys(rng.choices(range(40), weights, k=rng.randint(1, 9)))))
    for _ in range(300):
        keys = list(dict.fromkeys(rng.choices(range(40), weights, k=rng.randint(1, 9))))
        node = tree.root
        sharing = [c for c in node.children.values() if c.keyset & set(keys)]
        expected = min(sharing, key=lambda c: (context_distance(c.blocks, keys), c.slot)) if sharing else None
        assert tree._closest_child(node, keys, frozenset(keys)) is expected
    tree.check()
