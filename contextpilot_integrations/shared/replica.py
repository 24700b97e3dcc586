"""What the shared log needs of the index it keeps equal to every other worker's.

The shared log is a plug-in of the index: it is handed one :class:`Replica` (a
:class:`~contextpilot_integrations.ContextPilot` is one) and never imports the pilot. It
applies other workers' entries through the replica's mutators and hears of this worker's
changes through an observer (one :mod:`~..core.events` event per change).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ..core.events import Observer

__all__ = ["LockOf", "Replica"]

LockOf = Callable[[], Any]
"""Returns the lock guarding the replica (``None`` once it is gone): held across a fork."""


class Replica(Protocol):
    """An index the shared log keeps in step (the pilot's mutators it applies entries with)."""

    @property
    def cache_tokens(self) -> int | None:
        """The engine's cache size in tokens (a larger request is never indexed), if known."""

    def record_sent(self, request_id: str, block_ids: Sequence[str]) -> bool: ...

    def evict(self, request_ids: Iterable[str]) -> int: ...

    def truncate(self, request_id: str, cached_blocks: int) -> bool: ...

    def restore(self, request_id: str, cached_blocks: int | None = None) -> bool: ...

    def reset(self) -> None: ...

    def live_request_ids(self) -> list[str]: ...

    def live_orders(self) -> list[tuple[str, tuple[str, ...]]]: ...

    def add_observer(self, observer: Observer) -> None: ...

    def remove_observer(self, observer: Observer) -> None: ...
