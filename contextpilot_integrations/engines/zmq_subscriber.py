"""Subscribe to an engine's native KV-cache events over ZMQ: stock SGLang and vLLM, no plugin.

Both engines publish on a PUB socket, one per data-parallel rank or replica (SGLang adds the
rank to the port): multipart ``[topic, seq, payload]``, see :mod:`.wire`. One
:class:`ZmqEventSubscriber` follows one endpoint in a background thread and feeds the
same :class:`~.sink.KvEventSink` as the HTTP listener, so ``prepare`` never waits on it.

A missing sequence number is recovered from the engine's replay socket (``replay_endpoint``
in the engine's ``--kv-events-config``) before anything else is applied; only when the
replay cannot give every missed batch (no replay socket, no answer, or the engine's buffer
no longer holds them) does the sink reset the index, which must never predict a hit it
cannot confirm. Malformed payloads, unknown event types and a replay socket that refuses
are counted and logged; nothing raises into the caller, and the subscriber keeps running.

Launch lines (127.0.0.1; a replay socket on the next port)::

    python -m sglang.launch_server ... --enable-cache-report --kv-events-config \\
      '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","bind":true,"replay_endpoint":"tcp://127.0.0.1:5558"}'
    vllm serve ... --enable-prompt-tokens-details --kv-events-config \\
      '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'

Needs the ``engines`` extra (``pyzmq``, ``msgspec``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .sink import KvEventSink
from .wire import END_OF_REPLAY, decode_zmq_batch

__all__ = ["SubscriberStats", "ZmqEventSubscriber"]

logger = logging.getLogger(__name__)


@dataclass
class SubscriberStats:
    """What one subscriber has received and done."""

    batches: int = 0
    replayed_batches: int = 0
    recovered_gaps: int = 0
    unrecovered_gaps: int = 0
    """Gaps the replay socket could not fill: the sink reset the index."""
    malformed: int = 0
    unknown_events: int = 0
    other_group_events: int = 0
    replay_failures: int = 0
    duplicates: int = 0
    last_seq: int | None = None


class ZmqEventSubscriber:
    """Follows one engine's KV-event PUB socket (a background thread).

    Args:
        sink: where the events go (e.g. ``listener.sink``, or a :class:`KvEventSink`).
        endpoint: the engine's PUB endpoint, e.g. ``tcp://127.0.0.1:5557``.
        replay_endpoint: the engine's replay ROUTER endpoint, to recover missed batches.
        topic: the engine's ``topic`` (default: every message).
        bind: bind the SUB socket instead of connecting (for an engine that connects, as
            vLLM does to a concrete host).
        name: publisher name in the sink's sequence tracking (default: the endpoint).
        replay_timeout: seconds to wait for the replay socket before giving up (reset).
    """

    def __init__(
        self,
        sink: KvEventSink,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        bind: bool = False,
        name: str | None = None,
        replay_timeout: float = 2.0,
    ) -> None:
        import zmq

        self.sink = sink
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.name = name or f"zmq:{endpoint}"
        self.replay_timeout = replay_timeout
        self.stats = SubscriberStats()
        self._zmq = zmq
        self._context: Any = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._socket.setsockopt(zmq.LINGER, 0)
        (self._socket.bind if bind else self._socket.connect)(endpoint)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"contextpilot-zmq {endpoint}", daemon=True)
        self._thread.start()

    @property
    def bound_endpoint(self) -> str:
        """The endpoint the SUB socket is on (with the port chosen for ``tcp://...:*``)."""
        return str(self._socket.getsockopt_string(self._zmq.LAST_ENDPOINT))

    def snapshot(self) -> SubscriberStats:
        with self._lock:
            return SubscriberStats(**vars(self.stats))

    def stop(self) -> None:
        """Stop the thread and close the socket."""
        self._stopping.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        poller = self._zmq.Poller()
        poller.register(self._socket, self._zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = self._socket.recv_multipart(self._zmq.NOBLOCK)
                self._receive(frames)
            except self._zmq.Again:
                continue
            except self._zmq.ZMQError:
                if self._stopping.is_set():
                    return
                logger.exception("contextpilot: ZMQ subscriber %s failed to receive", self.endpoint)
                time.sleep(0.1)
            except Exception:  # never let one bad message end the subscription
                logger.exception("contextpilot: ZMQ subscriber %s failed on a message", self.endpoint)

    def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("malformed")
            logger.warning(
                "contextpilot: %s sent a message of %d frames, not [topic, seq, payload]", self.name, len(frames)
            )
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self.stats.last_seq
        if last is not None and seq <= last:
            self._count("duplicates")
            return
        if last is not None and seq > last + 1:
            self._recover(last + 1, seq)
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            decoded = decode_zmq_batch(payload, seq, self.name)
        except ValueError as exc:  # its events are lost as surely as a missing batch's
            self._count("malformed")
            logger.warning("contextpilot: %s batch %d cannot be read (%s): the index is reset", self.name, seq, exc)
            with self._lock:
                self.stats.last_seq = seq
            self.sink.lost(self.name, seq)
            return
        self.sink.apply(decoded.batch)
        with self._lock:
            self.stats.batches += 1
            self.stats.unknown_events += decoded.unknown_events
            self.stats.other_group_events += decoded.other_groups
            self.stats.last_seq = seq

    def _recover(self, first: int, upto: int) -> None:
        """Fetch batches ``first .. upto - 1`` from the replay socket and apply them in order;
        what cannot be fetched is left to the sink, which resets on the gap."""
        replayed = self._replay(first) if self.replay_endpoint else {}
        missing = [seq for seq in range(first, upto) if seq not in replayed]
        if missing:
            with self._lock:
                self.stats.unrecovered_gaps += 1
            logger.warning("contextpilot: %s lost batches %d..%d: the index is reset", self.name, first, upto - 1)
            return  # the next apply shows the sink a gap
        for seq in range(first, upto):
            self._apply(seq, replayed[seq])
        with self._lock:
            self.stats.recovered_gaps += 1
            self.stats.replayed_batches += upto - first

    def _replay(self, first: int) -> dict[int, bytes]:
        zmq = self._zmq
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        try:
            socket.connect(self.replay_endpoint)
            socket.send_multipart([b"", first.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + self.replay_timeout
            while time.monotonic() < deadline:
                if not socket.poll(int(max(1, (deadline - time.monotonic()) * 1000))):
                    break
                frames = socket.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:  # [b"", topic, seq, payload]
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    return got
                got[seq] = frames[3]
            self._count("replay_failures")
            logger.warning(
                "contextpilot: %s replay socket did not finish within %.1f s", self.name, self.replay_timeout
            )
        except zmq.ZMQError as exc:
            self._count("replay_failures")
            logger.warning("contextpilot: %s replay socket failed: %s", self.name, exc)
        finally:
            socket.close(linger=0)
        return got

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)


def subscribe_ranks(
    sink: KvEventSink, endpoint: str, ranks: int, *, replay_endpoint: str | None = None, **options: Any
) -> list[ZmqEventSubscriber]:
    """One subscriber per data-parallel rank: SGLang and vLLM add the rank to both ports."""

    def offset(address: str, rank: int) -> str:
        head, _, port = address.rpartition(":")
        return f"{head}:{int(port) + rank}"

    return [
        ZmqEventSubscriber(
            sink,
            offset(endpoint, rank),
            replay_endpoint=offset(replay_endpoint, rank) if replay_endpoint else None,
            **options,
        )
        for rank in range(ranks)
    ]
