"""Map the engine's KV blocks to our request ids.

KV-cache events (SGLang, vLLM) name blocks by a hash chain (block hash, parent hash, the
block's token ids), never by request. We record each request's prompt token ids, walk
them through the stored chain, and remember which requests hold which block. When a
block is removed from every storage tier, the requests whose chain ran through it have
lost everything from that block on. Work is proportional to the events and the tracked
prompts, never to the whole index: requests wait on the next block key they need.

Memory is bounded twice: by stored blocks (``max_blocks``) and by tracked prompt tokens
(``max_tracked_tokens``, plus ``max_requests``). Forgetting is always conservative: a
block dropped from the map counts as removed (its holders are shortened), and a request
no longer tracked is reported back so its prediction can be dropped too, since nothing
would tell us later when the engine evicts it.

Confirmation. A request counts as cached only as far as its pages can be walked from the
root of the engine's chain. After a late start or a reset, the engine may hold pages it
announced before we listened (the system prompt, say): nothing walks through them, so the
engine's own ``cached_tokens`` report for a served request anchors them. The pages it
confirmed become *anchored* pages (placeholders, since their hashes were never seen), and
the first stored block hanging below an unknown parent with the tokens of the request's
next page gives the last anchored page its real hash, so later removals map again.

Not thread-safe on its own: :class:`~contextpilot_integrations.engines.sink.KvEventSink`
guards it.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Hashable, Iterable, MutableMapping, Sequence
from typing import TypeVar

__all__ = ["EngineBlockMap", "block_token_ends", "blocks_held"]

PageKey = bytes  # parent block hash and the block's token ids, packed
DEFAULT_MEDIUM = "GPU"
_NO_PARENT = b"\x00"


BlockHash = int | bytes  # SGLang: int64; vLLM: SHA-256 bytes (or uint64)


def page_key(parent_hash: BlockHash | None, tokens: Sequence[int], partition: str | None = None) -> PageKey:
    """The identity of a page in the engine's chain: its parent's hash and its tokens; a
    first page also its cache partition (:mod:`~..core.partitions`): two tenants' first
    pages of the same tokens are two blocks at the engine (their hashes differ from there on)."""
    if parent_hash is None and partition is not None:
        head = _IN_PARTITION + hashlib.sha256(partition.encode()).digest()[:_PARTITION_DIGEST]
    elif parent_hash is None:
        head = _NO_PARENT
    elif isinstance(parent_hash, bytes):
        head = b"\x03" + len(parent_hash).to_bytes(1, "little") + parent_hash
    else:
        head = b"\x01" + parent_hash.to_bytes(9, "little", signed=True)
    try:
        return head + array("i", tokens).tobytes()
    except OverflowError:  # token ids beyond 32 bits: a distinct, wider encoding
        return head + b"\x02" + array("q", tokens).tobytes()


_IN_PARTITION = b"\x04"  # a first page in a cache partition, its name's digest next
_PARTITION_DIGEST = 16

_ANCHOR = b"\xffanchored:"  # prefix of a placeholder hash (a page the engine confirmed)


def _is_anchor(block_hash: BlockHash) -> bool:
    return isinstance(block_hash, bytes) and block_hash.startswith(_ANCHOR)


def _page_tokens(key: PageKey) -> bytes:
    """The token part of a page key (what an orphan block and a request's page share)."""
    if key[:1] == _NO_PARENT:
        return key[1:]
    if key[:1] == _IN_PARTITION:
        return key[1 + _PARTITION_DIGEST :]
    if key[:1] == b"\x03":
        return key[2 + key[1] :]
    return key[10:]


class _Block:
    __slots__ = ("key", "mediums", "orphan")

    def __init__(self, key: PageKey, medium: str, orphan: bool = False) -> None:
        self.key = key
        self.mediums: tuple[str, ...] = (medium,)
        self.orphan = orphan  # stored below a parent never seen (before we listened)


class _Request:
    __slots__ = ("block_ends", "chain", "partition", "tokens")

    def __init__(self, tokens: array[int], block_ends: tuple[int, ...] | None, partition: str | None = None) -> None:
        self.tokens = tokens
        self.block_ends = block_ends  # token offset where each of our blocks ends
        self.partition = partition  # the engine's cache partition it was sent in
        self.chain: list[BlockHash] = []  # engine block hashes of the cached prefix


def _as_tokens(token_ids: Sequence[int]) -> array[int]:
    try:
        return array("i", token_ids)
    except OverflowError:
        return array("q", token_ids)


class EngineBlockMap:
    """Engine block hashes <-> our request ids.

    Args:
        page_size: tokens per engine block (SGLang's ``--page-size``, vLLM's
            ``--block-size``); learned from the first ``BlockStored`` event when not given.
        max_requests: bound on tracked requests (oldest forgotten first).
        max_blocks: bound on stored engine blocks remembered (oldest dropped first, as if
            removed). About 200 bytes each.
        max_tracked_tokens: bound on the prompt tokens of tracked requests together
            (oldest requests forgotten first). About 4 bytes each, plus a chain entry per
            cached page.
    """

    def __init__(
        self,
        page_size: int | None = None,
        max_requests: int = 200_000,
        *,
        max_blocks: int = 1_000_000,
        max_tracked_tokens: int = 20_000_000,
    ) -> None:
        for name, value in (("max_requests", max_requests), ("max_blocks", max_blocks)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1")
        if max_tracked_tokens < 1:
            raise ValueError("max_tracked_tokens must be at least 1")
        self.page_size = page_size
        self.max_requests = max_requests
        self.max_blocks = max_blocks
        self.max_tracked_tokens = max_tracked_tokens
        self._by_key: dict[PageKey, BlockHash] = {}
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()  # oldest stored first
        self._requests: OrderedDict[str, _Request] = OrderedDict()  # oldest tracked first
        self._tracked_tokens = 0
        self._holders: dict[BlockHash, set[str]] = defaultdict(set)
        self._waiting: dict[PageKey, set[str]] = defaultdict(set)
        self._orphans: dict[bytes, list[BlockHash]] = {}  # page tokens -> blocks with unknown parents
        self._stuck: dict[bytes, set[str]] = defaultdict(set)  # next page tokens -> anchored requests
        self.anchored_pages = 0
        self.anchors_resolved = 0
        self._dropped: list[str] = []  # requests forgotten for the bounds, not yet reported

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def stored_blocks(self) -> int:
        return len(self._blocks)

    @property
    def tracked_tokens(self) -> int:
        return self._tracked_tokens

    def take_dropped(self) -> list[str]:
        """Requests forgotten to stay within the bounds since the last call: the caller
        must stop predicting hits for them (no event will tell it when they go)."""
        dropped, self._dropped = self._dropped, []
        return dropped

    # ---- our requests ----------------------------------------------------------------
    def track(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ends: Sequence[int] | None = None,
        engine_cached: int | None = None,
        partition: str | None = None,
    ) -> dict[str, int]:
        """Record a request's prompt token ids (and where each of its blocks ends), sent in
        cache ``partition`` (its first page is that partition's).

        ``engine_cached``: the engine's own count of this prompt's tokens it served from
        its cache; pages it covers that the events never showed are anchored (see the
        module docstring). Returns {request id: prompt tokens now cached} for other
        tracked requests whose cached prefix grew through the anchored pages.
        """
        tokens = _as_tokens(token_ids)
        ends = tuple(block_ends) if block_ends else None
        if ends is not None and (any(b <= a for a, b in itertools.pairwise(ends)) or ends[-1] > len(tokens)):
            raise ValueError("block_ends must increase and lie within the prompt")
        if engine_cached is not None and (isinstance(engine_cached, bool) or engine_cached < 0):
            raise ValueError("engine_cached must be a non-negative int")
        self.forget(request_id)
        self._requests[request_id] = _Request(tokens, ends, partition)
        self._tracked_tokens += len(tokens)
        while len(self._requests) > 1 and (
            len(self._requests) > self.max_requests or self._tracked_tokens > self.max_tracked_tokens
        ):
            oldest = next(iter(self._requests))
            self.forget(oldest)
            self._dropped.append(oldest)
        grown: dict[str, int] = {}
        if self.page_size:
            self._extend(request_id)
            if engine_cached:
                grown = self._anchor(request_id, min(engine_cached, len(tokens)) // self.page_size)
        grown.pop(request_id, None)
        return grown

    def forget(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        self._tracked_tokens -= len(request.tokens)
        for block_hash in request.chain:
            _discard(self._holders, block_hash, request_id)
        key = self._next_key(request)
        if key is not None:
            _discard(self._waiting, key, request_id)
            _discard(self._stuck, _page_tokens(key), request_id)

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
        kept = blocks_held(request.block_ends, cached_tokens, self.page_size)
        return None if kept == len(request.block_ends) else kept

    # ---- engine events -----------------------------------------------------------------
    def stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        block_size: int,
        medium: str | None = None,
        partition: str | None = None,
    ) -> tuple[dict[str, int], dict[str, int]]:
        """A ``BlockStored`` event (consecutive pages may be coalesced into one), in the cache
        ``partition`` it names (for a first page: the engine hashes the partition into it).

        Returns ({request id: prompt tokens now cached} for the requests whose cached
        prefix grew, which happens when blocks come back after an eviction;
        {request id: prompt tokens still cached} for requests shortened because old blocks
        were dropped to stay within ``max_blocks``).
        """
        grown: dict[str, int] = {}
        if not self.page_size:
            self.page_size = block_size
            for request_id in list(self._requests):
                self._extend(request_id)
        tier = medium or DEFAULT_MEDIUM
        parent = parent_hash
        for i, block_hash in enumerate(block_hashes):
            block = self._blocks.get(block_hash)
            if block is None:
                key = page_key(parent, token_ids[i * block_size : (i + 1) * block_size], partition)
                orphan = parent is not None and parent not in self._blocks
                block = self._blocks[block_hash] = _Block(key, tier, orphan)
                self._by_key[key] = block_hash
                for request_id in self._waiting.pop(key, ()):
                    self._extend(request_id)
                    grown[request_id] = self.cached_tokens(request_id)
                if orphan:
                    assert parent is not None
                    tokens = _page_tokens(key)
                    self._orphans.setdefault(tokens, []).append(block_hash)
                    for request_id in list(self._stuck.get(tokens, ())):
                        grown.update(self._resolve(request_id))
            elif tier not in block.mediums:
                block.mediums += (tier,)
            parent = block_hash
        shortened: dict[str, int] = {}
        if len(self._blocks) > self.max_blocks:
            oldest: list[BlockHash] = list(itertools.islice(self._blocks, len(self._blocks) - self.max_blocks))
            shortened = self._drop(oldest)
            for request_id in shortened:
                grown.pop(request_id, None)
        return grown, shortened

    def removed(self, block_hashes: Iterable[BlockHash], medium: str | None = None) -> dict[str, int]:
        """A ``BlockRemoved`` event; returns {request id: prompt tokens still cached}.

        A block demoted to another tier (e.g. host memory) is still reusable: only a block
        gone from every tier shortens the requests that ran through it.
        """
        tier = medium or DEFAULT_MEDIUM
        gone = []
        for block_hash in block_hashes:
            block = self._blocks.get(block_hash)
            if block is None:
                continue
            block.mediums = tuple(m for m in block.mediums if m != tier)
            if not block.mediums:
                gone.append(block_hash)
        return self._drop(gone)

    def cleared(self) -> list[str]:
        """``AllBlocksCleared``: returns the requests that held anything."""
        held = [rid for rid, request in self._requests.items() if request.chain]
        self._by_key.clear()
        self._blocks.clear()
        self._holders.clear()
        self._waiting.clear()
        self._orphans.clear()
        self._stuck.clear()
        for request_id, request in self._requests.items():
            request.chain = []
            key = self._next_key(request)
            if key is not None:
                self._waiting[key].add(request_id)
        return held

    # ---- internals -----------------------------------------------------------------------
    def _drop(self, block_hashes: Iterable[BlockHash]) -> dict[str, int]:
        """Blocks gone: cut every holder's chain there; returns {request id: tokens left}."""
        shortened: dict[str, int] = {}
        for block_hash in block_hashes:
            block = self._blocks.pop(block_hash, None)
            if block is None:
                continue
            self._by_key.pop(block.key, None)
            if block.orphan:
                self._forget_orphan(block.key, block_hash)
            for request_id in self._holders.pop(block_hash, ()):
                request = self._requests[request_id]
                stale = self._next_key(request)
                if stale is not None:
                    _discard(self._waiting, stale, request_id)
                    _discard(self._stuck, _page_tokens(stale), request_id)
                cut = request.chain.index(block_hash)
                for later in request.chain[cut + 1 :]:
                    _discard(self._holders, later, request_id)
                del request.chain[cut:]
                self._waiting[block.key].add(request_id)  # re-stored later: extend again
                shortened[request_id] = cut * (self.page_size or 0)
        return shortened

    def _anchor(self, request_id: str, pages: int) -> dict[str, int]:
        """The engine served ``pages`` leading pages of this request from its cache: those
        the events never showed become anchored pages. Returns the other requests that
        grew (they were waiting on an anchored page)."""
        request = self._requests[request_id]
        grown: dict[str, int] = {}
        while len(request.chain) < pages:
            key = self._next_key(request)
            if key is None:
                break
            if key not in self._by_key:
                anchor = _ANCHOR + hashlib.blake2b(key, digest_size=16).digest()
                self._blocks[anchor] = _Block(key, DEFAULT_MEDIUM)
                self._by_key[key] = anchor
                self.anchored_pages += 1
                for waiting in self._waiting.pop(key, ()):
                    if waiting != request_id:
                        self._extend(waiting)
                        grown[waiting] = self.cached_tokens(waiting)
            self._extend(request_id)
        grown.update(self._resolve(request_id))
        return grown

    def _resolve(self, request_id: str) -> dict[str, int]:
        """A request whose chain ends on an anchored page waits for the block stored below
        that page's real hash: an orphan block with the tokens of its next page. Found,
        the anchored page takes the orphan's parent hash and the chain walks on."""
        request = self._requests[request_id]
        key = self._next_key(request)
        if key is None or not request.chain or not _is_anchor(request.chain[-1]):
            return {}
        tokens = _page_tokens(key)
        candidates = [h for h in self._orphans.get(tokens, ()) if self._blocks[h].key[:1] != _NO_PARENT]
        if not candidates:
            self._stuck[tokens].add(request_id)
            return {}
        orphan = self._blocks[candidates[-1]]  # the most recent one
        real = _parent_of(orphan.key)
        anchor = request.chain[-1]
        _discard(self._stuck, tokens, request_id)
        if real in self._blocks:  # that hash is known after all: the guess would be a conflict
            return {}
        block = self._blocks.pop(anchor)
        self._blocks[real] = block
        self._by_key[block.key] = real
        holders = self._holders.pop(anchor, set())
        self._holders[real] = holders
        for holder in holders:
            chain = self._requests[holder].chain
            chain[chain.index(anchor)] = real
        for child in [h for h in self._orphans.get(tokens, ()) if _parent_of(self._blocks[h].key) == real]:
            self._blocks[child].orphan = False
            self._forget_orphan(self._blocks[child].key, child)
        self.anchors_resolved += 1
        grown: dict[str, int] = {}
        for holder in list(holders):
            before = len(self._requests[holder].chain)
            next_key = self._next_key(self._requests[holder])
            if next_key is not None:
                _discard(self._waiting, next_key, holder)
                _discard(self._stuck, _page_tokens(next_key), holder)
            self._extend(holder)
            if len(self._requests[holder].chain) > before:
                grown[holder] = self.cached_tokens(holder)
        return grown

    def _forget_orphan(self, key: PageKey, block_hash: BlockHash) -> None:
        tokens = _page_tokens(key)
        orphans = self._orphans.get(tokens)
        if orphans is not None and block_hash in orphans:
            orphans.remove(block_hash)
            if not orphans:
                del self._orphans[tokens]

    def _next_key(self, request: _Request) -> PageKey | None:
        size = self.page_size
        if not size:
            return None
        start = len(request.chain) * size
        if start + size > len(request.tokens):
            return None
        parent = request.chain[-1] if request.chain else None
        return page_key(parent, request.tokens[start : start + size], request.partition)

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
            _discard(self._waiting, key, request_id)
            _discard(self._stuck, _page_tokens(key), request_id)
            request.chain.append(block_hash)
            self._holders[block_hash].add(request_id)


def _parent_of(key: PageKey) -> BlockHash:
    """The parent hash a page key was made from (a key that has one)."""
    if key[:1] == b"\x03":
        return key[2 : 2 + key[1]]
    return int.from_bytes(key[1:10], "little", signed=True)


def blocks_held(block_ends: Sequence[int], cached_tokens: int, page_size: int | None) -> int:
    """How many leading blocks an engine holding ``cached_tokens`` prompt tokens serves.

    The engine caches whole pages only: a block's last partial page is shared with the
    next block, and is cached only when that block's start matches too. A block counts as
    held when its *whole pages* are (its end rounded down to a page), so the prediction
    it implies is never more than a page above the engine's count, and a request whose
    next block differs still keeps its earlier blocks. Without a page size, a block counts
    only when it is held to its last token.
    """
    page = page_size or 1
    return sum(1 for end in block_ends if end - end % page <= cached_tokens)


def block_token_ends(prompt_ids: Sequence[int], block_ids: Sequence[Sequence[int]]) -> list[int] | None:
    """Where each block ends in a prompt's token ids (exclusive positions, increasing).

    ``block_ids`` are the token ids of each block's rendered text tokenized alone (without
    special tokens), in send order; each is located in ``prompt_ids`` after the previous
    one. A tokenizer may merge a block's first or last token with its neighbours in the
    prompt, so when the whole block is not found its interior is, and the end is placed
    one token past the interior: late by at most a token, which can only make a block
    count as cached later, never earlier. ``None`` when a block cannot be located.
    """
    prompt = _as_tokens(prompt_ids)
    if prompt.typecode != "q":
        prompt = array("q", prompt)
    haystack = prompt.tobytes()
    ends: list[int] = []
    start = 0
    for ids in block_ids:
        if not ids:
            return None
        found = _find(haystack, ids, start)
        if found is not None:
            end = found + len(ids)
        elif len(ids) > 2:
            found = _find(haystack, ids[1:-1], start)
            if found is None:
                return None
            end = min(found + len(ids) - 1, len(prompt))
        else:
            return None
        if ends and end <= ends[-1]:
            return None
        ends.append(end)
        start = end
    return ends


def _find(haystack: bytes, needle: Sequence[int], start: int) -> int | None:
    """Token position of ``needle`` in ``haystack`` (8-byte tokens) at or after ``start``."""
    try:
        pattern = array("q", needle).tobytes()
    except OverflowError:
        return None
    at = start * 8
    while True:
        at = haystack.find(pattern, at)
        if at == -1:
            return None
        if at % 8 == 0:
            return at // 8
        at += 8 - at % 8


K = TypeVar("K", bound=Hashable)


def _discard(index: MutableMapping[K, set[str]], key: K, request_id: str) -> None:
    """Drop ``request_id`` from ``index[key]``, and the entry once it is empty."""
    members = index.get(key)
    if members is not None:
        members.discard(request_id)
        if not members:
            del index[key]
