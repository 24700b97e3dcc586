"""Never worse than retrieval order: reordering and labels only where the reuse pays.

A prompt a user sends without ContextPilot carries its blocks in the retriever's order,
unlabelled, with no order annotation. ContextPilot reorders blocks so requests share a
prefix, and restates the retriever's ranking after them (the order annotation); the
annotation, and labels where a form uses them, are prompt tokens the engine computes. So
each request goes out in the send that pays best, counting those tokens (with the pilot's
``token_counter``: the engine's tokenizer when given, else four characters a token, rounded
up per piece, as the simulator counts) against the reuse it buys:

- now: the leading blocks the engine is predicted to hold (the live index);
- later: the prefix later requests may reuse, learnt from this traffic
  (:class:`Cooccurrence`): a block's first place counts as much as the chance a later
  request carries it again, each next one as much as the chance it followed the block
  before it (a prefix cache reuses only a common prefix); sure for a partner later in a
  batch sent in order.

One text per block (the ``positions`` and ``moved`` forms, the default, and a
conversation's turns unless their labels pay, :mod:`.conversations`): a block is its text
alone whether the request is reordered or not, and the annotation ranks blocks by their
position in the prompt; a later request lines up with an earlier one whichever way that
one went out. The paper's form (``labels``: every block labelled, the ranking restated by
label; a conversation's turns whose blocks later turns are expected to refer to by label)
is another text, so the index keeps labelled blocks apart (:func:`labelled_key`).

Both terms count only as much as the engine has served what the index predicted
(:class:`Retention`, from the engine's cached-token reports), and a score is kept
(:class:`Balance`): the reuse the sends bought over retrieval order's, less the tokens they
added, over a recent window. While it is negative, later reuse counts for nothing: only a
send that pays now is made. A request larger than the engine's cache (when its size is
known) can reuse what others left cached but leaves nothing behind: only the reuse now
counts, and it is not indexed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from .annotations import Templates, render_order, render_position_order
from .blocks import CHARS_PER_TOKEN, Block
from .prepared import PreparedRequest

__all__ = [
    "FORMS",
    "LABELLED",
    "PARTITIONED",
    "Balance",
    "Chance",
    "Choice",
    "Cooccurrence",
    "Form",
    "Retention",
    "annotation_tokens",
    "key_blocks",
    "block_key",
    "choose_order",
    "estimate_tokens",
    "in_partition",
    "index_keys",
    "key_block",
    "label_tokens",
    "labelled_key",
    "labelled_keys",
    "leading_reuse",
    "page_margin",
    "plain_keys",
    "TokenCounter",
]

Form = Literal["positions", "moved", "labels"]
FORMS: tuple[Form, ...] = ("positions", "moved", "labels")
"""Annotation forms: the ranking restated by position (blocks as their text alone), only
the blocks whose position is not their rank, or the paper's (every block labelled, the
ranking restated by label)."""

TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class Choice:
    """The send order of one request and whether its blocks carry labels."""

    order: list[str]
    labels: bool = True
    cached: bool = True
    """Whether the engine will hold it afterwards (False: larger than its cache)."""
    bought: float = 0.0
    """Tokens reused now beyond what retrieval order would reuse, less the tokens added."""


def estimate_tokens(text: str) -> int:
    """About four characters a token, rounded up: never under-count a cost."""
    return -(-len(text) // CHARS_PER_TOKEN) if text else 0


def annotation_tokens(
    ranking: Sequence[Block],
    templates: Templates,
    order: Sequence[Block] | None = None,
    form: Form = "labels",
    count: TokenCounter = estimate_tokens,
) -> int:
    """Tokens of the order annotation for this ranking, sent in ``order`` (in ``form``).

    With a ``count`` of its own (the engine's tokenizer) the annotation is counted piece by
    piece: its frame, each item, each joiner. The pieces are few and recur (``#3``, a
    block's ``[label]``), so the pilot counts them before it takes its lock, and a piece
    counted alone never has fewer tokens than in context (no merge across its edges)."""
    if not ranking:
        return 0
    if count is not estimate_tokens:
        return _annotation_pieces(ranking, templates, order, form, count)
    if form == "labels" or order is None:
        return count(render_order(ranking, templates))
    if form == "positions":  # its length depends on the block count alone
        return -(-_position_chars(len(ranking), templates) // CHARS_PER_TOKEN)
    return count(render_position_order(ranking, order, templates, moved_only=form == "moved"))


def _annotation_pieces(
    ranking: Sequence[Block], templates: Templates, order: Sequence[Block] | None, form: Form, count: TokenCounter
) -> int:
    """:func:`annotation_tokens` as the sum of its pieces' tokens."""
    if form == "labels" or order is None:
        frame, joiner = templates.order, templates.order_joiner
        items = [templates.order_item.format(label=block.label) for block in ranking]
    elif form == "positions":  # any permutation has the same items
        frame, joiner = templates.position_order, templates.order_joiner
        items = [templates.position_item.format(position=p) for p in range(1, len(ranking) + 1)]
    else:
        frame, joiner = templates.moved_order, templates.moved_joiner
        position = {block.id: index for index, block in enumerate(order, 1)}
        items = [
            templates.moved_item.format(position=position[block.id], rank=rank)
            for rank, block in enumerate(ranking, 1)
            if position[block.id] != rank
        ]
    return count(frame.format(order="")) + sum(map(count, items)) + max(len(items) - 1, 0) * count(joiner)


@functools.lru_cache(maxsize=256)
def _position_chars(blocks: int, templates: Templates) -> int:
    """Characters of a ``positions`` annotation of this many blocks (any permutation)."""
    items = sum(len(templates.position_item.format(position=p)) for p in range(1, blocks + 1))
    return len(templates.position_order.format(order="")) + items + (blocks - 1) * len(templates.order_joiner)


def label_tokens(blocks: Sequence[Block], templates: Templates, count: TokenCounter = estimate_tokens) -> int:
    """Tokens the labels add to these blocks' prompt text (each label counted on its own,
    as each labelled block is a piece of the prompt)."""
    return sum(count(templates.block.format(label=block.label, text="")) for block in blocks)


Chance = Callable[[str | None, str], float]
"""That a later request carries ``key`` right after ``previous`` (None: in first place)."""


def leading_reuse(order: Sequence[str], tokens: Mapping[str, int], cached: int, chance: Chance) -> float:
    """Tokens of the leading run of ``order`` expected to be reused: its first ``cached``
    blocks (reused now) in full, then each block as much as the chance that a later
    request carries it and every block before it (a prefix cache reuses only a common
    prefix); the run ends where that chance is negligible."""
    return _reuse(order, tokens, cached, chance)[1]


def _reuse(order: Sequence[str], tokens: Mapping[str, int], cached: int, chance: Chance) -> tuple[int, float]:
    """(tokens reused now, :func:`leading_reuse`), in one pass: a hot path."""
    now = sum(map(tokens.__getitem__, order[:cached])) if cached else 0
    if isinstance(chance, Cooccurrence):  # the usual case, without a call per block
        return now, chance.carry(order, tokens, cached, float(now))
    total = float(now)
    carried = 1.0
    previous = order[cached - 1] if cached else None
    for key in order[cached:]:
        carried *= min(chance(previous, key), 1.0)
        if carried < _NEGLIGIBLE:
            break
        total += carried * tokens[key]
        previous = key
    return now, total


_NEGLIGIBLE = 1e-3


def block_key(block_id: str) -> str:
    """The index key of a block sent as its text alone: its id (one starting with NUL is
    escaped, so no user id is ever an internal key)."""
    return "\x00" + block_id if block_id.startswith("\x00") else block_id


def labelled_key(block_id: str) -> str:
    """The index key of a block sent with its label: another text, so never a prefix of
    the unlabelled block's (nor it of this)."""
    return LABELLED + block_id


def key_block(key: str) -> str:
    """The block id of an index key (the inverse of :func:`block_key`, :func:`labelled_key`
    and :func:`in_partition`)."""
    if key.startswith(PARTITIONED):
        key = key[key.index("\x00", len(PARTITIONED)) + 1 :]
    if key.startswith(LABELLED):
        return key[len(LABELLED) :]
    return key[1:] if key.startswith("\x00") else key


def plain_keys(order: Sequence[str], partition: str | None = None) -> list[str]:
    """Index keys of blocks sent as their text alone (in ``partition``: see :func:`in_partition`)."""
    if "\x00" not in "".join(order):  # the usual case, checked in C
        return in_partition(order, partition)
    return in_partition([block_key(key) for key in order], partition)


def key_blocks(keys: Sequence[str]) -> list[str]:
    """The block ids of index keys (:func:`key_block` of each)."""
    if "\x00" not in "".join(keys):
        return list(keys)
    return [key_block(key) for key in keys]


def labelled_keys(order: Sequence[str], partition: str | None = None) -> list[str]:
    return in_partition([LABELLED + key for key in order], partition)


def in_partition(keys: Sequence[str], partition: str | None) -> list[str]:
    """Index keys within a cache partition (:mod:`.partitions`): keys of one partition are
    never a prefix of another's, so no hit is ever predicted across partitions, in the
    index, the strategy's counts, the router's choice or the shared log. ``None``: the
    engine's default partition, keys unchanged."""
    if partition is None:
        return list(keys)
    head = f"{PARTITIONED}{partition}\x00"
    return [head + key for key in keys]


def index_keys(prepared: PreparedRequest) -> list[str]:
    """A request's send order as the index keys it (labelled blocks apart, in its partition)."""
    order = [block.id for block in prepared.blocks]
    return labelled_keys(order, prepared.partition) if prepared.labels else plain_keys(order, prepared.partition)


def choose_order(
    proposed: Sequence[str],
    retrieval: Sequence[str],
    tokens: Mapping[str, int],
    *,
    matched: Callable[[Sequence[str], bool], int],
    chance: Chance,
    annotation_cost: int,
    label_cost: int,
    form: Form = "positions",
    cache_tokens: int | None = None,
    page_tokens: int = 1,
    plain_ok: bool = True,
    kept: float = 1.0,
    budget: float = math.inf,
    retrieval_chance: Chance | None = None,
    prompt_tokens: int = 0,
    follow_cost: int = 0,
) -> Choice:
    """The send that pays best; ties go to the one that changes less.

    Outside a conversation (``plain_ok``) in the ``positions`` and ``moved`` forms: the
    retriever's order as a user sends it, or the strategy's order with the annotation. In
    the ``labels`` form: also the retriever's order labelled, and the strategy's order is
    labelled (plain blocks are another text, which later requests do not follow). In a
    conversation (not ``plain_ok``): labelled, in either order.

    Args:
        proposed, retrieval: the request's block ids, in the strategy's and the
            retriever's order.
        tokens: each id's tokens.
        matched: leading blocks of an order the engine is predicted to hold now, sent
            labelled (True) or as text alone (False).
        chance: that a later request carries a block right after another
            (:meth:`Cooccurrence.chance`, or sure for a batch partner).
        annotation_cost: tokens of the order annotation, if reordered.
        label_cost: tokens the labels add to the request.
        cache_tokens: the engine's cache size in tokens, if known.
        page_tokens: the engine's page in tokens (1: unknown); see :func:`page_margin`.
        kept: the share of what the index predicts cached that the engine really served
            (:meth:`Retention.share_or`): every reuse counts that much.
        budget: the most tokens a send may lose now for later reuse (:class:`Balance`:
            what earlier sends bought; unbounded for partners in a batch sent in order).
        retrieval_chance: ``chance`` for the retriever's order, where it differs (a batch's
            partners follow the planned order, not this one's).
        prompt_tokens: the rest of the prompt (the question): a request fits the cache
            with it, and with its labels and annotation.
        follow_cost: what a later request pays to line up with this one's prefix (about
            this one's annotation: it is most often reordered too), taken from the later
            reuse where no score keeps the bets honest (partners in a batch sent in order:
            a pair that each pay an annotation to share a prefix shorter than both costs
            the engine more). Online the score (:class:`Balance`) charges it when the
            follower goes out.
    """
    size = sum(map(tokens.__getitem__, retrieval)) + prompt_tokens if cache_tokens is not None else 0
    bets = budget > 0
    one_text = form != "labels" and plain_ok
    margin = page_margin(page_tokens)
    sends: list[tuple[Sequence[str], bool, Chance | None, int]] = []  # (order, labelled, chance ahead, cost)
    if plain_ok:  # as without ContextPilot
        sends.append((retrieval, False, (retrieval_chance or chance) if one_text else None, 0))
    if not one_text:  # labelled, in the retriever's order
        sends.append((retrieval, True, None if plain_ok else retrieval_chance or chance, label_cost))
    if list(proposed) != list(retrieval):
        sends.append((proposed, not one_text, chance, annotation_cost + (0 if one_text else label_cost)))
    values: list[tuple[float, float, int, bool]] = []  # (value, value now, reuse now, fits)
    for position, (order, labelled, ahead, cost) in enumerate(sends):
        fits = cache_tokens is None or size + cost <= cache_tokens  # else it leaves nothing cached
        now, reuse = _reuse(order, tokens, matched(order, labelled), ahead if ahead and fits and bets else _never)
        value = kept * reuse
        if follow_cost and value > kept * now:  # what the follower pays to line up
            value -= min(value - kept * now, follow_cost)
        if margin and position:  # every send but the first (the retriever's order, as it goes out)
            cost += margin
        values.append((value - cost, kept * now - cost, now, fits))
    paid_now = max(value[1] for value in values)
    best, pick = -math.inf, 0
    for position, (value, now_value, _, _) in enumerate(values):  # a bet loses at most the budget now
        if paid_now - now_value <= budget and value > best:
            best, pick = value, position
    order, labelled, _, _ = sends[pick]
    now_value, fits = values[pick][1], values[pick][3]
    if pick:
        now_value += margin  # a margin for the worst case, not tokens spent
    return Choice(list(order), labelled, fits, now_value - kept * values[0][2])  # not replace(): a hot path


def page_margin(page_tokens: int) -> int:
    """What page rounding can take from a send that is not the retriever's order, in tokens.

    An engine caches and reuses whole pages (SGLang ``--page-size``, vLLM ``--block-size``),
    so the reuse a send realizes is its cached prefix floored to a page: up to
    ``page_tokens - 1`` tokens less than its blocks' tokens say, while retrieval order's may
    come out whole. Where a page is not one token, a reordered or labelled send must beat
    retrieval order by more than that, or the reuse it buys on paper may buy nothing."""
    return max(page_tokens - 1, 0)


class Cooccurrence:
    """What this traffic has shown about later reuse: how often each block was sent, and
    how often a block came right after another in a send order. The chance that a later
    request carries a block in first place is ``n / (n + 1)`` after ``n`` sightings (none
    for a first sight); right after another block, the share of that block's sightings it
    followed. Bounded: past ``max_pairs`` pairs every count halves and zeros go (recent
    traffic weighs most). Not thread-safe: the pilot's lock guards it."""

    __slots__ = ("_follows", "_seen", "max_pairs")

    def __init__(self, max_pairs: int = 1_000_000) -> None:
        if max_pairs < 1:
            raise ValueError("max_pairs must be at least 1")
        self.max_pairs = max_pairs
        self._seen: dict[str, int] = {}
        self._follows: dict[tuple[str, str], int] = {}

    def chance(self, previous: str | None, key: str) -> float:
        if previous is None:
            n = self._seen.get(key, 0)
            return n / (n + 1)
        n = self._seen.get(previous, 0)
        return self._follows.get((previous, key), 0) / n if n else 0.0

    __call__ = chance  # a Cooccurrence is a Chance

    def carry(self, order: Sequence[str], tokens: Mapping[str, int], cached: int, total: float) -> float:
        """``total`` plus the later reuse of ``order`` after its first ``cached`` blocks, as
        :func:`leading_reuse` weighs it (this class's :meth:`chance`, inlined: a hot path)."""
        seen, follows = self._seen, self._follows
        carried = 1.0
        previous = order[cached - 1] if cached else None
        for key in order[cached:]:
            if previous is None:
                n = seen.get(key, 0)
                carried *= n / (n + 1)
            else:
                n = seen.get(previous, 0)
                carried *= follows.get((previous, key), 0) / n if n else 0.0  # a pair never outnumbers its first
            if carried < _NEGLIGIBLE:
                break
            total += carried * tokens[key]
            previous = key
        return total

    def record(self, order: Sequence[str], previous: str | None = None) -> None:
        """One request went out with its blocks in this order (``previous``: the block before
        them, when a long request is recorded in parts)."""
        seen, follows = self._seen, self._follows
        for key in order:
            seen[key] = seen.get(key, 0) + 1
            if previous is not None:
                pair = (previous, key)
                follows[pair] = follows.get(pair, 0) + 1
            previous = key
        if len(follows) > self.max_pairs or len(seen) > self.max_pairs:
            self._halve()

    def _halve(self) -> None:
        self._seen = {key: n >> 1 for key, n in self._seen.items() if n > 1}
        self._follows = {pair: n >> 1 for pair, n in self._follows.items() if n > 1}
        if len(self._follows) > self.max_pairs // 2:  # all seen twice or more: keep the top half
            ranked = sorted(self._follows.items(), key=lambda item: -item[1])
            self._follows = dict(ranked[: self.max_pairs // 2])

    def clear(self) -> None:
        self._seen, self._follows = {}, {}

    def __len__(self) -> int:
        return len(self._follows)


class Balance:
    """The score of the sends: tokens they reused beyond what retrieval order would have
    reused now, less the tokens their labels and annotations added, over a recent window
    (each entry's weight decays by ``decay`` per later request). Later reuse is paid from
    it: a bet on a prefix is repaid when a later request reuses that prefix beyond its own
    retriever's order. A bet is paid from what earlier sends bought (:attr:`budget`): at
    zero or below, the bets have not paid on this traffic, and only sends that pay now are
    made. Not thread-safe: the pilot's
    lock guards it."""

    __slots__ = ("decay", "value")

    def __init__(self, decay: float = 0.99) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.decay = decay
        self.value = 0.0

    def add(self, bought: float) -> None:
        """One request: ``bought`` tokens net (negative: it cost more than it bought now)."""
        self.value = self.value * self.decay + bought

    def correct(self, tokens: float) -> None:
        """The engine served ``tokens`` fewer (or more) cached tokens than predicted."""
        self.value += tokens

    @property
    def budget(self) -> float:
        """The most a send may lose now for later reuse: what the sends bought, if anything."""
        return max(self.value, 0.0)


class Retention:
    """The share of the cached tokens the index predicted that the engine reported serving,
    recent requests weighing most (each report's weight decays by ``decay`` per later
    report). An engine that keeps less than the index expects (llama-server with one slot
    keeps only its last prompt) brings it down, and with it the reuse that labels and
    reordering are paid for. Not thread-safe: the pilot's lock guards it."""

    __slots__ = ("_held", "_predicted", "decay")

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self.decay = decay
        self._held = self._predicted = 0.0

    def observe(self, predicted: int, held: int) -> None:
        """The engine served ``held`` of the ``predicted`` cached tokens of one request."""
        if predicted <= 0:
            return
        self._held = self._held * self.decay + min(max(held, 0), predicted)
        self._predicted = self._predicted * self.decay + predicted

    @property
    def tested(self) -> bool:
        """Whether the engine has reported on a prediction yet."""
        return self._predicted > 0.0

    def share_or(self, untested: float) -> float:
        """The share, or ``untested`` before the engine has reported on a prediction: 1.0
        where the index is all there is to go by, 0.0 where a bet cannot pay before then
        (a concurrent burst)."""
        return self._held / self._predicted if self._predicted else untested


LABELLED = "\x00labelled:"
"""Prefix of the index keys of labelled blocks (:func:`labelled_key`)."""

PARTITIONED = "\x00partition:"
"""Prefix of the index keys of a cache partition's blocks (:func:`in_partition`), before
the partition's name and a NUL (a partition name holds no control character)."""


def _never(_previous: str | None, _key: str) -> float:
    return 0.0
