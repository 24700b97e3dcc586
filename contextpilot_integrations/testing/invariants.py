"""The request-body audit: what the chat bodies sent to an engine break of the two invariants
a user cannot check (each location reference with its text in the same messages, one request
id per call). For tests and logs: :mod:`.audit` runs it after every test of the three suites;
the chat model classes prevent what it finds with
:func:`~contextpilot_integrations.pilot.binding.restore_references`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..core.annotations import (
    AMBIGUOUS,
    DEFAULT_TEMPLATES,
    Templates,
    quote_status,
    reference_pattern,
    reference_spans,
)

__all__ = ["dangling_references", "invariant_breaches", "message_texts"]


def dangling_references(texts: Sequence[str], templates: Templates = DEFAULT_TEMPLATES) -> list[str]:
    """The location references in ``texts`` (a request's messages, in order) that do not
    name exactly one text before them: what the model would be told to find but cannot,
    each as it names the block (``[label]``, or the quoted opening words). A quote counts as
    found only where a copy of a block begins with its words: where a line begins, outside
    reference sentences; it is named with :data:`~.annotations.AMBIGUOUS` appended where the
    words begin another text too, or occur inside one (another document, the question, the
    system prompt), in the messages up to the end of the one that holds the quote (what the
    model had read when that turn was sent; a later turn's blocks do not count against it).
    Copies are told apart by their first paragraph (up to the templates' separator): the
    block's own text is unknown here. An audit for tests and logs; the chat model classes
    prevent it with :func:`restore_references`."""
    by_label = reference_pattern(templates)
    by_quote = reference_pattern(templates, quote=True)
    block_head = templates.block.split("{text}")[0]
    joined = "\n".join(texts)
    dangling = [
        f"[{match.group(1)}]"
        for match in by_label.finditer(joined)
        if block_head.format(label=match.group(1)) not in joined[: match.start()]
    ]
    masks = [reference_spans(text, templates) for text in texts]
    for index, text in enumerate(texts):
        for match in by_quote.finditer(text):
            words = match.group(1)
            status = quote_status(texts[: index + 1], index, match.start(), words, templates, masks=masks)
            if status != "found":
                dangling.append(f'"{words}"' + (AMBIGUOUS if status == "ambiguous" else ""))
    return dangling


def message_texts(body: Mapping[str, Any]) -> list[str]:
    """The texts of a chat request body, in order: an OpenAI-style body's messages (the text
    parts of a message whose content is a list of parts), Anthropic's and Bedrock's shapes
    too (a top-level ``system``, the text inside ``tool_result`` / ``toolResult`` blocks),
    and Gemini's (``systemInstruction`` and ``contents``, each of ``parts``; a
    ``functionResponse``'s text values)."""
    texts = _part_texts(body.get("system"))
    for message in body.get("messages") or ():
        texts += _part_texts(message.get("content"))
    instruction = body.get("systemInstruction") or body.get("system_instruction")
    for content in [instruction, *(body.get("contents") or ())]:
        if isinstance(content, Mapping):
            texts += _part_texts(content.get("parts"))
    return texts


def _part_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts: list[str] = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, Mapping):
            inner = _inner_content(part)
            texts += _part_texts(inner) if inner is not None else [part.get("text", "")]
    return texts


def _inner_content(part: Mapping[str, Any]) -> Any:
    """What a tool's result part holds (Anthropic, Bedrock, Gemini); ``None`` for other parts."""
    if part.get("type") == "tool_result":
        return part.get("content")
    result = part.get("toolResult")
    if isinstance(result, Mapping):
        return result.get("content")
    response = part.get("functionResponse")
    if isinstance(response, Mapping) and isinstance(response.get("response"), Mapping):
        return [{"text": value} for value in response["response"].values() if isinstance(value, str)]
    return None


def invariant_breaches(bodies: Iterable[Mapping[str, Any]], templates: Templates = DEFAULT_TEMPLATES) -> list[str]:
    """What the chat request bodies sent to an engine break of the two invariants a user
    cannot check: a location reference whose block is not before it in the same messages,
    or a quote that names more than one text (:func:`dangling_references`), and a request
    id (``rid`` or ``request_id``) that more than one body sent. Empty when both hold. An
    audit for tests and logs."""
    breaches: list[str] = []
    ids: Counter[str] = Counter()
    for body in bodies:
        breaches += [
            f"reference to {name.removesuffix(AMBIGUOUS)} naming more than one text"
            if name.endswith(AMBIGUOUS)
            else f"reference to {name} without its text"
            for name in dangling_references(message_texts(body), templates)
        ]
        rid = body.get("rid") or body.get("request_id")
        if rid is not None:
            ids[str(rid)] += 1
    return breaches + [f"request id {rid!r} sent {count} times" for rid, count in ids.items() if count > 1]
