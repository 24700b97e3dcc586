"""A router's pilots, one per target, built to share one lock and one conversation store.

A conversation stays on one target, but its turns are one conversation whichever target
serves each: the history is what the caller sends, so the targets' pilots number a
conversation's turns once (``kept_turns`` means the same turns on every target, and a
reference only ever names a turn the caller keeps). Each pilot is given the group's lock
and store as it is built (:class:`~..pilot.group.Group`), and one step may touch several.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ..core.conversations import ConversationStore
from ..core.prepared import PreparedRequest
from ..pilot import ContextPilot

__all__ = ["PilotGroup"]


class _SharedConversations(ConversationStore):
    """The conversation store every target's pilot uses (under their one shared lock)."""

    def release_turn(self, conversation_id: str, turn: int) -> None:
        """A turn never reached the model: forget what it carried and, if no later turn was
        recorded meanwhile, give its number back (the caller's next turn takes it)."""
        self.forget_turn(conversation_id, turn)
        conversation = self._conversations.get(conversation_id)
        if conversation is not None and conversation.turns == turn + 1:
            conversation.turns = turn


class PilotGroup:
    """One :class:`ContextPilot` per target name, all under one lock and conversation store.

    Args:
        names: the targets' names, in order.
        strategy: every pilot's ordering strategy.
        max_conversations: conversations the shared store remembers.
        shared: the router's sharing setting; each pilot shares under its target's name.
        **pilot_options: passed to every pilot (the store takes the first one's
            ``conversation_ttl``).
    """

    def __init__(
        self, names: Sequence[str], strategy: str, max_conversations: int, shared: Any = None, **pilot_options: Any
    ) -> None:
        from ..shared.switch import per_target  # no broker client unless sharing is on

        self._lock = threading.RLock()
        self._max_conversations = max_conversations
        self._store: _SharedConversations | None = None
        self.pilots = {
            name: ContextPilot(strategy, shared=per_target(shared, name), _group=self, **pilot_options)
            for name in names
        }
        self._names = {id(pilot): name for name, pilot in self.pilots.items()}
        self.conversations = self.store(None, max_conversations)
        """The store the pilots were given (the first one made it)."""

    def lock(self) -> Any:
        """The one lock of every pilot (:class:`~..pilot.group.Group`)."""
        return self._lock

    def store(self, ttl: float | None, max_conversations: int) -> _SharedConversations:
        """The one conversation store, made for the first pilot with its ``ttl`` and the
        group's ``max_conversations`` (:class:`~..pilot.group.Group`)."""
        if self._store is None:
            self._store = _SharedConversations(ttl, self._max_conversations)
        return self._store

    def name_of(self, pilot: ContextPilot) -> str | None:
        """The target name whose pilot this is."""
        return self._names.get(id(pilot))

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget what a conversation's turns showed; whether it was tracked."""
        with self._lock:
            return self.conversations.end(conversation_id)

    def withdraw(self, name: str, prepared: PreparedRequest) -> None:
        """The request never reached the model: target ``name``'s pilot forgets it, and its
        conversation turn, if it is still the latest, gives its number back."""
        with self._lock:
            self.pilots[name].discard(prepared)
            if prepared.conversation_id is not None and prepared.turn is not None:
                self.conversations.release_turn(prepared.conversation_id, prepared.turn)
