"""What every model call of this package does around the provider's own call.

Before: take the prepared request of this invocation (or the one named explicitly), put
back the text of any location reference whose target the messages do not carry, and add
the engine's request-id fields. After: the engine's token counts go to the request's
pilot; a failure makes the pilot forget the request (and lets a retry take it again).
Transport failures surface as the core's :class:`EngineUnavailable`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.runnables import ensure_config

from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.block_tokenizer import BlockTokenizer
from contextpilot_integrations.engines.feedback import EventTracker, report_failed, report_served
from contextpilot_integrations.errors import as_engine_error
from contextpilot_integrations.pilot.binding import Binding, checked_for_sending
from contextpilot_integrations.pilot.telemetry import record_model_call

from . import _binding
from ._written import as_sent, newest_written, note_written
from .cache_markers import _part_text

BINDING_KWARG = "_contextpilot_binding"
"""A routed call names its request to the target's model explicitly."""
PROMPT_IDS_KEY = "prompt_token_ids"
BLOCK_ENDS_KEY = "block_ends"


def bind(
    run_manager: Any, kwargs: dict[str, Any], messages: Sequence[BaseMessage]
) -> tuple[Binding | None, list[BaseMessage]]:
    """The call's prepared request, and the messages to send (every reference resolvable)."""
    binding = kwargs.pop(BINDING_KWARG, None)
    if binding is None:
        # a model's stream() calls _stream without its run manager: the run's config is in context
        binding = _binding.take(run_manager if run_manager is not None else ensure_config().get("callbacks"))
    messages, written = as_sent(messages)  # documents kept in full in a graph's state: referred to here
    if binding is None:
        return None, messages
    return sendable(binding, messages, written, newest_written(messages))


def sendable(
    binding: Binding, messages: list[BaseMessage], written: dict[str, list[str]], key: str | None
) -> tuple[Binding, list[BaseMessage]]:
    """Where messages leave (after :func:`~._written.as_sent`): the pilot told which of the
    request's references went out in full (``key``: the request id its written message
    records), every reference left resolvable, and the binding located in the messages."""
    note_written(binding, written, key)
    segments, places = _segments(messages)
    binding = checked_for_sending(binding, segments)
    return binding, _rebuilt(messages, segments, places)


def with_ids(
    engine: str | None,
    binding: Binding | None,
    kwargs: dict[str, Any],
    extra_body: dict[str, Any] | None,
    prompt_ids: bool,
) -> dict[str, Any]:
    """``kwargs`` plus the body fields that carry the request id (a fresh one when unbound)."""
    fields = wire.REQUEST_ID_FIELDS.get(engine or "", ())
    if not fields and not prompt_ids:
        return kwargs
    rid = binding.prepared.request_id if binding is not None else f"cp-{uuid.uuid4().hex}"
    extra = {**(extra_body or {}), **(kwargs.get("extra_body") or {})}
    for name in fields:
        extra[name] = rid
    if prompt_ids:
        extra.update(wire.PROMPT_IDS_REQUEST.get(engine or "", {}))
    return {**kwargs, "extra_body": extra}


def block_ends(tokenizer: BlockTokenizer | None, binding: Binding | None, message: Any) -> list[int] | None:
    """Where each block of the request ends in the prompt's token ids the engine returned
    (the core client's :class:`BlockTokenizer`: each distinct block tokenized once by the
    engine), recorded in the message's ``response_metadata["block_ends"]``. ``None`` when
    unknown: the conservative mapping."""
    metadata = getattr(message, "response_metadata", None)
    ids = (metadata or {}).get(PROMPT_IDS_KEY)
    if tokenizer is None or binding is None or not ids:
        return None
    ends = tokenizer.block_ends(binding.prepared, ids)
    if ends is not None and isinstance(metadata, dict):
        metadata[BLOCK_ENDS_KEY] = list(ends)
    return ends


def report(
    binding: Binding | None,
    message: Any,
    *,
    usage_feedback: bool,
    tracker: EventTracker | None,
    block_ends: list[int] | None = None,
    chat_model: Any = None,
) -> None:
    """The engine's counts (LangChain's standard ``usage_metadata``) to the request's pilot, and an
    OpenTelemetry span of the call (the ``[otel]`` extra; ``chat_model``: the provider's model, which
    names the model and provider where the message does not yet)."""
    if binding is None or message is None:
        return
    usage = getattr(message, "usage_metadata", None) or {}
    details = usage.get("input_token_details") or {}
    metadata = getattr(message, "response_metadata", None) or {}
    ids = metadata.get(PROMPT_IDS_KEY)
    model, provider = _described(chat_model, metadata)
    record_model_call(
        binding.prepared,
        model=model,
        provider=provider,
        input_tokens=usage.get("input_tokens"),
        output_tokens=usage.get("output_tokens"),
        cache_read_tokens=details.get("cache_read"),
        cache_write_tokens=details.get("cache_creation"),
    )
    report_served(
        binding.pilot,
        binding.prepared,
        usage.get("input_tokens"),
        details.get("cache_read"),
        before_tokens=binding.before_tokens,
        usage_feedback=usage_feedback,
        tracker=tracker,
        input_ids=ids,
        block_ends=block_ends,
    )


def _described(chat_model: Any, metadata: dict[str, Any]) -> tuple[str | None, str | None]:
    """(model, provider) of a call: the answer's metadata, else what the chat model tells LangSmith
    (a message from the provider's ``_generate`` has not been given its ``model_name`` yet)."""
    model, provider = metadata.get("model_name") or metadata.get("model"), metadata.get("model_provider")
    if (model is None or provider is None) and chat_model is not None:
        try:
            params = chat_model._get_ls_params()
        except Exception:  # a model that cannot describe itself: a span without its name
            params = {}
        model, provider = model or params.get("ls_model_name"), provider or params.get("ls_provider")
    return model, provider


def failed(run_manager: Any, binding: Binding | None, tracker: EventTracker | None) -> None:
    if binding is not None:
        report_failed(binding.pilot, binding.prepared, tracker)
        _binding.failed(run_manager, binding)


def typed(exc: BaseException, where: str) -> BaseException:
    """A connection that failed or broke mid-answer, as the core's :class:`EngineUnavailable`."""
    return as_engine_error(exc, where)


def _segments(messages: Sequence[BaseMessage]) -> tuple[list[str], list[tuple[int, int | None]]]:
    """Every text of the messages in order, and where each came from (message, content part)."""
    segments: list[str] = []
    places: list[tuple[int, int | None]] = []
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, str):
            segments.append(content)
            places.append((index, None))
            continue
        for part_index, part in enumerate(content):
            text = _part_text(part)
            if text is not None:
                segments.append(text)
                places.append((index, part_index))
    return segments, places


def _rebuilt(
    messages: list[BaseMessage], segments: list[str], places: list[tuple[int, int | None]]
) -> list[BaseMessage]:
    """Copies of the messages whose texts changed (the caller's objects stay untouched)."""
    out = list(messages)
    for text, (index, part_index) in zip(segments, places, strict=True):
        message = out[index]
        if part_index is None:
            if message.content != text:
                out[index] = message.model_copy(update={"content": text})
            continue
        parts = list(message.content)
        part = parts[part_index]
        current = part if isinstance(part, str) else part["text"]
        if current != text:
            parts[part_index] = text if isinstance(part, str) else {**part, "text": text}
            out[index] = message.model_copy(update={"content": parts})
    return out
