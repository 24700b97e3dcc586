"""The callback server over real HTTP on 127.0.0.1, fed by SGLang's own caches and
publisher factory through our plugin."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.core.gain import LABELLED, index_keys, key_block
from contextpilot_integrations.engines import EvictionListener
from tests.sglang_support import block_workload, build_cache, import_sglang, match_tokens, serve_tokens

DEBUG = False


@pytest.fixture()
def listener() -> Iterator[EvictionListener]:
    with EvictionListener(ContextPilot(), token="s3cret", max_body_bytes=4096) as running:
        yield running


def headers(token: str = "s3cret") -> dict[str, str]:
    return {"X-ContextPilot-Token": token, "Content-Type": "application/json"}


def stored(seq: int, hashes: list[int], parent: int | None = None, publisher: str = "p") -> dict:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes))),
        "block_size": 1,
    }
    return {"seq": seq, "publisher": publisher, "ts": time.time(), "events": [event]}


def test_health_stats_and_binding(listener: EvictionListener) -> None:
    assert listener.url.startswith("http://127.0.0.1:")
    assert httpx.get(listener.url + "/health", headers=headers()).json() == {"status": "ok"}
    stats = httpx.get(listener.url + "/stats", headers=headers()).json()
    assert stats["events"]["batches"] == 0 and stats["pilot"]["live_requests"] == 0
    assert httpx.get(listener.url + "/nope", headers=headers()).status_code == 404
    with pytest.raises(ValueError, match="needs a token"):
        EvictionListener(ContextPilot(), host="0.0.0.0")


def test_bad_requests_are_refused_and_counted(listener: EvictionListener) -> None:
    url = listener.kv_events_url
    assert httpx.post(url, json=stored(0, [1])).status_code == 401
    assert httpx.post(url, json=stored(0, [1]), headers=headers("wrong")).status_code == 401
    assert httpx.post(url, content=b"{nope", headers=headers()).status_code == 400
    bad = stored(0, [1, 2])
    bad["events"][0]["token_ids"] = [1]
    response = httpx.post(url, json=bad, headers=headers())
    assert response.status_code == 400 and "token ids" in response.json()["error"]
    assert httpx.post(url, json={"seq": 0, "events": [{"type": "Nope"}]}, headers=headers()).status_code == 400
    huge = httpx.post(url, content=b"x" * 10_000, headers=headers())
    assert huge.status_code == 413
    bearer = httpx.post(url, json=stored(0, [1]), headers={"Authorization": "Bearer s3cret"})
    assert bearer.status_code == 200
    stats = listener.sink.stats()
    assert stats.rejected == 6 and stats.batches == 1


def test_evict_by_request_id(listener: EvictionListener) -> None:
    pilot = listener.sink.pilot
    kept = pilot.prepare(["alpha", "beta"], "q")
    gone = pilot.prepare(["gamma"], "q")
    response = httpx.post(
        listener.url + "/evict", json={"request_ids": [gone.request_id, "unknown"]}, headers=headers()
    )
    assert response.json() == {"evicted": 1}
    assert pilot.live_request_ids() == [kept.request_id]
    assert listener.sink.stats().unknown_request_ids == 1
    assert httpx.post(listener.url + "/evict", json={"ids": []}, headers=headers()).status_code == 400


def test_sequence_gap_and_clear_reset_the_index(listener: EvictionListener) -> None:
    pilot = listener.sink.pilot
    url = listener.kv_events_url
    pilot.prepare(["a", "b"], "q")
    assert httpx.post(url, json=stored(0, [1]), headers=headers()).status_code == 200
    assert httpx.post(url, json=stored(1, [2], 1), headers=headers()).status_code == 200
    assert pilot.stats().live_requests == 1
    httpx.post(url, json=stored(3, [3], 2), headers=headers())  # seq 2 was lost
    assert pilot.stats().live_requests == 0 and listener.sink.stats().sequence_gaps == 1
    pilot.prepare(["a"], "q")
    clear = {"seq": 4, "publisher": "p", "events": [{"type": "AllBlocksCleared"}]}
    httpx.post(url, json=clear, headers=headers())
    assert pilot.stats().live_requests == 0 and listener.sink.stats().index_resets == 2


def test_ten_thousand_events_a_second_for_ten_seconds() -> None:
    """Loopback only, bounded: 2 senders x 50 batches/s x 100 events, 10 s, none lost."""
    with EvictionListener(ContextPilot()) as running:
        url = running.kv_events_url

        def sender(name: str, base: int) -> None:
            with httpx.Client() as client:
                start = time.monotonic()
                for seq in range(500):
                    events = [
                        {
                            "type": "BlockStored",
                            "block_hashes": [base + seq * 100 + i],
                            "parent_block_hash": None,
                            "token_ids": [i],
                            "block_size": 1,
                        }
                        for i in range(100)
                    ]
                    batch = {"seq": seq, "publisher": name, "ts": time.time(), "events": events}
                    assert client.post(url, json=batch).status_code == 200
                    delay = start + (seq + 1) / 50 - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)

        started = time.monotonic()
        threads = [threading.Thread(target=sender, args=(f"s{i}", i * 10**9)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        elapsed = time.monotonic() - started
        stats = running.sink.stats()
    assert stats.events == 100_000 and stats.batches == 1_000 and stats.sequence_gaps == 0
    assert stats.engine_blocks == 100_000 and elapsed < 15
    assert stats.latency_p99_ms is not None and stats.latency_p99_ms < 1_000


@pytest.mark.parametrize("kind", ["radix", "unified-python", "unified-rust"])
def test_index_follows_sglang_evictions(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTPILOT_EVENTS_HEARTBEAT", "0")  # count only the batches published here
    sgl = import_sglang()
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch
    from sglang.srt.plugins import load_plugins

    load_plugins()  # what SGLang's scheduler does first: finds our entry point
    rng = random.Random(11)
    sizes, tokens_of, blocks, weights = block_workload(rng)
    cache, allocator = build_cache(kind, capacity=48)
    cache.take_events()
    pilot = ContextPilot()

    def sent_layout(keys: list[str]) -> tuple[list[int], list[int]]:
        """Labelled blocks are other text than blocks sent alone: other token ids."""
        tokens: list[int] = []
        ends = []
        for key in keys:
            offset = 1_000_000 if key.startswith(LABELLED) else 0
            tokens += [t + offset for t in tokens_of[int(key_block(key))]]
            ends.append(len(tokens))
        return tokens, ends

    with EvictionListener(pilot, page_size=1) as running:
        config = json.dumps({"publisher": "contextpilot_http", "endpoint": running.kv_events_url})
        publisher = EventPublisherFactory.create(config, 0)
        assert type(publisher).__name__ == "ContextPilotHttpPublisher"
        published = 0
        for _ in range(200):
            chosen = list(dict.fromkeys(rng.choices(list(sizes), weights, k=rng.randint(2, 6))))
            prepared = pilot.prepare([blocks[b] for b in chosen], "q")
            tokens, ends = sent_layout(index_keys(prepared))
            serve_tokens(cache, allocator, tokens)
            running.sink.track(prepared.request_id, tokens, ends)
            events = cache.take_events()
            if events:
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
                published += 1
        assert publisher.flush()
        deadline = time.monotonic() + 10
        while running.sink.stats().batches < published and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = running.sink.stats()
        publisher.shutdown()
    assert stats.batches == published and stats.sequence_gaps == 0 and stats.requests_shortened > 0
    probes = [
        [str(b) for b in dict.fromkeys(rng.choices(list(sizes), weights, k=rng.randint(1, 6)))] for _ in range(300)
    ]
    probes += [list(pilot._trie.order_of(rid)) for rid in pilot.live_request_ids()]  # plain ones by plain keys
    equal = 0
    for order in probes:
        predicted = pilot.predicted_cached_blocks(order)
        tokens, ends = sent_layout(order)
        cached = match_tokens(cache, tokens)
        actual = sum(1 for end in ends if end <= cached)
        assert predicted <= actual, f"{kind}: predicted {predicted} blocks of {order}, SGLang holds {actual}"
        equal += predicted == actual
        if predicted != actual and DEBUG:
            print("MISMATCH", order, predicted, actual, cached, ends)
            bm = running.sink.block_map
            for rid, req in bm._requests.items():
                if list(req.tokens[: len(tokens)]) == tokens[: len(req.tokens)] and req.tokens[:1] == tuple(tokens[:1]):
                    print(
                        "   ",
                        rid,
                        "chain",
                        len(req.chain),
                        "tokens",
                        len(req.tokens),
                        "live",
                        rid in pilot.live_request_ids(),
                        "trie",
                        pilot._trie.order_of(rid) if rid in pilot.live_request_ids() else None,
                    )
    assert equal >= 0.99 * len(probes), f"{kind}: {equal}/{len(probes)} probes agree"
    del sgl


def test_plugin_publisher_drops_and_the_gap_is_seen() -> None:
    import_sglang()
    from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch

    from contextpilot_integrations.engines.sglang_plugin import ContextPilotHttpPublisher

    pilot = ContextPilot()
    with EvictionListener(pilot) as running:
        publisher = ContextPilotHttpPublisher(endpoint=running.kv_events_url, max_queue_size=1, heartbeat=None)

        def batch(h: int) -> KVEventBatch:
            event = BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[h], block_size=1, lora_id=None)
            return KVEventBatch(ts=time.time(), events=[event])

        pilot.prepare(["x"], "q")
        for h in range(200):  # far faster than one sender thread can POST: some are dropped
            publisher.publish(batch(h))
        assert publisher.flush()
        publisher.publish(batch(999))  # received: reveals any sequence number that never came
        assert publisher.flush()
        time.sleep(0.05)
        stats = running.sink.stats()
        publisher.shutdown()
    assert publisher.dropped > 0 and publisher.sent + publisher.dropped == 201
    assert stats.sequence_gaps >= 1 and pilot.stats().live_requests == 0  # conservative after a gap
    with pytest.raises(ValueError, match="http"):
        ContextPilotHttpPublisher(endpoint="tcp://127.0.0.1:5557")


def test_listen_command(capsys: pytest.CaptureFixture[str]) -> None:
    from contextpilot_integrations.whatif.cli import main
    from tests.engine_support import free_port

    assert main(["listen", "--port", str(free_port()), "--seconds", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "contextpilot_http" in out and "received 0 batches" in out
    assert main(["listen", "--host", "0.0.0.0", "--seconds", "0.1"]) == 2
