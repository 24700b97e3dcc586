"""One way to prepare (issue 43): a pilot, a router and a micro-batcher in front of either
are one :class:`~contextpilot_integrations.pilot.ports.Preparer`; the binding each returns
names the pilot whose index holds the request, with no caller telling them apart."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from contextpilot_integrations import Block, ContextPilot, MicroBatcher
from contextpilot_integrations.engines.router import Router, Target
from contextpilot_integrations.pilot.binding import aprepare_bound, prepare_bound

DOCS = [Block(id=name, text=f"Document {name}. " * 30) for name in "abcd"]


def preparers() -> dict[str, Any]:
    router = Router([Target("one", "http://127.0.0.1:1"), Target("two", "http://127.0.0.1:2")])
    pilot = ContextPilot()
    return {
        "pilot": pilot,
        "router": router,
        "batcher over a pilot": MicroBatcher(ContextPilot(), window=0.001),
        "batcher over a router": MicroBatcher(Router([Target("three", "http://127.0.0.1:3")]), window=0.001),
    }


@pytest.mark.parametrize("name", list(preparers()))
def test_every_preparer_binds_its_request_to_the_pilot_that_holds_it(name: str) -> None:
    preparer = preparers()[name]
    first = prepare_bound(preparer, DOCS[:3], "q1")
    again = asyncio.run(aprepare_bound(preparer, DOCS[:3], "q2", partition=None))
    for binding in (first, again):
        assert binding.prepared.request_id in binding.pilot.live_request_ids()
    assert again.pilot is first.pilot and again.prepared.cached_blocks == 3  # the second finds the first
    result = preparer.prepare(DOCS[1:], "q3")
    assert preparer.bound(result).prepared.request_id in preparer.bound(result).pilot.live_request_ids()


def test_a_router_binds_to_the_target_it_routed_to() -> None:
    router = Router([Target("one", "http://127.0.0.1:1"), Target("two", "http://127.0.0.1:2")])
    routed = router.prepare(DOCS[:2], "q")
    binding = router.bound(routed)
    assert binding.pilot is router.pilot(routed.target) and binding.prepared is routed.prepared
