"""Cache-aware routing across targets, and micro-batching: the decisions on their own, then
real llama-servers (replicas, and the slots of one server) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from contextpilot_integrations import Block, ContextPilot, MicroBatcher
from contextpilot_integrations.engines import CacheAwarePolicy, EngineUnavailable, Router, RoutingClient, Target
from contextpilot_integrations.pilot.binding import aprepare_bound, prepare_bound
from contextpilot_integrations.testing.llama_server import free_port
from contextpilot_integrations.whatif import multihop_trace, working_set_tokens
from contextpilot_integrations.whatif.replay import replay_routed
from tests.engine_support import LlamaServer, start_llama_server, start_llama_servers


def docs(*names: str, size: int = 400) -> list[Block]:
    return [Block(id=name, text=(f"{name} is about topic {name}. " * 40)[:size]) for name in names]


TARGETS = [Target("a", "http://127.0.0.1:1"), Target("b", "http://127.0.0.1:2"), Target("c", "http://127.0.0.1:3")]


def seen_before(router: Router, blocks: list[Block]) -> None:
    """Other requests carried these blocks (then left): they recur, so every pilot labels them
    (a fresh pilot sends blocks nobody shared plain, as without ContextPilot)."""
    for target in router.targets:
        pilot = router.pilot(target)
        pilot.discard(pilot.prepare(blocks, "seen before"))


def test_cache_rule_sends_a_request_where_its_prefix_lives() -> None:
    router = Router(TARGETS)
    seen_before(router, docs("x", "y", "z"))
    first = router.prepare(docs("x", "y", "z"), "q")
    second = router.prepare(docs("x", "z", "w", "y"), "q")  # the same top block: the prefix under it
    assert second.target == first.target and second.reason == "cache"
    assert [b.id for b in second.prepared.blocks][:3] == [b.id for b in first.prepared.blocks]
    assert router.prepare(docs("p", "q"), "q").reason == "room"  # nothing shared: the emptiest cache


def test_balance_rule_and_stickiness_and_failures() -> None:
    router = Router(TARGETS, policy=CacheAwarePolicy(balance_abs_threshold=2, balance_rel_threshold=1.5))
    first = router.prepare(docs("x", "y"), "q")
    for _ in range(3):
        router.started(first.target)  # its engine is busy
    routed = router.prepare(docs("x", "y", "z"), "q")
    assert routed.reason == "balance" and routed.target != first.target
    talk = router.prepare(docs("m"), "q", conversation_id="c1")
    assert router.prepare(docs("n"), "q", conversation_id="c1").target == talk.target  # history lives there
    router.mark_down(talk.target)
    moved = router.prepare(docs("n"), "q", conversation_id="c1")
    assert moved.target != talk.target  # routed around while down
    assert router.pilot(talk.target).stats().live_requests == 0  # its prediction is void


def test_oversized_requests_are_cached_nowhere() -> None:
    small = [
        Target("a", "http://127.0.0.1:1", capacity_tokens=50),
        Target("b", "http://127.0.0.1:2", capacity_tokens=50),
    ]
    router = Router(small)
    routed = router.prepare(docs("x", "y"), "q")
    assert routed.reason == "oversized" and router.pilot(routed.target).stats().live_requests == 0


def test_baseline_routings() -> None:
    rr = Router(TARGETS, routing="round_robin")
    assert [rr.prepare(docs("x"), "q").target.name for _ in range(4)] == ["a", "b", "c", "a"]
    least = Router(TARGETS, routing="least_loaded")
    least.started(TARGETS[0])
    assert least.prepare(docs("x"), "q").target.name == "b"
    with pytest.raises(ValueError, match="routing"):
        Router(TARGETS, routing="random")


def test_prepare_bound_binds_the_routed_targets_pilot_to_the_prepared_request() -> None:
    routed = Router(TARGETS).prepare(docs("x", "y"), "q", "c1", kept_turns=[], partition="tenant")
    binding = prepare_bound(router := Router(TARGETS), docs("x", "y"), "q", "c1", kept_turns=[], partition="tenant")
    assert binding.pilot is router.pilot(routed.target)
    assert replace(binding.prepared, request_id=routed.prepared.request_id) == routed.prepared  # ids are random
    assert binding.prepared.request_id in binding.pilot.live_request_ids()
    assert router.conversation_target("c1") == routed.target.name


def test_aprepare_bound_binds_under_asyncio() -> None:
    router = Router(TARGETS)
    binding = asyncio.run(aprepare_bound(router, docs("x", "y"), "q"))
    assert router.target_of(binding.pilot) is not None
    assert binding.prepared.request_id in binding.pilot.live_request_ids()


def test_router_batches_keep_similar_requests_together_and_balance() -> None:
    from contextpilot_integrations.pilot import BatchRequest

    router = Router(TARGETS[:2])
    items = [
        BatchRequest(docs(*(["s1", "s2", "s3"] if i % 2 else ["t1", "t2", "t3"]), f"own{i}"), "q") for i in range(8)
    ]
    routed = router.plan(items)
    assert sorted(r.prepared.batch_index for r in routed) == list(range(8))  # type: ignore[type-var]
    by_group = {i % 2: {r.target.name for r in routed if r.prepared.batch_index % 2 == i % 2} for i in range(2)}  # type: ignore[operator]
    assert by_group[0] != by_group[1] and all(len(names) == 1 for names in by_group.values())


def test_micro_batcher_plans_a_burst_together() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=0.5, max_batch=6)  # the burst fills one batch, however slow the machine
    shared = docs("s1", "s2", "s3")

    async def burst() -> list[object]:
        return await asyncio.gather(*(batcher.aprepare([*shared[::-1], *docs(f"own{i}")], f"q{i}") for i in range(6)))

    prepared = asyncio.run(burst())
    assert batcher.batches == 1 and batcher.requests == 6
    assert sum(p.cached_blocks for p in prepared) == 5 * 3  # type: ignore[attr-defined]  # all but the first reuse
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda i=i: results.append(batcher.prepare([*shared, *docs(f"t{i}")], "q")))
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and batcher.batches <= 3
    with pytest.raises(ValueError):
        MicroBatcher(pilot, window=-1)


def test_a_bad_request_fails_only_its_caller() -> None:
    batcher = MicroBatcher(ContextPilot(), window=0.02)

    async def burst() -> list[object]:
        good = batcher.aprepare(docs("a"), "q")
        bad = batcher.aprepare(docs("b"), "q", kept_turns=5)  # type: ignore[arg-type]
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(burst())
    assert isinstance(bad, TypeError) and good.query == "q"  # type: ignore[attr-defined]  # (issue 20, item 5)


def test_the_simulator_routes_across_caches() -> None:
    trace = multihop_trace()[:900]
    capacity = int(working_set_tokens(trace) * 0.25 / 3)
    rr = replay_routed(trace, "retrieval", capacity, targets=3, routing="round_robin")
    ours = replay_routed(trace, "trie", capacity, targets=3, routing="cache_aware")
    assert ours.hit_ratio > 3 * rr.hit_ratio and ours.max_load_share <= 1.5 and ours.routing == "cache_aware"
    assert sum(ours.requests_per_target) == 900


# ---- real servers -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[LlamaServer]]:
    """Two llama-servers (one CPU thread each): replicas to route between."""
    with start_llama_servers(tmp_path_factory.mktemp("replicas"), 2, threads=1) as servers:
        yield servers


def test_routing_client_reuses_prefixes_and_routes_around_a_dead_replica(replicas: list[LlamaServer]) -> None:
    targets = [Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas)]
    dead = Target("dead", f"http://127.0.0.1:{free_port()}", engine="llamacpp")
    router = Router([dead, *targets])
    seen_before(router, docs("a", "b", "c"))
    with RoutingClient(router, timeout=30) as client:
        served = [client.chat(docs("a", "b", "c", f"own{i}"), f"q{i}", max_tokens=1) for i in range(4)]
        served += [client.chat(docs("x", "y", "z", f"more{i}"), f"p{i}", max_tokens=1) for i in range(4)]
    assert len(served) == 8  # nothing lost
    assert router.pilot(dead).stats().live_requests == 0
    assert any(r.attempts == 2 for r in served)  # the dead one was tried at most once, then avoided
    rest = served[1:4]
    assert all(r.target == rest[0].target for r in rest)  # the shared prefix's replica
    assert all((r.result.cached_tokens or 0) > 3 * 300 for r in rest)  # a, b, c served from its cache


def test_routing_client_pins_llama_server_slots(tmp_path: Path) -> None:
    server = start_llama_server(tmp_path, slots=2, context=8192)
    try:
        targets = [Target(f"slot{n}", server.url, slot=n, engine="llamacpp") for n in range(2)]
        router = Router(targets)
        seen_before(router, docs("a", "b", "c"))
        with RoutingClient(router, timeout=60) as client:
            a = client.chat(docs("a", "b", "c"), "q", max_tokens=1)
            b = client.chat(docs("x", "y", "z"), "q", max_tokens=1)  # no shared prefix: the other slot
            again = client.chat(docs("a", "c", "d", "b"), "q", max_tokens=1)
        assert a.target != b.target and again.target == a.target
        assert (again.result.cached_tokens or 0) > 3 * 300  # its slot still holds a, b, c
    finally:
        server.stop()


def test_every_target_down_raises_and_loses_no_state() -> None:
    router = Router([Target("d1", f"http://127.0.0.1:{free_port()}"), Target("d2", f"http://127.0.0.1:{free_port()}")])
    with RoutingClient(router, timeout=2) as client, pytest.raises(EngineUnavailable):
        client.chat(docs("a"), "q", max_tokens=1)
    assert all(router.pilot(t).stats().live_requests == 0 for t in router.targets)


def test_async_routing_client_routes_around_a_dead_replica(replicas: list[LlamaServer]) -> None:
    dead = Target("dead", f"http://127.0.0.1:{free_port()}", engine="llamacpp")
    router = Router([dead, *(Target(f"r{n}", s.url, engine="llamacpp") for n, s in enumerate(replicas))])

    async def run() -> list[object]:
        with RoutingClient(router, timeout=30) as client:
            return [await client.achat(docs("a", "b", f"own{i}"), f"q{i}", max_tokens=1) for i in range(3)]

    served = asyncio.run(run())
    assert len(served) == 3 and router.pilot(dead).stats().live_requests == 0
    assert all(router.loads()[t.name] == 0 for t in router.targets)  # every attempt was counted off


def test_call_fails_over_only_on_unreachable_targets() -> None:
    """What the framework adapters run: a prompt already prepared for one target goes to the
    next when that one cannot be reached (and is adopted there); an answer that is an error
    is not retried elsewhere."""
    import httpx

    from contextpilot_integrations.engines.feedback import Binding

    router = Router(TARGETS)
    routed = router.prepare(docs("x", "y"), "q")
    binding = Binding(router.pilot(routed.target), routed.prepared, 0)
    tried: list[str] = []

    def send(target: Target, prepared: object) -> str:
        tried.append(target.name)
        if len(tried) == 1:
            with httpx.Client() as http:
                http.get(f"http://127.0.0.1:{free_port()}")  # a real refused connection
        assert prepared is not None
        return target.name

    answered = router.call(binding, send)
    assert tried[0] == routed.target.name and answered == tried[1] != tried[0]
    adopted_by = next(t for t in router.targets if t.name == answered)
    assert router.pilot(adopted_by).stats().live_requests == 1  # that engine holds it now
    assert all(load == 0 for load in router.loads().values())

    async def refuse(target: Target, prepared: object) -> str:
        raise ValueError("the server answered 400")

    with pytest.raises(ValueError):
        asyncio.run(router.acall(binding, refuse))
    assert all(load == 0 for load in router.loads().values())
