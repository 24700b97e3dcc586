"""Each target's health: what a failed send says about it, and its circuit breaker.

A target that cannot be reached (refused, reset) is routed around for ``down_seconds``.
A slow answer (a timeout) is not a dead target; but one that fails ``breaker_failures``
times in a row (timeouts, 5xx, broken answers) opens its breaker: routed around for
``down_seconds``, then one request probes it (half-open), and its success closes the
breaker, its failure opens it again. The state here has no lock of its own: the router
changes it under its lock (:mod:`.router`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from ..errors import EngineError, EngineTimeout, EngineUnavailable

__all__ = ["Health", "TargetHealth", "TargetStats", "is_unreachable", "send_outcome"]


def is_unreachable(exc: BaseException) -> bool:
    """A connection-level failure (route around the target), not an answer from it:
    httpx's, ours, or the OpenAI SDK's (which the framework adapters use).

    A timeout is not one: the server took the request and is slow, which says nothing about
    the next request (and its cache still holds what it held). Only a connection that could
    not be made (refused, reset, a connect timeout) or broke marks a target unreachable.
    """
    import httpx

    openai = sys.modules.get("openai")  # only its own errors matter, so only if it is loaded
    sdk_timeouts = (openai.APITimeoutError,) if openai is not None else ()
    if _timed_out(exc, sdk_timeouts):
        return False
    if isinstance(exc, (httpx.TransportError, EngineUnavailable)):
        return True
    return openai is not None and isinstance(exc, openai.APIConnectionError)


def send_outcome(exc: BaseException) -> str:
    """What a failed send says about its target: ``unreachable``, ``timeout``, ``failed``
    (a 5xx, or an answer that broke or was malformed), ``ok`` (a 4xx: the target answered;
    the request was at fault) or ``other`` (not the target's doing)."""
    if is_unreachable(exc):
        return "unreachable"
    openai = sys.modules.get("openai")
    if _timed_out(exc, (openai.APITimeoutError,) if openai is not None else ()):
        return "timeout"
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return "failed" if status >= 500 else "ok"
    return "failed" if isinstance(exc, EngineError) else "other"


def _timed_out(exc: BaseException, sdk_timeouts: tuple[type[BaseException], ...]) -> bool:
    """Whether ``exc`` (or the error it was raised from) is a timeout of a request the
    server took; a connect timeout is not one (the server never got the request)."""
    import httpx

    timeouts = (EngineTimeout, httpx.TimeoutException, TimeoutError, asyncio.TimeoutError, *sdk_timeouts)
    found = False
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, httpx.ConnectTimeout):
            return False
        found = found or isinstance(link, timeouts)
        link = link.__cause__
    return found


class TargetStats(BaseModel):
    """One target's traffic, failures and circuit breaker (see :meth:`~.router.Router.stats`)."""

    sent: int
    in_flight: int
    failures: int
    """Sends that failed on the target's side: timeouts, unreachable, 5xx, broken answers."""
    timeouts: int
    unreachable: int
    consecutive_failures: int
    breaker: Literal["closed", "open", "half_open"]
    """``open``: routed around; ``half_open``: the cool-down is over, one request probes it."""
    breaker_opened: int
    """Times the breaker opened (a failed probe included)."""
    open_for_s: float
    """Seconds before an open breaker lets a probe through (0 unless open)."""


@dataclass
class TargetHealth:
    """One target's load, counters and breaker."""

    in_flight: int = 0
    down_until: float = 0.0
    tripped: bool = False
    """The breaker is open (before ``down_until``) or half-open (after it)."""
    probing: bool = False
    """A half-open breaker's probe is in flight: no other request goes there meanwhile."""
    sent: int = 0
    failures: int = 0
    timeouts: int = 0
    unreachable: int = 0
    consecutive: int = 0
    opened: int = 0
    last_used: int = -1

    def available(self, now: float) -> bool:
        """Routed to: closed, or half-open with no probe in flight."""
        return not self.tripped or (now >= self.down_until and not self.probing)

    def trip(self, until: float) -> None:
        """Open the breaker until ``until`` (counted once: not again for a send that was
        already in flight when it opened)."""
        self.opened += not self.tripped or self.probing
        self.tripped, self.probing, self.down_until = True, False, until

    def stats(self, now: float) -> TargetStats:
        """Its counters and breaker as seen at ``now``."""
        return TargetStats(
            sent=self.sent,
            in_flight=self.in_flight,
            failures=self.failures,
            timeouts=self.timeouts,
            unreachable=self.unreachable,
            consecutive_failures=self.consecutive,
            breaker=("open" if now < self.down_until else "half_open") if self.tripped else "closed",
            breaker_opened=self.opened,
            open_for_s=max(0.0, self.down_until - now) if self.tripped else 0.0,
        )


class Health:
    """Every target's :class:`TargetHealth`, by name; the caller holds its lock around each call.

    Args:
        names: the targets' names.
        breaker_failures: failures in a row that open a breaker.
        down_seconds: how long an open breaker routes around its target.
    """

    def __init__(self, names: list[str], breaker_failures: int, down_seconds: float) -> None:
        self.targets = {name: TargetHealth() for name in names}
        self.breaker_failures, self.down_seconds = breaker_failures, down_seconds
        self._uses = 0

    def up(self, now: float) -> set[str]:
        """Names of the targets routed to at ``now``."""
        return {name for name, health in self.targets.items() if health.available(now)}

    def started(self, name: str) -> None:
        """A send begins; past an open breaker's cool-down it is the probe."""
        health = self.targets[name]
        health.in_flight += 1
        health.sent += 1
        health.last_used = self._uses
        self._uses += 1
        if health.tripped and time.monotonic() >= health.down_until:
            health.probing = True

    def finished(self, name: str, outcome: str) -> None:
        """A send ended with ``outcome`` (see :meth:`~.router.Router.finished`)."""
        health = self.targets[name]
        health.in_flight -= 1
        if outcome == "ok":
            health.consecutive, health.tripped, health.probing = 0, False, False
            return
        if outcome not in ("failed", "timeout", "unreachable"):
            health.probing = False  # another request may probe
            return
        health.failures += 1
        health.timeouts += outcome == "timeout"
        health.unreachable += outcome == "unreachable"
        health.consecutive += 1
        if health.probing or (not health.tripped and health.consecutive >= self.breaker_failures):
            health.trip(time.monotonic() + self.down_seconds)  # slow, not gone: prediction kept

    def mark_down(self, name: str) -> None:
        """The target is unreachable: its breaker opens for ``down_seconds``."""
        health = self.targets[name]
        health.trip(time.monotonic() + self.down_seconds)
        health.failures += 1
        health.unreachable += 1
        health.consecutive += 1
