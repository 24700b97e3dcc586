"""A block-level trie of the block orders sent to the engine, keyed by request id.

It mirrors the engine's radix tree at block granularity: a path from the root is a prefix
some live request sent, so its length is the prefix the engine can reuse. Evicting a
request removes exactly the part of its path no other live request shares.

Not thread-safe on its own: :class:`~contextpilot_integrations.ContextPilot` guards it.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from ..errors import DuplicateRequestError

K = TypeVar("K", bound=Hashable)

__all__ = ["PrefixTrie"]


class _Node(Generic[K]):
    __slots__ = ("children", "count", "key", "parent", "request_ids")

    def __init__(self, key: K | None, parent: _Node[K] | None, count: int = 0) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[K, _Node[K]] = {}
        self.count = count  # live requests whose path passes through (or ends at) this node
        self.request_ids: set[str] | None = None  # requests whose path ends here


class PrefixTrie(Generic[K]):
    """Live block orders by request id, with prefix matching."""

    def __init__(self, max_search_nodes: int = 6) -> None:
        self.root: _Node[K] = _Node(None, None)
        self._terminal: dict[str, _Node[K]] = {}
        self._nodes = 0
        self.max_search_nodes = max_search_nodes

    # ---- queries -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._terminal)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._terminal

    @property
    def node_count(self) -> int:
        """Nodes below the root (one per cached block position)."""
        return self._nodes

    def request_ids(self) -> list[str]:
        return list(self._terminal)

    def order_of(self, request_id: str) -> list[K]:
        """The block order a live request was sent with."""
        node = self._terminal[request_id]
        keys: list[K] = []
        while node.parent is not None:
            keys.append(node.key)  # type: ignore[arg-type]
            node = node.parent
        keys.reverse()
        return keys

    def match_length(self, order: Sequence[K]) -> int:
        """How many leading blocks of ``order`` some live request already sent."""
        node = self.root
        for depth, key in enumerate(order):
            child = node.children.get(key)
            if child is None:
                return depth
            node = child
        return len(order)

    def best_prefix(self, keys: Collection[K], first: K | None = None) -> list[K]:
        """The longest live path made only of blocks in ``keys`` (any order); with ``first``
        (one of ``keys``), the longest that starts with it (``[first]`` if none is live).

        A depth-first search, most-shared child first, that explores at most
        ``max_search_nodes`` branches (each followed down while it does not fork), so its
        cost does not grow with the index; children are looked up by the request's keys.
        """
        start: _Node[K] = self.root
        best: tuple[K, ...] = ()
        if first is not None:
            child = self.root.children.get(first)
            if child is None or not child.children:  # nothing live follows it: the usual case
                return [first]
            start, best = child, (first,)
        budget = self.max_search_nodes
        wanted = set(keys)  # an exact set: ``children.keys() & wanted`` walks the smaller side, in C
        size = len(wanted)
        # a root path never repeats a block, so the blocks still usable below a node are
        # simply ``wanted``: nothing on the path above can appear again
        # entries are expanded lazily: (node, path to its parent, its key)
        stack: list[tuple[_Node[K], tuple[K, ...], K | None]] = [(start, best, None)]
        found: list[tuple[int, K, _Node[K]]] = []  # (live requests through it, key, child)
        while stack and budget > 0:
            node, path, key = stack.pop()
            if key is not None:
                path += (key,)
            budget -= 1
            while True:  # follow the path while it does not branch
                children = node.children
                if len(children) == 1:  # most nodes below the first few levels
                    [(key, child)] = children.items()
                    if key in wanted:
                        path += (key,)
                        node = child
                        continue
                    found = []
                    break
                common = children.keys() & wanted
                if len(common) == 1:
                    key = common.pop()
                    path += (key,)
                    node = children[key]
                    continue
                found = [(children[k].count, k, children[k]) for k in common]
                break
            if len(path) > len(best):
                best = path
                if len(path) == size:
                    break
            if found:
                found.sort()  # most-shared child explored first (keys differ: nodes are never compared)
                stack.extend([(child, path, k) for _, k, child in found])
        return list(best)

    # ---- updates -----------------------------------------------------------------
    def insert(self, request_id: str, order: Sequence[K]) -> int:
        """Record that ``request_id`` was sent with ``order``; returns the blocks it reused."""
        if request_id in self._terminal:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the index")
        self.root.count += 1
        return self._walk(request_id, self.root, order)[1]

    def end_of(self, request_id: str) -> object | None:
        """Where a live request's path ends (for :meth:`extend`), ``None`` when it is not live."""
        return self._terminal.get(request_id)

    def extend(self, request_id: str, more: Sequence[K], after: object) -> object | None:
        """Continue a live request's path by ``more`` (a long request entered in parts, the
        pilot's lock let go between them). ``after``: where its path ended after the previous
        part; if it moved since (truncated, evicted, restored), nothing changes and ``None``
        is returned. Returns where the path ends now."""
        node = self._terminal.get(request_id)
        if node is None or node is not after:
            return None
        node.request_ids.discard(request_id)  # type: ignore[union-attr]
        return self._walk(request_id, node, more)[0]

    def _walk(self, request_id: str, node: _Node[K], order: Sequence[K]) -> tuple[_Node[K], int]:
        """Take ``order`` below ``node`` for ``request_id``: along the children that exist
        (counted once more), then new ones; the request ends where it stops. Returns that
        node and how many keys were already there."""
        reused = 0
        for key in order:  # walk the shared part
            child = node.children.get(key)
            if child is None:
                break
            child.count += 1
            node = child
            reused += 1
        for key in order[reused:]:  # grow the rest
            child = node.children[key] = _Node(key, node, 1)
            node = child
        self._nodes += len(order) - reused
        if node.request_ids is None:
            node.request_ids = set()
        node.request_ids.add(request_id)
        self._terminal[request_id] = node
        return node, reused

    def evict(self, request_id: str) -> bool:
        """Forget a request; remove the nodes no other live request passes through."""
        node = self._terminal.pop(request_id, None)
        if node is None:
            return False
        node.request_ids.discard(request_id)  # type: ignore[union-attr]
        while node.parent is not None:
            parent = node.parent
            node.count -= 1
            if node.count == 0:
                del parent.children[node.key]  # type: ignore[arg-type]
                node.parent = None
                self._nodes -= 1
            node = parent
        node.count -= 1
        return True

    def truncate(self, request_id: str, keep: int) -> bool:
        """The engine now holds only the first ``keep`` blocks of this request's path.

        Drops the request when ``keep`` is 0; returns whether the request was live.
        """
        if request_id not in self._terminal:
            return False
        order = self.order_of(request_id)
        if keep >= len(order):
            return True
        self.evict(request_id)
        if keep > 0:
            self.insert(request_id, order[:keep])
        return True

    def shared_depths(self, order: Sequence[K]) -> list[int]:
        """Prefix lengths of a live request's ``order`` where another live request's shared
        part ends: the depths (in blocks) after which fewer live requests go on along it."""
        depths: list[int] = []
        node = self.root
        for depth, key in enumerate(order):
            child = node.children.get(key)
            if child is None:
                break
            if depth and child.count < node.count and node.count >= 2:
                depths.append(depth)
            node = child
        else:
            if order and node.count >= 2:
                depths.append(len(order))
            return depths
        if node is not self.root and node.count >= 2:
            depths.append(depth)
        return depths

    def sharing_below(self, order: Sequence[K], depth: int) -> list[str]:
        """Live requests whose path runs through the node at ``depth + 1`` along ``order``
        (they share its first ``depth + 1`` blocks)."""
        node = self.root
        for key in order[: depth + 1]:
            child = node.children.get(key)
            if child is None:
                return []
            node = child
        if node is self.root:
            return []
        found: list[str] = []
        stack = [node]
        while stack:
            current = stack.pop()
            found.extend(current.request_ids or ())
            stack.extend(current.children.values())
        return found

    def clear(self) -> None:
        self.root = _Node(None, None)
        self._terminal.clear()
        self._nodes = 0

    # ---- introspection (tests, drawings) -------------------------------------------
    def iter_nodes(self) -> Iterator[tuple[tuple[K, ...], int, frozenset[str]]]:
        """Every node as (path of keys, live count, request ids ending there), pre-order."""
        stack: list[tuple[_Node[K], tuple[K, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            if node is not self.root:
                yield path, node.count, frozenset(node.request_ids or ())
            for key, child in node.children.items():
                stack.append((child, (*path, key)))

    def check(self) -> None:
        """Assert the structural invariants (a tree; counts equal live requests below)."""
        seen: set[int] = set()
        total = 0

        def walk(node: _Node[K]) -> int:
            nonlocal total
            assert id(node) not in seen, "node reachable twice: not a tree"
            seen.add(id(node))
            below = len(node.request_ids or ())
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, "broken parent link"
                below += walk(child)
            assert node.count == below, f"count {node.count} != live requests below {below}"
            if node is not self.root:
                assert node.count > 0, "dead node left behind"
                total += 1
            return below

        assert walk(self.root) == len(self._terminal)
        assert total == self._nodes
        for rid, node in self._terminal.items():
            assert node.request_ids is not None and rid in node.request_ids
