"""The JSON bodies a real httpx client sends, for tests that audit every body a wiring sent
(each reference with the text it points to, one request id per call:
:func:`contextpilot_integrations.testing.invariants.invariant_breaches`)."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx

__all__ = ["Bodies"]


class Bodies:
    """Bodies in the order sent. Hook it into a client you build (:meth:`client`) or into a
    model's own async client (``client.event_hooks["request"].append(bodies.record)``)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def add(self, request: httpx.Request) -> None:
        self.keep(request.content)

    def keep(self, content: bytes | str) -> None:
        """Keep ``content`` if it is a JSON object (a chat body); anything else is no body to audit."""
        try:
            body = json.loads(content)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to be a chat body
            return
        if isinstance(body, dict):
            with self._lock:
                self.sent.append(body)

    async def record(self, request: httpx.Request) -> None:
        self.add(request)

    def client(self) -> httpx.Client:
        return httpx.Client(event_hooks={"request": [self.add]})
