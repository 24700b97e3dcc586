"""Applying shared-log entries and snapshots to one worker's index, idempotently.

Every worker applies every entry in the stream's order, so all indexes converge to the
same state. Applying an entry twice changes nothing: a request already live is not
indexed again, an eviction of an unknown request is a no-op. Entries of other workers may
arrive out of causal order (worker B reports the eviction of A's request before A's
"sent" reaches the stream): an evicted id is remembered (bounded), and a "sent" for it
later is ignored. A worker's own entries were applied when it learned them; of those it
applies only "sent" again (after an engine reset another worker reported, which came
first in the stream, so that it ends where every other worker ends).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .entries import Entry

if TYPE_CHECKING:
    from ..pilot import ContextPilot

__all__ = ["Applier"]


class Applier:
    """Applies entries to one pilot and keeps the bounded set of evicted ids."""

    def __init__(self, pilot: ContextPilot, max_tombstones: int = 200_000) -> None:
        self.pilot = pilot
        self.max_tombstones = max_tombstones
        self._tombstones: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self.applied = 0
        self.skipped = 0
        self.handlers: dict[str, Callable[..., None]] = {}
        """Entries that are not about the index (a router's ``stick``): kind -> handler,
        called with the entry's fields (its time left off), for other workers' entries."""

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

    def apply(self, entry: Entry, own: bool) -> None:
        """Apply one entry (``own``: this worker published it). Bad entries are skipped."""
        kind = entry[0]
        try:
            if kind == "sent":
                _, rid, order, _tokens, _ = entry
                if self.is_evicted(rid) or not self.pilot.record_sent(rid, order):
                    self.skipped += 1
                    return
            elif own:
                self.skipped += 1
                return
            elif kind == "evicted":
                rids = [rid for rid in entry[1] if isinstance(rid, str)]
                self.remember_evicted(rids)
                self.pilot.evict(rids)
            elif kind == "truncated":
                self.pilot.truncate(entry[1], entry[2])
            elif kind == "restored":
                if self.pilot.restore(entry[1], entry[2]) and entry[1] in self.pilot.live_request_ids():
                    self.forget_evicted(entry[1])  # back in the engine: a later "sent" replay may index it
            elif kind == "reset":
                self.pilot.reset()
            elif kind in self.handlers:
                self.handlers[kind](*entry[1:-1])
        except (TypeError, ValueError):
            self.skipped += 1  # a malformed entry from another worker never stops this one
            return
        self.applied += 1

    # ---- snapshots -------------------------------------------------------------------------
    def snapshot(self, seq: int) -> dict[str, Any]:
        """The index as of stream sequence ``seq`` (every entry up to it applied)."""
        return {"v": 1, "seq": seq, "live": self.pilot.live_orders(), "evicted": self.tombstones()}

    def load(self, snapshot: dict[str, Any]) -> int:
        """Apply a snapshot; returns its sequence (0 when it is not one this version reads)."""
        if not isinstance(snapshot, dict) or snapshot.get("v") != 1 or not isinstance(snapshot.get("seq"), int):
            return 0
        for item in snapshot.get("live", ()):  # first: a request restored after an eviction is live
            try:
                rid, order = item
                self.pilot.record_sent(rid, order)
            except (TypeError, ValueError):
                continue
        self.remember_evicted(rid for rid in snapshot.get("evicted", ()) if isinstance(rid, str))
        return int(snapshot["seq"])
