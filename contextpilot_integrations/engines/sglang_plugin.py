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
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from typing import Any

import httpx

from .wire import event_to_dict

__all__ = ["PUBLISHER_NAME", "ContextPilotHttpPublisher", "register"]

PUBLISHER_NAME = "contextpilot_http"
_STOP = object()


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
        **_config: SGLang's other ``--kv-events-config`` fields (unused).
    """

    def __init__(self, attn_dp_rank: int = 0, endpoint: str = "", max_queue_size: int = 100_000, **_config: Any):
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"contextpilot_http needs an http(s) endpoint, got {endpoint!r}")
        self.endpoint = endpoint
        self.rank = attn_dp_rank
        self.publisher_id = f"sglang-{os.getpid()}-{attn_dp_rank}"
        self.dropped = 0
        self.sent = 0
        self._seq = itertools.count()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, max_queue_size))
        token = os.environ.get("CONTEXTPILOT_EVENTS_TOKEN")
        headers = {"X-ContextPilot-Token": token} if token else {}
        self._client = httpx.Client(timeout=5.0, headers=headers)
        self._thread = threading.Thread(target=self._run, name="contextpilot-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: Any) -> None:
        """Queue one ``KVEventBatch``; never blocks the scheduler."""
        payload = {
            "seq": next(self._seq),
            "rank": self.rank,
            "publisher": self.publisher_id,
            "ts": getattr(batch, "ts", None) or time.time(),
            "events": [event_to_dict(event) for event in batch.events],
        }
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
            payload = self._queue.get()
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
