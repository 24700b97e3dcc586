"""The shared log's entries: what one worker tells the others, as compact, signed JSON.

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

Every message (and every snapshot) starts with an HMAC-SHA256 of its body under the
deployment's secret, bound to where it belongs (the subject, or the snapshot's name): a
client of the broker without the secret can store messages, but no worker applies them.
A message is checked whole before any of it is applied: one that is not signed, does not
decode, names more than :data:`~contextpilot_integrations.core.validation.MAX_BLOCKS` blocks, or
holds one malformed entry is skipped whole, so one bad publisher never stops the others.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from dataclasses import dataclass
from typing import Any

from ..core.validation import MAX_BLOCKS

__all__ = ["Batch", "Entry", "block_count", "decode_batch", "encode_batch", "seal", "unseal"]

Entry = tuple[Any, ...]
"""(kind, *details, time): an observer event with the time it was learned."""

_FORMAT = 1
_MAC = 64  # hex digits of an HMAC-SHA256


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


def seal(key: bytes, context: str, body: bytes) -> bytes:
    """``body`` with its MAC in front, bound to ``context`` (a subject or a snapshot name)."""
    return _mac(key, context, body) + body


def unseal(key: bytes, context: str, data: bytes) -> bytes | None:
    """The body of a sealed message, or ``None`` when its MAC is not the deployment's."""
    body = data[_MAC:]
    if len(data) < _MAC or not hmac.compare_digest(data[:_MAC], _mac(key, context, body)):
        return None
    return body


def _mac(key: bytes, context: str, body: bytes) -> bytes:
    message = b"contextpilot-shared/1\x00" + context.encode() + b"\x00" + body
    return hmac.new(key, message, hashlib.sha256).hexdigest().encode()


def encode_entry(entry: Entry) -> bytes:
    return json.dumps(entry, separators=(",", ":")).encode()


def encode_batch(batch: Batch, encoded: list[bytes] | None = None) -> bytes:
    """The message body (``encoded``: the entries already encoded, in order)."""
    entries = encoded if encoded is not None else [encode_entry(entry) for entry in batch.entries]
    head = json.dumps({"v": _FORMAT, "o": batch.origin, "n": batch.first}, separators=(",", ":"))
    return head[:-1].encode() + b',"e":[' + b",".join(entries) + b"]}"


def block_count(entry: Entry) -> int:
    """Block (or request) ids an entry names: what bounds a message."""
    if entry[0] == "sent":
        return len(entry[2])
    if entry[0] == "evicted":
        return len(entry[1])
    return 1


def decode_batch(data: bytes) -> Batch | None:
    """The batch, checked whole, or ``None`` when any of it is not what this version writes."""
    try:
        body = json.loads(data)
        if not isinstance(body, dict) or body.get("v") != _FORMAT:
            return None
        origin, first, raw = body["o"], body["n"], body["e"]
        if not isinstance(origin, str) or not _is_int(first) or not isinstance(raw, list):
            return None
        entries: list[Entry] = []
        blocks = 0
        for item in raw:
            entry = _entry(item)
            if entry is None:
                return None
            blocks += block_count(entry)
            if blocks > MAX_BLOCKS:
                return None
            entries.append(entry)
        return Batch(origin, first, entries)
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def _entry(item: object) -> Entry | None:
    """One entry with every field checked (its time as a finite float), or ``None``."""
    if not isinstance(item, list) or not item or not isinstance(item[0], str):
        return None
    kind, *fields = item
    if not fields:
        return None
    when = _time(fields[-1])
    fields = fields[:-1]
    if when is None:
        return None
    ok = False
    if kind == "sent" and len(fields) == 3:
        rid, order, tokens = fields
        ok = (
            _is_id(rid)
            and _ids(order)
            and len(order) > 0
            and type(tokens) is list
            and len(tokens) in (0, len(order))
            and set(map(type, tokens)) <= {int}  # JSON numbers: bools and floats are other types
            and (not tokens or min(tokens) >= 0)
        )
    elif kind == "evicted" and len(fields) == 1:
        ok = _ids(fields[0])
    elif kind == "truncated" and len(fields) == 2:
        ok = _is_id(fields[0]) and _is_int(fields[1]) and fields[1] >= 0
    elif kind == "restored" and len(fields) == 2:
        ok = _is_id(fields[0]) and (fields[1] is None or (_is_int(fields[1]) and fields[1] >= 0))
    elif kind == "reset":
        ok = not fields
    elif kind == "stick" and len(fields) == 2:
        ok = _is_id(fields[0]) and _is_id(fields[1])
    return (kind, *fields, when) if ok else None


def _ids(value: object) -> bool:
    """A list of at most MAX_BLOCKS non-empty str (checked in C: this runs for every block)."""
    return type(value) is list and len(value) <= MAX_BLOCKS and set(map(type, value)) <= {str} and "" not in value


def _is_id(value: object) -> bool:
    return isinstance(value, str) and bool(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _time(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        when = float(value)
    except OverflowError:  # an int beyond a float
        return None
    return when if math.isfinite(when) else None
