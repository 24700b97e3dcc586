"""The callback server under hostile and busy clients (issue 11, items 5-12): real HTTP and
raw sockets on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.engines import EvictionListener, KvEventBatch, KvEventSink
from contextpilot_integrations.engines.kv_mapping import EngineBlockMap

JSON = {"Content-Type": "application/json"}
HEAD = b"POST /evict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture()
def listener() -> Iterator[EvictionListener]:
    with EvictionListener(ContextPilot()) as running:
        yield running


def stored(seq: int, hashes: list[int], parent: int | None = None, publisher: str = "p") -> dict:
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(len(hashes))),
        "block_size": 1,
    }
    return {"seq": seq, "publisher": publisher, "ts": time.time(), "events": [event]}


def raw(listener: EvictionListener, request: bytes, timeout: float = 5.0) -> bytes:
    host, port = listener._server.server_address[:2]
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = [int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length")]
                if length and len(body) >= length[0]:
                    break
        return b"".join(chunks)


# ---- 5. a retried batch is a duplicate, not a gap ------------------------------------------------
def test_a_publisher_retry_is_ignored_not_a_reset(listener: EvictionListener) -> None:
    pilot = listener.sink.pilot
    pilot.prepare(["a", "b"], "q")
    url = listener.kv_events_url
    assert httpx.post(url, json=stored(0, [1])).json() == {"status": "ok"}
    assert httpx.post(url, json=stored(1, [2], 1)).json() == {"status": "ok"}
    assert httpx.post(url, json=stored(1, [2], 1)).json() == {"status": "duplicate"}  # the retry
    assert httpx.post(url, json=stored(0, [1])).json() == {"status": "duplicate"}
    stats = listener.sink.stats()
    assert stats.duplicate_batches == 2 and stats.sequence_gaps == 0 and stats.index_resets == 0
    assert pilot.stats().live_requests == 1


def test_a_restarted_engine_is_a_new_publisher(listener: EvictionListener) -> None:
    pilot = listener.sink.pilot
    url = listener.kv_events_url
    for seq in range(3):
        httpx.post(url, json=stored(seq, [seq + 1], seq or None, publisher="sglang-100-0"))
    pilot.prepare(["a"], "q")
    # the new process starts at 0 and announces its empty cache: the index is reset by that
    restart = {"seq": 0, "publisher": "sglang-200-0", "events": [{"type": "AllBlocksCleared"}]}
    assert httpx.post(url, json=restart).status_code == 200
    assert pilot.stats().live_requests == 0
    stats = listener.sink.stats()
    assert stats.sequence_gaps == 0 and stats.index_resets == 1 and stats.publishers == 2
    # a new publisher that starts past 0 has lost events
    pilot.prepare(["a"], "q")
    httpx.post(url, json=stored(5, [9], publisher="sglang-300-0"))
    assert pilot.stats().live_requests == 0 and listener.sink.stats().sequence_gaps == 1


def test_a_slow_apply_then_a_retry_keeps_the_index(listener: EvictionListener) -> None:
    """The plugin re-sends a batch after its 5 s timeout; the original is still applying."""
    from contextpilot_integrations.engines.sglang_plugin import ContextPilotHttpPublisher

    pilot = listener.sink.pilot
    pilot.prepare(["a", "b"], "q")
    original_apply = KvEventSink.apply
    calls = []

    def slow_apply(self: KvEventSink, batch: KvEventBatch) -> bool:
        calls.append(batch.seq)
        if len(calls) == 1:
            time.sleep(0.6)  # longer than the publisher's timeout below
        return original_apply(self, batch)

    KvEventSink.apply = slow_apply  # type: ignore[method-assign]
    try:
        publisher = ContextPilotHttpPublisher(endpoint=listener.kv_events_url)
        publisher._client.timeout = httpx.Timeout(0.3)

        batch = KvEventBatch(seq=0, events=[])  # the publisher reads only .ts and .events
        publisher.publish(batch)
        publisher.publish(batch)
        assert publisher.flush(timeout=10)
        publisher.shutdown()
        deadline = time.monotonic() + 5
        while len(calls) < 3 or listener.sink.stats().batches + listener.sink.stats().duplicate_batches < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)  # the first, slow apply is still running
    finally:
        KvEventSink.apply = original_apply  # type: ignore[method-assign]
    stats = listener.sink.stats()
    assert calls.count(0) >= 2 and stats.duplicate_batches >= 1
    assert stats.sequence_gaps == 0 and stats.index_resets == 0 and pilot.stats().live_requests == 1


# ---- 6. a burst of clients is queued, not reset ------------------------------------------------------
def test_two_hundred_concurrent_clients_are_all_served(listener: EvictionListener) -> None:
    pilot = listener.sink.pilot
    ids = [pilot.prepare([f"doc {i}"], "q").request_id for i in range(200)]
    barrier = threading.Barrier(200)
    codes: list[int] = []

    def client(rid: str) -> None:
        barrier.wait()
        try:
            with httpx.Client(timeout=30) as http:
                codes.append(http.post(listener.url + "/evict", json={"request_ids": [rid]}).status_code)
        except httpx.HTTPError:
            codes.append(0)

    threads = [threading.Thread(target=client, args=(rid,)) for rid in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert codes.count(200) == 200
    assert pilot.stats().live_requests == 0


# ---- 7. idle sockets neither starve /health nor pile up ------------------------------------------------
def test_idle_connections_cannot_starve_health() -> None:
    pilot = ContextPilot()
    with EvictionListener(pilot, max_connections=32, idle_timeout=2.0) as running:
        host, port = running._server.server_address[:2]
        idle = [socket.create_connection((host, port)) for _ in range(300)]
        try:
            time.sleep(0.2)
            started = time.monotonic()
            assert httpx.get(running.url + "/health", timeout=5).json() == {"status": "ok"}
            assert time.monotonic() - started < 1.0
            assert len(running._server._connections) <= 32
            assert running.sink.stats().idle_connections_closed > 0
        finally:
            for sock in idle:
                sock.close()
    with EvictionListener(pilot, idle_timeout=0.3) as running:
        host, port = running._server.server_address[:2]
        with socket.create_connection((host, port)) as sock:
            sock.settimeout(3)
            assert sock.recv(1) == b""  # closed by the server after the idle timeout


def test_at_the_cap_with_every_connection_busy_new_clients_get_503() -> None:
    with EvictionListener(ContextPilot(), max_connections=2, idle_timeout=5.0) as running:
        host, port = running._server.server_address[:2]
        busy = []
        for _ in range(2):  # headers sent, body withheld: busy, not idle
            sock = socket.create_connection((host, port))
            sock.sendall(b"POST /evict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
            sock.sendall(b"Content-Length: 100\r\n\r\n")
            busy.append(sock)
        time.sleep(0.2)
        try:
            answer = raw(running, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503")
            assert running.sink.stats().connections_refused == 1
        finally:
            for sock in busy:
                sock.close()


# ---- 8. empty tokens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
@pytest.mark.parametrize("token", ["", "   "])
def test_empty_tokens_are_refused(host: str, token: str) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        EvictionListener(ContextPilot(), host, token=token)


# ---- 9. memory and lock time are bounded -----------------------------------------------------------------
def test_block_map_is_bounded_and_forgetting_is_conservative() -> None:
    blocks = EngineBlockMap(page_size=1, max_blocks=100)
    blocks.stored(list(range(1, 81)), None, list(range(80)), 1)
    blocks.track("r", list(range(80)), block_ends=[40, 80])
    assert blocks.cached_tokens("r") == 80
    _, shortened = blocks.stored(list(range(1_001, 1_051)), None, list(range(500, 550)), 1)
    assert blocks.stored_blocks == 100 and shortened == {"r": 0}  # its oldest blocks were dropped
    assert blocks.blocks_within("r", 0) == 0
    tokens = EngineBlockMap(page_size=1, max_tracked_tokens=1_000)
    for i in range(5):
        tokens.track(f"t{i}", list(range(400)))
    assert tokens.tracked_tokens <= 1_000 and tokens.take_dropped() == ["t0", "t1", "t2"]


def test_the_page_size_given_is_used() -> None:
    """An empty block map is falsy: ``block_map or EngineBlockMap()`` once dropped it."""
    with EvictionListener(ContextPilot(), page_size=4) as running:
        assert running.sink.block_map.page_size == 4


def test_untracked_requests_leave_the_index() -> None:
    pilot = ContextPilot()
    sink = KvEventSink(pilot, EngineBlockMap(page_size=1, max_requests=2))
    rids = [pilot.prepare([f"doc {i}"], "q").request_id for i in range(3)]
    for rid in rids:
        sink.track(rid, [1, 2, 3], cached_tokens=3)  # confirmed by the engine: kept until forgotten
    assert pilot.live_request_ids() == rids[1:] and sink.stats().requests_untracked == 1


def test_one_huge_batch_is_refused_and_publishers_are_bounded(listener: EvictionListener) -> None:
    big = stored(0, list(range(300_000)))
    body = json.dumps(big).encode()
    with EvictionListener(ContextPilot(), max_body_bytes=len(body) + 1) as running:
        response = httpx.post(running.kv_events_url, content=body, headers=JSON, timeout=60)
        assert response.status_code == 413 and "blocks" in response.json()["error"]
        assert running.sink.stats().engine_blocks == 0
    sink = KvEventSink(ContextPilot(), max_publishers=5)
    for n in range(50):
        sink.apply(KvEventBatch.model_validate(stored(0, [n], publisher=f"p{n}")))
    assert sink.stats().publishers == 5


# ---- 10. browsers cannot reach it ---------------------------------------------------------------------------
def test_cross_origin_and_rebinding_requests_are_refused(listener: EvictionListener) -> None:
    pilot = listener.sink.pilot
    rid = pilot.prepare(["a"], "q").request_id
    body = json.dumps({"request_ids": [rid]})
    url = listener.url + "/evict"
    plain = httpx.post(url, content=body, headers={"Content-Type": "text/plain"})
    assert plain.status_code == 415
    cross = httpx.post(url, content=body, headers={**JSON, "Origin": "https://evil.example"})
    assert cross.status_code == 403
    rebinding = httpx.post(url, content=body, headers={**JSON, "Host": "evil.example:8765"})
    assert rebinding.status_code == 403
    assert httpx.get(listener.url + "/stats", headers={"Host": "evil.example"}).status_code == 403
    assert pilot.live_request_ids() == [rid]  # nothing was applied
    assert httpx.post(url, content=body, headers={"Content-Type": "application/json; charset=utf-8"}).json() == {
        "evicted": 1
    }


# ---- 11. malformed requests get 400, not a traceback ----------------------------------------------------------
@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (HEAD + b"Content-Length: \xb2\r\n\r\n", 411),  # a superscript two: str.isdigit() says yes
        (HEAD + b"Content-Length: -5\r\n\r\n", 411),
        (HEAD + b"Content-Length: 99999999999999999999\r\n\r\n", 411),
    ],
)
def test_bad_content_length(listener: EvictionListener, request_bytes: bytes, status: int) -> None:
    assert raw(listener, request_bytes).startswith(f"HTTP/1.1 {status}".encode())


def test_deep_json_and_non_finite_numbers_are_400(listener: EvictionListener) -> None:
    url = listener.kv_events_url
    deep = b"[" * 100_000 + b"]" * 100_000
    assert httpx.post(url, content=deep, headers=JSON).status_code == 400
    deep_object = b'{"seq": 0, "events": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    assert httpx.post(url, content=deep_object, headers=JSON).status_code == 400
    for ts in (b"Infinity", b"NaN", b"1e999"):
        body = b'{"seq": 0, "events": [], "ts": ' + ts + b"}"
        assert httpx.post(url, content=body, headers=JSON).status_code == 400
    stats = httpx.get(listener.url + "/stats")
    assert stats.status_code == 200 and "Infinity" not in stats.text
    assert httpx.get(listener.url + "/health").status_code == 200  # still serving


# ---- 12. nothing is applied after stop() ------------------------------------------------------------------------
def test_after_stop_a_keep_alive_connection_applies_nothing() -> None:
    pilot = ContextPilot()
    rid = pilot.prepare(["a"], "q").request_id
    running = EvictionListener(pilot)
    http = httpx.Client()
    assert http.get(running.url + "/health").status_code == 200  # the connection stays open
    running.stop()
    with pytest.raises(httpx.HTTPError):
        http.post(running.url + "/evict", json={"request_ids": [rid]})
    http.close()
    assert pilot.live_request_ids() == [rid]


# ---- issue 20, item 10: a request's head and body are read within a deadline -------------------------
def test_dripped_headers_cannot_hold_the_server() -> None:
    """Clients that send a request line, then a header line every 0.2 s (well inside the idle
    timeout), held every connection busy: /health answered 503 as long as they dripped."""
    with EvictionListener(ContextPilot(), max_connections=8, idle_timeout=5.0, header_timeout=0.5) as running:
        host, port = running._server.server_address[:2]
        dripping = threading.Event()
        drips: list[socket.socket] = []
        for _ in range(30):  # 8 are admitted (busy); the rest get 503
            sock = socket.create_connection((host, port), timeout=2)
            sock.sendall(b"POST /evict HTTP/1.1\r\n")
            drips.append(sock)

        def drip() -> None:
            while not dripping.wait(0.2):
                for sock in drips:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X-Drip: 1\r\n")

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        started = time.monotonic()
        try:
            while httpx.get(running.url + "/health", timeout=2).status_code != 200:
                # under the 5 s idle timeout, which a dripping client never reaches
                assert time.monotonic() - started < 4.5, "/health still refused while headers drip"
                time.sleep(0.05)
            recovered = time.monotonic() - started
            # each closed connection is counted by its own handler thread as it ends
            deadline = time.monotonic() + 4.0
            while running.sink.stats().slow_requests_closed < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert running.sink.stats().slow_requests_closed >= 8
            assert httpx.get(running.url + "/health", timeout=2).status_code == 200  # and stays served
        finally:
            dripping.set()
            dripper.join(timeout=5)
            for sock in drips:
                sock.close()
    assert recovered < 4.5  # header_timeout 0.5 s; the rest is a loaded 2-core machine


def test_a_dripped_body_is_cut_off_with_408() -> None:
    with EvictionListener(ContextPilot(), body_timeout=0.5) as running:
        host, port = running._server.server_address[:2]
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n")
            started = time.monotonic()
            answer = b""
            while not answer and time.monotonic() - started < 4:
                sock.sendall(b" ")  # one byte every 0.1 s: never idle, never done
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert time.monotonic() - started < 2.0
        assert running.sink.stats().slow_requests_closed == 1
        assert httpx.get(running.url + "/health", timeout=2).status_code == 200


@pytest.mark.parametrize("option", ["idle_timeout", "header_timeout", "body_timeout"])
@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_timeouts_must_be_positive_and_finite(option: str, seconds: float) -> None:
    with pytest.raises(ValueError, match=option):
        EvictionListener(ContextPilot(), **{option: seconds})  # type: ignore[arg-type]
