"""The pilot: :class:`ContextPilot`, a facade over parts with one job each.

- :mod:`.facade`: :class:`ContextPilot` itself, the lock, and the wiring of the parts;
- :mod:`.state`: the predicted engine state and its mutators;
- :mod:`.planner`: prepare one request, plan a batch, the send decision;
- :mod:`.settings`: the settings the planner reads, one frozen value swapped whole;
- :mod:`.reports`: what an engine's or a hosted API's report means for the index;
- :mod:`.stats`: :class:`PilotStats` and the counters;
- :mod:`.ports`: the narrow interfaces its users above talk through;
- :mod:`.wiring`: the shared log plugged in when sharing is on.
"""

from __future__ import annotations

from .facade import ContextPilot, join
from .planner import BatchItem, BatchRequest, batch_request
from .stats import PilotStats

__all__ = ["BatchItem", "BatchRequest", "ContextPilot", "PilotStats", "batch_request", "join"]
