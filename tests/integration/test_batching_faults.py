"""MicroBatcher under bad input, cancellation and dead event loops (issue 20, items 5 and 6).

The rule they pin: every caller gets its own request or its own error; one caller's bad
input, cancellation or closed event loop never fails or blocks another caller; and a
request nobody will send does not stay live in the index. Every risky call runs in a
thread joined with a timeout (or under ``asyncio.wait_for``), so a regression fails
instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import Block, BlockTypeError, ContextPilot, MicroBatcher
from contextpilot_integrations.engines import Router, Target
from contextpilot_integrations.pilot import BatchRequest
from tests.thread_support import in_thread

TIMEOUT = 10.0
"""Seconds a call may take before the test calls it a hang (the calls take milliseconds)."""


def docs(*names: str) -> list[Block]:
    return [Block(id=name, text=f"{name} is about topic {name}. " * 8) for name in names]


def wait_until(condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


def threaded_callers(batcher: MicroBatcher, calls: Sequence[tuple[list[Block], Any]]) -> list[Any]:
    """One thread per (blocks, query); each one's result or exception, in input order."""
    outcomes: list[Any] = [None] * len(calls)

    def call(index: int) -> None:
        blocks, query = calls[index]
        try:
            outcomes[index] = batcher.prepare(blocks, query)
        except Exception as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "a caller never returned"
    return outcomes


class GatedPlanner:
    """A pilot whose ``plan`` waits for ``release`` (after setting ``entered``): a batch
    caught between being planned and being handed out."""

    def __init__(self, pilot: ContextPilot) -> None:
        self.pilot = pilot
        self.entered = threading.Event()
        self.release = threading.Event()

    def plan(self, requests: Sequence[BatchRequest], *, in_order: bool = True) -> Any:
        self.entered.set()
        assert self.release.wait(TIMEOUT)
        return self.pilot.plan(requests, in_order=in_order)

    def bound(self, prepared: Any) -> Any:
        return self.pilot.bound(prepared)


class PickyPlanner:
    """A pilot that rejects any batch holding the query ``"poison"``, naming it, as
    :meth:`ContextPilot.plan` names a bad request (valid on arrival, refused by the planner)."""

    def __init__(self, pilot: ContextPilot) -> None:
        self.pilot = pilot
        self.batch_sizes: list[int] = []

    def plan(self, requests: Sequence[BatchRequest], *, in_order: bool = True) -> Any:
        self.batch_sizes.append(len(requests))
        for index, request in enumerate(requests):
            if request.query == "poison":
                raise ValueError(f"request #{index}: poisoned")
        return self.pilot.plan(requests, in_order=in_order)

    def bound(self, prepared: Any) -> Any:
        return self.pilot.bound(prepared)


# ---- 5. one bad request fails only its caller -------------------------------------------------
def test_a_bad_query_fails_only_its_own_caller() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=60.0, max_batch=5)  # the five valid ones fill the batch
    calls: list[tuple[list[Block], Any]] = [(docs("shared", f"own{i}"), f"q{i}") for i in range(5)]
    calls.append((docs("shared", "bad"), None))
    outcomes = threaded_callers(batcher, calls)
    assert isinstance(outcomes[5], BlockTypeError) and "request #" not in str(outcomes[5])
    for index, outcome in enumerate(outcomes[:5]):
        assert outcome.query == f"q{index}" and f"own{index}" in {b.id for b in outcome.blocks}
    assert batcher.batches == 1 and batcher.requests == 5  # the valid five still planned together
    assert sorted(pilot.live_request_ids()) == sorted(o.request_id for o in outcomes[:5])


@pytest.mark.parametrize(
    ("blocks", "query", "conversation_id", "kept_turns"),
    [
        ([""], "q", None, None),  # an empty block
        ("one string", "q", None, None),  # not a sequence of blocks
        (["a"], "q", "", None),  # an empty conversation id
        (["a"], "q", "c", 5),  # kept_turns not a collection
    ],
)
def test_every_bad_argument_is_refused_in_the_callers_own_call(
    blocks: Any, query: Any, conversation_id: Any, kept_turns: Any
) -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=0.05)

    async def burst() -> list[Any]:
        good = [batcher.aprepare(docs(f"g{i}"), f"q{i}") for i in range(3)]
        bad = batcher.aprepare(blocks, query, conversation_id, kept_turns=kept_turns)
        return await asyncio.wait_for(asyncio.gather(*good, bad, return_exceptions=True), TIMEOUT)

    *good, bad = asyncio.run(burst())
    assert isinstance(bad, (TypeError, ValueError)) and "request #" not in str(bad)
    assert [g.query for g in good] == ["q0", "q1", "q2"]
    assert sorted(pilot.live_request_ids()) == sorted(g.request_id for g in good)


