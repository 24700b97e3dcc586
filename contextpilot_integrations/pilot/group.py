"""What a pilot built among others shares with them: one lock and one conversation store.

A router builds one pilot per engine; a conversation moves between engines and one step may
touch several pilots, so they are built with the group's lock and store
(:class:`~..engines.pilot_group.PilotGroup`) rather than rewired afterwards. A pilot built
alone gets its own (:data:`ALONE`). Below the facade, which takes a group as it is built.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from ..core.conversations import ConversationStore

__all__ = ["ALONE", "Group"]


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
