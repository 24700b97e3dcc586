"""The narrow interfaces the pilot's users above it talk through.

A router (:mod:`..engines.router`) needs two things of its pilots beyond preparing and
reporting: that they share one lock and one conversation store, given to each pilot as it
is built (:class:`Group`), and, when sharing is on, a channel for its own entries (where each
conversation lives): :class:`Broadcast`. The shared log itself talks to the pilot through the
interface it owns, :class:`~..shared.replica.Replica`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from ..core.conversations import ConversationStore

__all__ = ["ALONE", "Broadcast", "Group"]


class Broadcast(Protocol):
    """Entries that are not about the index, to and from the other workers (the pilot's
    ``shared`` client is one)."""

    def publish(self, kind: str, *details: Any) -> None:
        """Send ``(kind, *details)`` to every other worker of the same scope."""

    def on(self, kind: str, handler: Callable[..., None]) -> None:
        """Call ``handler(*details)`` for each entry of ``kind`` another worker publishes."""


class Group(Protocol):
    """What a pilot built among others shares with them (a router's, one per engine): the
    lock and the conversation store, since a conversation moves between engines and one
    step may touch several pilots. Internal: a pilot alone gets its own (:data:`ALONE`)."""

    def lock(self) -> Any:
        """The lock guarding the pilot's state."""

    def store(self, ttl: float | None, max_conversations: int) -> ConversationStore:
        """The conversation store, given the pilot's own settings."""


class _Alone:
    """A pilot of its own: a fresh lock and conversation store."""

    def lock(self) -> Any:
        return threading.RLock()

    def store(self, ttl: float | None, max_conversations: int) -> ConversationStore:
        return ConversationStore(ttl, max_conversations)


ALONE: Group = _Alone()
"""The :class:`Group` of a pilot built alone."""