def test_a_batch_the_planner_rejects_fails_only_the_offending_caller() -> None:
    pilot = ContextPilot()
    planner = PickyPlanner(pilot)
    batcher = MicroBatcher(planner, window=60.0, max_batch=4)
    calls = [(docs("s", "a"), "q0"), (docs("s", "b"), "poison"), (docs("s", "c"), "q2"), (docs("s", "d"), "q3")]
    outcomes = threaded_callers(batcher, calls)
    assert isinstance(outcomes[1], ValueError) and "poisoned" in str(outcomes[1])
    assert [outcomes[i].query for i in (0, 2, 3)] == ["q0", "q2", "q3"]
    assert planner.batch_sizes[0] == 4  # the whole batch was tried first
    assert sorted(pilot.live_request_ids()) == sorted(outcomes[i].request_id for i in (0, 2, 3))


# ---- 6a. a cancelled caller leaves nothing live -------------------------------------------------
def test_a_caller_cancelled_before_planning_leaves_the_batch() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=60.0, max_batch=3)  # only a full batch is planned in time

    async def cancel_one() -> list[Any]:
        gone = asyncio.create_task(batcher.aprepare(docs("x"), "gone"))
        kept = asyncio.create_task(batcher.aprepare(docs("y"), "kept"))
        await asyncio.sleep(0)  # both queued in one batch
        gone.cancel()
        await asyncio.sleep(0)  # it left the batch: two more fill it
        later = [asyncio.create_task(batcher.aprepare(docs(f"z{i}"), f"later{i}")) for i in range(2)]
        return await asyncio.wait_for(asyncio.gather(kept, *later), TIMEOUT)

    planned = asyncio.run(cancel_one())
    assert [p.query for p in planned] == ["kept", "later0", "later1"] and batcher.requests == 3
    assert sorted(pilot.live_request_ids()) == sorted(p.request_id for p in planned)


def test_a_caller_cancelled_while_its_batch_is_planned_is_discarded() -> None:
    pilot = ContextPilot()
    planner = GatedPlanner(pilot)
    batcher = MicroBatcher(planner, window=0.001)

    async def cancel_during_planning() -> None:
        task = asyncio.create_task(batcher.aprepare(docs("x"), "gone"))
        assert await asyncio.to_thread(planner.entered.wait, TIMEOUT)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        planner.release.set()

    asyncio.run(asyncio.wait_for(cancel_during_planning(), TIMEOUT))
    wait_until(lambda: batcher.requests == 1)  # planned after its caller left
    wait_until(lambda: pilot.live_request_ids() == [])


def test_a_caller_cancelled_after_its_result_was_set_is_discarded() -> None:
    """The result is set, but the task is cancelled before it resumes: nobody got it."""
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=0.001)
    handed = threading.Event()

    async def cancel_late() -> None:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def spy(*args: Any, **kwargs: Any) -> Any:
            handle = call_soon_threadsafe(*args, **kwargs)
            handed.set()
            return handle

        loop.call_soon_threadsafe = spy  # type: ignore[method-assign, assignment]
        task = asyncio.create_task(batcher.aprepare(docs("x"), "late"))
        await asyncio.sleep(0)
        assert handed.wait(TIMEOUT)  # blocks the loop: the result waits in its queue
        await asyncio.sleep(0)  # the result is set now; the task resumes at the next step
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(cancel_late(), TIMEOUT))
    assert pilot.live_request_ids() == []


