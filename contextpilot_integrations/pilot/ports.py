"""The narrow interfaces the pilot's users above it talk through.

- :class:`Preparer`: what a framework adapter prepares with. A pilot, a router (which also
  picks the engine) and a micro-batcher in front of either prepare alike, each returning its
  own kind of result (a :class:`~..core.prepared.PreparedRequest`, or a routed one), and
  each binds that result to the pilot whose index now holds it: the
  :class:`~.facade.Binding` a model call later sends and reports to. No caller tells them
  apart.
- :class:`BatchPlanner`: what a micro-batcher plans a burst with (a pilot, or a router).
- :class:`~.group.Group`: the one lock and conversation store a router's pilots are built
  with (in :mod:`.group`, below the facade that takes it).
- :class:`Broadcast`: a router's channel for its own entries (where each conversation
  lives) when sharing is on. The shared log itself talks to the pilot through the interface
  it owns, :class:`~..shared.replica.Replica`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from ..core.blocks import BlockLike
from .facade import Binding
from .group import ALONE, Group
from .planner import BatchRequest

__all__ = ["ALONE", "BatchPlanner", "Broadcast", "Group", "Preparer"]

Result = TypeVar("Result")


class Preparer(Protocol[Result]):
    """Prepares one request, and binds what it prepared to the pilot that holds it."""

    def prepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        partition: str | None = None,
    ) -> Result:
        """Order one request's blocks for cache reuse and record it in an index."""

    async def aprepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        partition: str | None = None,
    ) -> Result:
        """Async variant of :meth:`prepare`."""

    def bound(self, result: Result) -> Binding:
        """The request behind ``result`` and the pilot whose index holds it."""


class BatchPlanner(Protocol[Result]):
    """Plans a batch together (ordered and scheduled), and binds each planned request."""

    def plan(self, requests: Sequence[BatchRequest], *, in_order: bool = True) -> Sequence[Result]:
        """The requests planned, in send order, each knowing its ``batch_index``."""

    def bound(self, result: Result) -> Binding:
        """The request behind ``result`` and the pilot whose index holds it."""


class Broadcast(Protocol):
    """Entries that are not about the index, to and from the other workers (the pilot's
    ``shared`` client is one)."""

    def publish(self, kind: str, *details: Any) -> None:
        """Send ``(kind, *details)`` to every other worker of the same scope."""

    def on(self, kind: str, handler: Callable[..., None]) -> None:
        """Call ``handler(*details)`` for each entry of ``kind`` another worker publishes."""
