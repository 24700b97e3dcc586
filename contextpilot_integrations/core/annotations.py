"""Prompt text: block rendering, the order annotation and location references.

Why annotations: reordering for cache reuse changes the order the model reads, and
de-duplication removes blocks it already saw. The paper (§5.3, §6) restores both pieces of
information in plain words after the blocks, where they do not disturb the shared prefix.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, model_validator

from .blocks import Block

__all__ = [
    "Templates",
    "opening",
    "parse_order_annotation",
    "render_block",
    "render_position_order",
    "render_reference",
]


class Templates(BaseModel):
    """The strings used to render a prepared request (all configurable).

    Placeholders: ``{label}`` and ``{text}`` in ``block``; ``{label}`` in ``reference``
    and ``order_item``; ``{opening}`` in ``quote_reference``; ``{order}`` in ``order``;
    ``{query}`` in ``question``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    block: str = "[{label}] {text}"
    separator: str = "\n\n"
    reference: str = "Please refer to [{label}] in the previous conversation."
    quote_reference: str = 'Please refer to "{opening}…" in the previous conversation.'
    """The reference to a block an earlier turn sent as its text alone (no label to name
    it by): the block's first :data:`QUOTE_WORDS` words, found verbatim in that turn."""
    order: str = "Context in priority order: {order}."
    order_item: str = "[{label}]"
    order_joiner: str = " > "
    question: str = "Question: {query}"
    position_order: str = "Context in priority order, by position: {order}."
    """The ranking by position in the prompt (blocks sent as their text alone)."""
    position_item: str = "#{position}"
    moved_order: str = "Context out of priority order: {order}; the rest as shown."
    """Only the blocks whose position is not their rank (the ``moved`` form)."""
    moved_item: str = "#{position} ranks {rank}"
    moved_joiner: str = ", "

    @model_validator(mode="after")
    def _check_placeholders(self) -> Templates:
        required = {
            "block": ("{label}", "{text}"),
            "reference": ("{label}",),
            "quote_reference": ("{opening}",),
            "order": ("{order}",),
            "order_item": ("{label}",),
            "question": ("{query}",),
            "position_order": ("{order}",),
            "position_item": ("{position}",),
            "moved_order": ("{order}",),
            "moved_item": ("{position}", "{rank}"),
        }
        for name, placeholders in required.items():
            value = getattr(self, name)
            for placeholder in placeholders:
                if placeholder not in value:
                    raise ValueError(f"template {name!r} must contain {placeholder}")
        return self


DEFAULT_TEMPLATES = Templates()


def render_block(block: Block, templates: Templates = DEFAULT_TEMPLATES, labelled: bool = True) -> str:
    """A block's prompt text. Depends on the block alone, so prefixes stay byte-identical;
    unlabelled, the text alone (the prompt a user sends without ContextPilot)."""
    return templates.block.format(label=block.label, text=block.text) if labelled else block.text


def render_reference(block: Block, templates: Templates = DEFAULT_TEMPLATES, labelled: bool = True) -> str:
    """The location annotation that replaces a block sent in an earlier turn: by its label
    where that turn sent it labelled, else by quoting its opening words."""
    if labelled:
        return templates.reference.format(label=block.label)
    return templates.quote_reference.format(opening=opening(block.text))


_WORD = re.compile(r"\S+")
QUOTE_WORDS, QUOTE_CHARS = 4, 40
"""How much of a block a quote reference names: its first words, few enough to cost little
and enough to tell a conversation's blocks apart (two that begin alike are never quoted),
cut at a number of characters (text without spaces, one long word)."""


def opening(text: str, words: int = QUOTE_WORDS, chars: int = QUOTE_CHARS) -> str:
    """The first ``words`` words of ``text``, at most ``chars`` characters, verbatim (so
    they are found in any copy of it)."""
    matches = list(itertools.islice(_WORD.finditer(text), words))
    if not matches:
        return ""
    start = matches[0].start()
    return text[start : min(matches[-1].end(), start + chars)]


def render_order(ranking: Sequence[Block], templates: Templates = DEFAULT_TEMPLATES) -> str:
    """The order annotation: the retriever's ranking, restated by label."""
    items = templates.order_joiner.join(templates.order_item.format(label=block.label) for block in ranking)
    return templates.order.format(order=items)


def render_position_order(
    ranking: Sequence[Block], order: Sequence[Block], templates: Templates = DEFAULT_TEMPLATES, moved_only: bool = False
) -> str:
    """The order annotation for blocks sent as their text alone: the retriever's ranking
    restated by each block's position in the prompt (1 = first shown); ``moved_only``:
    only the blocks whose position is not their rank, the rest read as shown."""
    position = {block.id: index for index, block in enumerate(order, 1)}
    if moved_only:
        items = templates.moved_joiner.join(
            templates.moved_item.format(position=position[block.id], rank=rank)
            for rank, block in enumerate(ranking, 1)
            if position[block.id] != rank
        )
        return templates.moved_order.format(order=items)
    items = templates.order_joiner.join(templates.position_item.format(position=position[b.id]) for b in ranking)
    return templates.position_order.format(order=items)


def parse_order_annotation(text: str, templates: Templates = DEFAULT_TEMPLATES) -> list[str]:
    """The labels of an order annotation, best first (the inverse of rendering it)."""
    prefix, _, _ = templates.order_item.partition("{label}")
    _, _, suffix = templates.order_item.partition("{label}")
    pattern = re.escape(prefix) + r"(.+?)" + re.escape(suffix)
    head, _, tail = templates.order.partition("{order}")
    body = text
    if head and body.startswith(head):
        body = body[len(head) :]
    if tail and body.endswith(tail):
        body = body[: -len(tail)]
    return [
        re.fullmatch(pattern, part).group(1)  # type: ignore[union-attr]
        for part in body.split(templates.order_joiner)
        if re.fullmatch(pattern, part)
    ]
