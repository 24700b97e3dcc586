"""A block-granular model of SGLang's radix cache, for what-if runs without a GPU.

It follows ``sglang.srt.mem_cache.radix_cache.RadixCache`` with the ``lru`` policy, with
blocks in place of tokens: nodes hold runs of blocks and split where requests diverge;
matching refreshes the access time of every node on the path; before a request's new
blocks are cached, least-recently-used unlocked leaves are evicted whole until they fit
(the request's own path is locked meanwhile). A request's hit is the token length of its
longest cached block prefix. The request's own tail (its question) is never reused by
another request, so it is not modelled.

Each evicted leaf that ended a request's path yields an eviction notice (request id,
blocks of its path still cached), which is what the engine's KV events tell
:meth:`ContextPilot.truncate`. The test suite checks hits against SGLang's own cache.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

__all__ = ["RadixCacheSimulator", "SimulatedRequest"]

BlockSpec = tuple[Hashable, int]  # (block key, tokens)


class _Node:
    __slots__ = ("blocks", "children", "depth", "last_access", "parent", "request_ids", "tokens")

    def __init__(self, blocks: list[BlockSpec], parent: _Node | None) -> None:
        self.blocks = blocks
        self.tokens = sum(tokens for _, tokens in blocks)
        self.parent = parent
        self.depth: int = (parent.depth if parent else 0) + len(blocks)  # blocks from the root
        self.children: dict[Hashable, _Node] = {}
        self.last_access = 0
        self.request_ids: list[str] = []  # requests whose cached path ends here


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
    oversized: bool = False
    """The request did not fit in the cache even after evicting all else: nothing of it
    was cached, so no later request can reuse it."""


class RadixCacheSimulator:
    """LRU radix cache over blocks.

    Args:
        capacity_tokens: cache size in tokens; ``None`` for unbounded.
    """

    def __init__(self, capacity_tokens: int | None = None) -> None:
        if capacity_tokens is not None and capacity_tokens < 0:
            raise ValueError("capacity_tokens must be >= 0")
        self.capacity_tokens = capacity_tokens
        self.root = _Node([], None)
        self.used_tokens = 0
        self._clock = itertools.count(1)
        self._heap: list[tuple[int, int, _Node]] = []  # (last access, tiebreak, leaf)
        self._tiebreak = itertools.count()

    def match(self, blocks: Sequence[Hashable]) -> int:
        """Cached leading blocks of this order, without touching the cache."""
        node, depth = self.root, 0
        while depth < len(blocks):
            child = node.children.get(blocks[depth])
            if child is None:
                break
            run = _common(child.blocks, blocks, depth)
            depth += run
            if run < len(child.blocks):
                break
            node = child
        return depth

    def request(
        self, request_id: str, blocks: Sequence[BlockSpec], generated: Sequence[BlockSpec] = ()
    ) -> SimulatedRequest:
        """Serve one request: report its hit, then cache its blocks.

        Args:
            blocks: (key, tokens) in send order: the prompt.
            generated: the answer, cached after the prompt once generation ends (as SGLang
                does), so the next turn of a chat, which starts with this one, hits it.
        """
        # SGLang's order of time stamps within one request: a node split by the match
        # keeps the match time for its lower part; the insert then touches the path
        # again; the new leaf is stamped last
        matched = next(self._clock) * 3
        now = matched + 1
        keys = [key for key, _ in blocks]
        node = self.root
        path = [node]
        depth = 0
        while depth < len(blocks):
            child = node.children.get(keys[depth])
            if child is None:
                break
            run = _common(child.blocks, keys, depth)
            if run < len(child.blocks):
                child.last_access = matched
                if not child.children:
                    self._push(child)
                node = self._split(child, run, now)
                depth += run
                path.append(node)
                break
            node = child
            depth += run
            path.append(node)
        for visited in path:
            visited.last_access = now
        hit_tokens = sum(n.tokens for n in path)
        evicted: dict[str, int] = {}
        rest = [*blocks[depth:], *generated]
        oversized = False
        if rest:
            need = sum(tokens for _, tokens in rest)
            if self.capacity_tokens is not None and self.used_tokens + need > self.capacity_tokens:
                self._evict(self.used_tokens + need - self.capacity_tokens, {id(n) for n in path}, evicted)
            if self.capacity_tokens is None or self.used_tokens + need <= self.capacity_tokens:
                leaf = _Node(rest, node)
                leaf.last_access = now + 1
                node.children[rest[0][0]] = leaf
                self.used_tokens += need
                node = leaf
            else:
                oversized = True
        if node is not self.root:
            node.request_ids.append(request_id)
            if not node.children:
                self._push(node)
        total = sum(tokens for _, tokens in blocks)
        return SimulatedRequest(request_id, hit_tokens, total, depth, tuple(evicted.items()), oversized)

    def _split(self, child: _Node, run: int, now: int) -> _Node:
        """Cut ``child`` after ``run`` blocks; the new upper node is returned."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.blocks[:run], parent)
        upper.last_access = now
        parent.children[upper.blocks[0][0]] = upper
        child.blocks = child.blocks[run:]
        child.tokens -= upper.tokens
        child.parent = upper
        upper.children[child.blocks[0][0]] = child
        return upper

    def _push(self, node: _Node) -> None:
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))

    def _evict(self, need: int, locked: set[int], evicted: dict[str, int]) -> None:
        skipped: list[tuple[int, int, _Node]] = []
        while need > 0 and self._heap:
            entry = heapq.heappop(self._heap)
            access, _, node = entry
            if node.parent is None or node.children:
                continue  # gone, or no longer a leaf
            if access != node.last_access:
                self._push(node)  # touched since it was queued
                continue
            if id(node) in locked:
                skipped.append(entry)
                continue
            parent = node.parent
            del parent.children[node.blocks[0][0]]
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


def _common(run: Sequence[BlockSpec], keys: Sequence[Hashable], start: int) -> int:
    """How many blocks of ``run`` equal ``keys[start:]``, from the start."""
    count = 0
    for (key, _), other in zip(run, itertools.islice(keys, start, None), strict=False):
        if key != other:
            break
        count += 1
    return count
