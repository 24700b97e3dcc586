"""The pilot: :class:`ContextPilot`, a facade over parts with one job each.

- :mod:`.facade`: :class:`ContextPilot` itself, the lock, and the wiring of the parts;
- :mod:`.state`: the predicted engine state and its mutators;
- :mod:`.planner`: prepare one request, plan a batch, the send decision;
- :mod:`.settings`: the settings the planner reads, one frozen value swapped whole;
- :mod:`.reports`: what an engine's or a hosted API's report means for the index;
- :mod:`.stats`: :class:`PilotStats` and the counters;
- :mod:`.ports`: the narrow interfaces its users above talk through (a router's group of pilots);
- :mod:`.wiring`: the shared log plugged in when sharing is on.

What its observers hear (:meth:`ContextPilot.add_observer`) are the events of
:mod:`..core.events`, exported here.
"""

from __future__ import annotations

from ..core.events import Evicted, IndexEvent, Observer, Reset, Restored, Sent, Truncated
from .facade import ContextPilot
from .planner import BatchItem, BatchRequest, batch_request
from .stats import PilotStats

__all__ = [
    "BatchItem",
    "BatchRequest",
    "ContextPilot",
    "Evicted",
    "IndexEvent",
    "Observer",
    "PilotStats",
    "Reset",
    "Restored",
    "Sent",
    "Truncated",
    "batch_request",
]
