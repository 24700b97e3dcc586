"""A whole-call deadline for sync HTTP calls.

httpx bounds each read (``timeout``), not a call: a server that sends a byte of its
headers every half second holds a call for as long as it likes. :func:`deadline` sets when
the calls made inside it must end (an outer deadline that ends sooner wins: a routed call
and the ``/tokenize`` after the answer share it), and :func:`deadline_transport` is httpx's
transport with every socket connect, read and write bounded by the time left, so a call
ends at its deadline whatever the server drips. The async client bounds its calls with
:func:`asyncio.wait_for` on :func:`time_left`.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

__all__ = ["DeadlinePassed", "deadline", "deadline_transport", "time_left"]

_END: ContextVar[float | None] = ContextVar("contextpilot_deadline", default=None)


class DeadlinePassed(httpcore.TimeoutException):
    """The call's deadline passed (httpx raises it as a plain :class:`httpx.TimeoutException`:
    a slow server, never an unreachable one)."""


@contextmanager
def deadline(seconds: float | None) -> Iterator[float | None]:
    """Calls made inside end within ``seconds`` (``None``: no limit of its own), or by an
    outer deadline if that ends sooner. Yields when (``time.monotonic()``) they must end."""
    outer = _END.get()
    end = outer if seconds is None else time.monotonic() + seconds
    if outer is not None and end is not None:
        end = min(end, outer)
    token = _END.set(end)
    try:
        yield end
    finally:
        _END.reset(token)


def time_left() -> float | None:
    """Seconds before the current deadline (``None``: none set; at most 0 once passed)."""
    end = _END.get()
    return None if end is None else end - time.monotonic()


def _bounded(timeout: float | None) -> tuple[float | None, bool]:
    """The timeout for one socket operation, and whether the deadline is what bounds it."""
    left = time_left()
    if left is None or (timeout is not None and timeout <= left):
        return timeout, False
    if left <= 0:
        raise DeadlinePassed("the call's deadline passed")
    return left, True


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        bounded, by_deadline = _bounded(timeout)
        try:
            return self._inner.read(max_bytes, bounded)
        except httpcore.TimeoutException:
            if by_deadline:
                raise DeadlinePassed("the call's deadline passed") from None
            raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        bounded, by_deadline = _bounded(timeout)
        try:
            self._inner.write(buffer, bounded)
        except httpcore.TimeoutException:
            if by_deadline:
                raise DeadlinePassed("the call's deadline passed") from None
            raise

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        bounded, by_deadline = _bounded(timeout)
        try:
            return _Stream(self._inner.start_tls(ssl_context, server_hostname, bounded))
        except httpcore.TimeoutException:
            if by_deadline:
                raise DeadlinePassed("the call's deadline passed") from None
            raise

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    """The standard sync backend, its streams bounded by the deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        bounded, by_deadline = _bounded(timeout)
        try:
            return _Stream(self._inner.connect_tcp(host, port, bounded, local_address, socket_options))
        except httpcore.TimeoutException:
            if by_deadline:  # out of time, not a server that cannot be reached
                raise DeadlinePassed("the call's deadline passed") from None
            raise

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        bounded, _ = _bounded(timeout)
        return _Stream(self._inner.connect_unix_socket(path, bounded, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def deadline_transport() -> httpx.HTTPTransport:
    """httpx's default transport (TLS verified, the same pool limits), its sockets bounded
    by :func:`deadline`. A client given it reads no proxy from the environment (engines
    are reached directly)."""
    ssl_context = httpx.create_ssl_context()
    transport = httpx.HTTPTransport(verify=ssl_context)
    limits = httpx.Limits()
    # the one place httpx lets a network backend in: the httpcore pool it wraps
    transport._pool = httpcore.ConnectionPool(
        ssl_context=ssl_context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_Backend(),
    )
    return transport
