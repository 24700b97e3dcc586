"""Per-conversation de-duplication (the paper's Alg. 3), bounded in memory.

A block already sent in full in an earlier turn becomes a location reference, but only
while that turn is still in the history the caller sends, and only if it is the same
text: a document updated under the same id is sent again in full, and from then on that
id is always sent in full in this conversation (the history now holds two texts under one
label, so a reference could point at either). Conversations end explicitly, expire after
``ttl`` seconds without a turn, and the least recently used ones are dropped beyond
``max_conversations``.

A reference names the earlier copy by its label where that turn sent it labelled, and
otherwise quotes its opening words, so no turn has to carry labels for later turns to
refer to it: a turn's prompt costs what it costs now, with no bet on turns to come. A
block whose opening words another block this conversation sent also begins with is sent
in full (a quote could point at either). Where references are a choice (prompts sent as
without ContextPilot, :func:`decide_turn`), a block becomes a reference only where its
reference costs fewer tokens than its text, counted in the blocks' own units.

Deciding and recording are two steps (:meth:`ConversationStore.split`, then
:meth:`ConversationStore.record`), so a caller can validate everything else in between
and a call that raises leaves nothing behind.

Not thread-safe on its own: :class:`~contextpilot_integrations.ContextPilot` guards it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from .annotations import Templates, opening, render_reference
from .blocks import Block

__all__ = ["ConversationStore", "Deduplication", "decide_turn", "keep_in_full"]

TokenCounter = Callable[[str], int]


@dataclass
class _Conversation:
    turns: int = 0
    # block id -> (turn, fingerprint of its text, sent with its label): ``hash(block.text)``,
    # which ``str`` caches, so it costs nothing after the first use
    carrier: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    ambiguous: set[str] = field(default_factory=set)  # ids seen with two texts: always sent in full
    # fingerprint of a carried block's opening words -> its id; two ids whose openings
    # collide cannot be quoted
    openings: dict[int, str] = field(default_factory=dict)
    unquotable: set[str] = field(default_factory=set)
    last_used: float = 0.0


@dataclass(frozen=True, slots=True)
class Deduplication:
    """The outcome for one turn: what to send, what to refer to, and where it was sent."""

    conversation_id: str
    turn: int
    fresh: list[Block]
    repeated: list[tuple[Block, int, bool]]
    """(block, the turn that carries it, whether that turn sent it labelled)."""
    updated: tuple[str, ...] = ()
    """Ids an earlier turn carried with a different text (sent in full again)."""
    labelled: bool = True
    """Whether the fresh blocks go out with their labels (later references name them by it)."""


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

    def split(
        self,
        conversation_id: str,
        blocks: Sequence[Block],
        kept_turns: Collection[int] | None = None,
    ) -> Deduplication:
        """Split a turn's blocks into fresh ones and references; records nothing.

        Args:
            kept_turns: the earlier turns (0-based) still in the history the caller sends;
                ``None`` means all of them.
        """
        self._expire()
        conversation = self._conversations.get(conversation_id)
        if conversation is None or not conversation.carrier:  # a first turn: every block is fresh
            return Deduplication(conversation_id, conversation.turns if conversation else 0, list(blocks), [])
        carrier, ambiguous, unquotable = conversation.carrier, conversation.ambiguous, conversation.unquotable
        fresh: list[Block] = []
        repeated: list[tuple[Block, int, bool]] = []
        updated: list[str] = []
        for block in blocks:
            carried = carrier.get(block.id)
            if carried is None or (ambiguous and block.id in ambiguous):
                fresh.append(block)
            elif carried[1] != hash(block.text):  # the same id with another text
                fresh.append(block)
                updated.append(block.id)
            elif (kept_turns is None or carried[0] in kept_turns) and (carried[2] or block.id not in unquotable):
                repeated.append((block, carried[0], carried[2]))
            else:  # its turn left the history, or a quote of it could point at another block
                fresh.append(block)
        return Deduplication(conversation_id, conversation.turns, fresh, repeated, tuple(updated))

    def record(self, dedup: Deduplication) -> None:
        """Record a turn decided by :meth:`split`: its fresh blocks are now carried by it."""
        conversation = self._conversations.get(dedup.conversation_id)
        if conversation is None:
            conversation = self._conversations[dedup.conversation_id] = _Conversation()
            while len(self._conversations) > self.max_conversations:
                self._conversations.popitem(last=False)
        else:
            self._conversations.move_to_end(dedup.conversation_id)
        if conversation.turns != dedup.turn:
            raise RuntimeError("the conversation moved on between split() and record()")
        if dedup.updated:
            conversation.ambiguous.update(dedup.updated)
        _carry(conversation, dedup.turn, dedup.fresh, dedup.labelled)
        conversation.turns += 1
        conversation.last_used = self._clock()

    def deduplicate(
        self,
        conversation_id: str,
        blocks: Sequence[Block],
        kept_turns: Collection[int] | None = None,
    ) -> Deduplication:
        """:meth:`split`, then :meth:`record`: one turn, decided and recorded."""
        dedup = self.split(conversation_id, blocks, kept_turns)
        self.record(dedup)
        return dedup

    def carry(self, conversation_id: str, turn: int, blocks: Sequence[Block], labelled: bool = True) -> None:
        """``turn`` sent these blocks in full after all (``labelled``: with their labels):
        later turns may refer to it for them."""
        conversation = self._conversations.get(conversation_id)
        if conversation is not None:
            blocks = [block for block in blocks if block.id not in conversation.ambiguous]
            _carry(conversation, turn, blocks, labelled)

    def forget_turn(self, conversation_id: str, turn: int) -> int:
        """A turn never reached the model: blocks it carried are no longer seen.

        Returns how many blocks it carried; later turns send them again.
        """
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            return 0
        carried = [block_id for block_id, (carrier, _, _) in conversation.carrier.items() if carrier == turn]
        for block_id in carried:
            del conversation.carrier[block_id]
        return len(carried)

    def end(self, conversation_id: str) -> bool:
        """Forget a conversation; returns whether it was tracked."""
        return self._conversations.pop(conversation_id, None) is not None

    def _expire(self) -> None:
        if self.ttl is None:
            return
        horizon = self._clock() - self.ttl
        while self._conversations:
            oldest_id, oldest = next(iter(self._conversations.items()))
            if oldest.last_used >= horizon:
                break
            del self._conversations[oldest_id]


def _carry(conversation: _Conversation, turn: int, blocks: Sequence[Block], labelled: bool) -> None:
    """``turn`` carries these blocks now; each claims its opening words for quotes (two
    blocks that begin alike can no longer be quoted)."""
    for block in blocks:
        conversation.carrier[block.id] = (turn, hash(block.text), labelled)
        owner = conversation.openings.setdefault(hash(opening(block.text)), block.id)
        if owner != block.id:
            conversation.unquotable.update((owner, block.id))


def keep_in_full(dedup: Deduplication, block_id: str) -> Deduplication:
    """``dedup`` with the block ``block_id`` (the retriever's top-ranked, first in the
    turn's blocks) sent in full rather than referred to (:mod:`.reading`)."""
    kept = [entry for entry in dedup.repeated if entry[0].id == block_id]
    if not kept:
        return dedup
    repeated = [entry for entry in dedup.repeated if entry[0].id != block_id]
    return replace(dedup, fresh=[kept[0][0], *dedup.fresh], repeated=repeated)


def decide_turn(
    dedup: Deduplication, ranking: Sequence[Block], templates: Templates, count: TokenCounter
) -> Deduplication:
    """A later turn sent as without ContextPilot (text alone, the retriever's order), with a
    reference in place of each repeated block whose reference costs fewer tokens than its
    text: never more tokens than sending every block again, and nothing bet on later turns
    (a reference needs no label in the turn it points to)."""
    referred = {
        block.id: (block, turn, labelled)
        for block, turn, labelled in dedup.repeated
        if count(render_reference(block, templates, labelled)) < block.token_count
    }
    fresh = [block for block in ranking if block.id not in referred]
    return replace(dedup, fresh=fresh, repeated=list(referred.values()), labelled=False)
