"""SGLang plugin: publish KV-cache events to ContextPilot's callback server over HTTP.

SGLang loads it through the ``sglang.srt.plugins`` entry point (installed with this
package) and then offers the publisher ``contextpilot_http``::

    python -m sglang.launch_server --model-path ... --enable-cache-report \\
        --kv-events-config '{"publisher":"contextpilot_http","endpoint":"http://127.0.0.1:PORT/kv-events"}'

``publish`` runs on SGLang's scheduler loop, so it only converts the batch and queues it;
a background thread POSTs it. When the bounded queue is full (or the server cannot be
reached) a batch is dropped and counted; its sequence number is then missing, and the
server makes its index conservative. No SGLang class is patched. Set
``CONTEXTPILOT_EVENTS_TOKEN`` when the callback server requires a token.

Heartbeat: a lost batch shows only when a later number arrives, and an idle engine sends
none, so the index could keep predicting what the lost batch removed. After
``CONTEXTPILOT_EVENTS_HEARTBEAT`` seconds (default 1; ``0``: never) without a batch, the
publisher sends an empty one with the next number: the server notices a loss within that
time.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import threading
import time
from typing import Any

import httpx

from .wire import event_to_dict

__all__ = ["PUBLISHER_NAME", "ContextPilotHttpPublisher", "register"]

PUBLISHER_NAME = "contextpilot_http"
HEARTBEAT_ENV = "CONTEXTPILOT_EVENTS_HEARTBEAT"
DEFAULT_HEARTBEAT_S = 1.0
_STOP = object()


def _heartbeat_from_env() -> float | None:
    raw = os.environ.get(HEARTBEAT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_HEARTBEAT_S
    try:
        seconds = float(raw)
    except ValueError:
        return DEFAULT_HEARTBEAT_S
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def register() -> None:
    """Entry point: make ``contextpilot_http`` known to SGLang's publisher factory."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    with contextlib.suppress(KeyError):  # already registered in this process
        EventPublisherFactory.register_publisher(PUBLISHER_NAME, ContextPilotHttpPublisher)


class ContextPilotHttpPublisher:
    """SGLang ``EventPublisher`` that POSTs each batch as JSON.

    Args:
        attn_dp_rank: SGLang's data-parallel rank (sent as ``rank``).
        endpoint: the callback URL, e.g. ``http://127.0.0.1:8765/kv-events``.
        max_queue_size: batches waiting to be sent; more are dropped and counted.
        heartbeat: seconds without a batch before an empty one is sent (``None``: never);
            default from ``CONTEXTPILOT_EVENTS_HEARTBEAT`` (SGLang passes only its own
            config fields), else 1 s.
        **_config: SGLang's other ``--kv-events-config`` fields (unused).
    """

    def __init__(
        self,
        attn_dp_rank: int = 0,
        endpoint: str = "",
        max_queue_size: int = 100_000,
        heartbeat: float | str | None = "env",
        **_config: Any,
    ):
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"contextpilot_http needs an http(s) endpoint, got {endpoint!r}")
        self.endpoint = endpoint
        self.rank = attn_dp_rank
        self.publisher_id = f"sglang-{os.getpid()}-{attn_dp_rank}"
        self.dropped = 0
        self.sent = 0
        self.heartbeats = 0
        chosen = _heartbeat_from_env() if heartbeat == "env" else heartbeat
        if isinstance(chosen, str) or (chosen is not None and not (math.isfinite(chosen) and chosen > 0)):
            raise ValueError("heartbeat must be None or a positive number of seconds")
        self.heartbeat: float | None = chosen
        self._seq = itertools.count()
        self._numbering = threading.Lock()  # a number and its place in the queue, together
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, max_queue_size))
        token = os.environ.get("CONTEXTPILOT_EVENTS_TOKEN")
        headers = {"X-ContextPilot-Token": token} if token else {}
        self._client = httpx.Client(timeout=5.0, headers=headers)
        self._thread = threading.Thread(target=self._run, name="contextpilot-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: Any) -> None:
        """Queue one ``KVEventBatch``; never blocks the scheduler."""
        self._enqueue(getattr(batch, "ts", None) or time.time(), [event_to_dict(event) for event in batch.events])

    def _enqueue(self, ts: float, events: list[dict[str, Any]]) -> None:
        with self._numbering:  # numbers reach the queue in order (the heartbeat numbers too)
            payload = {"seq": next(self._seq), "rank": self.rank, "publisher": self.publisher_id, "ts": ts}
            payload["events"] = events
            try:
                self._queue.put_nowait(payload)
            except queue.Full:
                self.dropped += 1  # its seq is never sent: the server sees the gap

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued batch was sent or dropped (for tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def shutdown(self) -> None:
        self.flush(timeout=5.0)
        self._queue.put(_STOP)
        self._thread.join(timeout=5.0)
        self._client.close()

    def _run(self) -> None:
        while True:
            try:
                payload = self._queue.get(timeout=self.heartbeat)
            except queue.Empty:  # idle for a heartbeat: an empty batch shows any loss before
                self.heartbeats += 1
                self._enqueue(time.time(), [])
                continue
            try:
                if payload is _STOP:
                    return
                for attempt in range(3):
                    try:
                        self._client.post(self.endpoint, json=payload).raise_for_status()
                        self.sent += 1
                        break
                    except httpx.HTTPError:
                        if attempt == 2:
                            self.dropped += 1
                        else:
                            time.sleep(0.05 * (attempt + 1))
            finally:
                self._queue.task_done()
