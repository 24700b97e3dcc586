"""The per-test audit (``testing/audit.py``): it sees the bodies every HTTP stack sends, and a
test that sends a breach on purpose says so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx
import pytest
import urllib3

from contextpilot_integrations import Block
from contextpilot_integrations.core.annotations import render_reference
from contextpilot_integrations.testing.bodies import Bodies
from contextpilot_integrations.testing.fake_http import serve_handler
from contextpilot_integrations.testing.invariants import invariant_breaches


class _Ok(BaseHTTPRequestHandler):
    """A stand-in engine (named as such): answers every POST with an empty JSON object."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def url() -> Iterator[str]:
    with serve_handler(_Ok, "audit-stand-in") as served:
        yield served


def _body(rid: str) -> dict[str, object]:
    return {"rid": rid, "messages": [{"role": "user", "content": "q"}]}


def test_every_http_stack_is_recorded(url: str, audited_bodies: Bodies) -> None:
    httpx.post(url, json=_body("sync"))
    asyncio.run(httpx.AsyncClient().post(url, json=_body("async")))
    urllib3.PoolManager().request("POST", url, body=json.dumps(_body("urllib3")).encode())
    httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000)  # no chat body: not kept, no error
    assert [body["rid"] for body in audited_bodies.sent] == ["sync", "async", "urllib3"]


@pytest.mark.breaches_allowed("sends a repeated id and a dangling reference to see the audit name them")
def test_a_breach_sent_on_purpose_is_named(url: str, audited_bodies: Bodies) -> None:
    reference = {"rid": "b", "messages": [{"role": "user", "content": render_reference(Block(id="7", text="x"))}]}
    for body in (_body("a"), _body("a"), reference):
        httpx.post(url, json=body)
    assert invariant_breaches(audited_bodies.sent) == [
        "reference to [7] without its text",
        "request id 'a' sent 2 times",
    ]
