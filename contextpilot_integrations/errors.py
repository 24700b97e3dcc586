"""Exceptions raised by contextpilot-integrations.

Every error subclasses :class:`ContextPilotError`, and input problems also subclass
:class:`ValueError` or :class:`TypeError`, so callers can catch either family.
"""

from __future__ import annotations


class ContextPilotError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidBlockError(ContextPilotError, ValueError):
    """A context block cannot be used: empty text, a bad id or a bad token count."""


class BlockTypeError(ContextPilotError, TypeError):
    """A context block is not text (bytes, images, dicts without ``text``...)."""


class DuplicateBlockError(InvalidBlockError):
    """Two different texts were given under the same block id in one retrieval."""


class UnknownStrategyError(ContextPilotError, ValueError):
    """The strategy name is not registered."""


class DuplicateRequestError(ContextPilotError, ValueError):
    """A request id is already live in the index."""


class SharedSettingsError(ContextPilotError, ValueError):
    """The settings of a shared index cannot work: a malformed broker URL, no secret."""


class EngineError(ContextPilotError):
    """The engine did not serve the request; the message names the server."""


class EngineUnavailable(EngineError):
    """The server could not be reached, or did not answer in time."""


class EngineTimeout(EngineUnavailable):
    """The server took the request but did not answer in time: slow, not unreachable."""


class EngineHTTPError(EngineError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def as_engine_error(exc: BaseException, where: str) -> BaseException:
    """A connection that failed or broke mid-answer (httpx's, or the OpenAI or Anthropic SDK's
    when in use) as :class:`EngineUnavailable`; anything else (a timeout, the server's own
    answer) unchanged."""
    import sys

    import httpx

    broken = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.TimeoutException)
    for sdk in (sys.modules.get("openai"), sys.modules.get("anthropic")):  # never imported here
        if sdk is not None and isinstance(exc, sdk.APIConnectionError) and not isinstance(exc, sdk.APITimeoutError):
            broken = True
    if not broken:
        return exc
    error = EngineUnavailable(f"{where}: the connection failed ({type(exc).__name__}: {exc})")
    error.__cause__ = exc
    return error


class CacheKeyWarning(UserWarning):
    """A ``prompt_cache_key`` the caller set is sent in place of ContextPilot's."""
