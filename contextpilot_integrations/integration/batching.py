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
import enum
import logging
import math
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..core.blocks import Block, BlockLike, normalize_blocks
from ..core.validation import check_conversation_id, check_kept_turns, check_partition, check_query
from ..pilot import BatchRequest
from ..pilot.facade import Binding
from ..pilot.ports import BatchPlanner, Preparer

if TYPE_CHECKING:
    from ..engines.router import Router
    from ..pilot import ContextPilot

__all__ = ["MicroBatcher"]

_log = logging.getLogger(__name__)

_IDLE_SECONDS = 5.0
"""A batcher's worker thread leaves after this long without requests."""


class _State(enum.Enum):
    QUEUED = "queued"  # in the open batch
    PLANNING = "planning"  # taken by a flush, not settled yet
    READY = "ready"  # result or error handed to the caller's thread or loop
    GONE = "gone"  # the caller left (cancelled, interrupted, its loop closed)


@dataclass(eq=False)
class _Waiter:
    request: BatchRequest
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[Any] | None = None
    event: threading.Event = field(default_factory=threading.Event)
    state: _State = _State.QUEUED
    result: Any = None
    error: BaseException | None = None


_Outcome = tuple[_Waiter, Any, BaseException | None]
"""A waiter, and its planned request or the error its caller gets."""


