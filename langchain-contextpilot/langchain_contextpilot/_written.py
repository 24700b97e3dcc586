"""Documents kept in full in a graph's or an agent's state, referred to only as they leave.

A node or a tool result that a graph keeps in its state cannot know what the model will be
sent: a later node may trim, summarize or remove the turn a reference points to. So the
state holds every document in full, with the spans of those an earlier turn carries
(``additional_kwargs[REFERENCES_KEY]``); where messages leave for the model, each such span
becomes its location reference only if the very messages sent carry its text before it.
Whatever rewrote the state, no reference leaves without its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage

from contextpilot_integrations import PreparedRequest, Reference, content_id
from contextpilot_integrations.core.annotations import quote_status, reference_pattern
from contextpilot_integrations.pilot.binding import Binding

from .cache_markers import part_text, parts_of

__all__ = ["REFERENCES_KEY", "REQUEST_KEY", "TURN_KEY", "as_sent", "newest_written", "note_written", "written_out"]

TURN_KEY = "contextpilot_turn"
"""Where a message written by this package records its conversation turn (``additional_kwargs``)."""
REQUEST_KEY = "contextpilot_request"
"""Where such a message records its prepared request's id (``additional_kwargs``)."""
REFERENCES_KEY = "contextpilot_references"
"""Where such a message records its documents that may go out as references
(``additional_kwargs``): ``[reference text, start, end, digest of content[start:end]]``."""


def written_out(prepared: PreparedRequest, include_question: bool = False) -> tuple[str, list[list[Any]]]:
    """The request's text with every document in full (what the state keeps), and where each
    document that an earlier turn carries sits in it: ``[reference text, start, end,
    digest]``. With every such document replaced by its reference, the text is
    ``prepared.render(include_question)``."""
    templates = prepared.templates
    pieces: list[str] = []
    spans: list[list[Any]] = []
    length = 0
    parts = [
        (prepared.rendered(part.block), part.text) if isinstance(part, Reference) else (prepared.rendered(part), None)
        for part in prepared.sequence
    ]
    tail = [prepared.order_annotation]
    if include_question:
        tail.append(templates.question.format(query=prepared.query))
    for text, reference in [*parts, *((text, None) for text in tail if text)]:
        length += len(templates.separator) if pieces else 0
        if reference is not None:
            spans.append([reference, length, length + len(text), content_id(text)])
        pieces.append(text)
        length += len(text)
    return templates.separator.join(pieces), spans


def as_sent(messages: Sequence[BaseMessage]) -> tuple[list[BaseMessage], dict[str, list[str]]]:
    """The messages as they leave for the model: in each message written by this package, a
    document that an earlier message *of these very messages* carries in full becomes its
    location reference; any other stays in full. Returns copies where that changed a
    message, and per written message (its request id) the reference texts left in full."""
    out = list(messages)
    written: dict[str, list[str]] = {}
    before: list[str] = []  # the texts sent ahead of the message at hand
    for index, message in enumerate(out):
        spans = message.additional_kwargs.get(REFERENCES_KEY)
        content = message.content
        if spans and isinstance(content, str):
            pieces: list[str] = []
            cursor = 0
            for reference, start, end, digest in sorted(spans, key=lambda span: span[1]):
                target = content[start:end]
                if start < cursor or content_id(target) != digest:  # the text was edited since: leave it
                    continue
                if any(target in text for text in before) and _names_one(
                    before, [*pieces, content[cursor:start]], reference, content[end:]
                ):
                    pieces += [content[cursor:start], reference]
                    cursor = end
                else:
                    written.setdefault(str(message.additional_kwargs.get(REQUEST_KEY)), []).append(reference)
            if cursor:
                out[index] = message.model_copy(update={"content": "".join([*pieces, content[cursor:]])})
        before += _texts(out[index])
    return out, written


def note_written(binding: Binding, written: dict[str, list[str]], key: str | None) -> None:
    """Tell the bound request's pilot which of its references went out in full after all
    (``key``: the request id its written message records; a retry sends it under another)."""
    full = written.get(key) if key is not None else None
    if full:
        binding.pilot.note_restored(
            binding.prepared, [ref.block.id for ref in binding.prepared.references if ref.text in full]
        )


def newest_written(messages: Sequence[BaseMessage]) -> str | None:
    """The request id the newest message written by this package records (the call's own)."""
    for message in reversed(messages):
        rid = message.additional_kwargs.get(REQUEST_KEY)
        if isinstance(rid, str):
            return rid
    return None


_QUOTE = reference_pattern(quote=True)


def _names_one(before: list[str], head: list[str], reference: str, rest: str) -> bool:
    """Whether ``reference``, placed after ``head`` (this message so far), names exactly one
    text: a quote's words may not begin or lie inside another text of what is sent (a
    summary put before it, say); a label reference is found by its label."""
    match = _QUOTE.search(reference)
    if match is None:
        return True
    lead = "".join(head)
    text = lead + reference + rest
    return quote_status([*before, text], len(before), len(lead) + match.start(), match.group(1)) == "found"


def _texts(message: BaseMessage) -> list[str]:
    return [text for part in parts_of(message) if (text := part_text(part)) is not None]
