"""Per-conversation de-duplication (the paper's Alg. 3), bounded in memory.

A block already sent in full in an earlier turn becomes a location reference, but only
while that turn is still in the history the caller sends, and only if it is the same
text: a document updated under the same id is sent again in full, and from then on that
id is always sent in full in this conversation (the history now holds two texts under one
label, so a reference could point at either). Conversations end explicitly, expire after
``ttl`` seconds without a turn, and the least recently used ones are dropped beyond
``max_conversations``.

A reference needs a label to point to, and both cost prompt tokens: a turn labels its
blocks and refers to earlier ones only where that pays (:func:`decide_turn`,
:func:`labels_pay`), counted in the blocks' own units. A block sent without its label
cannot be referred to: a later turn that repeats it sends it again (nothing is lost).
How often a block sent in full comes back in a later kept turn is learnt from the
traffic (:class:`Repeats`), so a label is a bet only where repeats are expected.

Deciding and recording are two steps (:meth:`ConversationStore.split`, then
:meth:`ConversationStore.record`), so a caller can validate everything else in between
and a call that raises leaves nothing behind.

Not thread-safe on its own: :class:`~contextpilot_integrations.ContextPilot` guards it.
"""

from __future__ import annotations

import functools
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

from .annotations import Templates, render_order, render_reference
from .blocks import Block

__all__ = ["ConversationStore", "Deduplication", "Repeats", "decide_turn", "labels_pay"]

TokenCounter = Callable[[str], int]


@dataclass
class _Conversation:
    turns: int = 0
    # block id -> (turn, fingerprint of its text, sent with its label): ``hash(block.text)``,
    # which ``str`` caches, so it costs nothing after the first use
    carrier: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    ambiguous: set[str] = field(default_factory=set)  # ids seen with two texts: always sent in full
    last_used: float = 0.0


@dataclass(frozen=True, slots=True)
class Deduplication:
    """The outcome for one turn: what to send, what to refer to, and where it was sent."""

    conversation_id: str
    turn: int
    fresh: list[Block]
    repeated: list[tuple[Block, int]]  # (block, turn that carries it)
    updated: tuple[str, ...] = ()
    """Ids an earlier turn carried with a different text (sent in full again)."""
    repeats: int = 0
    """Blocks of this turn a kept earlier turn sent in full, labelled or not (what
    :class:`Repeats` learns from); those sent without their label are in ``fresh``."""
    labelled: bool = True
    """Whether the fresh blocks go out with their labels (later turns may refer to them)."""


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
        self.repeats = Repeats()
        """How often blocks come back in later turns, over all conversations."""

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
        carrier, ambiguous = conversation.carrier, conversation.ambiguous
        fresh: list[Block] = []
        repeated: list[tuple[Block, int]] = []
        updated: list[str] = []
        repeats = 0
        for block in blocks:
            carried = carrier.get(block.id)
            if carried is None or (ambiguous and block.id in ambiguous):
                fresh.append(block)
            elif carried[1] != hash(block.text):  # the same id with another text
                fresh.append(block)
                updated.append(block.id)
            elif kept_turns is None or carried[0] in kept_turns:
                repeats += 1
                if carried[2]:
                    repeated.append((block, carried[0]))
                else:  # sent without its label: nothing to refer to
                    fresh.append(block)
            else:
                fresh.append(block)
        return Deduplication(conversation_id, conversation.turns, fresh, repeated, tuple(updated), repeats)

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
        turn, labelled = dedup.turn, dedup.labelled
        conversation.carrier.update({block.id: (turn, hash(block.text), labelled) for block in dedup.fresh})
        self.repeats.observe(len(dedup.fresh), dedup.repeats)

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

    def carry(self, conversation_id: str, turn: int, blocks: Sequence[Block]) -> None:
        """``turn`` sent these blocks in full after all: later turns may refer to it for them."""
        conversation = self._conversations.get(conversation_id)
        if conversation is None:
            return
        for block in blocks:
            if block.id not in conversation.ambiguous:  # sent in full as the reference's target: labelled
                conversation.carrier[block.id] = (turn, hash(block.text), True)

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


LABEL_MARGIN = 3
"""How many times a label is counted against the references it may buy: a labelled turn is
sent again as the history of the turns that could refer to it, labels included."""


