"""Prompt text: block rendering, the order annotation and location references.

Why annotations: reordering for cache reuse changes the order the model reads, and
de-duplication removes blocks it already saw. The paper (§5.3, §6) restores both pieces of
information in plain words after the blocks, where they do not disturb the shared prefix.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator

from .blocks import Block

__all__ = [
    "AMBIGUOUS",
    "Templates",
    "begins_line",
    "first_paragraph",
    "opening",
    "openings",
    "parse_order_annotation",
    "quote_status",
    "reference_pattern",
    "reference_spans",
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
    it by): the block's first words (:data:`QUOTE_LENGTHS`), found verbatim in that turn,
    and nowhere else in the messages (:func:`quote_status`)."""
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


def render_reference(
    block: Block, templates: Templates = DEFAULT_TEMPLATES, labelled: bool = True, words: str | None = None
) -> str:
    """The location annotation that replaces a block sent in an earlier turn: by its label
    where that turn sent it labelled, else by quoting its opening ``words`` (default: its
    first :data:`QUOTE_WORDS`, :func:`opening`)."""
    if labelled:
        return templates.reference.format(label=block.label)
    return templates.quote_reference.format(opening=opening(block.text) if words is None else words)


_WORD = re.compile(r"\S+")
QUOTE_WORDS, QUOTE_CHARS = 4, 40
"""How much of a block a quote reference names: its first words, few enough to cost little
and enough to tell a conversation's blocks apart, cut at a number of characters (text
without spaces, one long word)."""
QUOTE_LENGTHS = ((QUOTE_WORDS, QUOTE_CHARS), (8, 80), (16, 160))
"""The quotes tried, shortest first, (words, characters): a block is quoted with the first
whose words name it alone (:func:`quote_status`), so a longer quote only where a shorter
one's words occur in another text too (openings that begin alike, boilerplate, text without
spaces); where none does, the block is sent in full."""
QUOTE_MAX_CHARS = QUOTE_LENGTHS[-1][1]


def opening(text: str, words: int = QUOTE_WORDS, chars: int = QUOTE_CHARS) -> str:
    """The first ``words`` words of ``text``, at most ``chars`` characters, verbatim (so
    they are found in any copy of it)."""
    matches = list(itertools.islice(_WORD.finditer(text), words))
    if not matches:
        return ""
    start = matches[0].start()
    return text[start : min(matches[-1].end(), start + chars)]


def openings(text: str) -> list[str]:
    """The quotes of ``text`` :data:`QUOTE_LENGTHS` allows, shortest first, each longer than
    the one before (a short text has fewer)."""
    out: list[str] = []
    for words, chars in QUOTE_LENGTHS:
        quote = opening(text, words, chars)
        if quote and (not out or len(quote) > len(out[-1])):
            out.append(quote)
    return out


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


# ---- a quote reference names exactly one text ----------------------------------------------------------
AMBIGUOUS = " (names more than one text)"
"""What :func:`~contextpilot_integrations.testing.invariants.dangling_references` appends to a
quote that the messages carry, but not as one text alone."""

QuoteStatus = Literal["found", "dangling", "ambiguous"]


@functools.lru_cache(maxsize=64)
def _patterns(label_reference: str, quote_reference: str) -> tuple[re.Pattern[str], re.Pattern[str]]:
    head, _, tail = label_reference.partition("{label}")
    by_label = re.compile(re.escape(head) + r"(.+?)" + re.escape(tail))
    head, _, tail = quote_reference.partition("{opening}")
    # a quote is at most QUOTE_MAX_CHARS characters: it never spans what lies between a
    # document's stray "Please refer to" and a later reference's end
    by_quote = re.compile(re.escape(head) + rf"(.{{1,{QUOTE_MAX_CHARS}}}?)" + re.escape(tail), re.DOTALL)
    return by_label, by_quote


def reference_pattern(templates: Templates = DEFAULT_TEMPLATES, quote: bool = False) -> re.Pattern[str]:
    """The location reference sentence (``quote``: the one quoting an opening), the label or
    the opening words as its group 1."""
    return _patterns(templates.reference, templates.quote_reference)[1 if quote else 0]