# ---- 6b-6d. event loops that die or block ----------------------------------------------------------
def test_a_timed_out_caller_does_not_leave_a_dead_loops_timer() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=1.0)  # long past the timeout, even on a loaded machine
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(batcher.aprepare(docs("x"), "timed out"), 0.001))
    later = in_thread(lambda: batcher.prepare(docs("y"), "later"))
    assert later.query == "later" and pilot.live_request_ids() == [later.request_id]


def test_a_closed_loops_caller_is_dropped_and_the_others_are_released() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=0.1)
    loop = asyncio.new_event_loop()
    orphan = loop.create_task(batcher.aprepare(docs("x"), "orphan"))
    loop.run_until_complete(asyncio.sleep(0.001))  # the orphan waits in the batch
    loop.close()  # without cancelling it: its future can never be settled
    calls = [(docs("x", f"t{i}"), f"t{i}") for i in range(3)]
    outcomes = threaded_callers(batcher, calls)
    assert [o.query for o in outcomes] == ["t0", "t1", "t2"]
    wait_until(lambda: sorted(pilot.live_request_ids()) == sorted(o.request_id for o in outcomes))
    assert not orphan.done()


def test_a_sync_call_on_the_loop_thread_does_not_deadlock_the_loops_batch() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=0.05)

    async def mixed() -> tuple[Any, Any]:
        task = asyncio.create_task(batcher.aprepare(docs("x"), "async"))
        await asyncio.sleep(0)  # the async caller opened the batch
        sync = batcher.prepare(docs("y"), "sync")  # blocks this loop's thread
        return sync, await task

    sync, from_async = in_thread(lambda: asyncio.run(asyncio.wait_for(mixed(), TIMEOUT)))
    assert (sync.query, from_async.query) == ("sync", "async")
    assert sorted(pilot.live_request_ids()) == sorted([sync.request_id, from_async.request_id])


# ---- the window and max_batch still hold ----------------------------------------------------------
def test_a_full_batch_is_planned_at_once_and_released_in_schedule_order() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=60.0, max_batch=4)  # only max_batch can flush in time
    released: list[int] = []

    async def burst() -> list[Any]:
        async def one(index: int) -> Any:
            prepared = await batcher.aprepare(docs("s1", "s2", f"own{index}"), f"q{index}")
            released.append(prepared.batch_index)
            return prepared

        return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(4))), TIMEOUT)

    prepared = asyncio.run(burst())
    assert batcher.batches == 1 and [p.query for p in prepared] == ["q0", "q1", "q2", "q3"]
    planned_order = sorted(prepared, key=lambda p: pilot.live_request_ids().index(p.request_id))
    assert released == [p.batch_index for p in planned_order]


