"""Never worse than retrieval order: reorder only when the reuse pays for what it adds.

A prompt a user sends without ContextPilot carries its blocks in the retriever's order,
unlabelled, with no order annotation. ContextPilot adds a label to every block and, when it
reorders, the order annotation; both are prompt tokens the engine computes. So a request
is reordered only when the reuse the new order buys exceeds the annotation's tokens, and
that reuse counts the future as well as the present:

- now: the leading blocks the engine is predicted to hold (the live index);
- later: the leading blocks other requests carried too (popularity >= 2). The canonical
  order puts them first, so later requests carrying them follow the same prefix: measured
  on the bundled MultiHop-RAG sample, a gate on the immediate reuse alone lowered the
  online hit ratio (25% capacity: 16.4% -> 15.8%).

A request larger than the engine's cache (when its size is known) can reuse what others
left cached but leaves nothing behind: only the reuse now counts, and where even that does
not pay for the labels it goes out exactly as without ContextPilot (retriever's order, no
labels, no annotation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .annotations import Templates, render_block, render_order
from .blocks import CHARS_PER_TOKEN, Block

__all__ = ["Choice", "annotation_tokens", "choose_order", "label_tokens", "leading_reuse"]


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
    extra = sum(len(render_block(block, templates)) - len(block.text) for block in blocks)
    return _tokens(" " * max(extra, 0))


def leading_reuse(order: Sequence[str], tokens: Mapping[str, int], cached: int, shared: Callable[[str], bool]) -> int:
    """Tokens of the leading run of ``order`` that is reused now (its first ``cached``
    blocks) or later (blocks other requests carry too)."""
    total = 0
    for position, key in enumerate(order):
        if position >= cached and not shared(key):
            break
        total += tokens[key]
    return total


def choose_order(
    proposed: Sequence[str],
    retrieval: Sequence[str],
    tokens: Mapping[str, int],
    *,
    cached: Callable[[Sequence[str]], int],
    shared: Callable[[str], bool],
    annotation_cost: int,
    label_cost: int,
    cache_tokens: int | None = None,
) -> Choice:
    """The strategy's ``proposed`` order if it pays, else the retriever's.

    Args:
        proposed, retrieval: the request's block keys, in the strategy's and the
            retriever's order.
        tokens: each key's tokens.
        cached: leading blocks of an order the engine is predicted to hold now.
        shared: whether another request carried this block too.
        annotation_cost: tokens of the order annotation a reordered request carries.
        label_cost: tokens the labels add to the request.
        cache_tokens: the engine's cache size in tokens, if known.
    """
    fits = cache_tokens is None or sum(tokens[key] for key in retrieval) + label_cost <= cache_tokens
    kept = leading_reuse(retrieval, tokens, cached(retrieval), _never)
    if list(proposed) != list(retrieval):
        gain = leading_reuse(proposed, tokens, cached(proposed), shared if fits else _never) - kept
        if gain > annotation_cost:
            return Choice(list(proposed), cached=fits)
    if not fits and kept <= label_cost:  # nothing to leave behind, too little to reuse
        return Choice(list(retrieval), labels=False, cached=False)
    return Choice(list(retrieval), cached=fits)


def _never(_: str) -> bool:
    return False
