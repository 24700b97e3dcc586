"""What the pilot has done, counted: the counters its parts add to under the pilot's lock,
and :class:`PilotStats`, the frozen snapshot :meth:`ContextPilot.stats` hands out."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..core.prepared import Reference
from ..providers.plan import CachePlan
from ..providers.usage import ProviderTotals

__all__ = ["MAX_PARTITIONS_COUNTED", "PREPARE_SECONDS_BOUNDS", "Counters", "PartitionTotals", "PilotStats"]

PREPARE_SECONDS_BOUNDS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip
"""Upper bounds (seconds) of the ``prepare`` latency histogram: fixed, so its memory is too (a
prepare takes microseconds to a few milliseconds; one held up by a long plan's lock shows above)."""


class PartitionTotals(BaseModel):
    """One cache partition's share of the counters (see ``PilotStats.partitions``)."""

    model_config = ConfigDict(frozen=True)

    requests_prepared: int = 0
    predicted_cached_tokens: int = 0
    engine_requests: int = 0
    engine_prompt_tokens: int = 0
    engine_cached_tokens: int = 0


class PilotStats(BaseModel):
    """A snapshot of what the pilot holds and has done."""

    model_config = ConfigDict(frozen=True)

    strategy: str
    live_requests: int
    index_nodes: int
    conversations: int
    requests_prepared: int
    blocks_sent: int
    blocks_referenced: int
    tokens_sent: int
    tokens_referenced: int
    predicted_cached_blocks: int
    predicted_cached_tokens: int
    requests_evicted: int
    engine_requests: int = 0
    """Requests whose usage the engine reported (see :meth:`ContextPilot.record_usage`)."""
    engine_prompt_tokens: int = 0
    engine_cached_tokens: int = 0
    feedback_shortened: int = 0
    """Requests shortened because the engine reported less cached than predicted."""
    references_restored: int = 0
    """Location references sent as full text after all, because the messages that left for
    the engine did not carry the text they pointed to (see :meth:`ContextPilot.note_restored`)."""
    shared_connected: bool | None = None
    """Sharing across workers (``shared=``): whether this worker shares now (``shared_status``
    is ``"connected"``); ``None`` when sharing is off."""
    shared_status: str | None = None
    """Why or why not: ``"connected"``; ``"unauthenticated"`` (the broker answers, but what
    other workers publish there is not signed with this worker's secret); ``"refused"`` (the
    broker refuses the stream, its reason logged); ``"unreachable"``; ``"closed"``. ``None``
    when sharing is off."""
    shared_unsent: int = 0
    """Entries of this worker waiting for the broker (sent once it is back)."""
    shared_applied: int = 0
    """Entries of other workers applied to this index."""
    shared_rejected: int = 0
    """Messages of the shared log refused: not signed with this deployment's secret for its stream."""
    shared_behind: int = 0
    """Messages the stream holds (as last seen) that this worker has not applied yet."""
    shared_lag_seconds: float | None = None
    """Seconds from another worker learning the newest applied entry to this one applying it
    (by the broker's clock); ``None`` before any."""
    engine_cache_write_tokens: int = 0
    """Prompt tokens a hosted API reported writing to its cache (part of the prompt tokens)."""
    provider_usage: dict[str, ProviderTotals] = {}
    """Hosted APIs' usage by provider (see :meth:`ContextPilot.record_provider_usage`)."""
    cache_markers_placed: int = 0
    """Cache markers planned for hosted APIs (see :meth:`ContextPilot.note_cache_plan`)."""
    cache_plans_skipped: dict[str, int] = {}
    """Requests planned without a marker, by reason (e.g. below the model's minimum)."""
    predicted_kept: float = 1.0
    """The share of the predicted cached tokens the engine reported serving (recent
    reports weigh most; 1.0 before any): predicted reuse counts this much when deciding
    whether labels and reordering pay (:mod:`.gain`)."""
    send_balance: float = 0.0
    """Recent reuse the sends bought beyond retrieval order's, less the tokens they added
    (:class:`~.gain.Balance`): while negative, no send bets on later reuse."""
    prepare_seconds_buckets: tuple[tuple[float, int], ...] = ()
    """The ``prepare`` latency histogram: (bound in seconds, calls that took at most that), cumulative,
    over :data:`PREPARE_SECONDS_BOUNDS` (the ``+Inf`` bucket is ``prepare_count``)."""
    prepare_seconds_sum: float = 0.0
    """Seconds spent in :meth:`ContextPilot.prepare` (and ``aprepare``), in all."""
    prepare_count: int = 0
    """Calls of :meth:`ContextPilot.prepare` (and ``aprepare``) that returned a request."""
    partitions: dict[str, PartitionTotals] = {}
    """By cache partition (:func:`~contextpilot_integrations.cache_partition`; the engine's default one
    as ``"(default)"``), once a request names one: the first :data:`MAX_PARTITIONS_COUNTED`, then
    ``"(other)"``."""

    @property
    def engine_hit_ratio(self) -> float:
        """Cached prompt tokens over prompt tokens, as the engine reported them."""
        return self.engine_cached_tokens / self.engine_prompt_tokens if self.engine_prompt_tokens else 0.0

    @property
    def predicted_hit_ratio(self) -> float:
        """Predicted cached block tokens over block tokens sent."""
        return self.predicted_cached_tokens / self.tokens_sent if self.tokens_sent else 0.0


MAX_PARTITIONS_COUNTED = 64
"""Partitions counted apart in ``PilotStats.partitions`` (a bounded label set for metrics)."""
DEFAULT_PARTITION, OTHER_PARTITIONS = "(default)", "(other)"

_MAX_SKIP_REASONS = 64
"""Distinct reasons counted in ``PilotStats.cache_plans_skipped``; further ones count as "other"."""


@dataclass(slots=True)
class Counters:
    """The running totals behind :class:`PilotStats` (guarded by the pilot's lock)."""

    prepared: int = 0
    blocks_sent: int = 0
    blocks_referenced: int = 0
    tokens_sent: int = 0
    tokens_referenced: int = 0
    cached_blocks: int = 0
    cached_tokens: int = 0
    evicted: int = 0
    engine_requests: int = 0
    engine_prompt_tokens: int = 0
    engine_cached_tokens: int = 0
    feedback_shortened: int = 0
    references_restored: int = 0
    cache_write_tokens: int = 0
    provider_usage: dict[str, ProviderTotals] = field(default_factory=dict)
    cache_markers: int = 0
    plans_skipped: dict[str, int] = field(default_factory=dict)
    prepare_buckets: list[int] = field(default_factory=lambda: [0] * (len(PREPARE_SECONDS_BOUNDS) + 1))
    """Prepare calls per latency bucket (not cumulative; the last one is over every bound)."""
    prepare_seconds: float = 0.0
    partitions: dict[str, list[int]] = field(default_factory=dict)
    """Partition -> [prepared, predicted cached tokens, engine requests, prompt, cached tokens]."""

    def count_prepared(
        self,
        sizes: Sequence[int],
        references: Sequence[Reference],
        cached_blocks: int,
        cached_tokens: int,
        partition: str | None = None,
    ) -> None:
        """One request prepared: its blocks sent (their token counts), referenced and predicted cached."""
        if partition is not None or self.partitions:
            counts = self.in_partition(partition)
            counts[0] += 1
            counts[1] += cached_tokens
        self.prepared += 1
        self.blocks_sent += len(sizes)
        self.tokens_sent += sum(sizes)
        if references:
            self.blocks_referenced += len(references)
            self.tokens_referenced += sum([r.block.token_count for r in references])
        self.cached_blocks += cached_blocks
        self.cached_tokens += cached_tokens

    def in_partition(self, partition: str | None) -> list[int]:
        """The counts of ``partition`` (bounded: past the first few, one shared entry)."""
        name = DEFAULT_PARTITION if partition is None else partition
        counts = self.partitions.get(name)
        if counts is None:
            if len(self.partitions) >= MAX_PARTITIONS_COUNTED:
                name = OTHER_PARTITIONS
            counts = self.partitions.setdefault(name, [0, 0, 0, 0, 0])
        return counts

    def count_prepare_seconds(self, seconds: float) -> None:
        """One ``prepare`` call took ``seconds``: a bucket's count goes up (nothing grows)."""
        self.prepare_buckets[bisect_left(PREPARE_SECONDS_BOUNDS, seconds)] += 1
        self.prepare_seconds += seconds

    def count_cache_plan(self, plan: CachePlan) -> None:
        """A request's planned cache markers, or why it got none (reasons bounded)."""
        if not isinstance(plan, CachePlan):
            raise TypeError(f"plan must be a CachePlan, got {type(plan).__name__}")
        self.cache_markers += plan.markers
        if plan.skipped is not None:
            reasons = self.plans_skipped
            reason = plan.skipped if plan.skipped in reasons or len(reasons) < _MAX_SKIP_REASONS else "other"
            reasons[reason] = reasons.get(reason, 0) + 1

    def snapshot(self, strategy: str, live: int, nodes: int, conversations: int, **more: Any) -> PilotStats:
        """These totals as :class:`PilotStats` (``more``: sharing's status, the learned shares)."""
        return PilotStats(
            strategy=strategy,
            live_requests=live,
            index_nodes=nodes,
            conversations=conversations,
            requests_prepared=self.prepared,
            blocks_sent=self.blocks_sent,
            blocks_referenced=self.blocks_referenced,
            tokens_sent=self.tokens_sent,
            tokens_referenced=self.tokens_referenced,
            predicted_cached_blocks=self.cached_blocks,
            predicted_cached_tokens=self.cached_tokens,
            requests_evicted=self.evicted,
            engine_requests=self.engine_requests,
            engine_prompt_tokens=self.engine_prompt_tokens,
            engine_cached_tokens=self.engine_cached_tokens,
            feedback_shortened=self.feedback_shortened,
            references_restored=self.references_restored,
            engine_cache_write_tokens=self.cache_write_tokens,
            provider_usage=dict(self.provider_usage),
            cache_markers_placed=self.cache_markers,
            cache_plans_skipped=dict(self.plans_skipped),
            prepare_seconds_buckets=tuple(zip(PREPARE_SECONDS_BOUNDS, accumulate(self.prepare_buckets), strict=False)),
            prepare_seconds_sum=self.prepare_seconds,
            prepare_count=sum(self.prepare_buckets),
            partitions={
                name: PartitionTotals(
                    requests_prepared=counts[0],
                    predicted_cached_tokens=counts[1],
                    engine_requests=counts[2],
                    engine_prompt_tokens=counts[3],
                    engine_cached_tokens=counts[4],
                )
                for name, counts in self.partitions.items()
            },
            **more,
        )
