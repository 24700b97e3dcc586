"""What every LLM call of this package does around the provider's own call.

Before: take the prepared request (named by the chat engine, or left by the postprocessor
in the same query's span tree), put back the text of any location reference whose target
the messages do not carry, add the engine's request-id fields. After: the provider's token
counts (OpenAI-style or Anthropic-style raw usage) go to the request's pilot; a failure
makes the pilot forget it. Transport failures surface as the core's
:class:`EngineUnavailable`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, TextBlock

from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.block_tokenizer import BlockTokenizer
from contextpilot_integrations.engines.feedback import EventTracker, report_failed, report_served
from contextpilot_integrations.errors import EngineError, as_engine_error
from contextpilot_integrations.pilot.binding import Binding, checked_for_sending, partitioned
from contextpilot_integrations.pilot.telemetry import record_model_call

from . import _binding

BINDING_KWARG = "contextpilot_binding"
"""The chat engine names its prepared request to the LLM call explicitly."""


def bind(
    kwargs: dict[str, Any], messages: Sequence[ChatMessage], fields: Mapping[str, Any] | None = None
) -> tuple[Binding | None, list[ChatMessage]]:
    """The call's prepared request (in the cache partition its body ``fields`` name), and the
    messages to send (every reference resolvable)."""
    binding = kwargs.pop(BINDING_KWARG, None)
    if binding is None:
        binding = _binding.take()
    binding = partitioned(binding, {**(fields or {}), **(kwargs.get("extra_body") or {}), **kwargs})
    messages = list(messages)
    if binding is None:
        return None, messages
    segments, places = _segments(messages)
    binding = checked_for_sending(binding, segments)
    return binding, _rebuilt(messages, segments, places)


def bind_prompt(
    kwargs: dict[str, Any], prompt: str, fields: Mapping[str, Any] | None = None
) -> tuple[Binding | None, str]:
    """:func:`bind` for a completion prompt."""
    binding, messages = bind(kwargs, [ChatMessage(role="user", content=prompt)], fields)
    return binding, messages[0].content or ""


def request_id(binding: Binding | None) -> str:
    return binding.prepared.request_id if binding is not None else f"cp-{uuid.uuid4().hex}"


def id_fields(engine: str | None, rid: str, extra_body: dict[str, Any] | None, prompt_ids: bool) -> dict[str, Any]:
    """The request body's ``extra_body``: the id fields of ``engine``, and the prompt ids ask."""
    extra = dict(extra_body or {})
    for name in wire.REQUEST_ID_FIELDS.get(engine or "", ()):
        extra[name] = rid
    if prompt_ids:
        extra.update(wire.PROMPT_IDS_REQUEST.get(engine or "", {}))
    return extra


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
    """The provider's counts to the request's pilot; returns the cached tokens read.
    ``tokenizer``: where each block ends in the prompt's token ids is found with it."""
    prompt, cached, found = usage_of(raw)
    prompt_ids = ids or found
    if binding is not None and prompt is not None:
        ends = tokenizer.block_ends(binding.prepared, prompt_ids) if tokenizer is not None and prompt_ids else None
        report_served(
            binding.pilot,
            binding.prepared,
            prompt,
            cached,
            before_tokens=binding.before_tokens,
            usage_feedback=usage_feedback,
            tracker=tracker,
            input_ids=prompt_ids,
            block_ends=ends,
        )
        record_model_call(binding.prepared, raw, input_tokens=prompt, cache_read_tokens=cached)  # [otel] extra
    return cached


def failed(binding: Binding | None, tracker: EventTracker | None) -> None:
    if binding is not None:
        report_failed(binding.pilot, binding.prepared, tracker)
        _binding.failed(binding)


def typed(exc: BaseException, where: str) -> BaseException:
    """A connection that failed or broke mid-answer, as the core's :class:`EngineUnavailable`."""
    return as_engine_error(exc, where)


def reraise(error: BaseException, original: BaseException) -> Any:
    if error is original:
        raise original
    raise error from original


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
