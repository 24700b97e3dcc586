"""Applies engine KV events and evictions to a pilot: transport-neutral, thread-safe.

Sequence numbers, per publisher (one engine process and data-parallel rank):

- the next number: applied;
- a number already seen (a publisher retrying a batch whose answer it missed): a
  duplicate, acknowledged and ignored;
- a number further on: events were lost, so the pilot's index is reset, since it must
  never predict a hit it cannot confirm;
- a publisher id not seen before is a new engine process (a restart gets a new id). Its
  first batch carries ``AllBlocksCleared`` (SGLang sends one when it builds its cache),
  which resets the index; a new publisher whose first batch is not number 0, after
  another publisher, has lost events, which resets it too. The first publisher ever
  heard may start past 0 (we started after the engine): no reset, since nothing held came
  from events yet; :meth:`KvEventSink.track` confirms each request against them.
- a transport that cannot tell processes apart by id (ZMQ: the same address, numbers
  starting again at 0) calls :meth:`KvEventSink.restarted` when the numbers go back.

``AllBlocksCleared`` (engine restart, ``/flush_cache``) always resets the index.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from ..pilot import ContextPilot
from .kv_mapping import EngineBlockMap
from .wire import BlockRemovedEvent, BlockStoredEvent, KvEventBatch

__all__ = ["KvEventSink", "SinkStats"]


class SinkStats(BaseModel):
    """What the sink has received and done."""

    batches: int = 0
    events: int = 0
    duplicate_batches: int = 0
    sequence_gaps: int = 0
    index_resets: int = 0
    publishers: int = 0
    publisher_restarts: int = 0
    """Publishers whose numbers went back (a new engine process at the same address)."""
    requests_shortened: int = 0
    """Requests whose prediction a batch shortened (each counted once per batch)."""
    requests_unconfirmed: int = 0
    """Served requests held to fewer blocks than predicted: their pages were not (yet) confirmed."""
    anchored_pages: int = 0
    """Pages the engine reported cached that no event had shown (stored before we listened)."""
    anchors_resolved: int = 0
    """Anchored pages whose real hash a later stored block revealed."""
    requests_evicted: int = 0
    requests_untracked: int = 0
    """Requests dropped from the index because the block map's bounds forgot them."""
    unknown_request_ids: int = 0
    rejected: int = 0
    connections_refused: int = 0
    idle_connections_closed: int = 0
    unproven_connections_closed: int = 0
    """Connections closed mid-request at the bound to seat a new client: none had shown the
    token or had a request answered (clients dripping a request)."""
    slow_requests_closed: int = 0
    """Connections closed because a request's head or body did not arrive in time."""
    tracked_requests: int = 0
    engine_blocks: int = 0
    latency_p50_ms: float | None = None
    latency_p99_ms: float | None = None


