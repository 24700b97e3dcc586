"""What this worker publishes: the entries it learned, packed into signed messages, in order.

The pilot's observer only appends an entry here (under the pilot's lock: quick); the
client's thread packs the entries into messages (at most ``batch_entries`` entries, the
broker's payload and :data:`~..core.validation.MAX_BLOCKS` blocks each) and publishes
them, in order, each with a message id (``origin:first``) so a retried publish is stored
once. While the broker is unreachable the entries wait, bounded by ``max_unsent`` (the
oldest dropped, counted); a message kept through an outage is signed afresh when it goes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from collections import deque
from dataclasses import replace
from typing import Any

from ..core.validation import MAX_BLOCKS
from .broker import BrokerClock
from .entries import Batch, Entry, block_count, context, encode_batch, encode_entry, seal
from .options import SharedOptions

__all__ = ["Outbox"]

log = logging.getLogger("contextpilot_integrations.shared")

_OVERHEAD = 512  # bytes of a message besides its entries (MAC, header fields)


class Outbox:
    """This worker's entries waiting to go out, and the messages packed from them."""

    def __init__(self, options: SharedOptions) -> None:
        self.options = options
        self.origin = secrets.token_hex(6)
        """This worker's identity on the log (a fresh one per process)."""
        self.entries: deque[Entry] = deque()
        self.messages: deque[tuple[Batch, bytes]] = deque()  # batches waiting for the broker, in order
        self._numbers = itertools.count()
        self.dropped = 0  # entries dropped past max_unsent
        self.oversize = 0  # entries too large for any message
        self.published = 0  # entries the broker acknowledged
        self.inflight = 0  # messages being published now

    def append(self, entry: Entry) -> None:
        """Keep ``entry`` for the next message; past ``max_unsent`` the oldest is dropped (counted)."""
        self.entries.append(entry)
        if len(self.entries) > self.options.max_unsent:
            self.entries.popleft()
            self.dropped += 1

    @property
    def unsent(self) -> int:
        return len(self.entries) + sum(len(batch.entries) for batch, _ in list(self.messages))

    @property
    def waiting(self) -> bool:
        """Whether anything waits to be published."""
        return bool(self.entries or self.messages)

    def forked(self) -> None:
        """In a forked child: an identity of its own; what the parent had not sent is the parent's to send."""
        self.origin = secrets.token_hex(6)
        self._numbers = itertools.count()
        self.entries.clear()
        self.messages.clear()

    def pack(self, max_bytes: int, offset: float) -> None:
        """Move the entries into messages of at most ``batch_entries`` entries, ``max_bytes``
        bytes and ``MAX_BLOCKS`` blocks, each entry's time by the broker's clock (``offset``:
        its clock less this worker's). An entry too large for any message is dropped
        (counted): no worker could take it."""
        outbox, limit = self.entries, self.options.batch_entries
        room = max_bytes - _OVERHEAD
        while outbox:
            entries: list[Entry] = []
            encoded: list[bytes] = []
            size = blocks = 0
            while outbox and len(entries) < limit:
                entry = outbox[0]
                stamped = (*entry[:-1], entry[-1] + offset)
                data, count = encode_entry(stamped), block_count(entry)
                if len(data) > room or count > MAX_BLOCKS:
                    outbox.popleft()
                    self.oversize += 1
                    log.warning(
                        "shared index: an entry of %d bytes, %d blocks not shared (over the limits)", len(data), count
                    )
                    continue
                if entries and (size + len(data) + 1 > room or blocks + count > MAX_BLOCKS):
                    break
                outbox.popleft()
                entries.append(stamped)
                encoded.append(data)
                size, blocks = size + len(data) + 1, blocks + count
            if not entries:
                break
            first = next(self._numbers)
            for _ in range(len(entries) - 1):
                next(self._numbers)
            self.messages.append((Batch(self.origin, first, entries), b",".join(encoded)))

    async def publish(self, js: Any, max_bytes: int, stream_id: str, clock: BrokerClock) -> None:
        """Publish what waits, in order, each message signed now: bound to the stream
        ``stream_id`` and stamped with the broker's time."""
        self.pack(max_bytes, clock.offset)
        where = context(stream_id, self.options.subject)
        while self.messages:
            window = list(itertools.islice(self.messages, 16))
            self.inflight = len(window)
            signed = [
                seal(self.options.key, where, encode_batch(replace(batch, signed=clock.now()), encoded))
                for batch, encoded in window
            ]
            results = await asyncio.gather(
                *[
                    js.publish(self.options.subject, data, timeout=2.0, headers={"Nats-Msg-Id": batch.message_id})
                    for (batch, _), data in zip(window, signed, strict=True)
                ],
                return_exceptions=True,
            )
            self.inflight = 0
            for (batch, _), result in zip(window, results, strict=True):
                if isinstance(result, BaseException):
                    raise ConnectionError(f"publish failed: {result!r}")  # kept, in order, for the next session
                self.messages.popleft()
                self.published += len(batch.entries)
