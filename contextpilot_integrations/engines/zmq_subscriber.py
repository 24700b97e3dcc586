"""Subscribe to an engine's native KV-cache events over ZMQ: stock SGLang and vLLM, no plugin.

Both engines publish on a PUB socket, one per data-parallel rank or replica (SGLang adds the
rank to the port): multipart ``[topic, seq, payload]``, see :mod:`.wire`. One
:class:`ZmqEventSubscriber` follows one endpoint in a background thread and feeds the
same :class:`~.sink.KvEventSink` as the HTTP listener, so ``prepare`` never waits on it.

Who binds: the engine binds its replay ROUTER socket, and we connect to it. SGLang binds its
PUB socket too (``"bind": true``) and we connect; vLLM *connects* its PUB socket to a
concrete address, so the subscriber binds that one (``bind=True``). Every address is
loopback: a wildcard (``tcp://*``) would publish the cache's contents to the network.

Sequence numbers (each engine process counts from 0, with no process id on the wire):

- the next number: applied;
- a number further on: the missed batches are fetched from the replay socket and applied
  first. Only a gap of at most ``max_replay_gap`` (the engines keep 10,000 batches) is
  asked for; a larger one, or one the replay cannot fill (no replay socket, no answer, the
  buffer no longer holds them), resets the index, which must never predict a hit it cannot
  confirm; the stream then continues from the batch that showed the gap;
- a number at or below the last one applied: PUB/SUB delivers a message at most once, and
  our replays arrive on their own socket, so the only true duplicate is a batch that came
  both from a replay (the heartbeat's) and live: the same number *and* the same bytes as a
  recently applied batch (every batch carries its publication time). Anything else going
  back is a new engine process on the same address (a restart): the index is reset and the
  new stream is followed from there;
- the first batch a subscriber (or a restarted engine's stream) shows is expected to be 0.
  SGLang publishes its ``AllBlocksCleared`` as batch 0 when it builds its cache, usually
  before the subscription takes effect: batches before the first one received are fetched
  from the replay socket like any gap, and without one the loss is counted and the sink
  resets the index if it holds anything.

Malformed payloads (nested too deeply included), unknown event types and a replay socket
that refuses are counted and logged; an unreadable batch resets the index (its events are
lost). Nothing raises into the caller, and the subscriber keeps running until :meth:`stop`,
which waits for the thread: nothing is applied after it returns.

Launch lines (127.0.0.1; a replay socket on the next port)::

    python -m sglang.launch_server ... --enable-cache-report --kv-events-config \\
      '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","bind":true,"replay_endpoint":"tcp://127.0.0.1:5558"}'
    ZmqEventSubscriber(sink, "tcp://127.0.0.1:5557", replay_endpoint="tcp://127.0.0.1:5558")

    vllm serve ... --enable-prompt-tokens-details --kv-events-config \\
      '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","replay_endpoint":"tcp://127.0.0.1:5558"}'
    ZmqEventSubscriber(sink, "tcp://127.0.0.1:5557", bind=True, replay_endpoint="tcp://127.0.0.1:5558")

Needs the ``engines`` extra (``pyzmq``, ``msgspec``).
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..core.validation import MAX_BLOCKS
from .sink import KvEventSink
from .wire import END_OF_REPLAY, MAX_BATCH_BYTES, decode_zmq_batch

__all__ = ["MAX_REPLAY_GAP", "SubscriberStats", "ZmqEventSubscriber", "subscribe_ranks"]

logger = logging.getLogger(__name__)

MAX_REPLAY_GAP = 10_000
"""Missed batches worth asking the replay socket for: SGLang's and vLLM's replay buffer."""

_SLICE_S = 0.05
"""Every wait is cut in slices this long, to notice :meth:`ZmqEventSubscriber.stop`."""

_RECENT = 1_024
"""Batches whose bytes are remembered, to tell a duplicate from a restart."""


@dataclass
class SubscriberStats:
    """What one subscriber has received and done."""

    batches: int = 0
    replayed_batches: int = 0
    recovered_gaps: int = 0
    unrecovered_gaps: int = 0
    """Gaps the replay socket could not fill (or too long to ask for): the sink reset the index."""
    malformed: int = 0
    unknown_events: int = 0
    other_group_events: int = 0
    replay_failures: int = 0
    duplicates: int = 0
    """Batches received again with the same number and bytes (a replay overtaken live)."""
    restarts: int = 0
    """Sequence numbers that went back: a new engine process; the index was reset."""
    heartbeats: int = 0
    """Replay requests made because nothing arrived for ``heartbeat`` seconds."""
    last_seq: int | None = None


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


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
        max_replay_gap: longest gap asked of the replay socket; a longer one resets the index.
        heartbeat: if set (seconds) and there is a replay socket, a silence this long asks it
            for anything after the last batch: a lost last batch is noticed without waiting
            for the next one.
        max_batch_blocks: a batch naming more blocks
            (:data:`~contextpilot_integrations.core.validation.MAX_BLOCKS`, the HTTP listener's
            bound too) is refused before it is validated or reaches the sink: its events
            are lost, so the index is reset.
        max_batch_bytes: likewise, a batch larger than this.
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
        max_replay_gap: int = MAX_REPLAY_GAP,
        heartbeat: float | None = None,
        max_batch_blocks: int = MAX_BLOCKS,
        max_batch_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        if not (math.isfinite(replay_timeout) and replay_timeout > 0):
            raise ValueError("replay_timeout must be a positive number of seconds")
        if max_replay_gap < 0:
            raise ValueError("max_replay_gap must be >= 0")
        if heartbeat is not None and not (math.isfinite(heartbeat) and heartbeat > 0):
            raise ValueError("heartbeat must be None or a positive number of seconds")
        try:
            import zmq
        except ImportError as exc:
            raise ImportError(
                "the ZMQ subscriber needs pyzmq: pip install 'contextpilot-integrations[engines]'"
            ) from exc

        self.sink = sink
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.name = name or f"zmq:{endpoint}"
        self.replay_timeout = replay_timeout
        self.max_replay_gap = max_replay_gap
        self.heartbeat = heartbeat
        self.max_batch_blocks = max_batch_blocks
        self.max_batch_bytes = max_batch_bytes
        self.stats = SubscriberStats()
        self._zmq = zmq
        self._context: Any = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        try:
            self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._socket.setsockopt(zmq.LINGER, 0)
            (self._socket.bind if bind else self._socket.connect)(endpoint)
            self._bound_endpoint = str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))
        except Exception:
            self._socket.close(linger=0)
            raise
        self._lock = threading.Lock()  # guards stats
        self._work = threading.Lock()  # held while the sink is changed; stop() waits on it
        self._stopping = threading.Event()
        self._recent: OrderedDict[int, bytes] = OrderedDict()  # seq -> digest (thread only)
        self._last_heard = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"contextpilot-zmq {endpoint}", daemon=True)
        self._thread.start()

    @property
    def bound_endpoint(self) -> str:
        """The endpoint the SUB socket is on (with the port chosen for ``tcp://...:*``)."""
        return self._bound_endpoint

    def snapshot(self) -> SubscriberStats:
        with self._lock:
            return SubscriberStats(**vars(self.stats))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; it closes its socket. Nothing reaches the sink after this returns.

        Every wait of the thread is cut in short slices, so it ends within about 50 ms,
        unless the sink is still applying a batch: that one is waited for."""
        self._stopping.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("contextpilot: ZMQ subscriber %s still applying after %.0f s", self.name, timeout)
        with self._work:
            pass  # a batch being applied finishes; none starts after this (see _to_sink)

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._socket.close(linger=0)  # the thread that used it closes it

    def _loop(self) -> None:
        zmq = self._zmq
        while not self._stopping.is_set():
            try:
                if not self._socket.poll(int(_SLICE_S * 1000)):
                    self._maybe_heartbeat()
                    continue
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
                self._last_heard = time.monotonic()
                self._receive(frames)
            except zmq.Again:
                continue
            except zmq.ZMQError:
                if self._stopping.is_set():
                    return
                logger.exception("contextpilot: ZMQ subscriber %s failed to receive", self.endpoint)
                self._stopping.wait(0.1)
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
        payload = frames[2]
        if seq < 0:  # no engine numbers a batch so: its events, if any, are lost
            self._count("malformed")
            logger.warning("contextpilot: %s sent batch number %d: the index is reset", self.name, seq)
            self._to_sink(lambda: self.sink.lost(self.name, None))
            return
        digest = _digest(payload)
        last = self.stats.last_seq
        if last is not None and seq <= last:
            if self._recent.get(seq) == digest:
                self._count("duplicates")
                return
            self._restarted(seq, last)
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected:
            self._recover(expected, seq)
        self._apply(seq, payload, digest)

    def _restarted(self, seq: int, last: int) -> None:
        logger.warning(
            "contextpilot: %s went back from batch %d to %d: a new engine process; the index is reset",
            self.name, last, seq,
        )  # fmt: skip
        self._count("restarts")
        self._recent.clear()
        with self._lock:
            self.stats.last_seq = None
        self._to_sink(lambda: self.sink.restarted(self.name))

    def _apply(self, seq: int, payload: bytes, digest: bytes | None = None) -> None:
        try:
            decoded = decode_zmq_batch(
                payload, seq, self.name, max_blocks=self.max_batch_blocks, max_bytes=self.max_batch_bytes
            )
        except ValueError as exc:  # its events are lost as surely as a missing batch's
            self._count("malformed")
            logger.warning("contextpilot: %s batch %d cannot be read (%s): the index is reset", self.name, seq, exc)
            if self._to_sink(lambda: self.sink.lost(self.name, seq)):
                with self._lock:
                    self.stats.last_seq = seq
            return
        if not self._to_sink(lambda: self.sink.apply(decoded.batch)):
            return
        with self._lock:
            self.stats.batches += 1
            self.stats.unknown_events += decoded.unknown_events
            self.stats.other_group_events += decoded.other_groups
            self.stats.last_seq = seq
        self._recent[seq] = digest if digest is not None else _digest(payload)
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _to_sink(self, change: Any) -> bool:
        """Run ``change`` on the sink unless stopping; False if it was not run."""
        with self._work:
            if self._stopping.is_set():
                return False
            change()
            return True

    def _recover(self, first: int, upto: int) -> None:
        """Fetch batches ``first .. upto - 1`` from the replay socket and apply them in order;
        when they cannot all be fetched, the sink sees the gap and resets."""
        missed = upto - first
        if missed > self.max_replay_gap or not self.replay_endpoint:
            self._unrecovered(first, upto, "too many to replay" if self.replay_endpoint else "no replay socket")
            return
        replayed = self._replay(first, upto)
        if self._stopping.is_set():
            return
        if len(replayed) < missed:
            self._unrecovered(first, upto, "the replay socket no longer holds them")
            return
        for seq in range(first, upto):
            self._apply(seq, replayed[seq])
        with self._lock:
            self.stats.recovered_gaps += 1
            self.stats.replayed_batches += missed

    def _unrecovered(self, first: int, upto: int, why: str) -> None:
        with self._lock:
            self.stats.unrecovered_gaps += 1
        logger.warning("contextpilot: %s lost batches %d..%d (%s): the index is reset", self.name, first, upto - 1, why)

    def _maybe_heartbeat(self) -> None:
        """After ``heartbeat`` seconds of silence, ask the replay socket what came after the
        last batch, and apply it (the live copies then arrive as duplicates)."""
        if self.heartbeat is None or not self.replay_endpoint:
            return
        if time.monotonic() - self._last_heard < self.heartbeat:
            return
        self._last_heard = time.monotonic()
        self._count("heartbeats")
        last = self.stats.last_seq
        first = 0 if last is None else last + 1
        replayed = self._replay(first, first + min(self.max_replay_gap, _RECENT))  # live copies: duplicates
        if not replayed or self._stopping.is_set():
            return
        start = min(replayed)
        if start > first:
            self._unrecovered(first, start, "the replay socket no longer holds them")
        seq = start
        while seq in replayed:
            self._apply(seq, replayed[seq])
            seq += 1
        with self._lock:
            self.stats.recovered_gaps += start == first
            self.stats.replayed_batches += seq - start

    def _replay(self, first: int, upto: int) -> dict[int, bytes]:
        """The batches ``first <= seq < upto`` the replay socket still holds (others it sends
        are not kept). Waits in slices: :meth:`stop` interrupts it."""
        zmq = self._zmq
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        got: dict[int, bytes] = {}
        try:
            socket.connect(self.replay_endpoint)
            socket.send_multipart([b"", first.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + self.replay_timeout
            while not self._stopping.is_set() and len(got) < upto - first:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count("replay_failures")
                    logger.warning(
                        "contextpilot: %s replay socket did not finish within %.1f s", self.name, self.replay_timeout
                    )
                    break
                if not socket.poll(int(max(1, min(left, _SLICE_S) * 1000))):
                    continue
                frames = socket.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:  # [b"", topic, seq, payload]
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                if first <= seq < upto:
                    got[seq] = frames[3]
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
