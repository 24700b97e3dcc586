"""One LlamaIndex query's span tree links its postprocessor to its LLM call.

LlamaIndex runs a query as a tree of instrumentation spans (``query`` -> ``retrieve`` ...,
``synthesize`` -> ``predict`` -> the LLM call). A span handler on the root dispatcher (the
framework's way to observe every span) records each span's parent while its root span is
open; the postprocessor deposits its prepared request at the active span, the LLM call
takes the deposit nearest to its own span
(:class:`~contextpilot_integrations.pilot.binding.RunBinder`). When the root span ends, its whole
subtree is forgotten. Concurrent queries are different roots and never meet.

A streaming query calls its LLM only when the stream is read, after the query's spans have
ended: that call takes the request the last query *of the same context* (thread or task)
left untaken, as the context variable it set still holds it. Another thread or task never
sees it.
"""

from __future__ import annotations

import inspect
import threading
from contextvars import ContextVar
from typing import Any

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
            # an unknown parent began before this handler listened: it is a root of its own
            root = id_ if parent_span_id is None else self._root_of.setdefault(parent_span_id, parent_span_id)
            if root not in self._subtrees and len(self._subtrees) >= MAX_OPEN_ROOTS:
                self._end(next(iter(self._subtrees)))  # a root that never ended
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

    def _closed(self, id_: str) -> None:
        with self._guard:
            if self._root_of.get(id_) == id_:
                self._end(id_)

    def _end(self, root: str) -> None:
        spans = self._subtrees.pop(root, set())
        for span in spans:
            self._root_of.pop(span, None)
        self._runs.forget(spans)


_pending: ContextVar[object | None] = ContextVar("contextpilot_pending_deposit", default=None)
"""This context's last deposit (what a stream read after its query ended takes)."""

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
    _pending.set(span_binder().runs.deposit(span, binding))
    return True


def take() -> Binding | None:
    """The prepared request for an LLM call made now: from the active span's query, else
    the one this context's last query left untaken (a stream read after its query)."""
    runs = span_binder().runs
    return runs.take(active_span_id.get()) or runs.claim(_pending.get())


def failed(binding: Binding) -> None:
    span_binder().runs.failed(binding)
