"""What a served request tells the pilot: the engine's token accounting, and (without KV
events) which of its blocks the engine really had cached.

Every OpenAI-compatible server that fills ``usage.prompt_tokens_details.cached_tokens``
(llama.cpp, vLLM, SGLang, hosted APIs) reports how much of a prompt it served from its
cache. The prompt is the system prompt and history, then the blocks in send order, then
the request's own tail (references, annotation, question). Token counts of our blocks are
estimates unless given, so the engine's count is mapped onto them proportionally (the
engine's ``prompt_tokens`` against our estimate of the whole prompt), and only a clear
shortfall (under 90% of the predicted cached tokens) counts as an eviction.
:meth:`~contextpilot_integrations.ContextPilot.observe_cached` then drops what is gone.
Used by :class:`~.client.OpenAICompatClient` and the framework adapters alike.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.prepared import PreparedRequest
from ..core.usage import check_usage
from ..pilot import ContextPilot
from ..pilot.binding import Binding
from ..pilot.telemetry import record_model_call
from .kv_mapping import blocks_held

__all__ = [
    "Binding",
    "EngineUsage",
    "EventTracker",
    "cached_blocks_from_usage",
    "estimate_prompt_tokens",
    "report_call",
    "report_failed",
    "report_served",
]

_log = logging.getLogger(__name__)

SHORTFALL = 0.9
"""Below this share of the predicted cached tokens, the engine had less than predicted."""


class EventTracker(Protocol):
    """Where a served prompt's token ids go so KV events can be mapped to it (a sink)."""

    def track(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ends: Sequence[int] | None = None,
        cached_tokens: int | None = None,
        partition: str | None = None,
    ) -> None: ...

    def forget(self, request_id: str) -> None: ...


def estimate_prompt_tokens(text: str) -> int:
    """Characters to tokens, the estimate blocks use without a given count."""
    from ..core.blocks import CHARS_PER_TOKEN

    return len(text) // CHARS_PER_TOKEN


def cached_blocks_from_usage(
    prepared: PreparedRequest, prompt_tokens: int, cached_tokens: int, before_tokens: int
) -> int:
    """How many of the request's leading blocks the engine served from its cache.

    Args:
        prompt_tokens, cached_tokens: the engine's report.
        before_tokens: our estimate of the tokens before the blocks (system prompt, history).
    """
    sizes = [block.token_count for block in prepared.blocks]
    tail = sum(estimate_prompt_tokens(r.text) for r in prepared.references)
    tail += estimate_prompt_tokens(prepared.order_annotation) + estimate_prompt_tokens(prepared.query)
    estimate = before_tokens + sum(sizes) + tail
    scale = prompt_tokens / estimate if estimate else 1.0
    predicted = scale * (before_tokens + sum(sizes[: prepared.cached_blocks]))
    if cached_tokens >= SHORTFALL * predicted:
        return prepared.cached_blocks  # as predicted, within the estimate's error
    position = scale * before_tokens
    held = 0
    for size in sizes:
        position += scale * size
        if position > cached_tokens:
            break
        held += 1
    return min(held, prepared.cached_blocks)


