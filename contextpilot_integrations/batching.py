"""Micro-batching: concurrent requests planned together, released in schedule order.

Offline, a planned batch gains far more than requests prepared one at a time (the batch is
ordered and scheduled so prefix-sharing requests run back to back). Concurrent traffic,
LangChain's ``batch()`` or LlamaIndex queries gathered with ``asyncio.gather``, arrives
as a burst with no batch API: :class:`MicroBatcher` waits a few milliseconds (``window``)
for the rest of a burst, at most ``max_batch`` requests, plans them together with the
pilot's :meth:`~contextpilot_integrations.ContextPilot.plan` (or a router's, which routes
first and plans each target's share), and releases the callers in schedule order.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .blocks import BlockLike
from .pilot import BatchRequest
from .prepared import PreparedRequest

__all__ = ["MicroBatcher", "Planner", "Preparer", "aprepare_with", "prepare_with"]


class Planner(Protocol):
    """What plans a batch: a :class:`~contextpilot_integrations.ContextPilot`, or a router."""

    def plan(self, requests: Sequence[BatchRequest]) -> Sequence[Any]: ...


def _prepared_of(result: Any) -> PreparedRequest:
    """A pilot plans :class:`PreparedRequest` objects; a router wraps each with its target."""
    return result if isinstance(result, PreparedRequest) else result.prepared


@dataclass
class _Waiter:
    request: BatchRequest
    future: asyncio.Future[Any] | None = None
    event: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class MicroBatcher:
    """Gathers requests for ``window`` seconds (at most ``max_batch``), plans them together.

    Args:
        planner: a :class:`~contextpilot_integrations.ContextPilot`, or a
            :class:`~contextpilot_integrations.engines.router.Router`.
        window: seconds to wait for more requests after the first of a batch (a few ms:
            added to the first request's latency, saved many times over in prefill).
        max_batch: a batch this large is planned at once, without waiting.
    """

    def __init__(self, planner: Planner, *, window: float = 0.005, max_batch: int = 32) -> None:
        if window < 0 or max_batch < 1:
            raise ValueError("window must be >= 0 seconds and max_batch >= 1")
        self.planner = planner
        self.window = window
        self.max_batch = max_batch
        self.batches = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._pending: list[_Waiter] = []
        self._timer: threading.Timer | asyncio.TimerHandle | None = None

    # ---- async ------------------------------------------------------------------------------
    async def aprepare(
        self,
        blocks: Sequence[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
    ) -> Any:
        """Wait for the rest of the burst, then this request's place in the planned batch
        (what the planner's ``plan`` gives: a prepared request, or a routed one)."""
        loop = asyncio.get_running_loop()
        waiter = _Waiter(BatchRequest(blocks, query, conversation_id, kept_turns), loop.create_future())
        flush_now = self._add(waiter, lambda: loop.call_later(self.window, self._flush))
        if flush_now:
            self._flush()
        return await waiter.future  # type: ignore[misc]

    # ---- threads -----------------------------------------------------------------------------
    def prepare(
        self,
        blocks: Sequence[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
    ) -> Any:
        """Blocking variant of :meth:`aprepare`, for threads (LangChain's ``batch``)."""
        waiter = _Waiter(BatchRequest(blocks, query, conversation_id, kept_turns))

        def start() -> threading.Timer:
            timer = threading.Timer(self.window, self._flush)
            timer.daemon = True
            timer.start()
            return timer

        if self._add(waiter, start):
            self._flush()
        waiter.event.wait()
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    # ---- shared -------------------------------------------------------------------------------
    def _add(self, waiter: _Waiter, start_timer: Any) -> bool:
        """Queue a waiter; returns whether the batch is full (plan it now)."""
        with self._lock:
            self._pending.append(waiter)
            if len(self._pending) >= self.max_batch:
                return True
            if self._timer is None:
                self._timer = start_timer()
            return False

    def _flush(self) -> None:
        with self._lock:
            waiters, self._pending = self._pending, []
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if not waiters:
            return
        try:
            planned = list(self.planner.plan([w.request for w in waiters]))
        except BaseException as exc:  # every caller of the batch learns why
            for waiter in waiters:
                self._settle(waiter, None, exc)
            return
        with self._lock:
            self.batches += 1
            self.requests += len(waiters)
        for result in planned:  # schedule order: the first to send is released first
            index = _prepared_of(result).batch_index
            self._settle(waiters[index], result, None)  # type: ignore[index]

    @staticmethod
    def _settle(waiter: _Waiter, result: Any, error: BaseException | None) -> None:
        if waiter.future is not None:
            future = waiter.future
            loop = future.get_loop()

            def settle() -> None:
                if future.done():
                    return
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)

            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                settle()
            else:  # planned on another thread (a sync caller's timer): hand it to its loop
                loop.call_soon_threadsafe(settle)
        else:
            waiter.result, waiter.error = result, error
            waiter.event.set()


class Preparer(Protocol):
    """What prepares a request: a pilot, a router (which also picks the engine), or a
    :class:`MicroBatcher` in front of either."""

    def prepare(self, blocks: Sequence[BlockLike], query: str, conversation_id: str | None = None) -> Any: ...

    async def aprepare(self, blocks: Sequence[BlockLike], query: str, conversation_id: str | None = None) -> Any: ...


def prepare_with(
    preparer: Preparer, blocks: Sequence[BlockLike], query: str, conversation_id: str | None = None
) -> PreparedRequest:
    """Prepare with a pilot, a router or a micro-batcher alike (framework adapters)."""
    return _prepared_of(preparer.prepare(blocks, query, conversation_id))


async def aprepare_with(
    preparer: Preparer, blocks: Sequence[BlockLike], query: str, conversation_id: str | None = None
) -> PreparedRequest:
    """Async variant of :func:`prepare_with`."""
    return _prepared_of(await preparer.aprepare(blocks, query, conversation_id))
