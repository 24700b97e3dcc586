"""The paper's context index: a clustering tree of block sets (§4.1, Alg. 1, 2, 4).

Internal nodes hold the blocks their children share; a node's order is its parent's order
followed by its own remaining blocks in retrieval order (Alg. 4), so every node's order is
a prefix of its descendants' orders. Batches are built by hierarchical clustering over
Eq. 1 distances; single requests are placed by greedy descent (Alg. 1) and ordered with
the matched node's blocks first (Alg. 2). The structure is a tree by construction: each
node is created once, under one parent.

Not thread-safe on its own: :class:`~contextpilot_integrations.ContextPilot` guards it.
Batch builds need scipy (the ``paper`` extra), imported only when a tree is made: importing
the package stays fast, and an install without the extra runs every other strategy.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Literal

import numpy as np

from ..errors import DuplicateRequestError
from .distance import ALPHA, condensed_distances, context_distance

__all__ = ["SCIPY_MISSING", "ClusterTree", "LinkageMethod", "scipy_missing"]

LinkageMethod = Literal["single", "complete", "average", "weighted", "centroid", "median", "ward"]
"""scipy's linkage methods."""

SCIPY_MISSING = "the paper strategy needs scipy: pip install 'contextpilot-integrations[paper]'"


def scipy_missing() -> bool:
    """Whether scipy is absent (found without importing it, which takes a second)."""
    try:
        return importlib.util.find_spec("scipy") is None
    except ValueError:  # in sys.modules as None: blocked on purpose
        return True


class _Node:
    __slots__ = ("blocks", "by_key", "children", "keyset", "next_slot", "parent", "request_ids", "slot")

    def __init__(self, blocks: tuple[Hashable, ...], parent: _Node | None, slot: int) -> None:
        self.blocks = blocks
        self.keyset = frozenset(blocks)
        self.parent = parent
        self.slot = slot
        self.children: dict[int, _Node] = {}
        self.by_key: dict[Hashable, set[int]] = {}  # block -> slots of children holding it
        self.next_slot = 0
        self.request_ids: set[str] = set()

    def add_child(self, child_blocks: tuple[Hashable, ...]) -> _Node:
        return self.adopt(_Node(child_blocks, self, 0))

    def adopt(self, child: _Node) -> _Node:
        """Make ``child`` (new, or detached by :meth:`remove_child`) a child of this node."""
        child.parent = self
        child.slot = self.next_slot
        self.next_slot += 1
        self.children[child.slot] = child
        for key in child.keyset:
            self.by_key.setdefault(key, set()).add(child.slot)
        return child

    def remove_child(self, child: _Node) -> None:
        del self.children[child.slot]
        for key in child.keyset:
            slots = self.by_key[key]
            slots.discard(child.slot)
            if not slots:
                del self.by_key[key]
        child.parent = None

    @property
    def path(self) -> tuple[int, ...]:
        slots: list[int] = []
        node: _Node | None = self
        while node is not None and node.parent is not None:
            slots.append(node.slot)
            node = node.parent
        return tuple(reversed(slots))


