"""The narrow interfaces the pilot's users above it talk through.

A router (:mod:`..engines.router`) needs two things of its pilots beyond preparing and
reporting: that they share one lock and one conversation store (:func:`.facade.join`), and,
when sharing is on, a channel for its own entries (where each conversation lives):
:class:`Broadcast`. The shared log itself talks to the pilot through the interface it owns,
:class:`~..shared.replica.Replica`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Broadcast"]


class Broadcast(Protocol):
    """Entries that are not about the index, to and from the other workers (the pilot's
    ``shared`` client is one)."""

    def publish(self, kind: str, *details: Any) -> None:
        """Send ``(kind, *details)`` to every other worker of the same scope."""

    def on(self, kind: str, handler: Callable[..., None]) -> None:
        """Call ``handler(*details)`` for each entry of ``kind`` another worker publishes."""
