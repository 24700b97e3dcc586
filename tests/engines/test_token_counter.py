"""The engine's own token counts for the send decision (``EngineTokenCounter``): a live
llama-server's ``/tokenize``, and clear errors where no engine answers."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines import EngineTokenCounter, EvictionListener
from contextpilot_integrations.errors import EngineUnavailable
from tests.engine_support import free_port, start_llama_server

TEXT = "The quarterly report names three suppliers; the second one (Acme) shipped late."


def test_a_pilot_counts_blocks_as_the_engine_computes_them(tmp_path: Path) -> None:
    server = start_llama_server(tmp_path)
    try:
        with EngineTokenCounter(server.url + "/v1") as counter:
            count = counter(TEXT)
            # what the engine computes for the same text as a prompt (it may add a BOS token)
            answer = httpx.post(server.url + "/completion", json={"prompt": TEXT, "n_predict": 1}, timeout=60).json()
            assert count in (answer["tokens_evaluated"], answer["tokens_evaluated"] - 1)
            assert count != len(TEXT) // 4  # not the four-characters estimate
            pilot = ContextPilot(token_counter=counter)
            prepared = pilot.prepare([Block(id="a", text=TEXT), Block(id="b", text="given", tokens=3)], "q")
            assert [block.token_count for block in prepared.blocks] == [count, 3]
    finally:
        server.stop()


def test_no_engine_is_a_clear_error_and_the_request_is_not_recorded() -> None:
    pilot = ContextPilot(token_counter=EngineTokenCounter(f"http://127.0.0.1:{free_port()}", timeout=5))
    with pytest.raises(EngineUnavailable, match="not reachable"):
        pilot.prepare([Block(id="a", text=TEXT)], "q")
    assert pilot.stats().live_requests == 0


@pytest.mark.parametrize("given", [None, 32])
def test_the_engines_events_teach_the_pilot_its_page(given: int | None) -> None:
    """A stored block of 16 tokens over real HTTP: a pilot without a page learns 16, one
    given a page keeps it."""
    pilot = ContextPilot(page_tokens=given)
    event = {"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "block_size": 16}
    batch = {"seq": 0, "publisher": "p", "ts": time.time(), "events": [{**event, "token_ids": list(range(16))}]}
    with EvictionListener(pilot, token="s3cret") as listener:
        answer = httpx.post(listener.kv_events_url, json=batch, headers={"X-ContextPilot-Token": "s3cret"})
        assert answer.status_code < 300, answer.text
    assert pilot.page_tokens == (given or 16)
