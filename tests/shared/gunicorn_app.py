"""A WSGI app whose pilot is made at import: under ``gunicorn --preload`` that is in the
master, before the workers are forked (as teams deploy it). ``/prepare?n=N`` prepares
request ``rN``; ``/state`` sends what is pending, catches up and answers with this worker's
pid, identity and index."""

from __future__ import annotations

import json
import os
import urllib.parse
from collections.abc import Callable, Iterable
from typing import Any

from contextpilot_integrations import ContextPilot
from contextpilot_integrations.shared import SharedOptions

DOCS = [{"id": f"d{n}", "text": f"document {n} " * 10, "tokens": 30} for n in range(12)]

pilot = ContextPilot(shared=SharedOptions(url=os.environ["CONTEXTPILOT_TEST_BROKER"], snapshot_interval=0))


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""))
    if environ["PATH_INFO"] == "/prepare":
        n = int(query["n"][0])
        pilot.prepare([DOCS[(n + k) % len(DOCS)] for k in range(4)], "q", request_id=f"r{n}")
        body: dict[str, Any] = {"pid": os.getpid()}
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
