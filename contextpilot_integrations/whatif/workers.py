"""Several application workers in front of one engine: independent indexes vs one shared view.

A service run as ``uvicorn --workers N`` (or N pods) has N ``ContextPilot`` instances in
front of the same engine. Each one sees only the requests it prepared, so it predicts only
part of what the engine caches. :func:`replay_workers` deals a trace round-robin to N
workers, serves every prompt from ONE :class:`~.simulate.RadixCacheSimulator`, and tells
each eviction to the worker that sent the evicted request (what that worker's engine
feedback would tell it). With ``shared=True`` every worker also applies every other
worker's entries (sent requests, evictions), as :mod:`contextpilot_integrations.shared`
does through the broker, ``lag`` requests later (0: before the next request arrives).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..core.gain import index_keys
from ..pilot import ContextPilot
from .replay import (
    Arrival,
    Feedback,
    PromptShape,
    ReplayResult,
    _Blocks,
    _system,
    _Tally,
    arrival_order,
    prompt_units,
)
from .report import Row
from .simulate import RadixCacheSimulator, SimulatedRequest
from .trace import TraceRequest

__all__ = ["replay_workers", "worker_rows"]

_Entry = tuple[int, str, tuple[Any, ...]]  # (origin worker, pilot method, its arguments)


def replay_workers(
    trace: Sequence[TraceRequest],
    strategy: str,
    capacity_tokens: int | None,
    *,
    workers: int,
    shared: bool = False,
    lag: int = 0,
    feedback: Feedback = "request",
    shape: PromptShape | None = None,
    arrival: Arrival = "interleave",
    on_request: Callable[[], object] | None = None,
) -> ReplayResult:
    """Online replay of ``trace`` as ``workers`` workers (round-robin) on one engine.

    Args:
        shared: every worker applies every other worker's entries (``lag`` requests later).
        feedback: ``exact``, ``request`` or ``none``: eviction notices, each to the worker
            that sent the request (and through the shared log to all); ``usage``: each
            worker sees its own requests' cached-token counts.
    """
    if workers < 1:
        raise ValueError("workers must be at least 1")
    if lag < 0:
        raise ValueError("lag must be >= 0")
    shape = shape or PromptShape()
    pilots = [ContextPilot(strategy, max_live_requests=max(len(trace), 1)) for _ in range(workers)]
    cache = RadixCacheSimulator(capacity_tokens)
    blocks = _Blocks()
    tally = _Tally()
    owner: dict[str, int] = {}  # request id -> worker that sent it
    layout: dict[str, tuple[int, int]] = {}  # request id -> (units before its blocks, blocks)
    log: deque[tuple[int, _Entry]] = deque()  # (step at which it is applied, entry)
    system = _system(shape)
    for step, index in enumerate(arrival_order(trace, arrival)):
        while log and log[0][0] <= step:
            _, (origin, method, arguments) = log.popleft()
            for number, pilot in enumerate(pilots):
                if number != origin:
                    getattr(pilot, method)(*arguments)
        worker = step % workers
        pilot = pilots[worker]
        request = trace[index]
        start = time.perf_counter()
        prepared = pilot.prepare(blocks.of(request), request.question or "", request_id=f"r{index}")
        tally.seconds += time.perf_counter() - start
        own, block_tokens, reference_tokens = prompt_units(prepared, request, shape)
        served = cache.request(prepared.request_id, system + own)
        tally.add(served, block_tokens, reference_tokens)
        rid = prepared.request_id
        owner[rid] = worker
        layout[rid] = (len(system), len(prepared.blocks))
        entries: list[_Entry] = []
        if shared:
            entries.append((worker, "record_sent", (rid, index_keys(prepared))))
        entries += _feedback(pilots, served, feedback, owner, layout, prepared, worker)
        for entry in entries if shared else ():
            log.append((step + 1 + lag, entry))
        if on_request is not None:
            on_request()
    return ReplayResult(
        strategy=strategy,
        mode="online",
        capacity_tokens=capacity_tokens,
        requests=len(trace),
        prompt_tokens=tally.prompt,
        cached_tokens=tally.cached,
        block_tokens=tally.blocks,
        reference_tokens=tally.references,
        max_prompt_tokens=tally.longest,
        pilot_seconds=tally.seconds,
        oversized_requests=tally.oversized,
        held_tokens=cache.used_tokens,
        routing=f"{workers} workers, {'shared' if shared else 'independent'}",
    )


def _feedback(
    pilots: list[ContextPilot],
    served: SimulatedRequest,
    feedback: Feedback,
    owner: dict[str, int],
    layout: dict[str, tuple[int, int]],
    prepared: Any,
    worker: int,
) -> list[_Entry]:
    """Apply the engine's feedback to the worker it reaches; return it as shared-log entries."""
    entries: list[_Entry] = []
    if feedback == "none":
        return entries
    if feedback == "usage":
        before, count = layout[prepared.request_id]
        cached = max(0, min(count, served.hit_blocks - before))
        pilots[worker].observe_cached(prepared, cached)
        return entries  # observe_cached's evictions and truncations are local guesses here
    for rid, cached_units in served.evicted:
        where = layout.get(rid)
        if where is None:
            continue
        before, count = where
        target = pilots[owner[rid]]
        if feedback == "request":
            del layout[rid]
            target.evict([rid])
            entries.append((owner[rid], "evict", ([rid],)))
        else:
            keep = max(0, min(count, cached_units - before))
            target.truncate(rid, keep)
            entries.append((owner[rid], "truncate", (rid, keep)))
    return entries


def worker_rows(
    trace: Sequence[TraceRequest],
    strategy: str,
    capacity_tokens: int,
    fraction: float,
    *,
    workers: int,
    shared: bool,
    name: str,
    baseline: bool,
    feedback: Feedback,
    shape: PromptShape,
    arrival: Arrival,
) -> list[Row]:
    """The CLI's rows for ``--workers N [--shared]``: independent workers, and with
    ``shared`` the shared view beside them."""
    rows = []
    for view in (False, True) if shared else (False,):
        result = replay_workers(
            trace, strategy, capacity_tokens, workers=workers, shared=view, feedback=feedback, shape=shape,
            arrival=arrival,
        )  # fmt: skip
        text = f"{name}, {workers} workers, {'shared view' if view else 'independent'}"
        rows.append(Row(fraction, text, result, baseline and not view))
    return rows
