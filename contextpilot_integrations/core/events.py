"""What changed in a pilot's index, as one small typed event per change.

The pilot's state tells its observers (:meth:`ContextPilot.add_observer
<contextpilot_integrations.ContextPilot.add_observer>`; the shared log is one) of every
change to the predicted engine cache with one of these, as SGLang's cache tells its
listeners with ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``. They live in the
core so that both the pilot, which makes them, and the shared log below it, which turns
them into its wire entries (:mod:`contextpilot_integrations.shared.entries`) and back, can
name them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Evicted", "IndexEvent", "Observer", "Reset", "Restored", "Sent", "Truncated"]


@dataclass(frozen=True, slots=True)
class Sent:
    """A request entered the index: its index keys in send order and its blocks' token counts."""

    request_id: str
    keys: tuple[str, ...]
    token_counts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Evicted:
    """The engine no longer holds these requests' prefixes."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Truncated:
    """The engine holds only the first ``cached_blocks`` blocks of a request (0: none)."""

    request_id: str
    cached_blocks: int


@dataclass(frozen=True, slots=True)
class Restored:
    """The engine holds (again) the first ``cached_blocks`` blocks of a request (``None``: all)."""

    request_id: str
    cached_blocks: int | None


@dataclass(frozen=True, slots=True)
class Reset:
    """The engine holds nothing any more."""


IndexEvent = Sent | Evicted | Truncated | Restored | Reset
"""Any change to the index an observer hears of."""

Observer = Callable[[IndexEvent], None]
"""Called with each event, under the pilot's lock: quick, never raising."""
