"""The shared log's entries: what one worker tells the others, as compact, signed JSON.

One broker message carries a batch of entries from one worker, in the order that worker
learned them. Each entry is one of the index events of
:mod:`~contextpilot_integrations.core.events` (what the pilot's observers hear: see
:meth:`ContextPilot.add_observer <contextpilot_integrations.ContextPilot.add_observer>`),
written by :func:`entry_of` and read back by :func:`event_of`, here only::

    ["sent", request_id, [block ids in send order], [token counts], time]
    ["evicted", [request ids], time]
    ["truncated", request_id, cached_blocks, time]
    ["restored", request_id, cached_blocks or null, time]
    ["reset", time]
    ["stick", conversation_id, target name, time]   (a router: where a conversation lives)

The time (seconds since the epoch by the broker's clock: each worker converts its own
with its measured offset to it) measures propagation lag.

Every message (and every snapshot) starts with an HMAC-SHA256 of its body under the
deployment's secret, bound to the stream's identity (its name and creation time: another
deployment's stream, or one deleted and made again, is another identity) and to where it
belongs (the subject, or the snapshot's name): a client of the broker without the secret
can store messages, but no worker applies them, and a signed message copied into another
stream does not verify there. A message also carries when it was signed (``t``, the
broker's clock), so one stored again long after is told apart from a fresh one.
A message is checked whole before any of it is applied: one that is not signed, does not
decode, names more than :data:`~contextpilot_integrations.core.validation.MAX_BLOCKS` blocks, or
holds one malformed entry is skipped whole, so one bad publisher never stops the others.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..core.events import Evicted, IndexEvent, Reset, Restored, Sent, Truncated
from ..core.validation import MAX_BLOCKS

__all__ = [
    "Batch",
    "Entry",
    "block_count",
    "decode_batch",
    "encode_batch",
    "entry_of",
    "event_of",
    "evicted_ids",
    "key_id",
    "seal",
    "unseal",
]

Entry = tuple[Any, ...]
"""(kind, *details, time): an index event (or a router's ``stick``) with the time it was learned."""

_FORMAT = 2  # 2: bound to the stream's identity, with the time it was signed
_MAC = 64  # hex digits of an HMAC-SHA256


@dataclass(frozen=True, slots=True)
class Batch:
    """Entries one worker published in one message."""

    origin: str
    """The publishing worker (a fresh id per process: a restarted worker is a new origin)."""
    first: int
    """The origin's number of the first entry (the message id is ``origin:first``)."""
    entries: list[Entry]
    signed: float = 0.0
    """When it was signed (seconds since the epoch, the broker's clock)."""

    @property
    def message_id(self) -> str:
        return f"{self.origin}:{self.first}"


def seal(key: bytes, context: str, body: bytes) -> bytes:
    """``body`` with its MAC in front, bound to ``context`` (the stream's identity and a
    subject or a snapshot name, see :func:`context`)."""
    return _mac(key, context, body) + body


def unseal(keys: bytes | Sequence[bytes], context: str, data: bytes) -> bytes | None:
    """The body of a sealed message, or ``None`` when its MAC is under none of ``keys`` (the
    deployment's secrets: the one it signs with, then those it still accepts)."""
    body = data[_MAC:]
    if len(data) < _MAC:
        return None
    for key in [keys] if isinstance(keys, bytes) else keys:
        if hmac.compare_digest(data[:_MAC], _mac(key, context, body)):
            return body
    return None


def context(stream: str, name: str) -> str:
    """What a MAC is bound to: the stream's identity and the subject (or snapshot name)."""
    return f"{stream}\x00{name}"


def key_id(key: bytes) -> str:
    """A short public name of a secret (the snapshots it signs are kept under it), from
    which the secret cannot be learned."""
    return hmac.new(key, b"contextpilot-shared/key-id", hashlib.sha256).hexdigest()[:16]


def _mac(key: bytes, context: str, body: bytes) -> bytes:
    message = b"contextpilot-shared/2\x00" + context.encode() + b"\x00" + body
    return hmac.new(key, message, hashlib.sha256).hexdigest().encode()


def entry_of(event: IndexEvent, when: float) -> Entry:
    """The entry of an index event learned at ``when``."""
    match event:
        case Sent(request_id, keys, token_counts):
            return ("sent", request_id, keys, token_counts, when)
        case Evicted(request_ids):
            return ("evicted", request_ids, when)
        case Truncated(request_id, cached_blocks):
            return ("truncated", request_id, cached_blocks, when)
        case Restored(request_id, cached_blocks):
            return ("restored", request_id, cached_blocks, when)
        case Reset():
            return ("reset", when)


def event_of(entry: Entry) -> IndexEvent | None:
    """The index event of an entry (checked by :func:`decode_batch`); ``None`` for an entry
    that is not about the index (a router's ``stick``). TypeError or ValueError for an
    entry of an index kind without its fields."""
    kind = entry[0]
    if kind == "sent":
        _, request_id, keys, token_counts, _ = entry
        return Sent(request_id, tuple(keys), tuple(token_counts))
    if kind == "evicted":
        return Evicted(tuple(entry[1]))
    if kind == "truncated":
        return Truncated(entry[1], entry[2])
    if kind == "restored":
        return Restored(entry[1], entry[2])
    if kind == "reset":
        return Reset()
    return None


def evicted_ids(entry: Entry) -> Sequence[str]:
    """The request ids an entry evicts (none: it is of another kind)."""
    ids: Sequence[str] = entry[1] if entry[0] == "evicted" else ()
    return ids


def encode_entry(entry: Entry) -> bytes:
    return json.dumps(entry, separators=(",", ":")).encode()


def encode_entries(entries: list[Entry]) -> bytes:
    """A batch's entries, encoded once (its head is written again at each publish)."""
    return b",".join(encode_entry(entry) for entry in entries)


def encode_batch(batch: Batch, encoded: bytes | None = None) -> bytes:
    """The message body (``encoded``: :func:`encode_entries` of its entries)."""
    entries = encoded if encoded is not None else encode_entries(batch.entries)
    head = {"v": _FORMAT, "o": batch.origin, "n": batch.first, "t": batch.signed}
    return json.dumps(head, separators=(",", ":"))[:-1].encode() + b',"e":[' + entries + b"]}"


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
        origin, first, raw, signed = body["o"], body["n"], body["e"], _time(body["t"])
        if not isinstance(origin, str) or not _is_int(first) or not isinstance(raw, list) or signed is None:
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
        return Batch(origin, first, entries, signed)
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
