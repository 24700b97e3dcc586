"""The broker as the client sees it: the stream, where it stands, and the broker's clock.

Every time on the wire is the broker's: each session measures this worker's offset to it
(the best of three round trips, :func:`stream_facts`), entries are stamped and messages
signed by it (:class:`BrokerClock`), and a message's stored time (:func:`stored_at`) is
the broker's too. A stream is known by its identity, its name and creation time: one
deleted and made again, or another deployment's, is another stream.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .options import SharedOptions

__all__ = ["BrokerClock", "Refused", "StreamFacts", "open_stream", "rfc3339_ns", "stored_at", "stream_facts"]

_RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")
_DUPLICATE_WINDOW = 120.0  # the broker's de-duplication window (NATS' default), max_age if shorter


class Refused(Exception):
    """The broker answered, and refused the stream (its reason is the message)."""


class BrokerClock:
    """Now by the broker's clock, as measured at the last session."""

    def __init__(self) -> None:
        self.offset = 0.0
        """The broker's clock less this worker's, in seconds."""

    def now(self) -> float:
        return time.time() + self.offset


@dataclass(frozen=True)
class StreamFacts:
    """The stream's identity (name and creation time), first and last sequence."""

    identity: str
    first_seq: int
    last_seq: int


async def open_stream(js: Any, options: SharedOptions) -> None:
    """Make the stream with ``options``' limits, or use the one another worker made with its own."""
    from nats.js import api
    from nats.js.errors import APIError

    config = api.StreamConfig(
        name=options.stream,
        subjects=[f"contextpilot.{options.stream.lower()}.>"],
        storage=api.StorageType.FILE,
        max_age=options.max_age,
        max_msgs=options.max_entries,
        duplicate_window=min(_DUPLICATE_WINDOW, options.max_age),  # NATS refuses a window beyond the age
    )
    try:
        await js.add_stream(config)
    except APIError as exc:
        try:
            await js.stream_info(options.stream)  # made by another worker with other limits: use it
        except APIError:
            raise Refused(exc.description or str(exc)) from None


async def stream_facts(nc: Any, js: Any, stream: str, clock: BrokerClock) -> StreamFacts:
    """The stream's identity, first and last sequence; measures on the way the offset of the
    broker's clock to this worker's (the best of three round trips) and sets ``clock`` to it."""
    subject = f"{getattr(js, '_prefix', '$JS.API')}.STREAM.INFO.{stream}"
    best: tuple[float, float] | None = None  # (round trip, offset)
    info: dict[str, Any] = {}
    for _ in range(3):
        sent = time.time()
        reply = await nc.request(subject, b"", timeout=2.0)
        got = time.time()
        info = json.loads(reply.data)
        if not isinstance(info, dict) or "error" in info or "created" not in info:
            error = info.get("error") if isinstance(info, dict) else None
            raise Refused(str(error.get("description") if isinstance(error, dict) else "no stream information"))
        broker = rfc3339_ns(info.get("ts"))
        if broker is not None and (best is None or got - sent < best[0]):
            best = (got - sent, broker / 1e9 - (sent + got) / 2)
    if best is not None:  # an older broker does not tell its time: the clocks are taken to agree
        clock.offset = best[1]
    created = rfc3339_ns(info["created"])
    state = info.get("state")
    state = state if isinstance(state, dict) else {}
    identity = f"{stream}:{created if created is not None else info['created']}"
    return StreamFacts(identity, int(state.get("first_seq", 0)), int(state.get("last_seq", 0)))


def rfc3339_ns(text: object) -> int | None:
    """Nanoseconds since the epoch of a broker's RFC 3339 time (``None``: not one)."""
    match = _RFC3339.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        return None
    whole = datetime.fromisoformat(match[1] + ("+00:00" if match[3] == "Z" else match[3]))
    return int(whole.timestamp()) * 10**9 + int((match[2] or "").ljust(9, "0"))


def stored_at(message: Any) -> float | None:
    """When the broker stored a message (seconds since the epoch, its clock)."""
    try:
        return float(message.metadata.timestamp.timestamp())
    except Exception:
        return None
