"""The pilot's statistics as Prometheus metric families, read when a scrape asks.

Needs ``prometheus-client`` (the ``[metrics]`` extra), which this module imports: it is imported
only where metrics are asked for (the listener's ``GET /metrics``,
:mod:`contextpilot_integrations.integration.metrics`), so an install without the extra never
loads it. No background thread and no registry of its own: a scrape reads
:meth:`~contextpilot_integrations.ContextPilot.stats` once and turns the snapshot into families.
It lives below the engines so the eviction listener can serve it without importing upwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from .stats import PilotStats

__all__ = ["COUNTERS", "GAUGES", "SHARED_STATES", "exposition", "pilot_families"]

Row = tuple[Sequence[str], PilotStats]
"""One pilot's label values (e.g. its router target's name; none for a lone pilot) and its stats."""

COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("contextpilot_prepared_requests_total", "requests_prepared", "Requests prepared (and batch requests planned)."),
    ("contextpilot_sent_blocks_total", "blocks_sent", "Blocks sent in full."),
    ("contextpilot_sent_tokens_total", "tokens_sent", "Tokens of the blocks sent in full."),
    ("contextpilot_referenced_blocks_total", "blocks_referenced", "Blocks sent as a reference to an earlier turn."),
    ("contextpilot_referenced_tokens_total", "tokens_referenced", "Tokens of the blocks sent as references."),
    ("contextpilot_restored_references_total", "references_restored", "References sent as full text after all."),
    ("contextpilot_predicted_cached_blocks_total", "predicted_cached_blocks", "Blocks the index predicted cached."),
    ("contextpilot_predicted_cached_tokens_total", "predicted_cached_tokens", "Tokens the index predicted cached."),
    ("contextpilot_engine_reported_requests_total", "engine_requests", "Requests whose usage the engine reported."),
    ("contextpilot_engine_prompt_tokens_total", "engine_prompt_tokens", "Prompt tokens the engine reported."),
    ("contextpilot_engine_cached_tokens_total", "engine_cached_tokens", "Prompt tokens the engine served from cache."),
    (
        "contextpilot_engine_cache_write_tokens_total",
        "engine_cache_write_tokens",
        "Prompt tokens a hosted API reported writing to its cache.",
    ),
    ("contextpilot_evicted_requests_total", "requests_evicted", "Requests evicted from the index (events, feedback)."),
    (
        "contextpilot_feedback_shortened_requests_total",
        "feedback_shortened",
        "Requests shortened because the engine reported less cached than predicted.",
    ),
    ("contextpilot_cache_markers_total", "cache_markers_placed", "Cache markers planned for hosted APIs."),
)
"""(metric, :class:`PilotStats` field, help) of every plain counter."""

GAUGES: tuple[tuple[str, str, str], ...] = (
    ("contextpilot_live_requests", "live_requests", "Requests the index holds."),
    ("contextpilot_index_nodes", "index_nodes", "Nodes of the predicted prefix tree."),
    ("contextpilot_conversations", "conversations", "Conversations tracked."),
    ("contextpilot_engine_hit_ratio", "engine_hit_ratio", "Cached over prompt tokens, as the engine reported."),
    ("contextpilot_predicted_hit_ratio", "predicted_hit_ratio", "Predicted cached over block tokens sent."),
    (
        "contextpilot_predicted_kept_ratio",
        "predicted_kept",
        "Share of the predicted cached tokens the engine reported serving (recent reports weigh most).",
    ),
    ("contextpilot_send_balance_tokens", "send_balance", "Recent reuse bought beyond retrieval order, in tokens."),
)
"""(metric, :class:`PilotStats` field or property, help) of every plain gauge."""

SHARED_STATES = ("connected", "unauthenticated", "refused", "unreachable", "closed")
"""The shared log's states (``PilotStats.shared_status``), one series each."""

_PROVIDER = (
    ("requests", "Hosted API responses whose usage was read."),
    ("prompt_tokens", "Prompt tokens a hosted API reported."),
    ("cache_read_tokens", "Prompt tokens a hosted API read from its cache."),
    ("cache_write_tokens", "Prompt tokens a hosted API wrote to its cache."),
)


