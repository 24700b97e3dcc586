"""The two invariants, audited after every test: a pytest fixture for the suites' conftests.

Nothing lost (each location reference with its text in the same messages; a quote's words
begin copies of one text only) and exact binding (no request id sent twice) hold for every
chat body a wiring sends, whoever built its HTTP client. So :func:`audited_bodies` records,
for the length of one test, every JSON body sent through the HTTP stacks the wirings and
SDKs use (httpx and its fork httpx2: the chat models, the OpenAI, Anthropic and Gemini
SDKs, our engine clients; urllib3: boto3; aiohttp: Gemini's async calls) and fails the
test on a breach
(:func:`~contextpilot_integrations.testing.invariants.invariant_breaches`). A conftest imports
it; a test that sends a breach on purpose says so with ``@pytest.mark.breaches_allowed("why")``
(the marker is registered in each suite's pytest configuration).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .bodies import Bodies
from .invariants import invariant_breaches

__all__ = ["MARKER", "audited_bodies"]

MARKER = "breaches_allowed"


def _httpx_body(request: Any) -> bytes | None:
    try:
        return bytes(request.content)
    except Exception:  # a streamed body, not read yet: no chat body
        return None


def _sync(send: Callable[..., Any], body: Callable[..., Any], bodies: Bodies) -> Callable[..., Any]:
    @functools.wraps(send)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        content = body(*args, **kwargs)
        if isinstance(content, (bytes, str)):
            bodies.keep(content)
        return send(*args, **kwargs)

    return recorded


def _async(send: Callable[..., Any], body: Callable[..., Any], bodies: Bodies) -> Callable[..., Any]:
    @functools.wraps(send)
    async def recorded(*args: Any, **kwargs: Any) -> Any:
        content = body(*args, **kwargs)
        if isinstance(content, (bytes, str)):
            bodies.keep(content)
        return await send(*args, **kwargs)

    return recorded


def _urllib3_body(connection: Any, method: str, url: str, body: Any = None, *args: Any, **kwargs: Any) -> Any:
    return body


def _aiohttp_body(session: Any, method: str, url: Any, *, data: Any = None, json: Any = None, **kwargs: Any) -> Any:
    import json as json_module

    return json_module.dumps(json) if json is not None else data


_SENDS: tuple[tuple[str, str, str, Callable[..., Any], bool], ...] = (
    # (module, class, method, the body from its arguments, async)
    ("httpx", "HTTPTransport", "handle_request", lambda transport, request: _httpx_body(request), False),
    ("httpx", "AsyncHTTPTransport", "handle_async_request", lambda transport, request: _httpx_body(request), True),
    ("httpx2", "HTTPTransport", "handle_request", lambda transport, request: _httpx_body(request), False),
    ("httpx2", "AsyncHTTPTransport", "handle_async_request", lambda transport, request: _httpx_body(request), True),
    ("urllib3.connection", "HTTPConnection", "request", _urllib3_body, False),
    ("aiohttp", "ClientSession", "_request", _aiohttp_body, True),
)
"""Where each HTTP stack sends one request (once per attempt), and how to read its body."""


@pytest.fixture(autouse=True)
def audited_bodies(request: pytest.FixtureRequest) -> Iterator[Bodies]:
    """Every JSON body this test sends over HTTP; after the test, a failure naming each
    dangling reference and each request id sent twice, unless the test is marked
    ``breaches_allowed("why")``."""
    allowed = request.node.get_closest_marker(MARKER)
    if allowed is not None and not (allowed.args and isinstance(allowed.args[0], str) and allowed.args[0].strip()):
        pytest.fail(f"@pytest.mark.{MARKER} needs a reason: why does this test send a breach?")
    bodies = Bodies()
    with pytest.MonkeyPatch.context() as patch:
        for module_name, class_name, method, body, is_async in _SENDS:
            try:
                owner = getattr(importlib.import_module(module_name), class_name)
            except (ImportError, AttributeError):  # a stack not installed sends nothing
                continue
            wrap = _async if is_async else _sync
            patch.setattr(owner, method, wrap(getattr(owner, method), body, bodies))
        yield bodies
    breaches = invariant_breaches(bodies.sent)
    if breaches and allowed is None:
        listed = "\n".join(f"  - {breach}" for breach in breaches)
        pytest.fail(
            f"the bodies this test sent ({len(bodies.sent)}) break the project's invariants:\n{listed}\n"
            f"(a test that sends them on purpose says so: @pytest.mark.{MARKER}('why'))",
            pytrace=False,
        )
