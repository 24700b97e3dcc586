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
refer to it: a turn's prompt costs what it costs now, with no bet on turns to come. A quote
must name exactly one text: a block is quoted by its first four words only where they occur
in no other text of this turn or of a turn it keeps (another block, sent earlier or first
sent in this very turn, at its start or inside it; a question) and nowhere in its own text
past its first paragraph; else by its first eight words (80 characters), then sixteen (160)
where those name it alone (:data:`~.annotations.QUOTE_LENGTHS`); otherwise it is sent in
full. What the store cannot see (the system prompt, the answers) is checked where the
messages leave (:func:`~.prepared.resolve_request`). Where references are a choice
(prompts sent as without ContextPilot, :func:`decide_turn`), a block becomes a reference
only where its reference costs fewer tokens than its text, counted in the blocks' own
units.

For that check a conversation keeps the texts it sent (the very strings given, not copies)
and the turns that sent them, for its last ``turn_memory`` turns: a conversation that never
ends costs a bounded amount, like the number of conversations (``ttl``,
``max_conversations``). Older turns are forgotten: their blocks are sent in full again, and
a turn whose history still holds one of them refers to nothing (what a reference could be
confused with is no longer known). Each text is searched once for each quote's words (under
the pilot's lock; remembered until turns are forgotten).

Deciding and recording are two steps (:meth:`ConversationStore.split`, then
:meth:`ConversationStore.record`), so a caller can validate everything else in between
and a call that raises leaves nothing behind.

Not thread-safe on its own: :class:`~contextpilot_integrations.ContextPilot` guards it.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .annotations import Templates, first_paragraph, openings, render_reference
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
    # every text this conversation sent (blocks in full, questions), once each, in order, and
    # the turns that sent it: a quote's words must occur in none that a kept turn sent but
    # the quoted block's own
    texts: list[str] = field(default_factory=list)
    sent_in: dict[str, set[int]] = field(default_factory=dict)
    # a quote's words -> (how many of ``texts`` were searched for them, those holding them):
    # a memo, ``texts`` only grows, so each text is searched once per quote
    holding: dict[str, tuple[int, list[str]]] = field(default_factory=dict)
    last_used: float = 0.0
    horizon: int = 0  # turns before it are forgotten

    def forget_before(self, horizon: int) -> None:
        """Forget the turns before ``horizon``: what they carried, the texts only they sent."""
        self.horizon = horizon
        self.carrier = {block_id: kept for block_id, kept in self.carrier.items() if kept[0] >= horizon}
        for text, turns in list(self.sent_in.items()):
            later = {turn for turn in turns if turn >= horizon}
            if later:
                self.sent_in[text] = later
            else:
                del self.sent_in[text]
        self.texts = [text for text in self.texts if text in self.sent_in]
        self.holding.clear()

    def remember(self, turn: int, texts: Iterable[str]) -> None:
        for text in texts:
            turns = self.sent_in.get(text)
            if turns is None:
                turns = self.sent_in[text] = set()
                self.texts.append(text)
            turns.add(turn)


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
    texts: tuple[str, ...] = ()
    """The turn's other texts (its question, rendered): later quotes must not name them."""
    quotes: Mapping[str, str] = field(default_factory=dict)
    """Block id -> the words a quote reference names it by (of the repeated blocks an earlier
    turn sent unlabelled): the shortest of its :func:`~.annotations.openings` that names it
    alone."""


