"""Never worse than retrieval order: labels and reordering only where the reuse pays.

A prompt a user sends without ContextPilot carries its blocks in the retriever's order,
unlabelled, with no order annotation. ContextPilot adds a label to every block and, when it
reorders, the order annotation; both are prompt tokens the engine computes. So each request
goes out in the send that pays best, counting those tokens against the reuse it buys:
plain (as without ContextPilot), labelled in the retriever's order, or labelled in the
strategy's order with the annotation. Labelled and plain blocks are different text, so the
index keeps them apart (:func:`plain_keys`). The reuse counts the future as well as the
present:

- now: the leading blocks the engine is predicted to hold (the live index);
- later: a prefix that later requests may reuse. The canonical order puts blocks other
  requests carried first, so later requests carrying them follow the same prefix
  (measured on the bundled MultiHop-RAG sample, a gate on the immediate reuse alone
  lowered the online hit ratio, 25% capacity: 16.4% -> 15.8%). A prefix cache reuses only a
  common prefix, so each block counts as much as the chance that a later request carries
  it and every block before it: sure for a partner later in a batch sent in order; else
  ``recur``, the share of blocks that recur on this traffic, per block, for one that
  another request carried (and for the block after the run). On the sample nearly every
  block recurs, so labels pay; for a new pilot, or traffic where little recurs, a
  many-block bet is worth little and the request goes out plain.

Both count only as much as the engine has served what the index predicted
(:class:`Retention`, from the engine's cached-token reports): llama-server with one slot
keeps only its last prompt, and there labels and reordering soon stop being paid for.

A request larger than the engine's cache (when its size is known) can reuse what others
left cached but leaves nothing behind: only the reuse now counts, and it is not indexed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .annotations import Templates, render_order
from .blocks import CHARS_PER_TOKEN, Block
from .prepared import PreparedRequest

__all__ = [
    "PLAIN",
    "Choice",
    "Retention",
    "annotation_tokens",
    "choose_order",
    "index_keys",
    "label_tokens",
    "leading_reuse",
    "plain_keys",
]


@dataclass(frozen=True, slots=True)
class Choice:
    """The send order of one request and whether its blocks carry labels."""

    order: list[str]
    labels: bool = True
    cached: bool = True
    """Whether the engine will hold it afterwards (False: larger than its cache)."""


def _tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN) if text else 0  # rounded up: never under-count a cost


def annotation_tokens(ranking: Sequence[Block], templates: Templates) -> int:
    """Tokens of the order annotation for this ranking (about four characters a token)."""
    return _tokens(render_order(ranking, templates)) if ranking else 0


def label_tokens(blocks: Sequence[Block], templates: Templates) -> int:
    """Tokens the labels add to these blocks' prompt text."""
    return _tokens(" " * sum(len(templates.block.format(label=block.label, text="")) for block in blocks))


def leading_reuse(
    order: Sequence[str], tokens: Mapping[str, int], cached: int, chance: Callable[[str], float]
) -> float:
    """Tokens of the leading run of ``order`` expected to be reused: its first ``cached``
    blocks (reused now) in full, then each block a later request may carry too, weighed by
    the chance that a later request carries it and every block before it (a prefix cache
    reuses only a common prefix); the run ends at the first block with no chance."""
    return _leading_run(order, tokens, cached, chance)[1]


def _leading_run(
    order: Sequence[str], tokens: Mapping[str, int], cached: int, chance: Callable[[str], float]
) -> tuple[int, float, float]:
    """(blocks in the leading run, expected reused tokens, the chance a later request
    carries the whole run): see :func:`leading_reuse`."""
    total = 0.0
    carried = 1.0
    for position, key in enumerate(order):
        if position >= cached:
            weight = chance(key)
            if weight <= 0.0:
                return position, total, carried
            carried *= min(weight, 1.0)
        total += carried * tokens[key]
    return len(order), total, carried


def plain_keys(order: Sequence[str]) -> list[str]:
    """Index keys of blocks sent without labels: another text than the labelled blocks',
    so never a prefix of theirs (nor theirs of it)."""
    return [PLAIN + key for key in order]


def index_keys(prepared: PreparedRequest) -> list[str]:
    """A request's send order as the index keys it (labelled blocks by id, plain ones apart)."""
    order = [block.id for block in prepared.blocks]
    return order if prepared.labels else plain_keys(order)


def choose_order(
    proposed: Sequence[str],
    retrieval: Sequence[str],
    tokens: Mapping[str, int],
    *,
    matched: Callable[[Sequence[str], bool], int],
    shared: Callable[[str], float],
    annotation_cost: int,
    label_cost: int,
    cache_tokens: int | None = None,
    plain_ok: bool = True,
    recur: float = 1.0,
    kept: float = 1.0,
) -> Choice:
    """The send that pays best: the strategy's order (labelled, annotated if it differs), the
    retriever's order labelled, or (``plain_ok``) the retriever's order as a user sends it
    without ContextPilot. Ties go to the one that changes less.

    Args:
        proposed, retrieval: the request's block keys, in the strategy's and the
            retriever's order.
        tokens: each key's tokens.
        matched: leading blocks of an order the engine is predicted to hold now, sent
            labelled (True) or not (False).
        shared: the chance that a later request carries this block and reuses it (1.0: a
            request later in the same planned batch does; the ``recur`` share: another
            request carried it before; 0.0: none did).
        annotation_cost: tokens of the order annotation a reordered request carries.
        label_cost: tokens the labels add to the request.
        cache_tokens: the engine's cache size in tokens, if known.
        plain_ok: whether it may go without labels (not in a conversation, whose later
            turns refer to its blocks by label).
        recur: the chance that a block no other request carried yet will be carried by a
            later one (the share of blocks requested before, on this traffic): the block
            after the prefix's run counts that much more (times the run's own chance).
        kept: the share of what the index predicts cached that the engine really served
            (:meth:`Retention.share_or`): every reuse counts that much.
    """
    fits = cache_tokens is None or sum(tokens[key] for key in retrieval) + label_cost <= cache_tokens
    later = shared if fits else _never  # what it leaves cached pays off for later requests
    reordered = list(proposed) != list(retrieval)
    candidates: list[tuple[float, Choice]] = []
    if plain_ok:
        plain = kept * leading_reuse(retrieval, tokens, matched(retrieval, False), _never)
        candidates.append((plain, Choice(list(retrieval), labels=False, cached=fits)))
    if reordered:
        labelled = kept * leading_reuse(retrieval, tokens, matched(retrieval, True), _never) - label_cost
        candidates.append((labelled, Choice(list(retrieval), cached=fits)))
    run, reuse, carried = _leading_run(proposed, tokens, matched(proposed, True), later)  # now, then what recurs
    if fits and run < len(proposed):
        reuse += carried * recur * tokens[proposed[run]]
    ours = kept * reuse - label_cost - (annotation_cost if reordered else 0)
    candidates.append((ours, Choice(list(proposed), cached=fits)))
    best = max(value for value, _ in candidates)
    return next(choice for value, choice in candidates if value == best)


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


PLAIN = "\x00plain:"
"""Prefix of the index keys of blocks sent without labels (:func:`plain_keys`)."""


def _never(_: str) -> float:
    return 0.0
