"""OpenTelemetry spans of model calls, with the GenAI semantic conventions' usage (the ``[otel]`` extra).

When an adapter reads a prepared request's answer back (both adapters through
``integration.model_call.ModelCall``), :func:`record_model_call` records one span ``chat {model}``
(kind ``CLIENT``, a child of the current span) with the usage the answer reported and what the
index had predicted for it, so a trace shows the engine's cache reads beside ContextPilot's
prediction. Only the ``opentelemetry.trace`` API is used: without an SDK configured the span is a
no-op, and without ``opentelemetry-api`` installed nothing is imported and nothing happens.

The span is recorded as the answer is read: its duration is not the call's (an HTTP or
provider instrumentation has that). It never raises: telemetry must not fail a served call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core.prepared import PreparedRequest

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = ["PROVIDER_NAMES", "record_model_call"]

_log = logging.getLogger(__name__)

PROVIDER_NAMES: Mapping[str, str] = {
    "amazon_bedrock": "aws.bedrock",
    "bedrock": "aws.bedrock",
    "bedrock_converse": "aws.bedrock",
    "google_genai": "gcp.gen_ai",
    "google_vertexai": "gcp.vertex_ai",
    "azure_openai": "azure.ai.openai",
    "gemini": "gcp.gemini",
    "mistralai": "mistral_ai",
    "xai": "x_ai",
}
"""LangChain's ``model_provider`` (and ``ls_provider``) names whose ``gen_ai.provider.name`` is spelt
otherwise (the rest are the same: ``openai``, ``anthropic``, ...)."""


@functools.cache
def _tracer() -> Tracer | None:
    """This package's tracer (a proxy that follows an SDK configured later); ``None`` without the API."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer("contextpilot_integrations")


def record_model_call(
    prepared: PreparedRequest | None,
    raw: Any = None,
    *,
    model: str | None = None,
    provider: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    cache_read_tokens: int | None = None,
    cache_write_tokens: int | None = None,
    operation: str = "chat",
) -> None:
    """Record a completed model call's span (a no-op without an OpenTelemetry SDK).

    Args:
        prepared: the request ContextPilot prepared for it (its id, predicted cached tokens, references).
        raw: the provider's raw answer (a dict or a pydantic response, OpenAI- or Anthropic-style): what
            it names (model, output tokens, its API's shape) fills the arguments not given.
        model: the model that answered (``gen_ai.request.model`` and ``gen_ai.response.model``).
        provider: ``gen_ai.provider.name`` (LangChain's ``model_provider`` names are mapped).
        input_tokens: every prompt token, cache reads and writes included (as the conventions count).
    """
    tracer = _tracer()
    if tracer is None:
        return
    try:
        from opentelemetry.trace import SpanKind

        span = tracer.start_span(operation, kind=SpanKind.CLIENT)
        try:
            if span.is_recording():  # else nothing is read: no SDK, or not sampled
                found = _from_raw(raw)
                model = model or found.get("model")
                if model:
                    span.update_name(f"{operation} {model}")  # the conventions' span name
                provider = PROVIDER_NAMES.get(provider, provider) if provider else found.get("provider")
                values: dict[str, Any] = {
                    "gen_ai.operation.name": operation,
                    "gen_ai.provider.name": provider,
                    "gen_ai.system": provider,  # the name before semantic conventions 1.37, for older backends
                    "gen_ai.request.model": model,
                    "gen_ai.response.model": model,
                    "gen_ai.usage.input_tokens": input_tokens,
                    "gen_ai.usage.output_tokens": output_tokens if output_tokens is not None else found.get("output"),
                    "gen_ai.usage.cache_read.input_tokens": cache_read_tokens,
                    "gen_ai.usage.cache_creation.input_tokens": (
                        cache_write_tokens if cache_write_tokens is not None else found.get("written")
                    ),
                }
                if prepared is not None:
                    values |= {
                        "gen_ai.conversation.id": prepared.conversation_id,
                        "contextpilot.request_id": prepared.request_id,
                        "contextpilot.predicted_cached_tokens": prepared.cached_tokens,
                        "contextpilot.predicted_cached_blocks": prepared.cached_blocks,
                        "contextpilot.blocks": len(prepared.blocks),
                        "contextpilot.references": len(prepared.references),
                    }
                span.set_attributes({key: value for key, value in values.items() if value is not None})
        finally:
            span.end()
    except Exception:  # never fail the call it describes
        _log.debug("contextpilot telemetry: recording a model call's span failed", exc_info=True)


def _data(raw: Any) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    dump = getattr(raw, "model_dump", None)
    data = dump() if callable(dump) else None
    return data if isinstance(data, Mapping) else {}


def _model_of(raw: Any) -> str | None:
    model = _data(raw).get("model") if raw is not None else None
    return model if isinstance(model, str) and model else None


_OUTPUT_KEYS = ("completion_tokens", "output_tokens", "outputTokens", "candidates_token_count", "candidatesTokenCount")
"""Where each provider's usage counts the answer's tokens: OpenAI's Chat Completions (and every
OpenAI-compatible server); OpenAI's Responses, Anthropic and LangChain; Bedrock; Gemini."""


def _from_raw(raw: Any) -> dict[str, Any]:
    """Model, output tokens, cache writes and provider of a raw answer, or of its usage alone."""
    if raw is None:
        return {}
    data = _data(raw)
    usage = data.get("usage")
    usage = usage if isinstance(usage, Mapping) else data  # a usage report by itself
    output = next((usage[key] for key in _OUTPUT_KEYS if key in usage), None)
    written = usage.get("cache_creation_input_tokens")  # Anthropic's cache writes
    found: dict[str, Any] = {"model": _model_of(data)}
    for key, value in (("output", output), ("written", written)):
        if isinstance(value, int) and not isinstance(value, bool):
            found[key] = value
    if "prompt_tokens" in usage or "input_tokens_details" in usage:
        found["provider"] = "openai"
    elif data.get("type") == "message" or "cache_read_input_tokens" in usage:
        found["provider"] = "anthropic"
    return found