# ---- many callers at once --------------------------------------------------------------------------
def test_hundreds_of_mixed_callers_each_get_their_own_request() -> None:
    """Threads and two event loops share one batcher (through a router, so results are
    routed ones); some callers send bad input, some are cancelled at random moments.
    Every caller gets its own request or its own error, and exactly the requests that
    reached a caller stay live."""
    router = Router([Target("a", "http://127.0.0.1:1"), Target("b", "http://127.0.0.1:2")])
    batcher = MicroBatcher(router, window=0.002, max_batch=16)
    rng = random.Random(20)
    kinds: dict[str, str] = {}  # query -> "ok", "bad" or "cancel"
    plans: dict[str, tuple[list[Block], float]] = {}  # query -> its blocks, and when to cancel it
    for i in range(100):
        kinds[f"thread-{i}"] = "bad" if i % 9 == 0 else "ok"
    for name in ("loop1", "loop2"):
        for i in range(60):
            kinds[f"{name}-{i}"] = "cancel" if i % 4 == 1 else "bad" if i % 10 == 3 else "ok"
    for query in kinds:
        plans[query] = (docs(f"shared{rng.randrange(4)}", f"own-{query}"), rng.choice([0.0, rng.uniform(0, 0.006)]))
    received: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    cancelled: set[str] = set()
    record = threading.Lock()

    def query_of(query: str) -> Any:
        return None if kinds[query] == "bad" else query

    def threaded(query: str) -> None:
        try:
            result = batcher.prepare(plans[query][0], query_of(query))
            with record:
                received[query] = result
        except Exception as exc:
            with record:
                errors[query] = exc

    async def one(query: str) -> None:
        blocks, delay = plans[query]
        task = asyncio.create_task(batcher.aprepare(blocks, query_of(query)))
        if kinds[query] == "cancel":
            await asyncio.sleep(delay)
            task.cancel()
        try:
            result = await task
            with record:
                received[query] = result
        except asyncio.CancelledError:
            with record:
                cancelled.add(query)
        except Exception as exc:
            with record:
                errors[query] = exc

    def loop_callers(name: str) -> None:
        queries = [query for query in kinds if query.startswith(f"{name}-")]

        async def main() -> None:
            await asyncio.wait_for(asyncio.gather(*(one(query) for query in queries)), TIMEOUT)

        asyncio.run(main())

    workers = [threading.Thread(target=threaded, args=(q,), daemon=True) for q in kinds if q.startswith("thread-")]
    workers += [threading.Thread(target=loop_callers, args=(name,), daemon=True) for name in ("loop1", "loop2")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(TIMEOUT)
        assert not worker.is_alive(), "a caller never returned"

    assert len(kinds) == 220
    assert set(received) | set(errors) | cancelled == set(kinds)  # each caller heard back once
    assert not set(received) & set(errors) and not (set(received) | set(errors)) & cancelled
    for query, routed in received.items():
        assert kinds[query] != "bad"
        assert routed.prepared.query == query and f"own-{query}" in {b.id for b in routed.prepared.blocks}
    for query, error in errors.items():
        assert kinds[query] == "bad" and isinstance(error, BlockTypeError), (query, error)
    assert {q for q, kind in kinds.items() if kind == "ok"} <= set(received)
    assert cancelled  # the cancels at delay 0 at least

    def live() -> set[str]:
        return {rid for target in router.targets for rid in router.pilot(target).live_request_ids()}

    expected = {routed.prepared.request_id for routed in received.values()}
    assert len(expected) == len(received)
    wait_until(lambda: live() == expected)  # a discard may still be on its way from the planning thread
    assert live() == expected


@settings(max_examples=40, deadline=None)
@given(
    callers=st.lists(
        st.tuples(st.sampled_from(["async", "thread"]), st.sampled_from(["ok", "bad", "cancel"]), st.integers(0, 4)),
        min_size=1,
        max_size=12,
    ),
    max_batch=st.integers(1, 5),
    window=st.sampled_from([0.0, 0.001, 0.003]),
)
def test_property_every_caller_gets_its_own_outcome(
    callers: list[tuple[str, str, int]], max_batch: int, window: float
) -> None:
    """Property: whatever the mix, sizes and cancel points, each valid caller gets its own
    request, each bad one its own error, and only delivered requests stay live."""
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=window, max_batch=max_batch)

    async def one(index: int, how: str, kind: str, yields: int) -> tuple[str, Any]:
        query: Any = None if kind == "bad" else f"q{index}"
        blocks = docs(f"shared{index % 3}", f"own{index}")
        call = asyncio.to_thread(batcher.prepare, blocks, query) if how == "thread" else batcher.aprepare(blocks, query)
        task = asyncio.ensure_future(call)
        if kind == "cancel" and how == "async":
            for _ in range(yields):
                await asyncio.sleep(0)
            task.cancel()
        try:
            return "ok", await task
        except asyncio.CancelledError:
            return "cancelled", None
        except Exception as exc:
            return "error", exc

    async def main() -> list[tuple[str, Any]]:
        return await asyncio.wait_for(asyncio.gather(*(one(i, *c) for i, c in enumerate(callers))), TIMEOUT)

    outcomes = in_thread(lambda: asyncio.run(main()))
    delivered = set()
    for index, ((how, kind, _), (outcome, value)) in enumerate(zip(callers, outcomes, strict=True)):
        if kind == "bad":
            assert outcome == "error" and isinstance(value, BlockTypeError)
        elif kind == "ok" or how == "thread":  # a thread's call is not cancelled
            assert outcome == "ok", (outcome, value)
        else:
            assert outcome in ("ok", "cancelled")
        if outcome == "ok":
            assert value.query == f"q{index}" and f"own{index}" in {b.id for b in value.blocks}
            delivered.add(value.request_id)
    wait_until(lambda: set(pilot.live_request_ids()) == delivered)
