"""A hosted API's answer, back to the pilot: cache reads and writes, and what it still holds.

The adapters' chat models call :func:`report_provider_served` where they would call
:func:`~contextpilot_integrations.engines.feedback.report_served` for a local engine: the
provider's usage (:func:`~contextpilot_integrations.providers.read_provider_usage`) goes to the
pilot's statistics with its cache writes (:meth:`ContextPilot.record_provider_usage`), and, only with
``usage_feedback``, cache reads short of the prediction drop from the index what the
provider is taken to no longer hold. Off by default: a hosted API reads only at the entries
its markers wrote (or in 128-token steps), so a short read is mostly no eviction (taking it
as one cost 8-13% in the provider what-if,
:mod:`contextpilot_integrations.whatif.provider_sim`); forget requests one TTL after
sending (``pilot.evict``) instead. A report the provider got wrong is logged, never
raised: the call itself succeeded.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from ..core.prepared import PreparedRequest
from ..engines.feedback import cached_blocks_from_usage
from ..pilot.telemetry import record_model_call
from ..providers.usage import ProviderUsage, read_provider_usage

__all__ = ["report_provider_served"]

_log = logging.getLogger(__name__)


class UsageRecorder(Protocol):
    """What a report needs of the pilot (a :class:`~contextpilot_integrations.ContextPilot`):
    typed here, so that the providers' layer does not import the pilot that imports it."""

    def record_provider_usage(self, prepared: PreparedRequest, usage: ProviderUsage) -> None: ...

    def observe_cached(self, prepared: PreparedRequest, cached_blocks: int) -> int: ...


def report_provider_served(
    pilot: UsageRecorder | None,
    prepared: PreparedRequest,
    raw: object,
    provider: str | None,
    *,
    before_tokens: int = 0,
    usage_feedback: bool = False,
) -> ProviderUsage | None:
    """Record the usage in ``raw`` (any provider's, or LangChain's ``usage_metadata``) for
    ``prepared``; returns it (``None``: no usage, or a broken one, logged)."""
    try:
        usage = read_provider_usage(raw)
        if usage is not None and usage.provider is None and provider is not None:
            usage = dataclasses.replace(usage, provider=provider)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        _log.warning("the provider's usage for request %r is not reported: %s", prepared.request_id, exc)
        return None
    if usage is None or pilot is None:
        return usage
    record_model_call(  # an OpenTelemetry span with the usage (the [otel] extra; else nothing)
        prepared,
        raw,
        provider=usage.provider,
        input_tokens=usage.prompt_tokens,
        cache_read_tokens=usage.cache_read_tokens,
        cache_write_tokens=usage.cache_write_tokens,
    )
    pilot.record_provider_usage(prepared, usage)
    if usage_feedback and prepared.cached_blocks:
        held = cached_blocks_from_usage(prepared, usage.prompt_tokens, usage.cache_read_tokens, before_tokens)
        pilot.observe_cached(prepared, held)
    return usage
