"""How close the default strategy gets to what any ordering could reach (a script, not a test).

On the bundled MultiHop-RAG trace, side by side in one run:

* offline, unbounded cache: retrieval order, the default plan, the optimum of the tree
  objective on small neighbourhoods (exact, by dynamic programming over subsets), and two
  upper bounds for the whole batch: a maximum spanning tree of pairwise overlaps (each
  request reuses at most its overlap with one earlier request) and the reuse bound (every
  block some earlier request sent);
* online at 25% capacity: the default strategy vs. an oracle that knows the next requests
  and orders each request's new blocks for them (what no online strategy can beat by much).

Sending a batch depth-first through a tree whose nodes hold the blocks their requests
share saves exactly the tokens of the internal nodes (a node with k children k - 1 times),
so the exact optimum of a neighbourhood is a maximum over its binary trees.

The default keeps each request's top block first (``keep_top``: what a real model answers),
so a prompt shares more than the system prompt only with prompts of the same top block: its
bound is the spanning forest within each top block's requests. ``keep_top=False`` is held to
the unconstrained one. On neighbourhoods the exact optimum is also set against the spanning
bound of the same requests: how far from reachable the bound itself is. ``--families`` adds
the synthetic families (offline rows only).

Usage: python benchmarks/bench_bounds.py [--neighbourhoods 20] [--size 12] [--window 30]
       [--families memory-snippets,...]
"""

from __future__ import annotations

import argparse
import random
from collections import Counter
from collections.abc import Sequence

import numpy as np
from scipy.sparse import csr_matrix, diags
from scipy.sparse.csgraph import minimum_spanning_tree

from contextpilot_integrations.index import agglomerate
from contextpilot_integrations.whatif import (
    PromptShape,
    RadixCacheSimulator,
    TraceRequest,
    block_token_counts,
    multihop_trace,
    replay,
    reuse_bound,
    working_set_tokens,
)
from contextpilot_integrations.whatif.synthetic import FAMILIES, generate

BLOCKS_ONLY = PromptShape(system_tokens=0, annotate=False, questions=False)
"""The bounds are about block orders: here prompts are the blocks alone (the demo counts
every prompt token; its ratios are lower by the share of questions and annotations)."""


def spanning_tree_bound(sets: list[frozenset[str]], tokens: dict[str, int]) -> float:
    """Tokens of a maximum spanning forest over pairwise overlaps, as a share of all tokens."""
    keys = {key: i for i, key in enumerate(tokens)}
    rows = np.repeat(np.arange(len(sets)), [len(s) for s in sets])
    cols = np.fromiter((keys[k] for s in sets for k in s), dtype=np.int64)
    incidence = csr_matrix((np.ones(len(cols)), (rows, cols)), shape=(len(sets), len(keys)))
    weighted = incidence @ diags(np.array([tokens[k] for k in tokens], dtype=np.float64))
    overlap = (weighted @ incidence.T).tocoo()
    upper = overlap.row < overlap.col
    graph = csr_matrix((-overlap.data[upper], (overlap.row[upper], overlap.col[upper])), shape=overlap.shape)
    return -minimum_spanning_tree(graph).sum() / sum(tokens[k] for s in sets for k in s)


def top_block_bound(sets: list[frozenset[str]], tops: list[str], tokens: dict[str, int]) -> float:
    """:func:`spanning_tree_bound` within each top block's requests (``keep_top``), as a share
    of all tokens."""
    groups: dict[str, list[frozenset[str]]] = {}
    for blocks, top in zip(sets, tops, strict=True):
        groups.setdefault(top, []).append(blocks)
    saved = sum(
        spanning_tree_bound(group, tokens) * sum(tokens[k] for s in group for k in s)
        for group in groups.values()
        if len(group) > 1
    )
    return saved / sum(tokens[k] for s in sets for k in s)


def tree_optimum(sets: list[frozenset[str]], tokens: dict[str, int]) -> float:
    """Best saving of any binary tree over these requests (dynamic programming over subsets)."""
    m = len(sets)
    shared: dict[int, frozenset[str]] = {1 << i: s for i, s in enumerate(sets)}
    best: dict[int, float] = {1 << i: 0.0 for i in range(m)}
    for mask in range(1, 1 << m):
        if mask in best:
            continue
        low = mask & -mask
        shared[mask] = shared[low] & shared[mask ^ low]
        top = 0.0
        part = (mask - 1) & mask
        while part:
            if part & low:  # each split once: the part holding the lowest request
                top = max(top, best[part] + best[mask ^ part])
            part = (part - 1) & mask
        best[mask] = top + sum(tokens[k] for k in shared[mask])
    return best[(1 << m) - 1]