def _checked_request(
    blocks: Iterable[BlockLike], query: object, conversation_id: object, kept_turns: object, partition: object = None
) -> BatchRequest:
    """Validate one request in its caller's own call, so bad input fails that caller alone
    (a planner refuses a whole batch for one bad request)."""
    if not isinstance(blocks, (str, bytes, Mapping, Block)) and isinstance(blocks, Iterable):
        blocks = list(blocks)  # an iterator is read once: here, not again when planned
    normalize_blocks(blocks)
    check_query(query)
    check_conversation_id(conversation_id)
    kept = check_kept_turns(kept_turns)
    check_partition(partition)
    return BatchRequest(blocks, query, conversation_id, kept, partition=partition)  # type: ignore[arg-type]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class MicroBatcher:
    """Gathers requests for ``window`` seconds (at most ``max_batch``), plans them together.

    The window is timed by a thread, not by any caller's event loop, so threads and any
    number of event loops can share one batcher, and a loop that stops or closes strands
    nobody. A caller that leaves (cancelled, timed out, its loop closed) is taken out of
    its batch, or, if its request was already planned, the request is discarded from the
    planner's index: nothing stays live that nobody will send.

    ``batches`` and ``requests`` count the batches and requests planned.

    Args:
        planner: a :class:`~contextpilot_integrations.ContextPilot`, or a
            :class:`~contextpilot_integrations.engines.router.Router`.
        window: seconds to wait for more requests after the first of a batch (a few ms:
            added to the first request's latency, saved many times over in prefill).
        max_batch: a batch this large is planned at once, without waiting.
    """

    def __init__(self, planner: BatchPlanner[Any], *, window: float = 0.005, max_batch: int = 32) -> None:
        if window < 0 or max_batch < 1:
            raise ValueError("window must be >= 0 seconds and max_batch >= 1")
        self.planner = planner
        self.window = window
        self.max_batch = max_batch
        self.batches = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._pending: list[_Waiter] = []
        self._wake = threading.Condition(self._lock)
        self._due = 0.0  # when the open batch is planned (time.monotonic)
        self._worker_wakes = 0.0  # when the waiting worker wakes anyway (inf: only if told)
        self._worker: threading.Thread | None = None  # times the window; leaves when idle

    # ---- async ------------------------------------------------------------------------------
    async def aprepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        partition: str | None = None,
    ) -> Any:
        """Wait for the rest of the burst, then this request's place in the planned batch
        (what the planner's ``plan`` gives: a prepared request, or a routed one), planned in
        the engine's cache ``partition`` (see :meth:`ContextPilot.prepare`).

        Raises:
            InvalidBlockError, BlockTypeError, TypeError: this request is invalid (the
                other requests of its batch are planned without it).
        """
        request = _checked_request(blocks, query, conversation_id, kept_turns, partition)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(request, loop, loop.create_future())
        self._run(self._add(waiter, flush_now=False))
        try:
            return await waiter.future  # type: ignore[misc]
        except asyncio.CancelledError:
            self._leave(waiter)
            raise

    # ---- threads -----------------------------------------------------------------------------
    def prepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        partition: str | None = None,
    ) -> Any:
        """Blocking variant of :meth:`aprepare`, for threads (LangChain's ``batch``).

        Called on an event loop's thread, it plans the open batch at once rather than
        block that loop for the window (the loop's own callers are in that batch)."""
        waiter = _Waiter(_checked_request(blocks, query, conversation_id, kept_turns, partition))
        self._run(self._add(waiter, flush_now=_running_loop() is not None))
        try:
            waiter.event.wait()
        except BaseException:  # interrupted: nobody will send this request
            self._leave(waiter)
            raise
        if waiter.error is not None:
            raise waiter.error
        return waiter.result

    def bound(self, result: Any) -> Binding:
        """What :meth:`prepare` returned, bound to the pilot that holds it (the planner's binding)."""
        return self.planner.bound(result)

    # ---- the batch -----------------------------------------------------------------------------
    def _add(self, waiter: _Waiter, *, flush_now: bool) -> list[_Waiter]:
        """Queue a waiter; returns the batch to plan now (full, or ``flush_now``), else []."""
        worker = None
        with self._lock:
            self._pending.append(waiter)
            if flush_now or len(self._pending) >= self.max_batch:
                return self._take_locked()
            if len(self._pending) == 1:  # a new batch: its window starts now
                self._due = time.monotonic() + self.window
                if self._worker is None:
                    worker = self._worker = threading.Thread(target=self._work, name="MicroBatcher", daemon=True)
                elif self._worker_wakes > self._due:  # else it wakes in time and looks again
                    self._wake.notify()
        if worker is not None:
            worker.start()  # slow on a busy machine: the window counts from when its clock runs
            with self._lock:
                if self._pending and self._pending[0] is waiter:
                    self._due = max(self._due, time.monotonic() + self.window)
        return []

    def _take_locked(self) -> list[_Waiter]:
        waiters, self._pending = self._pending, []
        for waiter in waiters:
            waiter.state = _State.PLANNING
        return waiters

    def _work(self) -> None:
        """The window's clock: plans each batch when its window ends (one thread for all
        callers, so no caller's event loop has to stay alive for the others)."""
        while True:
            with self._lock:
                while not self._pending or time.monotonic() < self._due:
                    if not self._pending:
                        self._worker_wakes = math.inf
                        if not self._wake.wait(_IDLE_SECONDS) and not self._pending:
                            self._worker = None  # idle: the next batch starts a new one
                            return
                    else:
                        self._worker_wakes = self._due
                        self._wake.wait(self._due - time.monotonic())
                self._worker_wakes = 0.0  # awake
                waiters = self._take_locked()
            try:
                self._run(waiters)
            except Exception:  # keep the clock running for the next batches
                _log.exception("could not hand out a planned batch")

    def _run(self, waiters: list[_Waiter]) -> None:
        """Plan a batch and hand each caller its result; every waiter is settled, whatever
        the planner does."""
        if not waiters:
            return
        batches = 0
        try:
            outcomes, batches = self._plan(waiters)
        except BaseException as exc:  # not an Exception (e.g. KeyboardInterrupt): everyone learns it
            outcomes = [(waiter, None, exc) for waiter in waiters]
        with self._lock:  # counted before the callers are released: they may look at once
            self.batches += batches
            self.requests += sum(result is not None for _, result, _ in outcomes)
        settled: set[_Waiter] = set()
        here = _running_loop()
        for waiter, result, error in outcomes:
            if waiter not in settled:
                settled.add(waiter)
                self._settle(waiter, result, error, here)
            else:  # the planner gave this request twice
                self._discard(result)
        for waiter in waiters:
            if waiter not in settled:  # the planner gave no result for it
                error = RuntimeError("the planner returned no result for this request")
                self._settle(waiter, None, error, here)

    def _plan(self, waiters: list[_Waiter]) -> tuple[list[_Outcome], int]:
        """(waiter, result, error) in schedule order, and the batches planned. A batch the
        planner refuses is planned again one request at a time, so only the request at
        fault fails."""
        try:
            return self._plan_together(waiters), 1
        except Exception as exc:
            if len(waiters) == 1:
                return [(waiters[0], None, exc)], 0
        outcomes: list[_Outcome] = []
        batches = 0
        for waiter in waiters:
            try:
                outcomes += self._plan_together([waiter])
                batches += 1
            except Exception as alone:
                outcomes.append((waiter, None, alone))
        return outcomes, batches

    def _plan_together(self, waiters: list[_Waiter]) -> list[_Outcome]:
        outcomes: list[_Outcome] = []
        # concurrent callers: their requests reach the engine in no guaranteed order
        for result in self.planner.plan([waiter.request for waiter in waiters], in_order=False):
            index = self.planner.bound(result).prepared.batch_index  # schedule order: the first to send first
            if isinstance(index, int) and 0 <= index < len(waiters):
                outcomes.append((waiters[index], result, None))
            else:
                self._discard(result)  # belongs to no caller
        return outcomes

    # ---- handing results out -------------------------------------------------------------------
    def _settle(
        self, waiter: _Waiter, result: Any, error: BaseException | None, here: asyncio.AbstractEventLoop | None
    ) -> None:
        """Hand a result to its caller (``here``: the event loop running this thread)."""
        with self._lock:
            gone = waiter.state is _State.GONE
            if not gone:
                waiter.state, waiter.result, waiter.error = _State.READY, result, error
        if gone:
            self._discard(result)
        elif waiter.loop is None:
            waiter.event.set()
        elif waiter.loop is here:  # planned on the caller's own loop (a full batch)
            waiter.loop.call_soon(self._deliver, waiter)
        else:
            try:
                waiter.loop.call_soon_threadsafe(self._deliver, waiter)
            except RuntimeError:  # its event loop is closed: nobody will read this
                self._leave(waiter)

    def _deliver(self, waiter: _Waiter) -> None:
        """On the caller's event loop: resolve its future, unless the caller left."""
        future = waiter.future
        assert future is not None
        if future.done():  # cancelled meanwhile
            self._leave(waiter)
        elif waiter.state is _State.READY:
            if waiter.error is not None:
                future.set_exception(waiter.error)
            else:
                future.set_result(waiter.result)

    def _leave(self, waiter: _Waiter) -> None:
        """The caller will not use its request: drop it from the open batch, or discard
        what was planned for it (now, or when its batch is planned)."""
        with self._lock:
            state, waiter.state = waiter.state, _State.GONE
            if state is _State.QUEUED:
                self._pending.remove(waiter)
            result, waiter.result = (waiter.result, None) if state is _State.READY else (None, None)
        self._discard(result)

    def _discard(self, result: Any) -> None:
        """Forget a planned request nobody will send, in the pilot that planned it."""
        if result is None:
            return
        try:
            binding = self.planner.bound(result)
            binding.pilot.discard(binding.prepared)
        except Exception:  # never let one caller's cleanup fail the others
            _log.exception("could not discard a planned request")


if TYPE_CHECKING:  # mypy checks here that all three preparers implement the ports alike

    def _ports(
        pilot: ContextPilot, router: Router, batcher: MicroBatcher
    ) -> tuple[Preparer[Any], Preparer[Any], Preparer[Any], BatchPlanner[Any], BatchPlanner[Any]]:
        return pilot, router, batcher, pilot, router
