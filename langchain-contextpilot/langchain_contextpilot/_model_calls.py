"""LangChain's pieces of the model-call protocol (the core's
:class:`~contextpilot_integrations.integration.model_call.ModelCall`).

Where a call's prepared request comes from (named by a routed call, else taken from the
invocation's run tree), the texts of LangChain's messages (string contents and text parts),
the documents a graph's or agent's state keeps in full, and the usage of an answer
(LangChain's standard ``usage_metadata``). The protocol itself is the core's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage
from langchain_core.runnables import ensure_config

from contextpilot_integrations.engines import wire
from contextpilot_integrations.engines.feedback import EventTracker
from contextpilot_integrations.integration.model_call import EngineUsage, MessageTexts, ModelCall
from contextpilot_integrations.pilot.binding import Binding

from . import _binding
from ._written import as_sent, newest_written, note_written
from .cache_markers import part_text

BINDING_KWARG = "_contextpilot_binding"
"""A routed call names its request to the target's model explicitly."""
PROMPT_IDS_KEY = "prompt_token_ids"
BLOCK_ENDS_KEY = "block_ends"


def start(run_manager: Any, kwargs: dict[str, Any], tracker: EventTracker | None = None) -> ModelCall:
    """The call and its prepared request: the one a routed call names in ``kwargs`` (taken
    out of them), else the invocation's, from its run tree."""
    binding = kwargs.pop(BINDING_KWARG, None)
    if binding is None:
        # a model's stream() calls _stream without its run manager: the run's config is in context
        binding = _binding.take(run_manager if run_manager is not None else ensure_config().get("callbacks"))
    return ModelCall(binding, tracker=tracker, retake=lambda taken: _binding.failed(run_manager, taken))


def sent(
    call: ModelCall, messages: Sequence[BaseMessage], fields: Mapping[str, Any], key: str | None = None
) -> list[BaseMessage]:
    """The messages to send (:meth:`ModelCall.before`), documents kept in full in a graph's
    state referred to here, the pilot told which of the request's references went out in full
    (``key``: the request id its written message records; default: the newest one's)."""
    out, written = as_sent(messages)
    if call.binding is not None:
        note_written(call.binding, written, key if key is not None else newest_written(out))
    return call.before(out, MESSAGE_TEXTS, fields)


def with_ids(
    engine: str | None,
    binding: Binding | None,
    kwargs: dict[str, Any],
    extra_body: dict[str, Any] | None,
    prompt_ids: bool,
) -> dict[str, Any]:
    """``kwargs`` plus the body fields that carry the request id (a fresh one when unbound)."""
    if not wire.REQUEST_ID_FIELDS.get(engine or "") and not prompt_ids:
        return kwargs
    extra = {**(extra_body or {}), **(kwargs.get("extra_body") or {})}
    return {**kwargs, "extra_body": ModelCall(binding).id_fields(engine, extra, prompt_ids=prompt_ids)}


def usage_of(message: Any, chat_model: Any = None) -> EngineUsage:
    """The engine's counts in an answer (``usage_metadata``, the prompt's token ids in its
    ``response_metadata``); ``chat_model``: the provider's model, which names the model and
    provider where the message does not yet."""
    usage = getattr(message, "usage_metadata", None) or {}
    details = usage.get("input_token_details") or {}
    metadata = getattr(message, "response_metadata", None) or {}
    model, provider = _described(chat_model, metadata)
    return EngineUsage(
        prompt_tokens=usage.get("input_tokens"),
        cached_tokens=details.get("cache_read"),
        output_tokens=usage.get("output_tokens"),
        cache_write_tokens=details.get("cache_creation"),
        input_ids=metadata.get(PROMPT_IDS_KEY),
        model=model,
        provider=provider,
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
            text = part_text(part)
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


MESSAGE_TEXTS: MessageTexts[BaseMessage, tuple[int, int | None]] = MessageTexts(_segments, _rebuilt)
"""LangChain's messages as texts: string contents and text parts."""