class Repeats:
    """How many times a block sent in full comes back in a later turn of its conversation
    that still keeps it (where a reference could replace it), per block sent in full, over
    all conversations; recent turns weigh most (counts decay by ``decay`` a turn). Before
    any traffic it assumes ``prior`` repeats a block (the paper's multi-turn setting), worth
    ``weight`` blocks of evidence, which fades as turns come in: on traffic whose
    conversations never come back to a block, labels soon stop being paid for. Not
    thread-safe: the pilot's lock guards it."""

    __slots__ = ("_repeats", "_sent", "decay")

    def __init__(self, prior: float = 1.0, weight: float = 16.0, decay: float = 0.99) -> None:
        if prior < 0 or weight < 0 or not 0.0 < decay <= 1.0:
            raise ValueError("prior and weight must be at least 0, decay in (0, 1]")
        self.decay = decay
        self._sent = weight
        self._repeats = prior * weight

    def observe(self, sent: int, repeats: int) -> None:
        """One turn: ``sent`` blocks in full, ``repeats`` blocks a kept earlier turn sent."""
        self._sent = self._sent * self.decay + sent
        self._repeats = self._repeats * self.decay + repeats

    @property
    def rate(self) -> float:
        """Later repeats expected per block sent in full."""
        return self._repeats / self._sent if self._sent > 0 else 0.0


@functools.lru_cache(maxsize=4096)
def _costs(label: str, templates: Templates, count: TokenCounter) -> tuple[int, int]:
    """(tokens the label adds to a block, tokens a reference to it costs with its place in
    the order annotation)."""
    item = templates.order_item.format(label=label) + templates.order_joiner
    reference = templates.reference.format(label=label)
    return count(templates.block.format(label=label, text="")), count(reference) + count(item)


def _bet(blocks: Sequence[Block], rate: float, templates: Templates, count: TokenCounter, labels: bool = True) -> float:
    """What later references to these blocks are expected to buy (each later repeat saves a
    block's tokens less its reference's), less what their labels cost (``labels``: they are
    sent labelled now; else they already were)."""
    value = 0.0
    for block in blocks:
        label, reference = _costs(block.label, templates, count)
        value += rate * max(block.token_count - reference, 0) - (LABEL_MARGIN * label if labels else 0)
    return value


def labels_pay(blocks: Sequence[Block], rate: float, templates: Templates, count: TokenCounter) -> bool:
    """Whether a first turn's blocks are worth labelling, so later turns can refer to them
    (short blocks never are: a reference is about as long)."""
    return _bet(blocks, rate, templates, count) > 0


def decide_turn(
    dedup: Deduplication,
    ranking: Sequence[Block],
    rate: float,
    templates: Templates,
    count: TokenCounter,
    annotate: bool = True,
) -> Deduplication:
    """A later turn, sent in the retriever's order as the cheapest of: every block as its
    text alone (as without ContextPilot); every block labelled (a bet on later references,
    :func:`_bet`); or labelled with a reference for each repeated block whose reference
    costs fewer tokens than its text, plus the order annotation where references leave the
    retriever's order. Ties go to the plain send. A block referred to stays referable, as a
    block labelled now becomes: both count what later references are expected to buy."""
    plain = replace(dedup, fresh=list(ranking), repeated=[], labelled=False)
    labelled = replace(plain, labelled=True)
    best, value = plain, 0.0
    bet = _bet(ranking, rate, templates, count)
    if bet > value:
        best, value = labelled, bet
    references = [(b, t) for b, t in dedup.repeated if count(render_reference(b, templates)) < b.token_count]
    if references:
        referred = {block.id for block, _ in references}
        fresh = [block for block in ranking if block.id not in referred]
        saved = float(sum(block.token_count - count(render_reference(block, templates)) for block, _ in references))
        read = [block.id for block in fresh] + [block.id for block, _ in references]
        if annotate and read != [block.id for block in ranking]:
            saved -= count(render_order(ranking, templates))
        saved += _bet(fresh, rate, templates, count) + _bet([b for b, _ in references], rate, templates, count, False)
        if saved > value:
            best = replace(dedup, fresh=fresh, repeated=references, labelled=True)
    return best
