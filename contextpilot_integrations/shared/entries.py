"""The shared log's entries: what one worker tells the others, as compact JSON.

One broker message carries a batch of entries from one worker, in the order that worker
learned them. Each entry is one of the pilot's observer events (see
:meth:`ContextPilot.add_observer <contextpilot_integrations.ContextPilot.add_observer>`)::

    ["sent", request_id, [block ids in send order], [token counts], time]
    ["evicted", [request ids], time]
    ["truncated", request_id, cached_blocks, time]
    ["restored", request_id, cached_blocks or null, time]
    ["reset", time]
    ["stick", conversation_id, target name, time]   (a router: where a conversation lives)

The time (seconds since the epoch, when the worker learned it) measures propagation lag.
A message that does not decode is skipped whole (a newer worker's format, or damage), so
one bad publisher never stops the others from applying the rest.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

__all__ = ["Batch", "Entry", "decode_batch", "encode_batch"]

Entry = tuple[Any, ...]
"""(kind, *details, time): an observer event with the time it was learned."""

_FORMAT = 1
_KINDS = {"sent": 4, "evicted": 2, "truncated": 3, "restored": 3, "reset": 1, "stick": 3}  # kind -> fields after it


@dataclass(frozen=True, slots=True)
class Batch:
    """Entries one worker published in one message."""

    origin: str
    """The publishing worker (a fresh id per process: a restarted worker is a new origin)."""
    first: int
    """The origin's number of the first entry (the message id is ``origin:first``)."""
    entries: list[Entry]

    @property
    def message_id(self) -> str:
        return f"{self.origin}:{self.first}"


def encode_batch(batch: Batch) -> bytes:
    body = {"v": _FORMAT, "o": batch.origin, "n": batch.first, "e": batch.entries}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_batch(data: bytes) -> Batch | None:
    """The batch, or ``None`` when it is not one this version understands."""
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("v") != _FORMAT:
            return None
        origin, first, raw = body["o"], body["n"], body["e"]
        if not isinstance(origin, str) or not isinstance(first, int) or not isinstance(raw, list):
            return None
        entries = [tuple(entry) for entry in raw]
        for entry in entries:
            if not entry or _KINDS.get(entry[0]) != len(entry) - 1:
                return None
        return Batch(origin, first, entries)
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
