"""One LlamaIndex query's span tree links its postprocessor to its LLM call.

LlamaIndex runs a query as a tree of instrumentation spans (``query`` -> ``retrieve`` ...,
``synthesize`` -> ``predict`` -> the LLM call). A span handler on the root dispatcher (the
framework's way to observe every span) records each span's parent while its root span is
open; the postprocessor deposits its prepared request at the active span, the LLM call
takes the deposit nearest to its own span
(:class:`~contextpilot_integrations.pilot.binding.RunBinder`). When the root span ends, its whole
subtree is forgotten. Concurrent queries are different roots and never meet.

A streaming query (the refine and compact synthesizers) calls its LLM only when the stream
is read, after the query's spans have ended, in whatever thread or task reads it. So the
span that returns the framework's ``StreamingResponse`` carries itself into the stream: the
handler wraps the response's generator so that each step reads as that span, and keeps the
query's tree until the stream is read, closed or collected.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.span import active_span_id
from llama_index.core.instrumentation.span.base import BaseSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from pydantic import PrivateAttr

from contextpilot_integrations.pilot.binding import Binding, RunBinder

__all__ = ["deposit", "failed", "take"]

MAX_OPEN_ROOTS = 10_000


class SpanBinder(BaseSpanHandler[BaseSpan]):
    """Span parents per open root span, and the prepared requests deposited under them."""

    _runs: RunBinder = PrivateAttr(default_factory=lambda: RunBinder(max_runs=200_000, max_deposits=20_000))
    _root_of: dict[str, str] = PrivateAttr(default_factory=dict)
    _subtrees: dict[str, set[str]] = PrivateAttr(default_factory=dict)
    _deposited: set[str] = PrivateAttr(default_factory=set)
    """Roots with a deposit: only their streams are carried."""
    _streams: dict[str, int] = PrivateAttr(default_factory=dict)
    """Root -> its streams not done yet: the tree stays while one is."""
    _ended: set[str] = PrivateAttr(default_factory=set)
    """Roots whose span ended while a stream of theirs was not done."""
    _done: deque[str] = PrivateAttr(default_factory=deque)
    """Roots of streams just done, applied under the guard (a finalizer cannot wait for it)."""
    _guard: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @classmethod
    def class_name(cls) -> str:
        return "ContextPilotSpanBinder"

    @property
    def runs(self) -> RunBinder:
        return self._runs

    def new_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        parent_span_id: str | None = None,
        tags: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        with self._guard:
            self._apply_done()
            # an unknown parent began before this handler listened: it is a root of its own
            root = id_ if parent_span_id is None else self._root_of.setdefault(parent_span_id, parent_span_id)
            if root not in self._subtrees and len(self._subtrees) >= MAX_OPEN_ROOTS:
                self._end(next(iter(self._subtrees)))  # a root that never ended, or an unread stream's
            self._root_of[id_] = root
            self._subtrees.setdefault(root, {root}).add(id_)
        self._runs.started(id_, parent_span_id)
        return None  # nothing kept in open_spans

    def prepare_to_exit_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        result: Any | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(result, (StreamingResponse, AsyncStreamingResponse)):
            self._carry(id_, result)
        self._closed(id_)

    def prepare_to_drop_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        err: BaseException | None = None,
        **kwargs: Any,
    ) -> None:
        self._closed(id_)

    def deposit(self, span: str, binding: Binding) -> None:
        with self._guard:
            root = self._root_of.get(span)
            if root is not None:
                self._deposited.add(root)
        self._runs.deposit(span, binding)

    def _carry(self, span: str, response: StreamingResponse | AsyncStreamingResponse) -> None:
        """Make ``response``'s stream read as ``span`` (the innermost span returning it)."""
        stream: Any = response.response_gen
        if _carried(stream) or not isinstance(stream, (Iterator, AsyncIterator)):
            return
        with self._guard:
            root = self._root_of.get(span)
            if root is None or root not in self._deposited:
                return
            self._streams[root] = self._streams.get(root, 0) + 1
        lease = _Lease(self, root)
        if isinstance(stream, AsyncIterator):
            response.response_gen = _aread_as(span, stream, lease)
        else:
            response.response_gen = _read_as(span, stream, lease)

    def _closed(self, id_: str) -> None:
        with self._guard:
            self._apply_done()
            if self._root_of.get(id_) == id_:
                if self._streams.get(id_):
                    self._ended.add(id_)
                else:
                    self._end(id_)

    def _stream_done(self, root: str) -> None:
        """A carried stream of ``root`` was read, closed or collected (maybe inside a
        collection that interrupted this very handler: never wait for the guard)."""
        self._done.append(root)
        if self._guard.acquire(blocking=False):
            try:
                self._apply_done()
            finally:
                self._guard.release()

    def _apply_done(self) -> None:
        while self._done:
            root = self._done.popleft()
            left = self._streams.pop(root, 0) - 1
            if left > 0:
                self._streams[root] = left
            elif root in self._ended:
                self._end(root)

    def _end(self, root: str) -> None:
        spans = self._subtrees.pop(root, set())
        for span in spans:
            self._root_of.pop(span, None)
        self._deposited.discard(root)
        self._streams.pop(root, None)
        self._ended.discard(root)
        self._runs.forget(spans)


class _Lease:
    """A carried stream's hold on its query's tree, let go once: when the stream is done, or
    when it is collected unread (the finalizer)."""

    __slots__ = ("__weakref__", "release")

    def __init__(self, binder: SpanBinder, root: str) -> None:
        self.release = weakref.finalize(self, binder._stream_done, root)


_T = TypeVar("_T")

_reading: ContextVar[str | None] = ContextVar("contextpilot_reading_span", default=None)
"""While a carried stream steps: the span that returned it."""


def _read_as(span: str, stream: Iterator[_T], lease: _Lease) -> Generator[_T, None, None]:
    try:
        while True:
            token = _reading.set(span)
            try:
                item = next(stream)
            except StopIteration:
                return
            finally:
                _reading.reset(token)
            yield item
    finally:
        try:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        finally:
            lease.release()


async def _aread_as(span: str, stream: AsyncIterator[_T], lease: _Lease) -> AsyncGenerator[_T, None]:
    try:
        while True:
            token = _reading.set(span)
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:
                return
            finally:
                _reading.reset(token)
            yield item
    finally:
        try:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            lease.release()


def _carried(stream: Any) -> bool:
    """Whether ``stream`` is carried already (by a span nested in the one now ending)."""
    code = getattr(stream, "gi_code", None) or getattr(stream, "ag_code", None)
    return code is _read_as.__code__ or code is _aread_as.__code__


_binder: SpanBinder | None = None
_install = threading.Lock()


def span_binder() -> SpanBinder:
    """The span handler on the root dispatcher (added on first use)."""
    global _binder
    with _install:
        if _binder is None:
            _binder = SpanBinder()
            get_dispatcher().add_span_handler(_binder)
        return _binder


def deposit(binding: Binding) -> bool:
    """Leave ``binding`` at the active span (the query it belongs to); False outside a span."""
    span = active_span_id.get()
    if span is None:
        return False
    span_binder().deposit(span, binding)
    return True


def take() -> Binding | None:
    """The prepared request for an LLM call made now: from the query whose stream is being
    read, else from the active span's query."""
    reading = _reading.get()
    return span_binder().runs.take(reading if reading is not None else active_span_id.get())


def failed(binding: Binding) -> None:
    span_binder().runs.failed(binding)
