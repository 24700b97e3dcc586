"""Two tenants with the same documents on live engines, each with its own ``cache_salt``: the
engine serves neither from the other's cache, and ContextPilot predicts none of it, while
each tenant still reuses its own prefix (vLLM hashes the salt into the first block; SGLang
keys its radix tree by it).

Each engine starts once per module (about a minute on 2 cores). Without the engines the
tests skip, unless ``CONTEXTPILOT_REQUIRE_LIVE_ENGINES`` is set (CI): then they fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from contextpilot_integrations import Block, cache_partition
from contextpilot_integrations.engines.client import ChatResult
from contextpilot_integrations.engines.sink import KvEventSink
from contextpilot_integrations.engines.wire import BlockStoredEvent, KvEventBatch
from contextpilot_integrations.testing.live_engines import (
    SYSTEM_PROMPT,
    EventPath,
    event_path,
    settle_sink,
    warm_head,
)

pytestmark = pytest.mark.timeout(900)


class PartitionsSeen(KvEventSink):
    """A sink that also remembers the cache partition of every first page the engine stored."""

    seen: set[str | None]

    def apply(self, batch: KvEventBatch) -> bool:
        seen = self.__dict__.setdefault("seen", set())
        for event in batch.events:
            if isinstance(event, BlockStoredEvent) and event.parent_block_hash is None:
                seen.add(event.partition)
        return super().apply(batch)


@pytest.fixture(scope="module", params=["vllm-zmq", "sglang-plugin"])
def path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventPath]:
    with event_path(request.param, Path(tmp_path_factory.mktemp(request.param)), pytest.skip) as running:
        yield running


def test_two_tenants_with_the_same_documents_share_nothing_and_each_reuses_its_own(path: EventPath) -> None:
    path.flush()
    client, sink = path.connect(PartitionsSeen)
    pilot = client.pilot
    assert pilot is not None
    warm_head(path.engine.url)
    settle_sink(sink)
    docs = [Block(id=f"d{n}", text=f"Document {n}: " + "amber harbour " * 12) for n in range(4)]
    salts = {"tenant-a": "salt-of-tenant-a-7f3e", "tenant-b": "salt-of-tenant-b-19c2"}

    sent: list[int] = []  # each request's block tokens, as the pilot counts them (the engine's, once it read them)

    def ask(tenant: str, query: str, stream: bool = True) -> tuple[int, ChatResult]:
        partition = cache_partition(salt=salts[tenant])
        prepared = pilot.prepare(docs, query, partition=partition)
        served = client.chat(
            prepared, system_prompt=SYSTEM_PROMPT, max_tokens=2, stream=stream, cache_salt=salts[tenant]
        )
        whole = (served.prompt_tokens or 0) // path.page_size * path.page_size
        settle_sink(sink, prepared.request_id, whole)
        sent.append(sum(block.token_count for block in prepared.blocks))
        return prepared.cached_tokens, served

    with client:
        a_predicted, a_served = ask("tenant-a", "Which document mentions a harbour?")
        b_predicted, b_served = ask("tenant-b", "Which document mentions a harbour?", stream=False)
        a2_predicted, a2_served = ask("tenant-a", "Which document mentions amber?", stream=False)
        b2_predicted, b2_served = ask("tenant-b", "Which document mentions amber?")
    block_tokens = sent[-1]
    print(
        f"\n{path.name}: engine cached / predicted tokens: A {a_served.cached_tokens}/{a_predicted}, "
        f"B {b_served.cached_tokens}/{b_predicted}, A again {a2_served.cached_tokens}/{a2_predicted}, "
        f"B again {b2_served.cached_tokens}/{b2_predicted} (prompts of {b2_served.prompt_tokens} tokens)"
    )
    partitions = {cache_partition(salt=salt) for salt in salts.values()}
    # the engine's own events name each tenant's partition (vLLM: extra_keys; SGLang: cache_salt),
    # so each tenant's first page maps to its own block, and its requests walk their own chain
    assert isinstance(sink, PartitionsSeen) and partitions <= sink.seen, vars(sink).get("seen")
    for served in (a2_served, b2_served):
        confirmed = sink.confirmed_tokens(served.request_id)
        assert confirmed is not None and confirmed >= (served.prompt_tokens or 0) - 2 * path.page_size
    # across tenants: the engine served nothing of the other's cache, and we predicted nothing
    assert b_predicted == 0
    assert (b_served.cached_tokens or 0) == 0, b_served  # not even the system prompt: the salt comes first
    # each tenant reuses its own prefix: predicted whole, and the engine served it
    assert a2_predicted == block_tokens and b2_predicted == block_tokens
    assert a2_served.block_ends is not None and b2_served.block_ends is not None
    assert (a2_served.cached_tokens or 0) >= a2_served.block_ends[-1] - path.page_size
    assert (b2_served.cached_tokens or 0) >= b2_served.block_ends[-1] - path.page_size
    assert a_predicted == 0 and (a_served.cached_tokens or 0) == 0
