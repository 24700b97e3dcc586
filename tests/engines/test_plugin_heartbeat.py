"""Issue 24: a batch the plugin could not deliver shows within a heartbeat, not only when
the engine publishes again (an idle engine publishes nothing, and the index would keep
predicting what the lost batch removed)."""

from __future__ import annotations

import time

import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines.listener import EvictionListener
from contextpilot_integrations.engines.sglang_plugin import ContextPilotHttpPublisher
from contextpilot_integrations.engines.wire import KvEventBatch

EMPTY = KvEventBatch(seq=0, events=[])  # the publisher reads only .ts and .events


def test_a_lost_batch_shows_within_a_heartbeat() -> None:
    pilot = ContextPilot()
    with EvictionListener(pilot) as running:
        publisher = ContextPilotHttpPublisher(endpoint=running.kv_events_url, heartbeat=0.2)
        try:
            publisher.publish(EMPTY)
            assert publisher.flush()
            pilot.prepare(["a", "b"], "q")
            publisher.endpoint = running.kv_events_url + "-gone"  # 404: this batch is lost
            publisher.publish(EMPTY)
            assert publisher.flush()
            assert publisher.dropped >= 1 and running.sink.stats().sequence_gaps == 0
            publisher.endpoint = running.kv_events_url
            deadline = time.monotonic() + 5
            while running.sink.stats().sequence_gaps == 0:
                assert time.monotonic() < deadline, "no heartbeat revealed the lost batch"
                time.sleep(0.02)
        finally:
            publisher.shutdown()
    assert publisher.heartbeats >= 1
    assert pilot.stats().live_requests == 0  # nothing predicted that the lost batch may have removed


def test_the_heartbeat_is_configured_by_argument_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "http://127.0.0.1:9/kv-events"
    monkeypatch.setenv("CONTEXTPILOT_EVENTS_HEARTBEAT", "0")
    quiet = ContextPilotHttpPublisher(endpoint=url)
    monkeypatch.setenv("CONTEXTPILOT_EVENTS_HEARTBEAT", "2.5")
    slow = ContextPilotHttpPublisher(endpoint=url)
    monkeypatch.delenv("CONTEXTPILOT_EVENTS_HEARTBEAT")
    default = ContextPilotHttpPublisher(endpoint=url)
    try:
        assert (quiet.heartbeat, slow.heartbeat, default.heartbeat) == (None, 2.5, 1.0)
        with pytest.raises(ValueError, match="heartbeat"):
            ContextPilotHttpPublisher(endpoint=url, heartbeat=-1)
    finally:
        for publisher in (quiet, slow, default):
            publisher.shutdown()