def pilot_families(rows: Sequence[Row], label_names: Sequence[str] = ()) -> list[Metric]:
    """Metric families of one or more pilots' stats (one series per row, labelled ``label_names``)."""
    names = list(label_names)
    families: list[Metric] = []
    for name, key, doc in COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=names)
        for labels, stats in rows:
            counter.add_metric(labels, float(getattr(stats, key)))
        families.append(counter)
    for name, key, doc in GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=names)
        for labels, stats in rows:
            gauge.add_metric(labels, float(getattr(stats, key)))
        families.append(gauge)
    info = GaugeMetricFamily(
        "contextpilot_strategy_info", "The ordering strategy (value 1).", labels=[*names, "strategy"]
    )
    histogram = HistogramMetricFamily(
        "contextpilot_prepare_seconds", "Seconds a prepare call took (validation and the lock included).", labels=names
    )
    skipped = CounterMetricFamily(
        "contextpilot_cache_plans_skipped_total", "Hosted requests planned without a marker.", labels=[*names, "reason"]
    )
    for labels, stats in rows:
        info.add_metric([*labels, stats.strategy], 1.0)
        buckets = [(repr(bound), float(count)) for bound, count in stats.prepare_seconds_buckets]
        histogram.add_metric(labels, [*buckets, ("+Inf", float(stats.prepare_count))], stats.prepare_seconds_sum)
        for reason, count in sorted(stats.cache_plans_skipped.items()):
            skipped.add_metric([*labels, reason], float(count))
    families += [info, histogram, skipped, *_provider_families(rows, names), *_shared_families(rows, names)]
    families += _partition_families(rows, names)
    return families


def _provider_families(rows: Sequence[Row], names: list[str]) -> list[Metric]:
    """Hosted APIs' usage by provider (only series for providers that answered)."""
    families: list[Metric] = []
    for key, doc in _PROVIDER:
        family = CounterMetricFamily(f"contextpilot_provider_{key}_total", doc, labels=[*names, "provider"])
        for labels, stats in rows:
            for provider, totals in sorted(stats.provider_usage.items()):
                family.add_metric([*labels, provider], float(getattr(totals, key)))
        families.append(family)
    return families


def _shared_families(rows: Sequence[Row], names: list[str]) -> list[Metric]:
    """The shared log's health, for the pilots that share (none when sharing is off)."""
    sharing = [(labels, stats) for labels, stats in rows if stats.shared_status is not None]
    if not sharing:
        return []
    state = GaugeMetricFamily(
        "contextpilot_shared_status", "The shared log's state (1 for the current one).", labels=[*names, "status"]
    )
    unsent = GaugeMetricFamily("contextpilot_shared_unsent_entries", "Entries waiting for the broker.", labels=names)
    behind = GaugeMetricFamily(
        "contextpilot_shared_behind_messages", "Messages of the stream not applied yet.", labels=names
    )
    applied = CounterMetricFamily(
        "contextpilot_shared_applied_entries_total", "Entries of other workers applied.", labels=names
    )
    rejected = CounterMetricFamily(
        "contextpilot_shared_rejected_messages_total", "Messages refused: not signed for this stream.", labels=names
    )
    lag = GaugeMetricFamily(
        "contextpilot_shared_lag_seconds",
        "Seconds from another worker learning the newest entry to its apply here.",
        labels=names,
    )
    for labels, stats in sharing:
        current = stats.shared_status
        for status in (*SHARED_STATES, *([current] if current not in SHARED_STATES else [])):
            state.add_metric([*labels, str(status)], float(status == current))
        unsent.add_metric(labels, float(stats.shared_unsent))
        behind.add_metric(labels, float(stats.shared_behind))
        applied.add_metric(labels, float(stats.shared_applied))
        rejected.add_metric(labels, float(stats.shared_rejected))
        if stats.shared_lag_seconds is not None:
            lag.add_metric(labels, stats.shared_lag_seconds)
    return [state, unsent, behind, applied, rejected, lag]


def _partition_families(rows: Sequence[Row], names: list[str]) -> list[Metric]:
    """The hook for cache partitions: where the stats carry a ``partitions`` mapping (partition ->
    its counters, as fields or keys), each counter of :data:`COUNTERS` it has again, per partition,
    as ``contextpilot_partition_*{partition=...}``. Nothing while the stats have none."""
    families: list[Metric] = []
    for name, key, doc in COUNTERS:
        family = CounterMetricFamily(
            name.replace("contextpilot_", "contextpilot_partition_", 1),
            f"{doc} By cache partition.",
            labels=[*names, "partition"],
        )
        for labels, stats in rows:
            partitions = getattr(stats, "partitions", None)
            for partition, counts in sorted(partitions.items()) if isinstance(partitions, Mapping) else ():
                value = _count(counts, key)
                if value is not None:
                    family.add_metric([*labels, str(partition)], value)
        if family.samples:
            families.append(family)
    return families


def _count(counts: Any, key: str) -> float | None:
    value = counts.get(key) if isinstance(counts, Mapping) else getattr(counts, key, None)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class _Families:
    """A collector of families already read (one scrape's)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def exposition(stats: PilotStats) -> tuple[bytes, str]:
    """One pilot's stats in the Prometheus text format, and its content type (the listener's ``/metrics``)."""
    registry = CollectorRegistry()
    registry.register(_Families(pilot_families([((), stats)])))
    return generate_latest(registry), CONTENT_TYPE_LATEST