def report_served(
    pilot: ContextPilot | None,
    prepared: PreparedRequest,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    *,
    before_tokens: int = 0,
    usage_feedback: bool = True,
    tracker: EventTracker | None = None,
    input_ids: Sequence[int] | None = None,
    block_ends: Sequence[int] | None = None,
    page_size: int | None = None,
) -> int:
    """Record a served request: the engine's counts in the pilot's statistics, the prompt's
    token ids (with where each block ends, and the engine's cached tokens) with the event
    tracker, and a shortfall of cached blocks in the index: exact when ``block_ends`` are
    known (:func:`.kv_mapping.block_token_ends`), else estimated, with ``usage_feedback``.
    Returns how many live requests the feedback shortened. ``page_size``: the engine's
    page (default: the tracker's, learned from the events), so that a block whose whole
    pages were served counts as served (:func:`.kv_mapping.blocks_held`).

    Counts the engine got wrong (not ints, out of range, more cached than prompt tokens)
    are not reported: the call itself succeeded, so a warning is logged (once) instead."""
    if tracker is not None and input_ids:
        tracker.track(prepared.request_id, input_ids, block_ends, cached_tokens, partition=prepared.partition)
    if pilot is None:
        return 0
    try:
        check_usage(prompt_tokens, cached_tokens)
    except (TypeError, ValueError) as exc:
        _warn_once(pilot, f"the engine's usage for request {prepared.request_id!r} is not reported to the pilot: {exc}")
        return 0
    pilot.record_usage(prepared, prompt_tokens, cached_tokens)
    if block_ends is not None and cached_tokens is not None and prepared.cached_blocks:
        page = page_size if page_size is not None else _page_size(tracker)
        held = blocks_held(block_ends, cached_tokens, page)  # exact: token positions, whole pages
        return pilot.observe_cached(prepared, min(held, prepared.cached_blocks))
    if not usage_feedback or prompt_tokens is None or cached_tokens is None or not prepared.cached_blocks:
        return 0
    held = cached_blocks_from_usage(prepared, prompt_tokens, cached_tokens, before_tokens)
    return pilot.observe_cached(prepared, held)


def _page_size(tracker: EventTracker | None) -> int | None:
    """The engine page size a tracker (a sink) learned, if it knows one."""
    page = getattr(tracker, "page_size", None)
    return page if isinstance(page, int) and not isinstance(page, bool) and page > 0 else None


_warned: weakref.WeakSet[ContextPilot] = weakref.WeakSet()  # pilots whose engine sent a bad report
_warned_lock = threading.Lock()


def _warn_once(pilot: ContextPilot, message: str) -> None:
    """A pilot's first bad report is a warning; later ones (its engine again) go to debug."""
    with _warned_lock:
        first = pilot not in _warned
        _warned.add(pilot)
    if first:
        _log.warning("%s (later ones for this pilot are logged at debug level)", message)
    else:
        _log.debug(message)


@dataclass(frozen=True)
class EngineUsage:
    """What an engine's answer says of the call, read from the client's or a framework's own types."""

    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None = None
    cache_write_tokens: int | None = None
    input_ids: Sequence[int] | None = None
    """The prompt's token ids, where the engine returned them (KV-event mapping)."""
    model: str | None = None
    provider: str | None = None


def report_call(
    pilot: ContextPilot | None,
    prepared: PreparedRequest,
    usage: EngineUsage,
    *,
    before_tokens: int = 0,
    usage_feedback: bool = True,
    tracker: EventTracker | None = None,
    block_ends: Sequence[int] | None = None,
    raw: Any = None,
) -> int:
    """A served call, reported once for every caller (the engine client, both adapters): a span
    of its usage (the ``[otel]`` extra; ``raw``: the answer, naming what ``usage`` does not), then
    the counts to the pilot (:func:`report_served`, whose return it returns)."""
    record_model_call(
        prepared,
        raw,
        model=usage.model,
        provider=usage.provider,
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.output_tokens,
        cache_read_tokens=usage.cached_tokens,
        cache_write_tokens=usage.cache_write_tokens,
    )
    return report_served(
        pilot,
        prepared,
        usage.prompt_tokens,
        usage.cached_tokens,
        before_tokens=before_tokens,
        usage_feedback=usage_feedback,
        tracker=tracker,
        input_ids=usage.input_ids,
        block_ends=block_ends,
    )


def report_failed(pilot: ContextPilot | None, prepared: PreparedRequest, tracker: EventTracker | None = None) -> None:
    """The request was not served: the index and the conversation forget it."""
    if tracker is not None:
        tracker.forget(prepared.request_id)
    if pilot is not None:
        pilot.discard(prepared)
