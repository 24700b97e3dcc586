"""Map the engine's KV blocks to our request ids.

KV-cache events (SGLang, vLLM) name blocks by a hash chain (block hash, parent hash, the
block's token ids), never by request. We record each request's prompt token ids, walk
them through the stored chain, and remember which requests hold which block. When a
block is removed from every storage tier, the requests whose chain ran through it have
lost everything from that block on. Work is proportional to the events and the tracked
prompts, never to the whole index: requests wait on the next block key they need.

Not thread-safe on its own: :class:`~contextpilot_integrations.backends.events.KvEventSink`
guards it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

__all__ = ["EngineBlockMap"]

PageKey = tuple[int | None, tuple[int, ...]]  # (parent block hash, the block's token ids)
DEFAULT_MEDIUM = "GPU"


@dataclass
class _Block:
    key: PageKey
    mediums: set[str] = field(default_factory=set)


@dataclass
class _Request:
    tokens: tuple[int, ...]
    block_ends: tuple[int, ...] | None  # token offset where each of our blocks ends
    chain: list[int] = field(default_factory=list)  # engine block hashes of the cached prefix


class EngineBlockMap:
    """Engine block hashes <-> our request ids.

    Args:
        page_size: tokens per engine block (SGLang's ``--page-size``); learned from the
            first ``BlockStored`` event when not given.
        max_requests: bound on tracked requests (oldest forgotten first).
    """

    def __init__(self, page_size: int | None = None, max_requests: int = 200_000) -> None:
        self.page_size = page_size
        self.max_requests = max_requests
        self._by_key: dict[PageKey, int] = {}
        self._blocks: dict[int, _Block] = {}
        self._requests: dict[str, _Request] = {}
        self._holders: dict[int, set[str]] = defaultdict(set)
        self._waiting: dict[PageKey, set[str]] = defaultdict(set)

    def __len__(self) -> int:
        return len(self._requests)

    @property
    def stored_blocks(self) -> int:
        return len(self._blocks)

    # ---- our requests ----------------------------------------------------------------
    def track(self, request_id: str, token_ids: Sequence[int], block_ends: Sequence[int] | None = None) -> None:
        """Record a request's prompt token ids (and where each of its blocks ends)."""
        self.forget(request_id)
        self._requests[request_id] = _Request(tuple(token_ids), tuple(block_ends) if block_ends else None)
        while len(self._requests) > self.max_requests:
            self.forget(next(iter(self._requests)))
        if self.page_size:
            self._extend(request_id)

    def forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        for block_hash in request.chain:
            self._release(block_hash, request_id)
        key = self._next_key(request)
        if key is not None:
            self._unwait(key, request_id)

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of this request the engine holds, as far as the events tell."""
        request = self._requests[request_id]
        return len(request.chain) * (self.page_size or 0)

    def blocks_within(self, request_id: str, cached_tokens: int) -> int | None:
        """How many of the request's own blocks lie wholly within ``cached_tokens``.

        ``None`` means none of them was lost. Without known block ends only that, or 0,
        can be told safely: the index must never predict a hit the engine will miss.
        """
        request = self._requests[request_id]
        if request.block_ends is None:
            whole_pages = len(request.tokens) - len(request.tokens) % (self.page_size or 1)
            return None if cached_tokens >= whole_pages else 0
        kept = sum(1 for end in request.block_ends if end <= cached_tokens)
        return None if kept == len(request.block_ends) else kept

    # ---- engine events -----------------------------------------------------------------
    def stored(
        self,
        block_hashes: Sequence[int],
        parent_hash: int | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str | None = None,
    ) -> dict[str, int]:
        """A ``BlockStored`` event (consecutive pages may be coalesced into one).

        Returns {request id: prompt tokens now cached} for the requests whose cached
        prefix grew, which happens when blocks come back after an eviction.
        """
        grown: dict[str, int] = {}
        if not self.page_size:
            self.page_size = block_size
            for request_id in list(self._requests):
                self._extend(request_id)
        parent = parent_hash
        for i, block_hash in enumerate(block_hashes):
            key = (parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
            block = self._blocks.get(block_hash)
            if block is None:
                block = self._blocks[block_hash] = _Block(key)
                self._by_key[key] = block_hash
            block.mediums.add(medium or DEFAULT_MEDIUM)
            for request_id in self._waiting.pop(key, set()):
                self._extend(request_id)
                grown[request_id] = self.cached_tokens(request_id)
            parent = block_hash
        return grown

    def removed(self, block_hashes: Iterable[int], medium: str | None = None) -> dict[str, int]:
        """A ``BlockRemoved`` event; returns {request id: prompt tokens still cached}.

        A block demoted to another tier (e.g. host memory) is still reusable: only a block
        gone from every tier shortens the requests that ran through it.
        """
        shortened: dict[str, int] = {}
        for block_hash in block_hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                continue
            block.mediums.discard(medium or DEFAULT_MEDIUM)
            if block.mediums:
                continue
            del self._blocks[block_hash]
            self._by_key.pop(block.key, None)
            for request_id in self._holders.pop(block_hash, set()):
                request = self._requests[request_id]
                stale = self._next_key(request)
                if stale is not None:
                    self._unwait(stale, request_id)
                cut = request.chain.index(block_hash)
                for later in request.chain[cut + 1 :]:
                    self._release(later, request_id)
                request.chain = request.chain[:cut]
                self._waiting[block.key].add(request_id)  # re-stored later: extend again
                shortened[request_id] = cut * (self.page_size or 0)
        return shortened

    def cleared(self) -> list[str]:
        """``AllBlocksCleared``: returns the requests that held anything."""
        held = [rid for rid, request in self._requests.items() if request.chain]
        self._by_key.clear()
        self._blocks.clear()
        self._holders.clear()
        self._waiting.clear()
        for request_id, request in self._requests.items():
            request.chain = []
            key = self._next_key(request)
            if key is not None:
                self._waiting[key].add(request_id)
        return held

    # ---- internals -----------------------------------------------------------------------
    def _next_key(self, request: _Request) -> PageKey | None:
        size = self.page_size
        if not size:
            return None
        start = len(request.chain) * size
        if start + size > len(request.tokens):
            return None
        parent = request.chain[-1] if request.chain else None
        return parent, request.tokens[start : start + size]

    def _extend(self, request_id: str) -> None:
        request = self._requests[request_id]
        while True:
            key = self._next_key(request)
            if key is None:
                return
            block_hash = self._by_key.get(key)
            if block_hash is None:
                self._waiting[key].add(request_id)
                return
            self._unwait(key, request_id)
            request.chain.append(block_hash)
            self._holders[block_hash].add(request_id)

    def _release(self, block_hash: int, request_id: str) -> None:
        _discard(self._holders, block_hash, request_id)

    def _unwait(self, key: PageKey, request_id: str) -> None:
        _discard(self._waiting, key, request_id)


K = TypeVar("K", bound=Hashable)


def _discard(index: MutableMapping[K, set[str]], key: K, request_id: str) -> None:
    """Drop ``request_id`` from ``index[key]``, and the entry once it is empty."""
    members = index.get(key)
    if members is not None:
        members.discard(request_id)
        if not members:
            del index[key]
