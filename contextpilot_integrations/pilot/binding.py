"""Which prepared request a model call sends: carried by the framework's run tree.

A retrieval step prepares a request; a model call later in the same invocation sends it.
The two never see each other, and the prompt text is no reliable link (two users with the
same documents render the same text). Both frameworks run every step inside a tree of runs
(LangChain run ids, LlamaIndex spans), so the link is structural: the retrieval step
*deposits* its prepared request at its run; a model call *takes* the deposit whose run
shares the nearest ancestor with the call, made before it and not taken yet. Concurrent
invocations live in different subtrees and never meet, so every id sent is unique.

Framework-free: the adapters feed :class:`RunBinder` their run or span ids.
:func:`restore_references` is the second half of the contract: where messages leave for
the engine, every location reference must point at text that is in those messages.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.blocks import BlockLike
from ..core.partitions import partition_of_body
from ..core.prepared import PreparedRequest, resolve_references, resolve_request
from .facade import Binding
from .ports import Preparer

__all__ = [
    "Binding",
    "RunBinder",
    "aprepare_bound",
    "checked_for_sending",
    "partitioned",
    "prepare_bound",
    "resolve_references",
    "restore_references",
]

RunId = Hashable


@dataclass(slots=True)
class _Deposit:
    run: RunId
    binding: Binding
    order: int
    taken: bool = False
    failed: bool = False


@dataclass
class RunBinder:
    """Deposits of one invocation's prepared requests, matched to its model calls.

    Thread-safe. Bounded: at most ``max_runs`` parent links and ``max_deposits`` deposits
    (oldest dropped first); a LangChain invocation owns one binder, LlamaIndex drops a
    root span's state when the span ends.
    """

    max_runs: int = 10_000
    max_deposits: int = 1_000
    _parents: OrderedDict[RunId, RunId | None] = field(default_factory=OrderedDict, repr=False)
    _deposits: list[_Deposit] = field(default_factory=list, repr=False)
    _count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def started(self, run: RunId, parent: RunId | None) -> None:
        """A run began under ``parent`` (``None``: a root)."""
        with self._lock:
            self._parents[run] = parent
            while len(self._parents) > self.max_runs:
                self._parents.popitem(last=False)

    def deposit(self, run: RunId, binding: Binding) -> object:
        """The step running as ``run`` prepared ``binding.prepared`` for a later model call.
        Returns the deposit."""
        with self._lock:
            self._count += 1
            deposit = _Deposit(run, binding, self._count)
            self._deposits.append(deposit)
            if len(self._deposits) > self.max_deposits:
                del self._deposits[: len(self._deposits) - self.max_deposits]
            return deposit

    def take(self, run: RunId | None) -> Binding | None:
        """The deposit for a model call at ``run`` (its parent run, or the call's own run):
        the untaken one whose run shares the nearest ancestor with ``run`` (the latest on a
        tie). A deposit whose call failed (:meth:`failed`) can be taken again by a retry.
        ``None`` when the call is outside every deposit's invocation."""
        if run is None:
            return None
        with self._lock:
            lineage = self._lineage(run)
            depth = {ancestor: index for index, ancestor in enumerate(lineage)}
            best: tuple[int, int] | None = None
            chosen: _Deposit | None = None
            for deposit in self._deposits:
                if deposit.taken:
                    continue
                shared = next((depth[a] for a in self._lineage(deposit.run) if a in depth), None)
                if shared is None:
                    continue
                rank = (shared, -deposit.order)
                if best is None or rank < best:
                    best, chosen = rank, deposit
            if chosen is None:
                return None
            chosen.taken = True
            retry = chosen.failed
            chosen.failed = False
            binding = chosen.binding
        if retry:  # the failed attempt was forgotten; the retry sends it again, under a new id
            binding = Binding(binding.pilot, binding.pilot.adopt(binding.prepared, fresh_id=True))
            with self._lock:
                chosen.binding = binding
        return binding

    def failed(self, binding: Binding) -> None:
        """The call that took ``binding`` failed: a retry in the same invocation may take it."""
        with self._lock:
            for deposit in self._deposits:
                if deposit.binding.prepared.request_id == binding.prepared.request_id:
                    deposit.taken, deposit.failed = False, True

    def untaken(self) -> list[Binding]:
        """Deposits no model call took (what an unbound model call leaves unreported)."""
        with self._lock:
            return [deposit.binding for deposit in self._deposits if not deposit.taken]

    def forget(self, runs: Collection[RunId]) -> None:
        """Drop these runs and the deposits made at them (a finished root's subtree)."""
        with self._lock:
            for run in runs:
                self._parents.pop(run, None)
            self._deposits = [deposit for deposit in self._deposits if deposit.run not in runs]

    def _lineage(self, run: RunId) -> list[RunId]:
        chain = [run]
        seen = {run}
        parent = self._parents.get(run)
        while parent is not None and parent not in seen:
            chain.append(parent)
            seen.add(parent)
            parent = self._parents.get(parent)
        return chain


def checked_for_sending(binding: Binding, texts: MutableSequence[str]) -> Binding:
    """Where messages leave for the engine: write out every reference of the bound request
    that ``texts`` (the outgoing messages' texts, in order; edited in place) do not resolve
    to exactly one text, tell its pilot, and return the binding located in that prompt."""
    restored = restore_references(binding.prepared, texts)
    if restored:
        binding.pilot.note_restored(binding.prepared, restored)
    return binding.located("\n".join(texts))


def restore_references(prepared: PreparedRequest, texts: MutableSequence[str]) -> list[str]:
    """Put back the full text of every reference of ``prepared`` that would not name exactly
    one text in ``texts`` (the outgoing messages' texts, in order; edited in place): a
    reference by label stays only if its block, labelled, comes before it; a quote only if
    its words begin a copy of its block before it and occur nowhere else in ``texts``
    outside that block's first paragraph (the system prompt, another document, the
    question, an answer; :func:`~contextpilot_integrations.core.prepared.resolve_references`).
    Only the reference the request placed is replaced (found by the request's own
    rendering), never the same sentence inside a document or an earlier message.
    Returns the ids of the blocks restored (sent in full after all)."""
    return resolve_request(texts, prepared)


def prepare_bound(
    preparer: Preparer[Any],
    blocks: Sequence[BlockLike],
    query: str,
    conversation_id: str | None = None,
    *,
    kept_turns: Collection[int] | None = None,
    partition: str | None = None,
) -> Binding:
    """Prepare with a pilot, a router or a micro-batcher alike (the :class:`~.ports.Preparer`
    port), and name the pilot whose index now holds the request (a router's target state):
    what an adapter deposits. ``partition``: the engine's cache partition
    (:func:`~..core.partitions.cache_partition`)."""
    return preparer.bound(preparer.prepare(blocks, query, conversation_id, kept_turns=kept_turns, partition=partition))


async def aprepare_bound(
    preparer: Preparer[Any],
    blocks: Sequence[BlockLike],
    query: str,
    conversation_id: str | None = None,
    *,
    kept_turns: Collection[int] | None = None,
    partition: str | None = None,
) -> Binding:
    """Async variant of :func:`prepare_bound`."""
    result = await preparer.aprepare(blocks, query, conversation_id, kept_turns=kept_turns, partition=partition)
    return preparer.bound(result)


def partitioned(binding: Binding | None, fields: Mapping[str, Any], adapters: Collection[str] = ()) -> Binding | None:
    """The binding as its model call sends it: indexed in the cache partition the call's body
    ``fields`` name (its ``cache_salt``, ``extra_key``, LoRA adapter:
    :func:`~..core.partitions.partition_of_body`) when that is not the one it was prepared
    in. A body that names none keeps the prepared partition (one given to the retrieval step)."""
    if binding is None:
        return None
    partition = partition_of_body(fields, adapters)
    if partition is None or partition == binding.prepared.partition:
        return binding
    return Binding(binding.pilot, binding.pilot.repartition(binding.prepared, partition), binding.before_tokens)
