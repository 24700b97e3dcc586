"""Per-conversation de-duplication (the paper's Alg. 3), bounded in memory.

A block already sent in full in an earlier turn becomes a location reference, but only
while that turn is still in the history the caller sends; otherwise it is sent again and
this turn becomes its carrier. Conversations end explicitly, expire after ``ttl`` seconds
without a turn, and the least recently used ones are dropped beyond ``max_conversations``.

Not thread-safe on its own: :class:`~contextpilot_integrations.ContextPilot` guards it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from .blocks import Block

__all__ = ["ConversationStore", "Deduplication"]


@dataclass
class _Conversation:
    turns: int = 0
    carrier: dict[str, int] = field(default_factory=dict)  # block id -> turn that sent it in full
    last_used: float = 0.0


@dataclass(frozen=True, slots=True)
class Deduplication:
    """The outcome for one turn: what to send, what to refer to, and where it was sent."""

    turn: int
    fresh: list[Block]
    repeated: list[tuple[Block, int]]  # (block, turn that carries it)


class ConversationStore:
    """Seen blocks per conversation id."""

    def __init__(
        self,
        ttl: float | None = 3600.0,
        max_conversations: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        self.ttl = ttl
        self.max_conversations = max_conversations
        self._clock = clock
        self._conversations: OrderedDict[str, _Conversation] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._conversations)

    def __contains__(self, conversation_id: object) -> bool:
        self._expire()
        return conversation_id in self._conversations

    def turns(self, conversation_id: str) -> int:
        """How many turns this conversation has had (0 if unknown)."""
        conversation = self._conversations.get(conversation_id)
        return conversation.turns if conversation else 0

    def deduplicate(
        self,
        conversation_id: str,
        blocks: Sequence[Block],
        kept_turns: Collection[int] | None = None,
    ) -> Deduplication:
        """Split a turn's blocks into fresh ones and references, and record the turn.

        Args:
            kept_turns: the earlier turns (0-based) still in the history the caller sends;
                ``None`` means all of them.
        """
        self._expire()
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            conversation = self._conversations[conversation_id] = _Conversation()
            while len(self._conversations) > self.max_conversations:
                self._conversations.popitem(last=False)
        else:
            self._conversations.move_to_end(conversation_id)
        turn = conversation.turns
        fresh: list[Block] = []
        repeated: list[tuple[Block, int]] = []
        for block in blocks:
            carrier = conversation.carrier.get(block.id)
            if carrier is not None and (kept_turns is None or carrier in kept_turns):
                repeated.append((block, carrier))
            else:
                fresh.append(block)
                conversation.carrier[block.id] = turn
        conversation.turns += 1
        conversation.last_used = self._clock()
        return Deduplication(turn, fresh, repeated)

    def forget_turn(self, conversation_id: str, turn: int) -> int:
        """A turn never reached the model: blocks it carried are no longer seen.

        Returns how many blocks it carried; later turns send them again.
        """
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            return 0
        carried = [block_id for block_id, carrier in conversation.carrier.items() if carrier == turn]
        for block_id in carried:
            del conversation.carrier[block_id]
        return len(carried)

    def end(self, conversation_id: str) -> bool:
        """Forget a conversation; returns whether it was tracked."""
        return self._conversations.pop(conversation_id, None) is not None

    def clear(self) -> None:
        self._conversations.clear()

    def _expire(self) -> None:
        if self.ttl is None:
            return
        horizon = self._clock() - self.ttl
        while self._conversations:
            oldest_id, oldest = next(iter(self._conversations.items()))
            if oldest.last_used >= horizon:
                break
            del self._conversations[oldest_id]
