"""A block-granular model of SGLang's radix cache, for what-if runs without a GPU.

The cache is a trie of blocks with token counts and a capacity in tokens. A request's hit
is the token length of its longest cached block prefix; its blocks are then inserted,
evicting least-recently-used leaves (never the request's own path) until they fit, the
way SGLang's ``RadixCache`` evicts with the ``lru`` policy. The request's own tail (its
question) is never reused by another request, so it is not cached. Every evicted leaf that
ended a request's path yields that request id as an eviction notice, which is what the
engine's events tell :meth:`ContextPilot.evict`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["RadixCacheSimulator", "SimulatedRequest"]


class _Node:
    __slots__ = ("children", "depth", "key", "last_access", "parent", "request_ids", "tokens")

    def __init__(self, key: Hashable | None, tokens: int, parent: _Node | None) -> None:
        self.key = key
        self.depth = parent.depth + 1 if parent is not None else 0
        self.tokens = tokens
        self.parent = parent
        self.children: dict[Hashable, _Node] = {}
        self.last_access = 0
        self.request_ids: list[str] = []


@dataclass(frozen=True, slots=True)
class SimulatedRequest:
    """What the cache did for one request."""

    request_id: str
    hit_tokens: int
    block_tokens: int
    hit_blocks: int
    evicted: tuple[tuple[str, int], ...] = field(default=())
    """Eviction notices: (request id, blocks of its path still cached) for every request
    whose cached path got shorter while serving this one (0: nothing left)."""


class RadixCacheSimulator:
    """LRU radix cache over blocks.

    Args:
        capacity_tokens: cache size in tokens; ``None`` for unbounded.
    """

    def __init__(self, capacity_tokens: int | None = None) -> None:
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self.root = _Node(None, 0, None)
        self.used_tokens = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, _Node]] = []  # (last access, tiebreak, leaf)
        self._tiebreak = itertools.count()

    def match(self, blocks: Sequence[Hashable]) -> int:
        """Cached leading blocks of this order, without touching the cache."""
        node = self.root
        for depth, key in enumerate(blocks):
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                return depth
        return len(blocks)

    def request(self, request_id: str, blocks: Sequence[tuple[Hashable, int]]) -> SimulatedRequest:
        """Serve one request: report its hit, then cache its blocks.

        Args:
            blocks: (key, tokens) in send order.
        """
        now = next(self._clock)
        node = self.root
        path = [node]
        hit_tokens = hit_blocks = 0
        for key, _ in blocks:
            child = node.children.get(key)
            if child is None:
                break
            node = child
            path.append(node)
            hit_blocks += 1
            hit_tokens += node.tokens
        for visited in path:
            visited.last_access = now
        evicted: dict[str, int] = {}
        protected = {id(n) for n in path}
        for key, tokens in blocks[hit_blocks:]:
            if self.capacity_tokens is not None:
                if tokens > self.capacity_tokens:
                    break
                self._evict(self.used_tokens + tokens - self.capacity_tokens, protected, evicted)
                if self.used_tokens + tokens > self.capacity_tokens:
                    break  # everything else is the request's own path
            child = _Node(key, tokens, node)
            child.last_access = now
            node.children[key] = child
            self.used_tokens += tokens
            protected.add(id(child))
            node = child
        if node is not self.root:
            node.request_ids.append(request_id)
            self._push(node)
        total = sum(tokens for _, tokens in blocks)
        return SimulatedRequest(request_id, hit_tokens, total, hit_blocks, tuple(evicted.items()))

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def _evict(self, need: int, protected: set[int], evicted: dict[str, int]) -> None:
        skipped: list[tuple[int, int, _Node]] = []
        while need > 0 and self._heap:
            entry = heapq.heappop(self._heap)
            access, _, node = entry
            if node.parent is None or node.children or access != node.last_access:
                if node.parent is not None and not node.children:
                    self._push(node)  # touched since: re-queue with its new time
                continue
            if id(node) in protected:
                skipped.append(entry)
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.used_tokens -= node.tokens
            need -= node.tokens
            for rid in node.request_ids:
                evicted[rid] = parent.depth
            if parent is not self.root:
                parent.request_ids.extend(node.request_ids)  # their prefix is shorter now
                if not parent.children:
                    self._push(parent)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
