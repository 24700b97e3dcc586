"""An async HTTP client that works from any event loop, one after another or side by side.

An ``httpx.AsyncClient`` pools connections on the event loop that opened them; after that
loop closes (the end of an ``asyncio.run``), the next loop's first request takes a dead
connection and fails ("the connection failed"). Chat model classes keep one async client per
model, so a model used from a second ``asyncio.run`` fails once, unless the client retries,
and ours do not (an engine refuses a retried request id). :class:`LoopLocalTransport` keeps
one connection pool per running loop and drops the pools of loops that have closed.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

import httpx

__all__ = ["LoopLocalTransport", "loop_local_async_client"]

_TRANSPORT_OPTIONS = ("verify", "cert", "http1", "http2", "limits", "retries", "socket_options")


class LoopLocalTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncHTTPTransport(**options)`` per running event loop. Thread-safe; holds
    pools for live loops only (a closed loop's pool is dropped, and a collected loop's
    entry goes with it)."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncHTTPTransport] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def _pool(self) -> httpx.AsyncHTTPTransport:
        loop = asyncio.get_running_loop()
        with self._lock:
            for closed in [other for other in self._pools if other.is_closed()]:
                del self._pools[closed]  # its connections died with it
            pool = self._pools.get(loop)
            if pool is None:
                pool = self._pools[loop] = httpx.AsyncHTTPTransport(**self._options)
            return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._pool().handle_async_request(request)

    async def aclose(self) -> None:
        """Close the running loop's pool (the others belong to loops this one cannot run)."""
        with self._lock:
            pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.aclose()


def loop_local_async_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient(**options)`` whose connections belong to the loop using them:
    what the chat model classes of the adapters use unless given a client of your own."""
    transport = {name: options.pop(name) for name in _TRANSPORT_OPTIONS if name in options}
    return httpx.AsyncClient(transport=LoopLocalTransport(**transport), **options)
