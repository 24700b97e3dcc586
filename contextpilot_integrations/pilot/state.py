"""The engine's cache as the pilot predicts it, and every change to that prediction.

One :class:`EngineState` per pilot: the live :class:`~..index.prefix_trie.PrefixTrie`, the
ordering strategy that learns from it, which requests are live (oldest first, bounded), the
send order of each (so :meth:`EngineState.restore` can bring a prefix back) and the
observers told of each change (the shared log). A request enters through one
:meth:`EngineState.record`, however the pilot learns of it: prepared here, adopted from
another engine's pilot, or sent by another worker. Nothing here takes a lock: the pilot
calls every method under its own.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from ..core.blocks import Block
from ..core.events import Evicted, IndexEvent, Observer, Reset, Restored, Sent, Truncated
from ..core.gain import index_keys, key_block, labelled_keys, plain_keys
from ..core.prepared import PreparedRequest
from ..core.validation import check_request_id
from ..errors import DuplicateRequestError
from ..index.prefix_trie import PrefixTrie
from ..index.strategies import PlannedBatch, Strategy, make_strategy
from .stats import Counters

__all__ = ["EngineState", "checked_ids", "checked_order"]


class EngineState:
    """The predicted engine state: what is live, in which order, and who hears of changes."""

    def __init__(self, strategy: Strategy, trie: PrefixTrie[str], max_live_requests: int, id_prefix: str) -> None:
        self.trie = trie
        self.strategy = strategy
        self.max_live_requests = max_live_requests
        self.counters = Counters()  # the pilot's totals, shared with the planner and the reports
        self.live: OrderedDict[str, int] = OrderedDict()  # request id -> when it entered, oldest first
        self.orders: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # send orders, for restore()
        self.reserved: set[str] = set()  # ids of a batch being planned
        self.footprints: dict[str, int] = {}  # live request id -> tokens it added to the engine's cache
        self.held_tokens = 0  # their sum
        self.hears_evictions = False  # the engine's evictions reach the pilot (KV events, a simulator)
        self.observers: list[Observer] = []
        self._unshared = threading.local()
        self._ticks = itertools.count()
        self._id_base = id_prefix
        self._id_prefix, self._ids, self._id_pid = self._id_series()

    @classmethod
    def make(cls, strategy: str, max_live_requests: int, id_prefix: str, **options: Any) -> EngineState:
        """An empty state: a new trie and the strategy ``strategy`` (with ``options``) bound to it."""
        trie: PrefixTrie[str] = PrefixTrie()
        return cls(make_strategy(strategy, trie, **options), trie, max_live_requests, id_prefix)

    def new_request_id(self, request_id: str | None) -> str:
        """A generated id, or the caller's own once checked to be new here."""
        if request_id is None:
            if self._id_pid != os.getpid():  # a forked worker (gunicorn --preload): ids of its own
                self._id_prefix, self._ids, self._id_pid = self._id_series()
            return f"{self._id_prefix}{next(self._ids)}"
        check_request_id(request_id)
        if request_id in self.live or request_id in self.reserved:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the index")
        return request_id

    def _id_series(self) -> tuple[str, Iterator[int], int]:
        """A prefix no other process makes (random, renewed in a forked child) and its count."""
        return f"{self._id_base}-{secrets.token_hex(6)}-", itertools.count(), os.getpid()

    def notify(self, event: IndexEvent) -> None:
        """Tell every observer of ``event``, here under the pilot's lock, so that they hear
        the changes in the order the index made them (whichever thread made each)."""
        if getattr(self._unshared, "depth", 0):  # a change this worker keeps to itself
            return
        for observer in self.observers:
            observer(event)

    @contextlib.contextmanager
    def unshared(self) -> Iterator[None]:
        """Changes made in this thread meanwhile reach no observer (the shared log)."""
        self._unshared.depth = getattr(self._unshared, "depth", 0) + 1
        try:
            yield
        finally:
            self._unshared.depth -= 1

    # ---- a request enters ----------------------------------------------------------------------
    def record(self, rid: str, order: Sequence[str], blocks: Sequence[Block] | None) -> int:
        """The engine now holds ``order`` (index keys) for request ``rid``: insert it, mark it
        live, keep its order, forget the oldest past the bound, and tell the observers
        (``blocks``: what was sent, for their token counts; ``None`` for a request another
        worker sent, which the observers already know). Returns the blocks predicted cached."""
        cached = self.trie.insert(rid, order)
        self.live[rid] = next(self._ticks)
        self.orders[rid] = tuple(order)
        self.enforce_bound()
        if blocks is not None and self.observers:
            self.notify(Sent(rid, tuple(order), tuple([block.token_count for block in blocks])))
        return cached

    def adopt(self, prepared: PreparedRequest, fresh_id: bool) -> PreparedRequest:
        """Record a request prepared elsewhere as this engine will hold it (a later turn of a
        conversation is not indexed); a new id when asked or when its id is taken here."""
        order = index_keys(prepared)
        rid = prepared.request_id
        if fresh_id or rid in self.live or rid in self.reserved:
            rid = self.new_request_id(None)
        cached = 0
        if not prepared.turn:
            cached = self.record(rid, order, prepared.blocks)
        adopted = replace(
            prepared,
            request_id=rid,
            cached_blocks=cached,
            cached_tokens=sum(block.token_count for block in prepared.blocks[:cached]),
        )
        return adopted

    def move(self, prepared: PreparedRequest, partition: str | None) -> PreparedRequest:
        """The request goes out in another cache partition than it was prepared for (its
        model call's body names one): indexed there instead, under the same id, with the
        blocks predicted cached there. Its turn and counts stay; the observers hear it leave
        and enter."""
        moved = replace(prepared, partition=partition)
        rid = prepared.request_id
        if rid not in self.live:  # not indexed (a later turn) or gone already: nothing held
            return moved
        self._drop(rid)
        self.orders.pop(rid, None)
        if self.observers:
            self.notify(Evicted((rid,)))
        cached = self.record(rid, index_keys(moved), moved.blocks)
        return replace(moved, cached_blocks=cached, cached_tokens=sum(b.token_count for b in moved.blocks[:cached]))

    def learn(self, rid: str, order: list[str], part: slice) -> None:
        """Let the strategy learn a request it did not order (another worker's), entered in
        parts: ``part``, these of its blocks now (the trie strategy counts each part, the
        paper's tree learns the request whole with the first)."""
        if self.strategy.name == "trie":  # it learns the blocks' popularity (no ordering needed)
            self.strategy.commit(PlannedBatch([], []), [(rid, order[part])])
        elif not part.start:
            self.strategy.order(rid, order)  # the paper's tree learns the request

    def extend(self, rid: str, more: list[str], after: object) -> object | None:
        """The next blocks of a live request entered in parts (:meth:`record` took the first;
        ``after``: where its path ended then). ``None``, adding nothing, when it changed
        meanwhile (evicted, truncated, reset); else where its path ends now."""
        end = self.trie.extend(rid, more, after)
        if end is not None and rid in self.orders:
            self.orders[rid] = (*self.orders[rid], *more)
        return end

    def hold(self, rid: str, tokens: int, capacity: int | None) -> None:
        """Live request ``rid`` added ``tokens`` to the engine's cache (what it computed, as
        the engine reported: its prompt less its cached tokens). With the cache's size known,
        the oldest requests are forgotten while the live ones hold more than it: the engine
        evicts least recently used first, so a prediction it has already dropped does not buy
        a failed reorder (a prefix a newer request reused stays predicted through that one).
        Once the engine's own evictions reach the pilot (:attr:`hears_evictions`), they are
        followed instead."""
        if rid not in self.live:
            return
        self.held_tokens += tokens - self.footprints.get(rid, 0)
        self.footprints[rid] = tokens
        if capacity is None or self.hears_evictions or self.held_tokens <= capacity:
            return
        gone, held = [], self.held_tokens
        for old in self.live:
            if held <= capacity:
                break
            if old != rid:
                gone.append(old)
                held -= self.footprints.get(old, 0)
        self.evict(gone)

    def _drop(self, rid: str) -> None:
        """A live request leaves the prediction: its footprint, its place in the trie and the strategy."""
        del self.live[rid]
        self.held_tokens -= self.footprints.pop(rid, 0)
        self.forget(rid)

    # ---- the engine dropped or got back blocks -------------------------------------------------
    def evict(self, request_ids: list[str], heard: bool = False) -> int:
        """``heard``: the engine's own eviction (events, a simulator), not the pilot's inference."""
        self.hears_evictions |= heard
        evicted = 0
        for rid in request_ids:
            self.orders.pop(rid, None)
            if rid in self.live:
                self._drop(rid)
                evicted += 1
        self.counters.evicted += evicted
        if self.observers and request_ids:
            self.notify(Evicted(tuple(request_ids)))
        return evicted

    def truncate(self, request_id: str, cached_blocks: int, heard: bool = False) -> bool:
        self.hears_evictions |= heard
        if self.observers:
            self.notify(Truncated(request_id, cached_blocks))
        if request_id not in self.live:
            return False
        if cached_blocks == 0:
            self._drop(request_id)
            self.counters.evicted += 1
            return True
        whole = len(self.orders.get(request_id, ())) or cached_blocks
        if request_id in self.footprints and cached_blocks < whole:  # it holds that share of its blocks now
            kept = self.footprints[request_id] * cached_blocks // whole
            self.held_tokens -= self.footprints[request_id] - kept
            self.footprints[request_id] = kept
        return self.trie.truncate(request_id, cached_blocks)

    def restore(self, request_id: str, cached_blocks: int | None) -> bool:
        if self.observers:
            self.notify(Restored(request_id, cached_blocks))
        order = self.orders.get(request_id)
        if order is None:
            return False
        keep = len(order) if cached_blocks is None else min(cached_blocks, len(order))
        if request_id in self.live:
            if keep <= len(self.trie.order_of(request_id)):
                return True
            self.trie.evict(request_id)
        elif keep == 0:
            return True
        else:
            self.live[request_id] = next(self._ticks)
        self.trie.insert(request_id, order[:keep])
        self.enforce_bound()
        return True

    def reset(self) -> None:
        self.counters.evicted += len(self.live)
        self.live.clear()
        self.orders.clear()
        self.footprints.clear()
        self.held_tokens = 0
        self.trie.clear()
        self.strategy.reset()
        if self.observers:
            self.notify(Reset())

    def forget(self, rid: str) -> None:
        self.trie.evict(rid)
        self.strategy.forget(rid)

    def enforce_bound(self) -> None:
        while len(self.live) > self.max_live_requests:
            oldest = next(iter(self.live))
            self._drop(oldest)
            self.orders.pop(oldest, None)
            self.counters.evicted += 1
        while len(self.orders) > self.max_live_requests:
            self.orders.popitem(last=False)

    # ---- queries -------------------------------------------------------------------------------
    def shared_depths(self, prepared: PreparedRequest) -> tuple[int, ...]:
        """Where the live requests sharing this one's send order end (not live: its cached blocks)."""
        if prepared.request_id in self.live:
            return tuple(self.trie.shared_depths(index_keys(prepared)))
        return (prepared.cached_blocks,) if prepared.cached_blocks else ()

    def predicted_cached_blocks(self, ids: list[str], partition: str | None = None) -> int:
        plain, labelled = plain_keys(ids, partition), labelled_keys(ids, partition)
        return max(self.trie.match_length(plain), self.trie.match_length(labelled))

    def reusable_tokens(self, sizes: dict[str, int], partition: str | None = None) -> int:
        """Tokens of the blocks ``sizes`` weighs (by id) the engine could serve, sent plain or sent
        labelled (in ``partition``): the longest live prefix they can follow."""
        keys, heads = list(sizes), []
        for indexed in (plain_keys(keys, partition), labelled_keys(keys, partition)):
            if self.strategy.name == "retrieval":
                heads.append(keys[: self.trie.match_length(indexed)])
            else:
                heads.append([key_block(key) for key in self.trie.best_prefix(indexed)])
        return max(sum(sizes[key] for key in head) for head in heads)

    def live_orders(self) -> list[tuple[str, tuple[str, ...]]]:
        return [(rid, tuple(self.trie.order_of(rid))) for rid in self.live]

    def check(self) -> None:
        self.trie.check()
        assert set(self.trie.request_ids()) == set(self.live), "index and live ids differ"


def checked_ids(request_ids: Iterable[str]) -> list[str]:
    """Request ids as a list (one id alone is one), each a ``str``, or ``TypeError``."""
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    for rid in ids:
        if not isinstance(rid, str):
            raise TypeError(f"request ids must be str, got {type(rid).__name__}")
    return ids


def checked_order(request_id: str, block_ids: Sequence[str]) -> list[str]:
    """Another worker's request as :meth:`EngineState.record` takes it, or the error."""
    check_request_id(request_id)
    order = list(block_ids)
    if not order or not all(isinstance(key, str) for key in order):
        raise TypeError("block_ids must be a non-empty sequence of str")
    return order
