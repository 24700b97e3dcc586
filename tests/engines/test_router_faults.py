"""The router under faults and bad input (issue 20, "Nothing lost, round two").

``Replica`` is a stand-in, named as such: a stdlib HTTP server on 127.0.0.1 that answers
chat completions like an OpenAI-compatible engine, and can be told to be down (it drops
each connection without answering, as a crashed server's reset does) or slow (it answers
after a delay). It records every request body it receives, so a test can check what the
model would have read. Real engines cannot be made to fail on cue like this; the routing
over real llama-servers is in ``test_router.py``.

The rule pinned here: the model sees every document (a reference only ever points at a
turn whose text is in the messages sent), a call that raises changes nothing, and one
caller's bad input never fails another caller.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contextpilot_integrations import BatchRequest, Block, MicroBatcher
from contextpilot_integrations.engines import EngineTimeout, EngineUnavailable, Router, RoutingClient, Target
from contextpilot_integrations.errors import BlockTypeError, DuplicateRequestError
from contextpilot_integrations.testing.invariants import dangling_references
from tests.thread_support import in_thread

ROUTINGS = Router.ROUTINGS
POOL = {name: Block(id=name, text=f"Document {name}: " + f"the facts about {name}. " * 30) for name in "WXYZ"}
REFERENCE = "Please refer to "


def docs(*names: str) -> list[Block]:
    return [POOL[name] for name in names]


# ---- the stand-in replicas --------------------------------------------------------------------------------
class Replica:
    """A stand-in OpenAI-compatible replica on 127.0.0.1 (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "up"  # "up", "down" (drops the connection) or "slow" (answers after ``delay``)
        self.delay = 0.0
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with replica._lock:
                    replica.bodies.append(body)
                    mode, delay = replica.mode, replica.delay
                if mode == "down":
                    self.close_connection = True  # no answer: the client sees the connection reset
                    return
                if mode == "slow":
                    time.sleep(delay)
                if body.get("stream"):
                    payload = b'data: {"choices": [{"delta": {"content": "ok"}}]}\n\ndata: [DONE]\n\n'
                    kind = "text/event-stream"
                else:
                    payload, kind = b'{"choices": [{"message": {"content": "ok"}}]}', "application/json"
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except OSError:  # the client gave up waiting (a deadline)
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def reset(self) -> None:
        with self._lock:
            self.mode, self.delay, self.bodies = "up", 0.0, []

    def received(self, request_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [body for body in self.bodies if body.get("rid") == request_id]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    started = [Replica(name) for name in "ABC"]
    try:
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture
def fresh(replicas: list[Replica]) -> list[Replica]:
    for replica in replicas:
        replica.reset()
    return replicas


def targets_of(replicas: list[Replica]) -> list[Target]:
    return [Target(r.name, r.url) for r in replicas]


def assert_every_reference_is_carried(replicas: list[Replica]) -> int:
    """Every reference any replica received names a document whose text is in the messages
    of that same request (the history the caller sent). Returns how many were checked."""
    checked = 0
    for replica in replicas:
        for body in replica.bodies:
            messages = [str(m.get("content") or "") for m in body["messages"]]
            dangling = Counter(dangling_references(messages)) - Counter(dangling_references(messages[:-1]))
            assert not dangling, f"{replica.name} got references without their text: {dangling} in {messages!r:.400}"
            checked += messages[-1].count(REFERENCE)
    return checked


def finishes(call: Callable[[], Any], seconds: float = 5.0) -> Any:
    """``call()``, failing (instead of hanging the suite) if it does not return within ``seconds``."""
    return in_thread(call, seconds)


# ---- 1. the router's lock is never taken twice ---------------------------------------------------------------
TARGETS = [Target("a", "http://127.0.0.1:1"), Target("b", "http://127.0.0.1:2"), Target("c", "http://127.0.0.1:3")]


@pytest.mark.parametrize("conversation_id", [None, "user-42"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_every_routing_mode_prepares_plans_and_micro_batches_without_deadlock(
    routing: str, conversation_id: str | None
) -> None:
    router = Router(TARGETS, routing=routing)
    blocks = docs("X", "Y")
    first = finishes(lambda: router.prepare(blocks, "q", conversation_id))
    again = finishes(lambda: router.prepare(blocks, "q2", conversation_id))
    assert finishes(router.loads) == {"a": 0, "b": 0, "c": 0}  # from another thread: the lock is free
    if conversation_id is not None:
        assert again.target == first.target and again.reason == "conversation"
        assert (first.prepared.turn, again.prepared.turn) == (0, 1)
    planned = finishes(lambda: router.plan([BatchRequest(blocks, f"q{i}", conversation_id) for i in range(3)]))
    assert sorted(r.prepared.batch_index for r in planned) == [0, 1, 2]
    batcher = MicroBatcher(router, window=0.01)
    assert finishes(lambda: batcher.prepare(blocks, "q", conversation_id)).prepared.query == "q"

    async def burst() -> list[Any]:
        return await asyncio.gather(*(batcher.aprepare(blocks, f"q{i}", conversation_id) for i in range(4)))

    assert len(finishes(lambda: asyncio.run(burst()))) == 4
    assert finishes(router.loads) == {"a": 0, "b": 0, "c": 0}
    if conversation_id is not None:  # one conversation, numbered once, whatever the routing
        assert finishes(lambda: router.prepare(blocks, "q", conversation_id)).prepared.turn == 2 + 3 + 1 + 4


@pytest.mark.parametrize("routing", ROUTINGS)
def test_concurrent_conversations_are_numbered_once_each(routing: str) -> None:
    """Threads preparing many conversations at once: each conversation's turns are 0..n-1,
    on one target, and the round-robin order is not disturbed by the conversations."""
    router = Router(TARGETS, routing=routing)
    turns: dict[str, list[tuple[int, str]]] = {f"c{n}": [] for n in range(8)}

    def talk(cid: str) -> None:
        for n in range(25):
            routed = router.prepare(docs("X", "Y", "Z")[: 1 + n % 3], f"q{n}", cid)
            turns[cid].append((routed.prepared.turn, routed.target.name))  # type: ignore[arg-type]

    def everyone() -> None:
        threads = [threading.Thread(target=talk, args=(cid,)) for cid in turns]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    finishes(everyone, 20)
    for record in turns.values():
        assert [turn for turn, _ in record] == list(range(25))
        assert len({name for _, name in record}) == 1


# ---- 2. failover keeps the caller's kept_turns; turns are the conversation's ----------------------------------
def chat_turn(client: RoutingClient, blocks: list[Block], query: str, kept: dict[int, list[dict[str, str]]]) -> Any:
    """One turn of a caller that keeps the turns in ``kept`` (turn -> its two messages)."""
    history = [message for turn in sorted(kept) for message in kept[turn]]
    return client.chat(blocks, query, "c", kept_turns=set(kept), history=history, max_tokens=1)


def messages_of(served: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": served.prepared.render()}, {"role": "assistant", "content": served.result.text}]


@pytest.mark.breaches_allowed(
    "the caller keeps a turn whose own message refers to a turn it dropped; that stale reference is "
    "the caller's history (the new turn's references all have their text, checked here)"
)
def test_failover_keeps_kept_turns_and_numbers_turns_per_conversation(fresh: list[Replica]) -> None:
    """The issue's sequence: two replicas taking turns being down. The model must read X in
    full when the caller keeps no turn that carried it, whichever replica answers."""
    a, b = fresh[:2]
    router = Router(targets_of([a, b]), down_seconds=0)  # a replica that failed may be tried again at once
    with RoutingClient(router, timeout=5) as client:
        turn0 = chat_turn(client, docs("X"), "q0", {})
        assert (turn0.target.name, turn0.prepared.turn) == ("A", 0)
        a.mode = "down"
        turn1 = chat_turn(client, docs("Y", "X"), "q1", {0: messages_of(turn0)})
        assert (turn1.target.name, turn1.attempts, turn1.prepared.turn) == ("B", 2, 1)
        assert [r.block.id for r in turn1.prepared.references] == ["X"]  # turn 0 carries X, and is kept
        a.mode, b.mode = "up", "down"
        turn2 = chat_turn(client, docs("X"), "q2", {})  # no history: X must be sent in full
        assert (turn2.target.name, turn2.attempts, turn2.prepared.turn) == ("A", 2, 2)
        assert [block.id for block in turn2.prepared.blocks] == ["X"] and not turn2.prepared.references
        assert POOL["X"].text in a.received(turn2.prepared.request_id)[0]["messages"][-1]["content"]
        b.mode = "up"
        # keep only turn 1 (answered by B): Y is a reference to it, X (carried by turn 0) is not
        turn3 = chat_turn(client, docs("X", "Y"), "q3", {1: messages_of(turn1)})
        assert turn3.prepared.turn == 3 and [r.block.id for r in turn3.prepared.references] == ["Y"]
    assert assert_every_reference_is_carried([a, b]) == 3  # turn 1 (on A, then B) and turn 3
    assert router.loads() == {"A": 0, "B": 0}


def test_a_turn_that_fails_everywhere_gives_its_number_back(fresh: list[Replica]) -> None:
    a, b = fresh[:2]
    router = Router(targets_of([a, b]), down_seconds=0)
    with RoutingClient(router, timeout=5) as client:
        turn0 = chat_turn(client, docs("X"), "q0", {})
        a.mode = b.mode = "down"
        with pytest.raises(EngineUnavailable):
            chat_turn(client, docs("Y"), "q1", {0: messages_of(turn0)})
        a.mode = b.mode = "up"
        turn1 = chat_turn(client, docs("Y", "X"), "q1", {0: messages_of(turn0)})
    assert turn1.prepared.turn == 1  # the caller's second answered turn is turn 1
    assert [r.block.id for r in turn1.prepared.references] == ["X"]
    assert all(router.pilot(t).stats().live_requests <= 1 for t in router.targets)
    assert router.loads() == {"A": 0, "B": 0}


@pytest.mark.breaches_allowed(
    "the caller keeps a turn whose own message refers to a turn it dropped; that stale reference is "
    "the caller's history (the new turn's references all have their text, checked here)"
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    routing=st.sampled_from(ROUTINGS),
    count=st.integers(2, 3),
    steps=st.lists(
        st.tuples(
            st.lists(st.booleans(), min_size=3, max_size=3),  # which replicas are down
            st.lists(st.sampled_from(sorted(POOL)), min_size=1, max_size=4, unique=True),
            st.one_of(st.none(), st.lists(st.booleans(), max_size=8)),  # which answered turns to keep
        ),
        min_size=1,
        max_size=7,
    ),
)
def test_no_reference_is_ever_sent_without_its_text(
    replicas: list[Replica],
    routing: str,
    count: int,
    steps: list[tuple[list[bool], list[str], list[bool] | None]],
) -> None:
    """Property: replicas going down and up at random, any routing, a caller keeping any
    subset of its answered turns: every reference a replica receives has its text in the
    messages of that request; answered turns are numbered 0, 1, 2...; loads return to 0."""
    used = replicas[:count]
    for replica in replicas:
        replica.reset()
    router = Router(targets_of(used), routing=routing, down_seconds=0)

    def converse() -> None:
        answered: list[list[dict[str, str]]] = []
        with RoutingClient(router, timeout=5) as client:
            for down, names, keep in steps:
                for replica, is_down in zip(used, down, strict=False):
                    replica.mode = "down" if is_down else "up"
                kept = (
                    dict(enumerate(answered))
                    if keep is None
                    else {turn: answered[turn] for turn, flag in zip(range(len(answered)), keep, strict=False) if flag}
                )
                try:
                    served = chat_turn(client, docs(*names), f"q{len(answered)}", kept)
                except EngineUnavailable:
                    assert all(r.mode == "down" for r in used)
                    continue
                assert served.prepared.turn == len(answered)
                assert sorted(b.id for b in served.prepared.ranking) == sorted(names)
                answered.append(messages_of(served))

    finishes(converse, 30)
    assert_every_reference_is_carried(used)
    assert all(load == 0 for load in router.loads().values())


def test_a_cancelled_turn_gives_its_number_back(fresh: list[Replica]) -> None:
    """Cancelling ``achat`` (the caller gave up) withdraws the request like any failure."""
    a = fresh[0]
    router = Router(targets_of([a]))

    async def talk() -> Any:
        with RoutingClient(router, timeout=5) as client:
            turn0 = await client.achat(docs("X"), "q0", "c", max_tokens=1)
            a.mode, a.delay = "slow", 1.0
            task = asyncio.create_task(client.achat(docs("Y"), "q1", "c", history=messages_of(turn0), max_tokens=1))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert router.loads() == {"A": 0}
            a.mode = "up"
            return await client.achat(docs("Y", "X"), "q1", "c", history=messages_of(turn0), max_tokens=1)

    turn1 = finishes(lambda: asyncio.run(talk()))
    assert turn1.prepared.turn == 1 and [r.block.id for r in turn1.prepared.references] == ["X"]
    assert router.pilot("A").live_request_ids() == [a.bodies[0]["rid"]]  # turn 0's; the cancelled one is gone


# ---- 3. a slow answer is not a dead replica -------------------------------------------------------------------
@pytest.mark.parametrize("use_async", [False, True])
def test_a_slow_answer_keeps_the_replica_and_its_predictions(fresh: list[Replica], use_async: bool) -> None:
    a, b = fresh[:2]
    router = Router(targets_of([a, b]))
    shared = docs("W", "X", "Y")
    for target in router.targets:  # these blocks recur: labelled (a fresh pilot sends unshared blocks plain)
        router.pilot(target).discard(router.pilot(target).prepare(shared, "seen before"))
    with RoutingClient(router, timeout=5, deadline=0.3) as client:

        def chat(query: str) -> Any:
            if use_async:
                return asyncio.run(client.achat([*shared, POOL["Z"]], query, max_tokens=1))
            return client.chat([*shared, POOL["Z"]], query, max_tokens=1)

        assert chat("q0").target.name == "A"
        prefix = [block.id for block in shared]
        assert router.pilot("A").predicted_cached_blocks(prefix) == 3
        a.mode, a.delay = "slow", 20.0
        started = time.monotonic()
        with pytest.raises(EngineTimeout):
            chat("slow")
        assert time.monotonic() - started < 10.0  # the deadline, not the slow answer, ended it
        assert not router.is_down("A") and router.pilot("A").predicted_cached_blocks(prefix) == 3
        assert b.bodies == []  # not resent elsewhere: the deadline was the caller's
        a.mode = "up"
        served = [chat(f"q{n}") for n in range(1, 9)]
    assert [(r.target.name, r.reason, r.attempts) for r in served] == [("A", "cache", 1)] * 8
    assert router.loads() == {"A": 0, "B": 0}


def test_timeouts_are_not_unreachable_but_refused_connections_are() -> None:
    import httpx

    from contextpilot_integrations.engines.router import is_unreachable

    request = httpx.Request("POST", "http://127.0.0.1:1")
    assert is_unreachable(httpx.ConnectError("refused", request=request))
    assert is_unreachable(httpx.RemoteProtocolError("reset", request=request))
    assert is_unreachable(httpx.ConnectTimeout("no connection", request=request))  # never got the request
    assert not is_unreachable(httpx.ReadTimeout("slow", request=request))
    assert not is_unreachable(EngineTimeout("slow"))
    assert not is_unreachable(asyncio.TimeoutError())
    wrapped = EngineUnavailable("x timed out")
    wrapped.__cause__ = httpx.ReadTimeout("slow", request=request)
    assert not is_unreachable(wrapped)
    openai = pytest.importorskip("openai")
    sdk_timeout = openai.APITimeoutError(request=request)
    assert not is_unreachable(sdk_timeout)
    sdk_timeout.__cause__ = httpx.ConnectTimeout("no connection", request=request)
    assert is_unreachable(sdk_timeout)
    assert is_unreachable(openai.APIConnectionError(request=request))


# ---- 4. a rejected call changes nothing -----------------------------------------------------------------------
def routing_state(router: Router) -> tuple[object, ...]:
    """Everything a rejected call must leave as it was."""
    turns = {cid: (c.turns, dict(c.carrier)) for cid, c in router._group.conversations._conversations.items()}
    live = {t.name: router.pilot(t).live_request_ids() for t in router.targets}
    return dict(router._placements._where), router._next, turns, live, router.loads()


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize(
    "bad",
    [
        {"query": None},
        {"blocks": [b"bytes"]},
        {"kept_turns": 5},
        {"conversation_id": 7},
        {"blocks": [{"id": "d", "text": "one"}, {"id": "d", "text": "two"}]},
    ],
)
def test_a_rejected_prepare_records_nothing(routing: str, bad: dict[str, Any]) -> None:
    router = Router(TARGETS, routing=routing, max_conversations=2)
    finishes(lambda: router.prepare(docs("X"), "q", "alice"))
    finishes(lambda: router.prepare(docs("Y"), "q", "bob"))
    before = routing_state(router)
    call = {"blocks": docs("Z"), "query": "q", "conversation_id": "mallory", **bad}
    with pytest.raises((TypeError, ValueError)):
        router.prepare(call.pop("blocks"), call.pop("query"), call.pop("conversation_id"), **call)
    assert routing_state(router) == before
    assert router.conversation_target("alice") is not None and router.conversation_target("mallory") is None


def test_a_rejected_plan_records_nothing() -> None:
    router = Router(TARGETS, routing="round_robin", max_conversations=2)
    finishes(lambda: router.prepare(docs("X"), "q", "alice"))
    before = routing_state(router)
    with pytest.raises(BlockTypeError, match="request #1"):
        router.plan([BatchRequest(docs("Y"), "q", "mallory"), BatchRequest(docs("Z"), None, "eve")])  # type: ignore[arg-type]
    assert routing_state(router) == before and router.conversation_target("mallory") is None


def test_a_batch_with_a_live_request_id_records_nothing() -> None:
    """Before, the other target's share was planned (and its conversation recorded) before the
    share with the taken id failed."""
    router = Router(TARGETS[:2])
    router.plan([BatchRequest(docs("X", "Y"), "q", request_id="r1")])  # live on "a"
    router.started(TARGETS[0])  # "a" is busy: new prefixes go to "b"
    before = routing_state(router)
    batch = [
        BatchRequest(docs("Z", "W"), "q", "zed"),
        BatchRequest(docs("Z", "W"), "q2"),
        BatchRequest(docs("X", "Y"), "q3", request_id="r1"),  # a's prefix, a taken id
    ]
    with pytest.raises(DuplicateRequestError, match="r1"):
        router.plan(batch)
    assert routing_state(router) == before
    router.finished(TARGETS[0])


# ---- issue 31, item 7: a replica that accepts connections and never answers ---------------------------
class Silent:
    """A stand-in for a hung replica, named as such: a TCP socket on 127.0.0.1 that accepts
    every connection and never reads or answers (a wedged engine process)."""

    def __init__(self) -> None:
        import socket

        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[Any] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(connection)  # held open, never answered

    def stop(self) -> None:
        self.sock.close()
        for connection in self.accepted:
            connection.close()


@pytest.fixture
def silent() -> Iterator[Silent]:
    server = Silent()
    yield server
    server.stop()


def test_a_replica_that_never_answers_loses_its_traffic_after_n_timeouts(fresh: list[Replica], silent: Silent) -> None:
    """30 sequential calls over two healthy replicas and a hung one: without a breaker every
    third call timed out (10 of 30); with it, the first ``breaker_failures`` do, then none.
    The hung replica keeps its predicted cache (slow is not down) and its stats show why."""
    a, b = fresh[:2]
    router = Router([Target("A", a.url), Target("B", b.url), Target("S", silent.url)])  # breaker_failures=3
    known = docs("W", "X", "Y")
    router.pilot("S").discard(router.pilot("S").prepare(known, "seen before"))
    router.pilot("S").prepare(known, "served before the hang")  # S holds this prefix
    failed = 0
    with RoutingClient(router, timeout=5, deadline=1.0) as client:
        for n in range(30):
            try:
                client.chat([Block(id=f"d{n}", text=f"Document {n}. " * 20)], f"q{n}", max_tokens=1)
            except EngineTimeout:
                failed += 1
    assert failed <= 3, f"{failed} of 30 calls failed"
    stats = router.stats()["S"]
    assert stats.breaker == "open" and stats.timeouts == failed and stats.breaker_opened == 1
    assert stats.failures == failed and stats.consecutive_failures == 3 and stats.open_for_s > 0
    assert router.is_down("S") and router.stats()["A"].breaker == "closed"
    assert router.pilot("S").predicted_cached_blocks([b.id for b in known]) == 3  # slow, not down
    assert router.loads() == {"A": 0, "B": 0, "S": 0}


def test_concurrent_callers_stop_reaching_a_replica_that_never_answers(fresh: list[Replica], silent: Silent) -> None:
    """Four threads, thirty calls each (over ten failed without a breaker): once the
    breaker opens nothing more goes to the hung replica; what failed is at most the
    breaker's count plus the calls already in flight."""
    a, b = fresh[:2]
    router = Router([Target("A", a.url), Target("B", b.url), Target("S", silent.url)])  # breaker_failures=3
    failures: list[int] = []
    lock = threading.Lock()

    def caller(worker: int, client: RoutingClient) -> None:
        for n in range(30):
            try:
                client.chat([Block(id=f"w{worker}-{n}", text=f"Doc {worker} {n}. " * 20)], "q", max_tokens=1)
            except EngineTimeout:
                with lock:
                    failures.append(1)

    with RoutingClient(router, timeout=5, deadline=1.0) as client:
        threads = [threading.Thread(target=caller, args=(w, client)) for w in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert len(failures) <= 3 + 3, f"{len(failures)} of 120 calls failed"
    stats = router.stats()["S"]
    assert stats.breaker == "open" and stats.failures == len(failures) and stats.breaker_opened == 1


@pytest.mark.parametrize("use_async", [False, True])
def test_the_breaker_probes_after_its_cool_down_and_closes_on_success(fresh: list[Replica], use_async: bool) -> None:
    a, b = fresh[:2]
    router = Router(targets_of([a, b]), breaker_failures=2, down_seconds=3.0)
    with RoutingClient(router, timeout=5, deadline=1.0) as client:

        def chat(query: str) -> Any:
            blocks = [Block(id=query, text=f"About {query}. " * 20)]
            if use_async:
                return asyncio.run(client.achat(blocks, query, max_tokens=1))
            return client.chat(blocks, query, max_tokens=1)

        a.mode, a.delay = "slow", 2.0  # takes requests, answers too late
        outcomes = []
        for n in range(6):
            try:
                outcomes.append(chat(f"q{n}").target.name)
            except EngineTimeout:
                outcomes.append("timeout")
        assert outcomes.count("timeout") == 2 and outcomes[-3:] == ["B"] * 3
        assert router.stats()["A"].breaker == "open"
        time.sleep(3.05)
        assert router.stats()["A"].breaker == "half_open" and not router.is_down("A")
        with pytest.raises(EngineTimeout):  # the probe fails: open again
            for n in range(3):
                chat(f"probe{n}")
        assert router.stats()["A"].breaker == "open" and router.stats()["A"].breaker_opened == 2
        a.mode = "up"
        time.sleep(3.05)
        served = [chat(f"after{n}").target.name for n in range(4)]
    assert "A" in served  # the probe succeeded: closed, A takes its share again
    assert router.stats()["A"].breaker == "closed" and router.stats()["A"].consecutive_failures == 0
    assert router.loads() == {"A": 0, "B": 0}
