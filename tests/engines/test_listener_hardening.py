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
from contextpilot_integrations.pilot import IndexEvent

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
            assert httpx.get(running.url + "/health", timeout=30).json() == {"status": "ok"}
            assert len(running._server._connections) <= 32
            assert running.sink.stats().unproven_connections_closed > 0  # never sent a byte
        finally:
            for sock in idle:
                sock.close()
    with EvictionListener(pilot, idle_timeout=0.3) as running:
        host, port = running._server.server_address[:2]
        with socket.create_connection((host, port)) as sock:
            sock.settimeout(3)
            assert sock.recv(1) == b""  # closed by the server after the idle timeout


def test_at_the_cap_with_every_proven_connection_busy_new_clients_get_503() -> None:
    """503 only when every seat holds a client that had a request answered and is busy with
    another: those keep their seats."""
    with EvictionListener(ContextPilot(), max_connections=2, idle_timeout=5.0) as running:
        host, port = running._server.server_address[:2]
        busy = []
        for _ in range(2):  # one request answered, then a second whose body is withheld
            sock = socket.create_connection((host, port), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n")
            busy.append(sock)
        time.sleep(0.2)
        try:
            answer = raw(running, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503")
            assert running.sink.stats().connections_refused == 1
        finally:
            for sock in busy:
                sock.close()


@pytest.mark.parametrize("token", [None, "s3cret-token"])
def test_clients_dripping_requests_cannot_keep_a_legitimate_client_out(token: str | None) -> None:
    """Three times as many connections as seats, each dripping its request's head or body
    (well inside every timeout), and reconnecting when closed: a client that sends whole
    requests is served every time, with the token or without one."""
    seats = 8
    with EvictionListener(
        ContextPilot(), max_connections=seats, header_timeout=30.0, body_timeout=30.0, token=token
    ) as running:
        host, port = running._server.server_address[:2]
        stop = threading.Event()

        def drip(body: bool) -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2) as sock:
                    sock.sendall(HEAD + (b"Content-Length: 100\r\n\r\n" if body else b""))
                    while not stop.wait(0.1):
                        sock.sendall(b" " if body else b"X-Drip: 1\r\n")

        drippers = [threading.Thread(target=drip, args=(n % 2 == 0,), daemon=True) for n in range(3 * seats)]
        for thread in drippers:
            thread.start()
        time.sleep(0.5)
        headers = {"X-ContextPilot-Token": token} if token else {}
        try:
            codes = [httpx.get(running.url + "/health", headers=headers, timeout=10).status_code for _ in range(20)]
        finally:
            stop.set()
            for thread in drippers:
                thread.join(timeout=10)
        assert codes == [200] * 20
        assert running.sink.stats().unproven_connections_closed > 0


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
    timeout), held every connection busy: /health answered 503 as long as they dripped. Now
    a new client takes the seat of one that proved nothing, and each dripping head is cut
    off at its deadline."""
    with EvictionListener(ContextPilot(), max_connections=8, idle_timeout=5.0, header_timeout=0.5) as running:
        host, port = running._server.server_address[:2]
        dripping = threading.Event()
        drips: list[socket.socket] = []
        for _ in range(30):
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
        try:
            assert httpx.get(running.url + "/health", timeout=10).status_code == 200
            # every dripping connection ends: its seat taken, or its head past the deadline
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                stats = running.sink.stats()
                if stats.slow_requests_closed + stats.unproven_connections_closed >= 30:
                    break
                time.sleep(0.05)
            stats = running.sink.stats()
            assert (
                stats.slow_requests_closed > 0 and stats.slow_requests_closed + stats.unproven_connections_closed >= 30
            )
            assert httpx.get(running.url + "/health", timeout=10).status_code == 200  # and stays served
        finally:
            dripping.set()
            dripper.join(timeout=5)
            for sock in drips:
                sock.close()


def test_a_dripped_body_is_cut_off_with_408() -> None:
    with EvictionListener(ContextPilot(), body_timeout=0.5) as running:
        host, port = running._server.server_address[:2]
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n")
            started = time.monotonic()
            answer = b""
            while not answer and time.monotonic() - started < 30:
                sock.sendall(b" ")  # one byte every 0.1 s: never idle, never done
                sock.settimeout(0.1)
                with contextlib.suppress(TimeoutError):
                    answer = sock.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408"), answer
        assert running.sink.stats().slow_requests_closed == 1
        assert httpx.get(running.url + "/health", timeout=2).status_code == 200


@pytest.mark.parametrize("option", ["idle_timeout", "header_timeout", "body_timeout"])
@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_timeouts_must_be_positive_and_finite(option: str, seconds: float) -> None:
    with pytest.raises(ValueError, match=option):
        EvictionListener(ContextPilot(), **{option: seconds})  # type: ignore[arg-type]


# ---- one client's large bodies, and who may reach other workers ----------------------------------------
def test_a_body_of_invalid_items_costs_one_error_not_one_per_item(listener: EvictionListener) -> None:
    """A 1 MiB body of half a million invalid events, then one just under the bound: each is
    refused from one error (413 for the list over the bound, 400 naming the first bad item)."""
    url, json_type = listener.kv_events_url, {"Content-Type": "application/json"}
    many = b'{"seq": 0, "events": [' + b"0," * 524_287 + b"0]}"
    answer = httpx.post(url, content=many, headers=json_type, timeout=60)
    assert answer.status_code == 413 and "events: over" in answer.json()["error"]
    under = b'{"seq": 0, "events": [' + b"0," * 199_999 + b"0]}"
    answer = httpx.post(url, content=under, headers=json_type, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"].startswith("invalid kv-events body: events.0:")
    ids = json.dumps({"request_ids": [0] * 300_000}).encode()
    assert httpx.post(listener.url + "/evict", content=ids, headers=json_type, timeout=60).status_code == 413


def test_a_body_over_the_limit_gets_413_not_a_reset() -> None:
    """A client still sending a body over the limit reads the 413 (the rest is read away)."""
    with EvictionListener(ContextPilot(), max_body_bytes=1 << 20) as running:
        host, port = running._server.server_address[:2]
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % (4 << 20))
            for _ in range(32):  # 2 MiB more, past what the listener takes
                sock.sendall(b"x" * 65536)
            assert sock.recv(65536).startswith(b"HTTP/1.1 413")


def test_events_from_a_listener_without_a_token_stay_in_this_worker() -> None:
    """Any local process may post to a listener without a token: what it says changes this
    worker's index but reaches no observer (the shared log); with a token it does."""
    for token in (None, "s3cret-token"):
        pilot = ContextPilot()
        heard: list[IndexEvent] = []
        pilot.add_observer(lambda event, into=heard: into.append(event))
        rid = pilot.prepare(["alpha text", "beta text"], "q").request_id
        heard.clear()
        with EvictionListener(pilot, token=token) as running:
            headers = {"X-ContextPilot-Token": token} if token else {}
            cleared = {"seq": 0, "publisher": "p", "events": [{"type": "AllBlocksCleared"}]}
            assert httpx.post(running.kv_events_url, json=cleared, headers=headers).status_code == 200
            assert pilot.live_request_ids() == []  # applied here
            other = pilot.prepare(["gamma text"], "q").request_id
            heard.clear()
            assert httpx.post(running.url + "/evict", json={"request_ids": [other]}, headers=headers).json() == {
                "evicted": 1
            }
        assert rid not in pilot.live_request_ids()
        assert bool(heard) == (token is not None), heard