def reference_spans(text: str, templates: Templates = DEFAULT_TEMPLATES) -> list[tuple[int, int]]:
    """Where ``text`` holds a reference sentence (by label or by quote): no copy of a block."""
    by_label, by_quote = _patterns(templates.reference, templates.quote_reference)
    return sorted([m.span() for m in by_label.finditer(text)] + [m.span() for m in by_quote.finditer(text)])


def begins_line(text: str, position: int) -> bool:
    """Whether ``position`` begins a line of ``text`` (only spaces before it on its line):
    where a block's copy begins in a prompt, blocks being rendered a paragraph each."""
    start = text.rfind("\n", 0, position) + 1
    return start == position or text[start:position].isspace()


def _occurrences(text: str, words: str, masks: Sequence[tuple[int, int]]) -> list[int]:
    """Where ``words`` occur in ``text``, outside reference sentences (``masks``)."""
    found = []
    at = text.find(words)
    while at != -1:
        end = at + len(words)
        if not any(start <= at and end <= stop for start, stop in masks):
            found.append(at)
        at = text.find(words, at + 1)
    return found


def _paragraph_end(text: str, start: int, separator: str) -> int:
    end = text.find(separator, start) if separator else -1
    return len(text) if end == -1 else end


def first_paragraph(text: str, words: str, separator: str) -> int:
    """Where the first paragraph of a block's ``text`` that begins with ``words`` (its opening)
    ends: the only part of it where the words may occur again."""
    return _paragraph_end(text, text.find(words) + len(words), separator)


def quote_status(
    texts: Sequence[str],
    index: int,
    position: int,
    words: str,
    templates: Templates = DEFAULT_TEMPLATES,
    target: str | None = None,
    masks: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> QuoteStatus:
    """Whether the quote of ``words`` at ``texts[index][position]`` names exactly one text.

    The rule: outside reference sentences, every occurrence of the quoted words in ``texts``
    is where a line begins and a copy of one text begins with them, or inside the first
    paragraph of such a copy (up to the template's separator: blocks are rendered a
    paragraph each); all such copies are the same text; and one of them comes before the
    quote. ``"dangling"``: no copy before it; ``"ambiguous"``: the words begin another text
    too, or occur inside one (another document, the question, the system prompt).

    Without ``target`` (the audit: only the messages are known), copies are told apart by
    their first paragraph. With ``target`` (the quoted block's text, where messages leave),
    each occurrence must also lie in the first paragraph of a copy of that very text, so two
    texts that share a first paragraph are told apart too.

    ``texts``: the messages the quote is judged in (the audit: up to the end of the one that
    holds it; where a request leaves: all of them). ``masks``: each text's
    :func:`reference_spans`, when the caller has them.
    """
    separator = templates.separator
    masks = masks if masks is not None else [reference_spans(text, templates) for text in texts]
    paragraphs: set[str] = set()
    before = stray = False
    reach = first_paragraph(target, words, separator) - target.find(words) if target is not None else 0
    for number, text in enumerate(texts):
        extent = -1  # the end of the first paragraph of the copy the occurrences lie in
        copies: list[int] | None = None
        for at in _occurrences(text, words, masks[number]):
            if target is not None:
                copies = _copies(text, target, words) if copies is None else copies
                if not any(start <= at and at + len(words) <= start + reach for start in copies):
                    stray = True  # not in the first paragraph of a copy of the very text quoted
                    continue
            if at < extent:
                continue  # inside the first paragraph of a copy begun above
            if not begins_line(text, at):
                stray = True  # inside another text
                continue
            extent = _paragraph_end(text, at + len(words), separator)
            paragraphs.add(text[at:extent])
            before = before or number < index or (number == index and at < position)
    if not before:
        return "dangling"
    return "ambiguous" if stray or len(paragraphs) > 1 else "found"


def _copies(text: str, target: str, words: str) -> list[int]:
    """Where copies of ``target`` begin in ``text``, as the position of their ``words``."""
    lead = target.find(words)
    found = []
    at = text.find(target)
    while at != -1:
        found.append(at + lead)
        at = text.find(target, at + 1)
    return found