def plan_saving(sets: list[frozenset[str]], tokens: dict[str, int], penalty: float) -> float:
    requests = [sorted(s) for s in sets]
    plan = agglomerate(requests, tokens, penalty)
    cache = RadixCacheSimulator(None)
    saved = 0
    for index in plan.schedule:
        order = [requests[index][i] for i in plan.orders[index]]
        saved += cache.request(str(index), [(k, tokens[k]) for k in order]).hit_tokens
    return saved


def neighbourhoods(name: str, sets: list[frozenset[str]], tokens: dict[str, int], count: int, size: int) -> None:
    """One row: the greedy plans against the exact optimum, and the optimum against the
    spanning-tree bound, summed over ``count`` neighbourhoods of ``size`` requests (a
    centre, its nearest half, a random overlapping rest)."""
    rng = random.Random(1)
    greedy = tuned = optimum = bounds = 0.0
    worst = reach = 1.0
    for _ in range(count):
        centre = rng.randrange(len(sets))
        others = sorted(
            (j for j in range(len(sets)) if j != centre and sets[j] & sets[centre]),
            key=lambda j: -sum(tokens[k] for k in sets[j] & sets[centre]),
        )
        near = size // 2
        group = [centre, *others[:near], *rng.sample(others[near:], max(0, min(size - 1 - near, len(others) - near)))]
        members = [sets[j] for j in group]
        best = tree_optimum(members, tokens)
        found = plan_saving(members, tokens, 0.0)
        greedy, tuned, optimum = greedy + found, tuned + plan_saving(members, tokens, 0.05), optimum + best
        worst = min(worst, found / best if best else 1.0)
        bound = spanning_tree_bound(members, tokens) * sum(tokens[k] for m in members for k in m)
        bounds += bound
        reach = min(reach, best / bound if bound else 1.0)
    print(
        f"{name:<16}{greedy / optimum:>9.1%}{worst:>9.1%}{tuned / optimum:>9.1%}{optimum / bounds:>11.1%}{reach:>9.1%}"
    )


def best_head(cache: RadixCacheSimulator, keys: set, required: Sequence = ()) -> list:
    """The longest cached path that starts with ``required`` and goes on only through
    ``keys`` (exhaustive; ``[]`` when no cached path starts with ``required``)."""
    best: list = []
    stack: list[tuple[object, list]] = [(cache.root, [])]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():  # type: ignore[attr-defined]
            run = [k for k, _ in child.blocks]
            taken = 0
            while taken < len(run):
                depth = len(path) + taken
                if not (run[taken] == required[depth] if depth < len(required) else run[taken] in keys):
                    break
                taken += 1
            if taken == len(run):
                stack.append((child, path + run))
            if len(path) + taken > len(best) and len(path) + taken >= len(required):
                best = path + run[:taken]
    return best


def lookahead_tail(
    rest: list[str], future: list[frozenset[str]], tokens: dict[str, int], seen: Counter[str]
) -> list[str]:
    """``rest`` ordered for the requests ahead: one at a time, the block most of the
    ``future`` requests that can still follow carry (by tokens), then the others by how
    often they were seen."""
    rest, tail = list(rest), []
    while rest and future:
        pick = max(rest, key=lambda k: (sum(tokens[k] for s in future if k in s), seen[k]))
        future = [s for s in future if pick in s]
        if not future:
            break
        tail.append(pick)
        rest.remove(pick)
    return tail + sorted(rest, key=lambda k: -seen[k])


