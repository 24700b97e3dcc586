"""Applying shared-log entries and snapshots to one worker's index, idempotently.

Every worker applies every entry in the stream's order, its own included, so all indexes
converge to the same state. A worker applies its own entries when it learns them (so
``prepare`` sees them at once) and again where the stream placed them: a reset it learned
while cut off from the broker lands after entries other workers stored meanwhile, and it
must wipe those here as it does everywhere else. Applying an entry twice changes nothing: a
request already live is not indexed again, an eviction of an unknown request is a no-op.
Entries of other workers may arrive out of causal order (worker B reports the eviction of
A's request before A's "sent" reaches the stream): an evicted id is remembered (bounded),
and a "sent" for it later is ignored.

A snapshot names the stream it was taken from (its identity: name and creation time) and
the sequence it covers; one taken from another stream (deleted and made again) or claiming
a sequence the stream does not hold is ignored. A large entry is applied in parts (the
pilot indexes a long request a part at a time, an eviction of many requests goes a part at
a time), so the pilot's lock is never held across all of it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..core.events import Evicted, Reset, Restored, Sent, Truncated
from ..core.validation import MAX_BLOCKS
from .entries import Entry, event_of
from .replica import LockOf, Replica

__all__ = ["Applier", "Snapshot"]

_PART = 1_024  # request ids evicted under one hold of the pilot's lock


@dataclass(frozen=True)
class Snapshot:
    """A snapshot checked whole (see :meth:`Applier.check`), ready to load."""

    seq: int
    live: list[tuple[str, list[str]]]
    evicted: list[str]
    origins: dict[str, int]


class Applier:
    """Applies entries to one pilot (a :class:`~.replica.Replica`) and keeps the bounded set of evicted ids."""

    def __init__(
        self, pilot: Replica, max_tombstones: int = 200_000, max_origins: int = 100_000, lock_of: LockOf | None = None
    ) -> None:
        self._pilot = weakref.ref(pilot)  # the pilot owns its client, not the reverse: dropped, it is collected
        self._lock_of = lock_of  # the pilot's lock, held across a fork
        self.max_tombstones = max_tombstones
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self.max_origins = max_origins
        self._numbers: OrderedDict[str, int] = OrderedDict()  # origin -> its last batch applied
        self._lock = threading.Lock()
        self.applied = 0
        self.skipped = 0
        self.handlers: dict[str, Callable[..., None]] = {}
        """Entries that are not about the index (a router's ``stick``): kind -> handler,
        called with the entry's fields (its time left off), for other workers' entries."""

    def on(self, kind: str, handler: Callable[..., None]) -> None:
        """Hand other workers' entries of ``kind`` (not about the index) to ``handler``."""
        self.handlers[kind] = handler

    def locks(self) -> list[Any]:
        """The locks a fork must take so the child gets them free: the pilot's (while it
        lives and its lock is known), then this applier's."""
        pilot_lock = self._lock_of() if self._lock_of is not None else None
        return [pilot_lock, self._lock] if pilot_lock is not None else [self._lock]

    @property
    def pilot(self) -> Replica:
        pilot = self._pilot()
        if pilot is None:
            raise ReferenceError("the pilot was dropped")
        return pilot

    def remember_evicted(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._tombstones[rid] = None
                self._tombstones.move_to_end(rid)
            while len(self._tombstones) > self.max_tombstones:
                self._tombstones.popitem(last=False)

    def forget_evicted(self, request_id: str) -> None:
        with self._lock:
            self._tombstones.pop(request_id, None)

    def is_evicted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._tombstones

    def tombstones(self) -> list[str]:
        with self._lock:
            return list(self._tombstones)

    def fresh(self, origin: str, first: int) -> bool:
        """Whether a batch comes after everything of its origin applied so far: a signed
        message stored again (a replay by a client of the broker, a publish retried after the
        de-duplication window) is not applied twice."""
        with self._lock:
            if first <= self._numbers.get(origin, -1):
                return False
            self._numbers[origin] = first
            self._numbers.move_to_end(origin)
            while len(self._numbers) > self.max_origins:
                self._numbers.popitem(last=False)
            return True

    def apply(self, entry: Entry, own: bool) -> None:
        """Apply one checked entry (see :func:`.entries.decode_batch`), in stream order.
        ``own``: this worker published it (a router's own "stick" is already recorded)."""
        pilot = self.pilot
        try:
            match event_of(entry):
                case Sent(rid, order, tokens):
                    limit = pilot.cache_tokens
                    if (
                        (limit is not None and sum(tokens) > limit)  # larger than this engine's cache: never indexed
                        or self.is_evicted(rid)
                        or not pilot.record_sent(rid, order)
                    ):
                        self.skipped += 1
                        return
                case Evicted(request_ids):
                    self.remember_evicted(request_ids)
                    for start in range(0, len(request_ids), _PART):  # the pilot's lock let go between parts
                        pilot.evict(request_ids[start : start + _PART])
                case Truncated(rid, cached_blocks):
                    pilot.truncate(rid, cached_blocks)
                case Restored(rid, cached_blocks):
                    if pilot.restore(rid, cached_blocks) and rid in pilot.live_request_ids():
                        self.forget_evicted(rid)  # back in the engine: a later "sent" replay may index it
                case Reset():
                    pilot.reset()
                case None if entry[0] in self.handlers and not own:
                    self.handlers[entry[0]](*entry[1:-1])
        except (TypeError, ValueError):
            self.skipped += 1  # what the pilot refuses (a request over its bounds) never stops this worker
            return
        self.applied += 1

    # ---- snapshots -------------------------------------------------------------------------
    def snapshot(self, stream: str, seq: int) -> dict[str, Any]:
        """The index as of sequence ``seq`` of ``stream`` (its identity): every entry up to it applied."""
        with self._lock:
            numbers = dict(self._numbers)
        live = self.pilot.live_orders()
        return {"v": 2, "stream": stream, "seq": seq, "live": live, "evicted": self.tombstones(), "origins": numbers}

    def load(self, snapshot: object, stream: str, last_seq: int) -> int:
        """Apply a snapshot of ``stream`` (its identity) that holds ``last_seq`` messages at
        most; returns its sequence, 0 when it is not one to use (nothing applied then)."""
        checked = self.check(snapshot, stream, last_seq)
        if checked is None:
            return 0
        self.restore(checked)
        return checked.seq

    @staticmethod
    def check(snapshot: object, stream: str, last_seq: int) -> Snapshot | None:
        """The snapshot checked whole, or ``None`` when it is not of ``stream`` (its identity),
        claims more than the ``last_seq`` messages the stream holds, or is malformed."""
        if not isinstance(snapshot, dict) or snapshot.get("v") != 2 or snapshot.get("stream") != stream:
            return None
        seq, live, evicted = snapshot.get("seq"), snapshot.get("live"), snapshot.get("evicted")
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq <= last_seq:
            return None  # a sequence the stream never reached: not this stream's
        if not isinstance(live, (list, tuple)) or not isinstance(evicted, (list, tuple)):
            return None
        checked = []
        for item in live:
            if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str) and item[0]):
                return None
            rid, order = item
            if not (
                isinstance(order, (list, tuple))
                and 0 < len(order) <= MAX_BLOCKS
                and all(isinstance(k, str) for k in order)
            ):
                return None
            checked.append((rid, list(order)))
        origins = snapshot.get("origins")
        numbers = {
            origin: first
            for origin, first in (origins.items() if isinstance(origins, dict) else ())
            if isinstance(first, int) and not isinstance(first, bool)
        }
        return Snapshot(seq, checked, [rid for rid in evicted if isinstance(rid, str)], numbers)

    def restore(self, snapshot: Snapshot) -> None:
        """Apply a checked snapshot (each request under its own hold of the pilot's lock)."""
        pilot = self.pilot
        for rid, order in snapshot.live:  # first: a request restored after an eviction is live
            try:
                pilot.record_sent(rid, order)
            except (TypeError, ValueError):
                continue
        self.remember_evicted(snapshot.evicted)
        for origin, first in snapshot.origins.items():
            self.fresh(origin, first)
