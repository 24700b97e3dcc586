"""LlamaIndex's pieces of the model-call protocol (the core's
:class:`~contextpilot_integrations.integration.model_call.ModelCall`).

Where a call's prepared request comes from (named by the chat engine, or left by the
postprocessor in the same query's span tree), the texts of LlamaIndex's messages (their text
blocks), and the usage of a raw answer (OpenAI-style or Anthropic-style). The protocol itself
is the core's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, TextBlock

from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.block_tokenizer import BlockTokenizer
from contextpilot_integrations.engines.feedback import EventTracker
from contextpilot_integrations.errors import EngineError
from contextpilot_integrations.integration.model_call import EngineUsage, MessageTexts, ModelCall
from contextpilot_integrations.pilot.binding import Binding

from . import _binding

BINDING_KWARG = "contextpilot_binding"
"""The chat engine names its prepared request to the LLM call explicitly."""


def bind(
    kwargs: dict[str, Any],
    messages: Sequence[ChatMessage],
    fields: Mapping[str, Any] | None = None,
    tracker: EventTracker | None = None,
) -> tuple[ModelCall, list[ChatMessage]]:
    """The call and its prepared request (named in ``kwargs``, taken out of them, else the
    query's), in the cache partition its body ``fields`` name, and the messages to send
    (every reference resolvable)."""
    binding = kwargs.pop(BINDING_KWARG, None)
    if binding is None:
        binding = _binding.take()
    call = ModelCall(binding, tracker=tracker, retake=_binding.failed)
    body = {**(fields or {}), **(kwargs.get("extra_body") or {}), **kwargs}
    return call, call.before(list(messages), MESSAGE_TEXTS, body)


def bind_prompt(
    kwargs: dict[str, Any], prompt: str, fields: Mapping[str, Any] | None = None, tracker: EventTracker | None = None
) -> tuple[ModelCall, str]:
    """:func:`bind` for a completion prompt."""
    call, messages = bind(kwargs, [ChatMessage(role="user", content=prompt)], fields, tracker)
    return call, messages[0].content or ""


def usage_of(raw: Any) -> tuple[int | None, int | None, list[int] | None]:
    """(prompt tokens, cached tokens, prompt token ids) of a raw answer or stream chunk:
    OpenAI-style (``prompt_tokens_details.cached_tokens``) or Anthropic-style
    (``cache_read_input_tokens``, input counted with cache reads and writes)."""
    if raw is None:
        return None, None, None
    data = raw if isinstance(raw, dict) else raw.model_dump() if hasattr(raw, "model_dump") else {}
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    try:
        ids = wire.input_ids(data, "the server")
    except EngineError:
        ids = None
    usage = usage or {}
    if "prompt_tokens" in usage:
        details = usage.get("prompt_tokens_details") or {}
        return usage.get("prompt_tokens"), details.get("cached_tokens") if isinstance(details, dict) else None, ids
    if "input_tokens" in usage:
        read = usage.get("cache_read_input_tokens") or 0
        written = usage.get("cache_creation_input_tokens") or 0
        return usage["input_tokens"] + read + written, read, ids
    return None, None, ids


def report(
    binding: Binding | None,
    raw: Any,
    *,
    usage_feedback: bool,
    tracker: EventTracker | None,
    ids: list[int] | None = None,
    tokenizer: BlockTokenizer | None = None,
) -> int | None:
    """The provider's counts to the request's pilot (:meth:`ModelCall.served`); returns the
    cached tokens read. ``tokenizer``: where each block ends in the prompt's token ids is found with it."""
    prompt, cached, found = usage_of(raw)
    if binding is not None and prompt is not None:
        usage = EngineUsage(prompt, cached, input_ids=ids or found)
        ModelCall(binding, tracker=tracker).served(usage, usage_feedback=usage_feedback, tokenizer=tokenizer, raw=raw)
    return cached


def _segments(messages: Sequence[ChatMessage]) -> tuple[list[str], list[tuple[int, int]]]:
    segments: list[str] = []
    places: list[tuple[int, int]] = []
    for index, message in enumerate(messages):
        for block_index, block in enumerate(message.blocks):
            if isinstance(block, TextBlock):
                segments.append(block.text)
                places.append((index, block_index))
    return segments, places


def _rebuilt(messages: list[ChatMessage], segments: list[str], places: list[tuple[int, int]]) -> list[ChatMessage]:
    """Copies of the messages whose texts changed (the caller's objects stay untouched)."""
    out = list(messages)
    for text, (index, block_index) in zip(segments, places, strict=True):
        message = out[index]
        block = message.blocks[block_index]
        if isinstance(block, TextBlock) and block.text != text:
            blocks = list(message.blocks)
            blocks[block_index] = TextBlock(text=text)
            out[index] = message.model_copy(update={"blocks": blocks})
    return out


MESSAGE_TEXTS: MessageTexts[ChatMessage, tuple[int, int]] = MessageTexts(_segments, _rebuilt)
"""LlamaIndex's messages as texts: their text blocks."""
