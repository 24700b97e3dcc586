"""Prometheus metrics of a pilot or a router, for the platform's scraper (the ``[metrics]`` extra).

:func:`register_metrics` adds a :class:`ContextPilotCollector` to a ``prometheus_client``
registry: at each scrape it reads :meth:`~contextpilot_integrations.ContextPilot.stats` (for a
:class:`~contextpilot_integrations.engines.Router`, each target's pilot, labelled ``target``,
and the router's health and circuit breakers through its public methods) and yields metric
families; no thread, no state of its own. The families and their names are in
:mod:`~contextpilot_integrations.pilot.metrics` and ``docs/metrics.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..engines.router import Router
from ..pilot import ContextPilot

if TYPE_CHECKING:
    from prometheus_client.core import Metric
    from prometheus_client.registry import CollectorRegistry

__all__ = ["ContextPilotCollector", "register_metrics"]

BREAKER_STATES = ("closed", "open", "half_open")
"""A router target's circuit breaker states, one series each (1 for the current one)."""

_ROUTER_COUNTERS = (
    ("contextpilot_router_sent_requests_total", "sent", "Requests sent to the target."),
    ("contextpilot_router_failures_total", "failures", "Sends that failed on the target's side."),
    ("contextpilot_router_timeouts_total", "timeouts", "Sends that timed out."),
    ("contextpilot_router_unreachable_total", "unreachable", "Sends that found the target unreachable."),
    ("contextpilot_router_breaker_opened_total", "breaker_opened", "Times the target's circuit breaker opened."),
)
_ROUTER_GAUGES = (
    ("contextpilot_router_in_flight_requests", "in_flight", "Requests in flight to the target."),
    ("contextpilot_router_consecutive_failures", "consecutive_failures", "Failures in a row."),
    ("contextpilot_router_breaker_open_seconds", "open_for_s", "Seconds before an open breaker lets a probe through."),
)


class ContextPilotCollector:
    """A Prometheus collector (``collect()``) over one pilot or a router's targets, read at scrape time.

    Needs ``prometheus-client`` (``pip install contextpilot-integrations[metrics]``).
    """

    def __init__(self, source: ContextPilot | Router) -> None:
        if not isinstance(source, ContextPilot | Router):
            raise TypeError(f"source must be a ContextPilot or a Router, got {type(source).__name__}")
        from ..pilot import metrics  # prometheus_client, only now: an ImportError names the extra below

        self._families = metrics.pilot_families
        self.source = source

    def collect(self) -> Iterable[Metric]:
        source = self.source
        if isinstance(source, ContextPilot):
            return self._families([((), source.stats())])
        names = [target.name for target in source.targets]
        families = self._families([((name,), source.pilot(name).stats()) for name in names], ["target"])
        return [*families, *_router_families(source, names)]


def _router_families(router: Router, names: list[str]) -> list[Metric]:
    """Each target's health: up (not routed around), its breaker, its sends and failures."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    stats = router.stats()
    up = GaugeMetricFamily("contextpilot_router_target_up", "1 unless routed around.", labels=["target"])
    breaker = GaugeMetricFamily(
        "contextpilot_router_breaker_state",
        "The circuit breaker's state (1 for the current one).",
        labels=["target", "state"],
    )
    families: list[Metric] = [up, breaker]
    for name in names:
        up.add_metric([name], 0.0 if router.is_down(name) else 1.0)
        for state in BREAKER_STATES:
            breaker.add_metric([name, state], float(stats[name].breaker == state))
    for kind, table in ((CounterMetricFamily, _ROUTER_COUNTERS), (GaugeMetricFamily, _ROUTER_GAUGES)):
        for metric, key, doc in table:
            family = kind(metric, doc, labels=["target"])
            for name in names:
                family.add_metric([name], float(getattr(stats[name], key)))
            families.append(family)
    return families


def register_metrics(
    pilot_or_router: ContextPilot | Router, registry: CollectorRegistry | None = None
) -> ContextPilotCollector:
    """Register a :class:`ContextPilotCollector` over ``pilot_or_router`` with ``registry`` (default:
    ``prometheus_client``'s own ``REGISTRY``, which ``start_http_server`` serves); returns it, so that
    ``registry.unregister(collector)`` undoes it.

    Raises:
        ImportError: ``prometheus-client`` is not installed (the ``[metrics]`` extra).
        TypeError: neither a pilot nor a router.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError as exc:
        raise ImportError("metrics need prometheus-client: pip install 'contextpilot-integrations[metrics]'") from exc
    collector = ContextPilotCollector(pilot_or_router)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
