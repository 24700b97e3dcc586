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
                self.repeats.gone(self._conversations.popitem(last=False)[0])
        else:
            self._conversations.move_to_end(dedup.conversation_id)
        if conversation.turns != dedup.turn:
            raise RuntimeError("the conversation moved on between split() and record()")
        if dedup.updated:
            conversation.ambiguous.update(dedup.updated)
        turn, labelled = dedup.turn, dedup.labelled
        conversation.carrier.update({block.id: (turn, hash(block.text), labelled) for block in dedup.fresh})
        self.repeats.turn(dedup.conversation_id, len(dedup.fresh), dedup.repeats)

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
        if turn == conversation.turns - 1:  # its blocks were never sent: nothing to count
            self.repeats.withdraw(conversation_id)
        return len(carried)

    def end(self, conversation_id: str) -> bool:
        """Forget a conversation; returns whether it was tracked."""
        self.repeats.gone(conversation_id)
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
            self.repeats.gone(oldest_id)


LABEL_MARGIN = 3
"""How many times a label is counted against the references it may buy: a labelled turn is
sent again as the history of the turns that could refer to it, labels included."""


class Repeats:
    """How many times a block sent in full comes back in a later turn of its conversation
    that still keeps it (where a reference could replace it), per block sent in full, over
    all conversations; recent turns weigh most (counts decay by ``decay`` a counted turn).
    Before any traffic it assumes ``prior`` repeats a block (the paper's multi-turn
    setting), worth ``weight`` blocks of evidence, which fades as turns come in.

    Censored, because a first turn's blocks cannot come back before its conversation does:
    counted at once, 300 first turns arriving before any second one read as conversations
    that never come back. A turn's blocks count in full once its conversation moves on (its
    next turn shows what came back) or is gone (ended, expired, dropped, or silent for
    ``wait`` turns of all conversations); until then as a share ``silent turns / wait``.
    ``wait`` is ``patience`` times the usual gap between two turns of a conversation here,
    within ``min_wait``..``max_wait`` (``max_wait`` before any gap is seen): where no
    conversation comes back, short blocks (labels barely pay) stop being labelled within a
    few dozen turns, long ones within ``max_wait``; the maps hold the conversations heard
    from in the last ``patience * max_wait`` turns. Not thread-safe: the pilot's lock
    guards it."""

    __slots__ = ("_at", "_gap", "_gaps", "_gone", "_pending", "_repeats", "_sent", "_silent", "_turns", "decay",
                 "max_wait", "min_wait", "patience")  # fmt: skip

    def __init__(
        self,
        prior: float = 1.0,
        weight: float = 16.0,
        decay: float = 0.99,
        patience: float = 4.0,
        min_wait: int = 16,
        max_wait: int = 256,
    ) -> None:
        if prior < 0 or weight < 0 or not 0.0 < decay <= 1.0:
            raise ValueError("prior and weight must be at least 0, decay in (0, 1]")
        if patience <= 0 or not 1 <= min_wait <= max_wait:
            raise ValueError("patience must be above 0, and 1 <= min_wait <= max_wait")
        self.decay = decay
        self.patience = patience
        self.min_wait = min_wait
        self.max_wait = max_wait
        self._sent = weight
        self._repeats = prior * weight
        self._turns = 0  # turns heard, over all conversations: the clock of the waits
        # conversation -> (its last turn's clock, blocks that turn sent in full), oldest first
        self._pending: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._silent = 0  # blocks the pending turns sent
        self._at = 0  # the same, each times its turn's clock (with ``_silent``: their summed age)
        self._gone: OrderedDict[str, int] = OrderedDict()  # counted gone by the wait: its last turn's clock
        self._gaps = self._gap = 0.0  # decayed count and sum of the gaps seen

    def observe(self, sent: int, repeats: int) -> None:
        """Count ``sent`` blocks in full whose conversations moved on or are gone, and
        ``repeats`` blocks a kept earlier turn had sent."""
        self._sent = self._sent * self.decay + sent
        self._repeats = self._repeats * self.decay + repeats

    def turn(self, conversation_id: str, sent: int, repeats: int) -> None:
        """A conversation's turn: ``sent`` blocks in full (counted once it moves on or is
        gone), ``repeats`` blocks a kept earlier turn sent (counted now)."""
        self._turns += 1
        last = self._settle(conversation_id)
        if last is not None:  # it moved on: what its last turn sent is now known
            self._learn_gap(self._turns - last[0])
            self.observe(last[1], repeats)
        else:
            before = self._gone.pop(conversation_id, None)
            if before is not None:  # back after the wait: the gaps are longer than thought
                self._learn_gap(self._turns - before)
            if repeats:
                self.observe(0, repeats)
        self._pending[conversation_id] = (self._turns, sent)
        self._silent += sent
        self._at += sent * self._turns
        self._expire()

    def gone(self, conversation_id: str) -> None:
        """The conversation ended (or was dropped): what its last turn sent is now known."""
        last = self._settle(conversation_id)
        self._gone.pop(conversation_id, None)
        if last is not None:
            self.observe(last[1], 0)

    def withdraw(self, conversation_id: str) -> None:
        """The conversation's last turn never reached the model: what it sent counts for nothing."""
        self._settle(conversation_id)

    @property
    def wait(self) -> int:
        """Turns of other conversations after which a silent one counts as gone."""
        if not self._gaps:
            return self.max_wait
        return int(min(self.max_wait, max(self.min_wait, self.patience * self._gap / self._gaps)))

    @property
    def rate(self) -> float:
        """Later repeats expected per block sent in full."""
        sent = self._sent + (self._turns * self._silent - self._at) / self.wait
        return self._repeats / sent if sent > 0 else 0.0

    def _settle(self, conversation_id: str) -> tuple[int, int] | None:
        last = self._pending.pop(conversation_id, None)
        if last is not None:
            self._silent -= last[1]
            self._at -= last[1] * last[0]
        return last

    def _learn_gap(self, gap: int) -> None:
        self._gaps = self._gaps * self.decay + 1
        self._gap = self._gap * self.decay + gap

    def _expire(self) -> None:
        now, pending, gone = self._turns, self._pending, self._gone
        horizon = now - self.wait
        while pending:
            conversation_id, (at, sent) = next(iter(pending.items()))
            if at > horizon:
                break
            self._settle(conversation_id)
            self.observe(sent, 0)
            gone[conversation_id] = at
        horizon = now - int(self.patience * self.max_wait)
        while gone and next(iter(gone.values())) < horizon:
            gone.popitem(last=False)


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
