"""A WSGI app whose pilot is made at import: under ``gunicorn --preload`` that is in the
master, before the workers are forked (as teams deploy it). ``/prepare?n=N`` prepares
request ``rN``; ``/state`` sends what is pending, catches up and answers with this worker's
pid, identity and index. ``/per_request?n=N`` is the handler that builds its integration per
request without ``pilot=`` (a pilot of its own through :func:`own_pilot`, as all seven
integrations do; ``CONTEXTPILOT_SHARED`` set): it answers with the broker clients this worker
runs once that pilot is dropped."""

from __future__ import annotations

import gc
import json
import os
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.integration.implicit import own_pilot
from contextpilot_integrations.shared import SharedOptions

DOCS = [{"id": f"d{n}", "text": f"document {n} " * 10, "tokens": 30} for n in range(12)]

pilot = ContextPilot(shared=SharedOptions(url=os.environ["CONTEXTPILOT_TEST_BROKER"], snapshot_interval=0))


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
    if environ["PATH_INFO"] == "/prepare":
        n = int(query["n"][0])
        pilot.prepare([DOCS[(n + k) % len(DOCS)] for k in range(4)], "q", request_id=f"r{n}")
        body: dict[str, Any] = {"pid": os.getpid()}
    elif environ["PATH_INFO"] == "/per_request":
        n = int(query["n"][0])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            own = own_pilot("the per-request handler")
        own.prepare([DOCS[(n + k) % len(DOCS)] for k in range(4)], "q", request_id=f"p{n}")
        del own
        gc.collect()
        deadline = time.monotonic() + 10
        while _clients() > 1 and time.monotonic() < deadline:  # the dropped pilot's client stops
            time.sleep(0.05)
        body = {"pid": os.getpid(), "clients": _clients(), "warnings": [str(w.category.__name__) for w in caught]}
    else:
        flushed = pilot.shared.flush(10.0)
        caught_up = pilot.shared.wait_caught_up(10.0)
        body = {
            "pid": os.getpid(),
            "origin": pilot.shared.origin,
            "flushed": flushed,
            "caught_up": caught_up,
            "connected": pilot.stats().shared_connected,
            "live": sorted(pilot.live_request_ids()),
        }
    start_response("200 OK", [("Content-Type", "application/json"), ("Connection", "close")])
    return [json.dumps(body).encode()]


def _clients() -> int:
    """Broker clients running in this worker (the preloaded pilot's is one)."""
    return sum(thread.name.startswith("contextpilot-shared") for thread in threading.enumerate())