def oracle_online(trace: Sequence[TraceRequest], tokens: dict[str, int], capacity: int, window: int) -> float:
    """Hit ratio when each request's new blocks are ordered for the next ``window`` requests."""
    cache = RadixCacheSimulator(capacity)
    sets = [frozenset(r.blocks) for r in trace]
    seen: Counter[str] = Counter()
    hit = total = 0
    for i, request in enumerate(trace):
        seen.update(request.blocks)
        head = best_head(cache, set(request.blocks))
        future = [s for s in sets[i + 1 : i + 1 + window] if s.issuperset(head)]
        tail = lookahead_tail([k for k in request.blocks if k not in set(head)], future, tokens, seen)
        served = cache.request(request.id, [(k, tokens[k]) for k in head + tail])
        hit += served.hit_tokens
        total += served.block_tokens
    return hit / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--neighbourhoods", type=int, default=20)
    parser.add_argument("--size", type=int, default=12, help="requests per neighbourhood (exact DP is 3^size)")
    parser.add_argument("--window", type=int, default=30, help="requests the online oracle sees ahead")
    parser.add_argument("--families", default=",".join(FAMILIES), help="synthetic families for the offline rows")
    args = parser.parse_args()
    trace = multihop_trace()
    tokens = block_token_counts(trace)
    capacity = working_set_tokens(trace) // 4

    print("== offline, unbounded cache: share of all block tokens reused, and of each plan's bound ==")
    print(
        f"{'trace':<16}{'retrieval':>10}{'trie':>8}{'top bound':>11}{'share':>7}"
        f"{'top free':>10}{'bound':>8}{'share':>7}{'reuse bound':>13}{'plan s':>8}"
    )
    traces = [("MultiHop-RAG", trace)]
    for name in (n for n in args.families.split(",") if n):
        drawn = generate(FAMILIES[name], seed=0)  # single-shot: every line a request of its own
        traces.append((name, [r.model_copy(update={"conversation": None, "turn": None}) for r in drawn]))
    for name, lines in traces:
        counts = block_token_counts(lines)
        blocks = [frozenset(r.blocks) for r in lines]
        retrieval = replay(lines, "retrieval", "offline", None, shape=BLOCKS_ONLY).hit_ratio
        kept = replay(lines, "trie", "offline", None, shape=BLOCKS_ONLY)
        free = replay(lines, "trie", "offline", None, shape=BLOCKS_ONLY, keep_top=False).hit_ratio
        top_bound = top_block_bound(blocks, [r.blocks[0] for r in lines], counts)
        bound = spanning_tree_bound(blocks, counts)
        print(
            f"{name:<16}{retrieval:>10.1%}{kept.hit_ratio:>8.1%}{top_bound:>11.1%}{kept.hit_ratio / top_bound:>7.0%}"
            f"{free:>10.1%}{bound:>8.1%}{free / bound:>7.0%}{reuse_bound(lines):>13.1%}{kept.pilot_seconds:>8.2f}"
        )
    print("trie: the default (top block first); top bound: the spanning forest within each top block's")
    print("requests; top free: keep_top=False, held to the unconstrained spanning-tree bound")
    paper = replay(trace, "paper", "offline", None, shape=BLOCKS_ONLY)
    print(f"MultiHop-RAG, the paper strategy: {paper.hit_ratio:.1%} (plan {paper.pilot_seconds:.2f} s)")
    print(
        f"\n== {args.neighbourhoods} neighbourhoods of {args.size} requests a trace: the exact optimum (any order) =="
    )
    print(f"{'trace':<16}{'greedy':>9}{'worst':>9}{'default':>9}{'optimum /':>11}{'lowest':>9}")
    print(f"{'':<16}{'/ optimum':>9}{'':>9}{'/ optimum':>9}{'bound':>11}{'':>9}")
    for name, lines in traces:
        neighbourhoods(
            name, [frozenset(r.blocks) for r in lines], block_token_counts(lines), args.neighbourhoods, args.size
        )
    print("greedy: the tree merged by shared tokens alone; default: penalty 0.05; bound: the spanning-tree")
    print("bound of the same requests, which no ordering reaches (prefixes must nest)")

    print("\n== online, 25% capacity ==")
    for strategy in ("retrieval", "trie"):
        result = replay(trace, strategy, "online", capacity, shape=BLOCKS_ONLY, feedback="exact")
        print(f"{strategy:<22}{result.hit_ratio:7.1%}")
    oracle = oracle_online(trace, tokens, capacity, args.window)
    print(f"{f'oracle, next {args.window} known':<22}{oracle:7.1%}")


if __name__ == "__main__":
    main()
