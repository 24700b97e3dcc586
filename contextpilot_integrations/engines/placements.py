"""Where each conversation lives: the target its history is cached on.

A conversation stays on one target, so the router remembers where (most recent last; the
least recent beyond ``max_conversations`` forgotten) and, with sharing on, tells the other
application replicas as it places one (the ``stick`` entries they hear). No lock of its own:
the router holds its lock around each call (:mod:`.router`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

from ..pilot.ports import Broadcast

__all__ = ["Placements"]


class Placements:
    """Conversation id -> target name, bounded by ``max_conversations``."""

    def __init__(self, max_conversations: int) -> None:
        self.max_conversations = max_conversations
        self._where: OrderedDict[str, str] = OrderedDict()

    def get(self, conversation_id: str) -> str | None:
        """The target name a conversation stays on, if it is remembered."""
        return self._where.get(conversation_id)

    def forget(self, conversation_id: str) -> bool:
        """Forget where a conversation lives; whether it was remembered."""
        return self._where.pop(conversation_id, None) is not None

    def record(self, sticks: Mapping[str, str], channel: Callable[[str], Broadcast | None] | None = None) -> None:
        """Place each conversation on its target, most recent last; ``channel(name)``: where to
        tell the other replicas of a placement that changed (``None``: heard from them)."""
        for conversation_id, name in sticks.items():
            shared = channel(name) if channel is not None else None
            if shared is not None and self._where.get(conversation_id) != name:
                shared.publish("stick", conversation_id, name)
            self._where[conversation_id] = name
            self._where.move_to_end(conversation_id)
        while len(self._where) > self.max_conversations:
            self._where.popitem(last=False)