class ConversationStore:
    """Seen blocks per conversation id."""

    def __init__(
        self,
        ttl: float | None = 3600.0,
        max_conversations: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        turn_memory: int = 256,
    ) -> None:
        if max_conversations < 1 or turn_memory < 1:
            raise ValueError("max_conversations and turn_memory must be at least 1")
        self.ttl = ttl
        self.max_conversations = max_conversations
        self.turn_memory = turn_memory
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
        texts: Sequence[str] = (),
        separator: str = "\n\n",
    ) -> Deduplication:
        """Split a turn's blocks into fresh ones and references; records nothing.

        Args:
            kept_turns: the earlier turns (0-based) still in the history the caller sends;
                ``None`` means all of them.
            texts: the turn's other texts the model reads (its question, as rendered): a
                block whose opening words they contain is not quoted.
            separator: what the prompt puts between blocks (the templates'): a block whose
                opening words recur in its own text past its first paragraph is not quoted.
        """
        self._expire()
        conversation = self._conversations.get(conversation_id)
        texts = tuple(texts)
        if conversation is None or not conversation.carrier:  # a first turn: every block is fresh
            turn = conversation.turns if conversation else 0
            return Deduplication(conversation_id, turn, list(blocks), [], texts=texts)
        horizon = conversation.horizon
        if horizon and (kept_turns is None or any(turn < horizon for turn in kept_turns)):
            # the history holds a forgotten turn: a reference could name one of its texts
            return Deduplication(conversation_id, conversation.turns, list(blocks), [], texts=texts)
        carrier, ambiguous = conversation.carrier, conversation.ambiguous
        fresh: list[Block] = []
        repeated: list[tuple[Block, int, bool]] = []
        updated: list[str] = []
        quotes: dict[str, str] = {}
        for block in blocks:
            carried = carrier.get(block.id)
            if carried is None or (ambiguous and block.id in ambiguous):
                fresh.append(block)
            elif carried[1] != hash(block.text):  # the same id with another text
                fresh.append(block)
                updated.append(block.id)
            elif kept_turns is not None and carried[0] not in kept_turns:  # its turn left the history
                fresh.append(block)
            elif carried[2]:  # sent labelled: referred to by its label
                repeated.append((block, carried[0], True))
            elif words := _quote(conversation, block, blocks, texts, separator, kept_turns):
                repeated.append((block, carried[0], False))
                quotes[block.id] = words
            else:  # every quote of it could name another text
                fresh.append(block)
        return Deduplication(
            conversation_id, conversation.turns, fresh, repeated, tuple(updated), texts=texts, quotes=quotes
        )

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
        conversation.remember(dedup.turn, dedup.texts)
        conversation.turns += 1
        conversation.last_used = self._clock()
        if conversation.turns - conversation.horizon > self.turn_memory + self.turn_memory // 4:  # now and then
            conversation.forget_before(conversation.turns - self.turn_memory)

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
    """``turn`` carries these blocks now; their texts join those a quote must not name."""
    for block in blocks:
        conversation.carrier[block.id] = (turn, hash(block.text), labelled)
    conversation.remember(turn, [block.text for block in blocks])


def _quote(
    conversation: _Conversation,
    block: Block,
    blocks: Sequence[Block],
    texts: Sequence[str],
    separator: str,
    kept_turns: Collection[int] | None,
) -> str | None:
    """The shortest quote of ``block`` (:func:`~.annotations.openings`) whose words name it
    alone, or ``None``: the words occur in no other text of this turn (``blocks``,
    ``texts``) nor of a turn it keeps, nor in its own text past its first paragraph (every
    copy of it begins with them)."""
    for words in openings(block.text):
        if _names_alone(conversation, block, words, blocks, texts, separator, kept_turns):
            return words
    return None


def _names_alone(
    conversation: _Conversation,
    block: Block,
    words: str,
    blocks: Sequence[Block],
    texts: Sequence[str],
    separator: str,
    kept_turns: Collection[int] | None,
) -> bool:
    text = block.text
    reach = first_paragraph(text, words, separator)
    if text.find(words, reach - len(words) + 1) != -1:
        return False
    sent_in = conversation.sent_in  # this turn's texts the conversation sent already are searched below, once
    if any(words in other for other in texts) or any(
        words in other.text for other in blocks if other.text not in sent_in and other.text != text
    ):
        return False
    earlier = conversation.texts
    searched, holding = conversation.holding.get(words, (0, []))
    if searched < len(earlier):
        found = [other for other in itertools.islice(earlier, searched, None) if words in other]
        holding = holding + found if found else holding
        conversation.holding[words] = (len(earlier), holding)
    here = {other.text for other in blocks} if holding else set()  # in this turn's prompt, whoever sent it before
    return not any(
        other != text and (other in here or kept_turns is None or not sent_in[other].isdisjoint(kept_turns))
        for other in holding
    )


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
        if count(render_reference(block, templates, labelled, dedup.quotes.get(block.id))) < block.token_count
    }
    fresh = [block for block in ranking if block.id not in referred]
    return replace(dedup, fresh=fresh, repeated=list(referred.values()), labelled=False)
