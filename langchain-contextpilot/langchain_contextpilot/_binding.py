"""One LangChain invocation's run tree links its retrieval step to its model call.

LangChain's configure hooks add a handler to the callback manager of every run; a hook with
a handler class adds a new one only where no run above already has one. So each root
invocation (``chain.invoke``, each input of ``chain.batch``, a graph step's run) gets its
own :class:`InvocationBinder`, and every run below it shares that one. The binder records
the run tree; the retrieval step deposits its prepared request at its run, the model call
takes it (:class:`~contextpilot_integrations.pilot.binding.RunBinder`). Nothing is shared between
invocations, so concurrent users never see each other's requests.
"""

from __future__ import annotations

import warnings
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler, BaseCallbackManager
from langchain_core.tracers.context import register_configure_hook

from contextpilot_integrations.pilot.binding import Binding, RunBinder

__all__ = ["ContextPilotBindingWarning", "InvocationBinder", "deposit", "take"]


class ContextPilotBindingWarning(UserWarning):
    """A chain prepared requests with ContextPilot but its chat model cannot send them."""


class InvocationBinder(BaseCallbackHandler):
    """The run tree of one invocation, and the requests its steps prepared."""

    run_inline = True  # record each run before its children start, in async chains too
    raise_error = False  # bookkeeping only: a problem here must never fail the user's chain

    def __init__(self) -> None:
        self.runs = RunBinder()
        self._models: dict[UUID, str] = {}  # chat model runs -> class name
        self._bound: set[UUID] = set()  # model runs that took a deposit or were ours

    # ---- the run tree --------------------------------------------------------------------
    def _started(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        self.runs.started(run_id, parent_run_id)

    def on_chain_start(
        self, serialized: Any, inputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._started(run_id, parent_run_id)

    def on_retriever_start(
        self, serialized: Any, query: str, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._started(run_id, parent_run_id)

    def on_tool_start(
        self, serialized: Any, input_str: str, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._started(run_id, parent_run_id)

    def on_llm_start(
        self, serialized: Any, prompts: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._model_started(serialized, run_id, parent_run_id)

    def on_chat_model_start(
        self, serialized: Any, messages: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        self._model_started(serialized, run_id, parent_run_id)

    def _model_started(self, serialized: Any, run_id: UUID, parent_run_id: UUID | None) -> None:
        self._started(run_id, parent_run_id)
        ids = (serialized or {}).get("id") or ["a chat model"]
        if len(self._models) < 1_000:
            self._models[run_id] = str(ids[-1])

    def on_chain_end(self, outputs: Any, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any) -> None:
        if parent_run_id is None:
            self._check_bound()

    def on_chain_error(
        self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None, **kwargs: Any
    ) -> None:
        if parent_run_id is None:
            self._check_bound()

    # ---- deposits ------------------------------------------------------------------------
    def take(self, run_id: UUID | None, model_run: UUID | None = None) -> Binding | None:
        if model_run is not None:
            self._bound.add(model_run)
        return self.runs.take(run_id)

    def _check_bound(self) -> None:
        """At the end of the invocation: warn when its model calls could not send what its
        retrieval steps prepared (the engine gets no request id, the pilot no report)."""
        unbound = sorted({name for run, name in self._models.items() if run not in self._bound})
        if unbound and self.runs.untaken():
            warnings.warn(
                f"ContextPilot prepared requests in this chain, but {', '.join(unbound)} cannot send their "
                "request ids or report the engine's cached tokens: the index is never corrected by the "
                "engine. Wrap the model: ContextPilotChatModel(llm=...), or use ChatSGLang.",
                ContextPilotBindingWarning,
                stacklevel=2,
            )


class _PerInvocation:
    """Stands where LangChain expects the hook's context variable: a new binder each time,
    which LangChain adds only to a run no ancestor gave one."""

    def get(self) -> InvocationBinder:
        return InvocationBinder()


register_configure_hook(_PerInvocation(), inheritable=True, handle_class=InvocationBinder)  # type: ignore[arg-type]


def binder_of(callbacks: Any) -> InvocationBinder | None:
    """The invocation's binder among a callback manager's handlers."""
    handlers = getattr(callbacks, "handlers", None) or []
    return next((handler for handler in handlers if isinstance(handler, InvocationBinder)), None)


def deposit(callbacks: Any, run_id: UUID | None, binding: Binding) -> None:
    """A step running as ``run_id`` (with this callback manager) prepared ``binding``."""
    binder = binder_of(callbacks)
    if binder is not None and run_id is not None:
        binder.runs.deposit(run_id, binding)


def take(callbacks: Any, run_id: UUID | None = None) -> Binding | None:
    """The prepared request for a model call: ``callbacks`` is its run manager (its own
    run) or the callback manager of its config (its parent run)."""
    binder = binder_of(callbacks)
    if binder is None:
        return None
    if run_id is None and isinstance(callbacks, BaseCallbackManager):
        run_id = callbacks.parent_run_id
    own = getattr(callbacks, "run_id", None)
    return binder.take(own or run_id, own)


def failed(callbacks: Any, binding: Binding) -> None:
    """The call that took ``binding`` failed: a retry within the invocation may take it again."""
    binder = binder_of(callbacks)
    if binder is not None:
        binder.runs.failed(binding)