class ClusterTree:
    """The paper's index: build by clustering, search by descent, evict by request id.

    Args:
        alpha: weight of the position term in Eq. 1.
        linkage_method: scipy linkage method for batch builds.
        max_cluster_size: batches larger than this are clustered in consecutive chunks
            (the condensed distance matrix is quadratic in memory).
        progress: a callable wrapping an iterable (``tqdm``-like) for long builds.
    """

    def __init__(
        self,
        alpha: float = ALPHA,
        linkage_method: LinkageMethod = "average",
        max_cluster_size: int = 16_000,
        progress: Callable[[Sequence[int]], Sequence[int]] | None = None,
    ) -> None:
        if scipy_missing():
            raise ImportError(SCIPY_MISSING)
        self.alpha = alpha
        self.linkage_method = linkage_method
        self.max_cluster_size = max_cluster_size
        self.progress = progress
        self.root = _Node((), None, 0)
        self._node_of: dict[str, _Node] = {}

    def __len__(self) -> int:
        return len(self._node_of)

    # ---- Alg. 1 and 2: one request -------------------------------------------------
    def search(self, keys: Sequence[Hashable]) -> tuple[_Node, tuple[int, ...]]:
        """Greedy descent (Alg. 1): the deepest node whose blocks the request all holds.

        At each node, among the children that share a block with the request, take the
        one at minimum Eq. 1 distance; descend only if the request holds all its blocks
        (so its whole prefix is reusable).
        """
        node, _ = self._descend(keys)
        return node, node.path

    def _descend(self, keys: Sequence[Hashable]) -> tuple[_Node, _Node | None]:
        """Alg. 1's matched node, and the closest child the request holds only part of."""
        keyset = frozenset(keys)
        node = self.root
        while node.children:
            best = self._closest_child(node, keys, keyset)
            if best is None:
                break
            if not best.keyset <= keyset:
                return node, best
            node = best
            if node.keyset == keyset:
                break
        return node, None

    def _closest_child(self, node: _Node, keys: Sequence[Hashable], keyset: frozenset[Hashable]) -> _Node | None:
        """The child at minimum Eq. 1 distance (ties: lowest slot) among those sharing a block.

        Exact, without reading every child that shares a popular block: postings are read
        rarest first, and reading stops once the closest child seen so far is closer than
        any unread child could be. A child found only in the ``remaining`` unread postings
        shares at most ``remaining`` blocks with the request, so its distance is at least
        ``1 - remaining / len(keys)``.
        """
        postings = sorted((found for key in keyset if (found := node.by_key.get(key))), key=len)
        if not postings:
            return None
        size = len(keys)
        first_term: dict[int, float] = {}  # slot -> 1 - |S| / max(|Ci|, |Cj|), a lower bound of d
        best_distance = math.inf
        children = node.children
        for read, posting in enumerate(postings, start=1):
            lowest, lowest_slot = math.inf, -1
            for slot in posting:
                if slot not in first_term:
                    child = children[slot]
                    bound = first_term[slot] = 1.0 - len(child.keyset & keyset) / max(len(child.blocks), size)
                    if bound < lowest:
                        lowest, lowest_slot = bound, slot
            if lowest < best_distance:  # a new candidate might beat the best: its exact distance
                best_distance = min(best_distance, context_distance(children[lowest_slot].blocks, keys, self.alpha))
            if read < len(postings) and best_distance >= 1.0 - (len(postings) - read) / size:
                continue  # an unread child could still be as close: read the next posting
            break
        candidates = [children[s] for s, bound in first_term.items() if bound <= best_distance]
        return min(candidates, key=lambda child: (context_distance(child.blocks, keys, self.alpha), child.slot))

    def insert(
        self, request_id: str, keys: Sequence[Hashable]
    ) -> tuple[list[Hashable], tuple[int, ...], tuple[int, ...]]:
        """Place a request (Alg. 1), order it (Alg. 2) and record it.

        When the closest child below the matched node starts with blocks the request
        holds, those are reused too: the child is split there (the new node holds the
        blocks both share, as Alg. 4's internal nodes do) and the request goes below it.

        Returns:
            The send order, the search path and the path of the node now holding it.
        """
        if request_id in self._node_of:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the index")
        node, partial = self._descend(keys)
        search_path = node.path
        if partial is not None:
            node = self._split(node, partial, frozenset(keys))
        if node.keyset != frozenset(keys):
            rest = tuple(key for key in keys if key not in node.keyset)
            node = node.add_child(node.blocks + rest)
        node.request_ids.add(request_id)
        self._node_of[request_id] = node
        return list(node.blocks), search_path, node.path

    @staticmethod
    def _split(parent: _Node, child: _Node, keyset: frozenset[Hashable]) -> _Node:
        """Cut ``child`` after its leading blocks in ``keyset``; returns the upper part."""
        shared = len(parent.blocks)
        while shared < len(child.blocks) and child.blocks[shared] in keyset:
            shared += 1
        if shared == len(parent.blocks):
            return parent
        parent.remove_child(child)
        upper = parent.add_child(child.blocks[:shared])
        upper.adopt(child)
        return upper

    # ---- Alg. 4: a batch -------------------------------------------------------------
    def build(self, batch: Sequence[tuple[str, Sequence[Hashable]]]) -> list[tuple[list[Hashable], tuple[int, ...]]]:
        """Cluster a batch into the tree; returns each request's order and leaf path."""
        for request_id, _ in batch:
            if request_id in self._node_of:
                raise DuplicateRequestError(f"request id {request_id!r} is already in the index")
        chunks = range(0, len(batch), self.max_cluster_size)
        for start in self.progress(chunks) if self.progress else chunks:
            self._build_chunk(batch[start : start + self.max_cluster_size])
        return [(list(self._node_of[rid].blocks), self._node_of[rid].path) for rid, _ in batch]

    def _build_chunk(self, batch: Sequence[tuple[str, Sequence[Hashable]]]) -> None:
        # identical block sets collapse into one leaf
        leaf_of_set: dict[frozenset[Hashable], int] = {}
        leaves: list[Sequence[Hashable]] = []
        members: list[list[str]] = []
        for request_id, keys in batch:
            index = leaf_of_set.setdefault(frozenset(keys), len(leaves))
            if index == len(leaves):
                leaves.append(keys)
                members.append([])
            members[index].append(request_id)
        m = len(leaves)
        keysets = [frozenset(keys) for keys in leaves]
        children: list[tuple[int, int] | None] = [None] * m
        representative = list(range(m))  # the leaf whose retrieval order a cluster uses
        if m > 1:
            numbering: dict[Hashable, int] = {}
            coded = [[numbering.setdefault(k, len(numbering)) for k in keys] for keys in leaves]
            from scipy.cluster.hierarchy import linkage  # here: it takes a second to import

            merges = linkage(condensed_distances(coded, self.alpha), method=self.linkage_method)
            size = [1] * m
            for a, b in merges[:, :2].astype(np.int64).tolist():
                if size[b] > size[a]:
                    a, b = b, a  # the larger cluster takes the lower slot
                keysets.append(keysets[a] & keysets[b])
                children.append((a, b))
                size.append(size[a] + size[b])
                representative.append(min(representative[a], representative[b]))
        self._attach(m, keysets, children, representative, leaves, members)

    def _attach(
        self,
        m: int,
        keysets: list[frozenset[Hashable]],
        children: list[tuple[int, int] | None],
        representative: list[int],
        leaves: list[Sequence[Hashable]],
        members: list[list[str]],
    ) -> None:
        stack: list[tuple[int, _Node]] = [(len(keysets) - 1, self.root)]
        while stack:
            cluster, parent = stack.pop()
            keyset = keysets[cluster]
            if keyset == parent.keyset:
                node = parent  # identical block sets collapse into one node
            else:
                own = tuple(k for k in leaves[representative[cluster]] if k not in parent.keyset and k in keyset)
                node = parent.add_child(parent.blocks + own)
            pair = children[cluster]
            if pair is None:
                for request_id in members[cluster]:
                    node.request_ids.add(request_id)
                    self._node_of[request_id] = node
            else:
                stack.append((pair[1], node))
                stack.append((pair[0], node))

    def graft(self, other: ClusterTree) -> None:
        """Move every node of ``other`` (a batch built aside) under this tree's root."""
        for request_id in other._node_of:
            if request_id in self._node_of:
                raise DuplicateRequestError(f"request id {request_id!r} is already in the index")
        for child in list(other.root.children.values()):
            other.root.remove_child(child)
            self.root.adopt(child)
        for request_id, node in other._node_of.items():
            if node is other.root:
                node = self.root
            node.request_ids.add(request_id)
            self._node_of[request_id] = node
        other.clear()

    # ---- eviction ----------------------------------------------------------------------
    def evict(self, request_id: str) -> bool:
        """Forget a request; prune nodes left with no request and no children."""
        node = self._node_of.pop(request_id, None)
        if node is None:
            return False
        node.request_ids.discard(request_id)
        while node.parent is not None and not node.request_ids and not node.children:
            parent = node.parent
            parent.remove_child(node)
            node = parent
        return True

    def clear(self) -> None:
        self.root = _Node((), None, 0)
        self._node_of.clear()

    # ---- introspection -----------------------------------------------------------------
    def iter_nodes(self) -> Iterator[tuple[tuple[int, ...], tuple[Hashable, ...], frozenset[str]]]:
        """Every node as (path, ordered blocks, request ids held), pre-order."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node.path, node.blocks, frozenset(node.request_ids)
            stack.extend(reversed(list(node.children.values())))

    def path_of(self, request_id: str) -> tuple[int, ...]:
        return self._node_of[request_id].path

    def check(self) -> None:
        """Assert the invariants: a tree, parent order is a prefix of each child's order."""
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            assert id(node) not in seen, "node reachable twice: not a tree"
            seen.add(id(node))
            for slot, child in node.children.items():
                assert child.parent is node and child.slot == slot, "broken parent link"
                assert child.blocks[: len(node.blocks)] == node.blocks, "order not a prefix"
                assert child.keyset > node.keyset, "child does not extend its parent"
                for key in child.keyset:
                    assert slot in node.by_key[key]
                stack.append(child)
            if node is not self.root:
                assert node.request_ids or node.children, "dead node left behind"
        for request_id, node in self._node_of.items():
            assert request_id in node.request_ids and id(node) in seen