class KvEventSink:
    """Applies event batches and evictions to a pilot (thread-safe).

    Transport-neutral: the HTTP listener and the ZMQ subscriber both feed it.

    Args:
        pilot: the pilot whose index the events keep true.
        block_map: engine blocks <-> request ids (bounded; see :class:`EngineBlockMap`).
        max_publishers: sequence numbers remembered for at most this many publishers
            (least recently heard forgotten first).
    """

    def __init__(
        self, pilot: ContextPilot, block_map: EngineBlockMap | None = None, *, max_publishers: int = 1_024
    ) -> None:
        self.pilot = pilot
        self.block_map = block_map if block_map is not None else EngineBlockMap()  # an empty map is falsy
        self.max_publishers = max_publishers
        self._lock = threading.Lock()
        self._last_seq: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._stats = SinkStats()
        self._latencies: deque[float] = deque(maxlen=10_000)

    def track(
        self,
        request_id: str,
        token_ids: Iterable[int],
        block_ends: Iterable[int] | None = None,
        cached_tokens: int | None = None,
        partition: str | None = None,
    ) -> None:
        """Record a served request's prompt token ids (and where each of its blocks ends),
        sent in the engine's cache ``partition`` (:mod:`~..core.partitions`).

        The pilot's prediction for it is then held to what the engine's events confirm:
        its pages walked through the stored chain, plus the pages the engine itself
        reported as served from its cache (``cached_tokens``). A request whose leading
        pages were stored before we listened (a late start, a reset) is otherwise
        confirmed only up to the pages we know; its blocks come back when their store
        events arrive.
        """
        tokens = list(token_ids)
        ends = list(block_ends) if block_ends is not None else None
        with self._lock:
            grown = self.block_map.track(request_id, tokens, ends, cached_tokens, partition)
            for other, cached in grown.items():
                self.pilot.restore(other, self.block_map.blocks_within(other, cached))
            keep = self.block_map.blocks_within(request_id, self.block_map.cached_tokens(request_id))
            if keep is not None and self.pilot.truncate(request_id, keep):
                self._stats.requests_unconfirmed += 1
            self._evict_untracked()

    @property
    def page_size(self) -> int | None:
        """The engine's page size (given, or learned from the first stored block)."""
        with self._lock:
            return self.block_map.page_size

    def confirmed_tokens(self, request_id: str) -> int | None:
        """Prompt tokens of a tracked request the events confirm cached (``None``: not tracked)."""
        with self._lock:
            if request_id not in self.block_map:
                return None
            return self.block_map.cached_tokens(request_id)

    def forget(self, request_id: str) -> None:
        """Stop tracking a request (it failed, or the pilot forgot it)."""
        with self._lock:
            self.block_map.forget(request_id)

    def apply(self, batch: KvEventBatch) -> bool:
        """Apply one batch; returns False for a duplicate (already applied) batch."""
        with self._lock:
            stats = self._stats
            source = (batch.publisher, batch.rank)
            last = self._last_seq.get(source)
            if last is not None and batch.seq <= last:
                stats.duplicate_batches += 1
                return False
            # a first publisher heard past number 0 means we started late, not that we lost
            # what we knew: nothing held came from events, and tracking confirms each request
            # only up to the pages the events (or the engine's cached-token report) show
            if (last is not None and batch.seq != last + 1) or (
                last is None and batch.seq > 0 and self._last_seq and self.pilot.stats().live_requests
            ):
                stats.sequence_gaps += 1
                self._reset()  # events were lost: predict nothing we cannot confirm
            self._last_seq[source] = batch.seq
            self._last_seq.move_to_end(source)
            while len(self._last_seq) > self.max_publishers:
                self._last_seq.popitem(last=False)
            stats.publishers = len(self._last_seq)
            shortened_here: set[str] = set()  # vLLM sends one removal per block: count requests once
            for event in batch.events:
                if isinstance(event, BlockStoredEvent):
                    grown, shortened = self.block_map.stored(
                        event.block_hashes,
                        event.parent_block_hash,
                        event.token_ids,
                        event.block_size,
                        event.medium,
                        event.partition,
                    )
                    for request_id, tokens in grown.items():
                        self.pilot.restore(request_id, self.block_map.blocks_within(request_id, tokens))
                    shortened_here |= self._shorten(shortened)
                elif isinstance(event, BlockRemovedEvent):
                    shortened_here |= self._shorten(self.block_map.removed(event.block_hashes, event.medium))
                else:
                    self._reset()
            stats.requests_shortened += len(shortened_here)
            if self.pilot.page_tokens is None and self.block_map.page_size:  # the send decision weighs pages
                self.pilot.page_tokens = self.block_map.page_size
            stats.batches += 1
            stats.events += len(batch.events)
            if batch.ts is not None:
                self._latencies.append(max(0.0, time.time() - batch.ts))
            return True

    def lost(self, publisher: str, seq: int | None) -> None:
        """A batch arrived that cannot be read: its events are lost, so nothing is confirmed.
        ``seq`` (if known) counts as applied."""
        with self._lock:
            self._stats.sequence_gaps += 1
            self._reset()
            if seq is not None:
                for source in [source for source in self._last_seq if source[0] == publisher]:
                    self._last_seq[source] = seq

    def restarted(self, publisher: str) -> None:
        """The publisher's numbers went back: a new engine process under the same name. Its
        cache starts empty, so the index is reset, and its numbers are followed afresh."""
        with self._lock:
            self._stats.publisher_restarts += 1
            self._reset()
            for source in [source for source in self._last_seq if source[0] == publisher]:
                del self._last_seq[source]
            self._stats.publishers = len(self._last_seq)

    def evict(self, request_ids: list[str]) -> int:
        with self._lock:
            for request_id in request_ids:
                self.block_map.forget(request_id)
            known = self.pilot.evict(request_ids)
            self._stats.requests_evicted += known
            self._stats.unknown_request_ids += len(set(request_ids)) - known
            return known

    def count(self, name: str) -> None:
        """Add one to a counter of :class:`SinkStats` (refusals, closed connections)."""
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def reject(self) -> None:
        self.count("rejected")

    def stats(self) -> SinkStats:
        with self._lock:
            latencies = sorted(self._latencies)
            update: dict[str, Any] = {
                "tracked_requests": len(self.block_map),
                "engine_blocks": self.block_map.stored_blocks,
                "anchored_pages": self.block_map.anchored_pages,
                "anchors_resolved": self.block_map.anchors_resolved,
            }
            if latencies:
                update["latency_p50_ms"] = latencies[len(latencies) // 2] * 1e3
                update["latency_p99_ms"] = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e3
            return self._stats.model_copy(update=update)

    def _shorten(self, cached: dict[str, int]) -> set[str]:
        """Truncate these requests' predictions; returns those that were live."""
        shortened = set()
        for request_id, tokens in cached.items():
            keep = self.block_map.blocks_within(request_id, tokens)
            if keep is not None and self.pilot.truncate(request_id, keep):
                shortened.add(request_id)
        return shortened

    def _evict_untracked(self) -> None:
        dropped = self.block_map.take_dropped()
        if dropped:
            self._stats.requests_untracked += self.pilot.evict(dropped)

    def _reset(self) -> None:
        self.block_map.cleared()
        self.pilot.reset()
        self._stats.index_resets += 1
