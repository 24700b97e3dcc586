"""Route each request to the engine that holds its prefix: llama-server slots or replicas.

A prefix cache only helps a request sent where its prefix lives. With one slot, a prefix
kept in host RAM costs a restore about as large as the reuse; with several slots or
replicas, the engine's own placement rarely picks the one holding it. So the
:class:`Router` keeps one predicted cache state per target (a :class:`ContextPilot` each,
kept true by that target's events or cached-token reports) and chooses like SGLang's router
``cache_aware`` policy (:mod:`.selector`: balance, else the longest cached prefix, else room).

A conversation stays on one target (its history is cached there), but its turns are one
conversation whichever target serves each: the targets' pilots share one conversation store
and number a conversation's turns once (:mod:`.pilot_group`). A target that cannot be reached
(refused, reset) is marked down for ``down_seconds`` and routed around; the request is
prepared again for another target, with the same ``kept_turns``, and sent there, so it is
never lost. A slow answer (a timeout, the ``deadline``) is not a dead target: the call
raises, and the target keeps its place and its predicted cache. But a target that fails
``breaker_failures`` times in a row is a circuit breaker opened (:mod:`.health`), its
predicted cache kept. :meth:`Router.stats` shows each target's failures and breaker. A
request larger than every target's cache is sent anyway (to the least loaded) and recorded
as cached nowhere. A call that raises, bad input included, leaves the routing state as it was.

The parts, one job each: :mod:`.selector` (the decision), :mod:`.health` (breakers and
counters), :mod:`.pilot_group` (the pilots), :mod:`.placements` (where each conversation
lives), :mod:`.routing_client` (:class:`RoutingClient`
sends; thread-safe, sync and async); the router composes them.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..core.blocks import Block, BlockLike, normalize_blocks
from ..core.gain import in_partition
from ..core.prepared import PreparedRequest
from ..core.validation import (
    check_conversation_id,
    check_kept_turns,
    check_partition,
    check_query,
    check_request_id,
)
from ..errors import DuplicateRequestError
from ..pilot import BatchItem, BatchRequest, ContextPilot, batch_request
from ..pilot.binding import Binding
from ..pilot.ports import Broadcast
from .health import Health, TargetStats, is_unreachable, send_outcome
from .pilot_group import PilotGroup
from .placements import Placements
from .routing_client import RoutedResult, RoutingClient
from .selector import ROUTINGS, CacheAwarePolicy, select
from .targets import Routed, Target

T = TypeVar("T")

__all__ = [
    "CacheAwarePolicy",
    "Routed",
    "RoutedResult",
    "Router",
    "RoutingClient",
    "Target",
    "TargetStats",
    "is_unreachable",
]


@dataclass
class _Draft:
    """Routing decisions not recorded yet: those of a batch so far (its load, its blocks,
    where its conversations go, round-robin turns taken). Recorded once nothing can fail."""

    pending: dict[str, int] = field(default_factory=dict)
    pending_blocks: dict[str, set[str]] = field(default_factory=dict)
    sticks: dict[str, str] = field(default_factory=dict)
    turned: int = 0

    def add(
        self, target: Target, blocks: Sequence[Block], conversation_id: str | None, partition: str | None = None
    ) -> None:
        self.pending[target.name] = self.pending.get(target.name, 0) + 1
        self.pending_blocks.setdefault(target.name, set()).update(in_partition([b.id for b in blocks], partition))
        if conversation_id is not None:
            self.sticks[conversation_id] = target.name


class Router:
    """Per-target predicted cache state and the routing decision (no I/O of its own).

    Conversations: the targets' pilots share one conversation store, so turn ``n`` of a
    conversation is its ``n``-th turn whichever target served the earlier ones, and
    ``kept_turns`` names the same turns on every target (see the module docstring). A turn
    that fails everywhere gives its number back (:meth:`withdraw`).

    Args:
        targets: where requests can go (distinct names).
        strategy: the ordering strategy of every target's pilot (``"retrieval"`` keeps the
            retriever's order, for a baseline that only routes).
        policy: thresholds of the cache-aware policy; ``routing="cache_aware"`` uses it,
            ``"round_robin"`` and ``"least_loaded"`` are there to compare with.
        down_seconds: how long an unreachable target, or one whose breaker opened, is
            routed around (then one request probes it).
        breaker_failures: failures in a row (timeouts, 5xx, broken answers) that open a
            target's circuit breaker; an unreachable target's opens at once.
        max_conversations: conversations remembered (where each one lives, and what its
            turns showed); the least recent are forgotten.
        shared: share every target's predicted state and where conversations live with the
            other application replicas (a ``nats://`` URL or
            :class:`~contextpilot_integrations.shared.SharedOptions`; default
            ``CONTEXTPILOT_SHARED``): each target's pilot shares under the target's name.
        **pilot_options: passed to every target's :class:`ContextPilot`.
    """

    ROUTINGS = ROUTINGS

    def __init__(
        self,
        targets: Sequence[Target],
        *,
        strategy: str = "trie",
        policy: CacheAwarePolicy | None = None,
        routing: str = "cache_aware",
        down_seconds: float = 30.0,
        breaker_failures: int = 3,
        max_conversations: int = 10_000,
        shared: Any = None,
        **pilot_options: Any,
    ) -> None:
        names = [target.name for target in targets]
        if not targets or len(set(names)) != len(names):
            raise ValueError("give at least one target, each with its own name")
        if routing not in self.ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(self.ROUTINGS)}, got {routing!r}")
        if max_conversations < 1:
            raise ValueError("max_conversations must be at least 1")
        if isinstance(breaker_failures, bool) or not isinstance(breaker_failures, int) or breaker_failures < 1:
            raise ValueError(f"breaker_failures must be an int >= 1, got {breaker_failures!r}")
        if not (math.isfinite(down_seconds) and down_seconds >= 0):
            raise ValueError(f"down_seconds must be a number of seconds >= 0, got {down_seconds!r}")
        self.targets = list(targets)
        self.policy = policy or CacheAwarePolicy()
        self.routing = routing
        self.down_seconds = down_seconds
        self.breaker_failures = breaker_failures
        self.max_conversations = max_conversations
        # one conversation store, decided and recorded under one lock
        self._group = PilotGroup(names, strategy, max_conversations, shared, **pilot_options)
        self._health = Health(names, breaker_failures, down_seconds)
        self._by_name = {t.name: t for t in self.targets}
        self._placements = Placements(max_conversations)  # conversation -> target name
        self._next = 0
        self._lock = threading.Lock()
        for pilot in self._group.pilots.values():
            sharing: Broadcast | None = pilot.shared
            if sharing is not None:  # other replicas' conversations, as they place them
                sharing.on("stick", self._stick)

    def _stick(self, conversation_id: str, name: str) -> None:
        """Another replica placed this conversation on target ``name``."""
        if not isinstance(conversation_id, str) or name not in self._by_name:
            return
        with self._lock:
            self._placements.record({conversation_id: name})

    # ---- state ----------------------------------------------------------------------------
    def pilot(self, target: Target | str) -> ContextPilot:
        """The predicted cache state of one target."""
        return self._group.pilots[target if isinstance(target, str) else target.name]

    def bound(self, routed: Routed) -> Binding:
        """A request this router prepared or planned, bound to its target's pilot (the
        :class:`~..pilot.ports.Preparer` port)."""
        return Binding(self.pilot(routed.target), routed.prepared)

    def target_of(self, pilot: ContextPilot) -> Target | None:
        """The target whose state ``pilot`` is."""
        name = self._group.name_of(pilot)
        return self._by_name[name] if name is not None else None

    def loads(self) -> dict[str, int]:
        """Requests in flight per target."""
        with self._lock:
            return {name: health.in_flight for name, health in self._health.targets.items()}

    def sent(self) -> dict[str, int]:
        """Requests sent per target, in all."""
        with self._lock:
            return {name: health.sent for name, health in self._health.targets.items()}

    def is_down(self, target: Target | str) -> bool:
        """Whether the target is being routed around (unreachable lately, or its breaker is
        open, or half-open with its probe in flight)."""
        name = target if isinstance(target, str) else target.name
        with self._lock:
            return not self._health.targets[name].available(time.monotonic())

    def stats(self) -> dict[str, TargetStats]:
        """Per target name: requests sent and in flight, failures, and the circuit breaker."""
        now = time.monotonic()
        with self._lock:
            return {name: health.stats(now) for name, health in self._health.targets.items()}

    def conversation_target(self, conversation_id: str) -> str | None:
        """The name of the target a conversation stays on, if it is remembered."""
        with self._lock:
            return self._placements.get(conversation_id)

    def started(self, target: Target) -> None:
        """A send to ``target`` begins; past an open breaker's cool-down it is the probe."""
        with self._lock:
            self._health.started(target.name)

    def finished(self, target: Target, outcome: str = "ok") -> None:
        """A send to ``target`` ended: ``ok`` (it answered, an HTTP 4xx included: it is up),
        ``failed``, ``timeout`` or ``unreachable`` (counted towards its breaker), or
        ``other`` (the caller's error or cancellation; ``down``: already counted by
        :meth:`mark_down`). See :func:`~.health.send_outcome`."""
        with self._lock:
            self._health.finished(target.name, outcome)

    def mark_down(self, target: Target) -> None:
        """The target is unreachable: route around it for ``down_seconds`` (its breaker
        open); its prediction is void (it may have restarted empty)."""
        with self._lock:
            self._health.mark_down(target.name)
        self.pilot(target).reset()

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation: where it lives and what its turns showed. Returns whether
        it was tracked."""
        with self._lock:
            stuck = self._placements.forget(conversation_id)
        return self._group.end_conversation(conversation_id) or stuck

    def withdraw(self, routed: Routed) -> None:
        """The request never reached the model (its send failed): its target's state forgets
        it, and its conversation turn, if it is still the latest, gives its number back, so
        the caller's next try (or next turn) is numbered as if it had never been made."""
        self._group.withdraw(routed.target.name, routed.prepared)

    # ---- the decision ------------------------------------------------------------------------
    def choose(
        self,
        blocks: Sequence[BlockLike],
        conversation_id: str | None = None,
        exclude: Collection[str] = (),
        pending: dict[str, int] | None = None,
        pending_blocks: dict[str, set[str]] | None = None,
        partition: str | None = None,
    ) -> tuple[Target, str]:
        """The target for these blocks, and why (see :mod:`.selector`); a conversation
        is then remembered on it.

        ``pending`` / ``pending_blocks``: requests (and their blocks) already routed to each
        target but not sent yet (a batch): load, and a prefix the batch plan will share.
        ``partition``: the engines' cache partition the request goes to: only a prefix held
        in it counts (:func:`~contextpilot_integrations.cache_partition`).
        """
        normalized, _ = normalize_blocks(blocks)
        check_conversation_id(conversation_id)
        check_partition(partition)
        draft = _Draft(dict(pending or {}), {name: set(ids) for name, ids in (pending_blocks or {}).items()})
        with self._lock:
            target, reason = self._decide(normalized, conversation_id, exclude, draft, partition)
            draft.add(target, normalized, conversation_id, partition)
            self._record(draft)
        return target, reason

    def _decide(
        self,
        blocks: Sequence[Block],
        conversation_id: str | None,
        exclude: Collection[str],
        draft: _Draft,
        partition: str | None = None,
    ) -> tuple[Target, str]:
        """The decision (:func:`~.selector.select`), with the lock held; it records nothing
        (``draft`` counts the round-robin turn it takes)."""
        sticky = None
        if conversation_id is not None:
            sticky = draft.sticks.get(conversation_id) or self._placements.get(conversation_id)
        health = self._health.targets
        keys = in_partition([block.id for block in blocks], partition) if self.routing == "cache_aware" else []

        def reuse(target: Target) -> int:
            """Its cache's reusable tokens, or the batch's blocks routed there, if more."""
            batch_blocks = draft.pending_blocks.get(target.name, set())
            shared = sum(block.token_count for block, key in zip(blocks, keys, strict=True) if key in batch_blocks)
            return max(self.pilot(target).reusable_tokens(blocks, partition), shared)

        target, reason = select(
            self.targets,
            up=self._health.up(time.monotonic()),
            loads={name: state.in_flight + draft.pending.get(name, 0) for name, state in health.items()},
            last_used={name: state.last_used for name, state in health.items()},
            size=sum(block.token_count for block in blocks),
            reuse=reuse,
            routing=self.routing,
            policy=self.policy,
            exclude=exclude,
            sticky=sticky,
            turn=self._next + draft.turned,
        )
        if self.routing == "round_robin" and reason == "fixed":
            draft.turned += 1
        return target, reason

    def _record(self, draft: _Draft) -> None:
        """Record decisions (with the lock held): round-robin turns taken, and where each
        conversation lives (most recent last; the least recent beyond the bound forgotten)."""
        self._next += draft.turned
        self._placements.record(draft.sticks, lambda name: self.pilot(name).shared)

    def prepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        exclude: Collection[str] = (),
        partition: str | None = None,
    ) -> Routed:
        """Choose a target and prepare the request with its predicted cache state (in the engines'
        cache ``partition``: see :meth:`ContextPilot.prepare`).

        Raises:
            InvalidBlockError, BlockTypeError, TypeError: bad input; nothing is recorded then
                (no target remembered for the conversation, no round-robin turn taken).
        """
        normalized, _ = normalize_blocks(blocks)
        check_query(query)
        check_conversation_id(conversation_id)
        check_partition(partition)
        kept = check_kept_turns(kept_turns)
        draft = _Draft()
        with self._lock:  # decide, prepare, record: one step (preparing takes microseconds)
            target, reason = self._decide(normalized, conversation_id, exclude, draft, partition)
            pilot = self.pilot(target)
            prepared = pilot.prepare(normalized, query, conversation_id, kept_turns=kept, partition=partition)
            if reason == "oversized":
                pilot.evict([prepared.request_id])  # larger than the cache: cached nowhere
            draft.add(target, normalized, conversation_id, partition)
            self._record(draft)
        return Routed(prepared, target, reason, kept)

    async def aprepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        exclude: Collection[str] = (),
        partition: str | None = None,
    ) -> Routed:
        """Async variant of :meth:`prepare` (it never blocks on I/O, so it runs inline)."""
        return self.prepare(blocks, query, conversation_id, kept_turns=kept_turns, exclude=exclude, partition=partition)

    # ---- sending a prompt a framework already rendered -----------------------------------------
    def attempts(self, binding: Binding | None) -> list[Target]:
        """Where to send a prepared prompt, first choice first: the target it was prepared
        for, then the others, least loaded first."""
        first = self.target_of(binding.pilot) if binding is not None else None
        loads = self.loads()
        rest = sorted((t for t in self.targets if t is not first), key=lambda t: loads[t.name])
        return ([first] if first is not None else []) + rest

    def _as_known_to(self, binding: Binding | None, target: Target) -> PreparedRequest | None:
        """The request as ``target``'s state knows it: sent elsewhere than prepared for
        (failover), it is adopted there, since that engine will hold it."""
        if binding is None:
            return None
        if self.target_of(binding.pilot) is target:
            return binding.prepared
        return self.pilot(target).adopt(binding.prepared)

    @contextmanager
    def attempt(self, target: Target, *, last: bool) -> Iterator[None]:
        """One try at ``target``, counted as load while it runs. An unreachable target is
        marked down and the failure swallowed (the caller tries the next one), unless it
        was the ``last`` one left; any other failure (an error answer, a timeout) raises,
        and counts towards the target's breaker, its prediction kept."""
        self.started(target)
        outcome = "other"  # cancelled, unless the send ends otherwise
        try:
            yield
            outcome = "ok"
        except Exception as exc:
            outcome = send_outcome(exc)
            if last or outcome != "unreachable":
                raise
            outcome = "down"
            self.mark_down(target)
        finally:
            self.finished(target, outcome)

    def call(self, binding: Binding | None, send: Callable[[Target, PreparedRequest | None], T]) -> T:
        """``send`` to each target of :meth:`attempts` until one answers."""
        targets = self.attempts(binding)
        for number, target in enumerate(targets, 1):
            with self.attempt(target, last=number == len(targets)):
                return send(target, self._as_known_to(binding, target))
        raise RuntimeError("no target")  # pragma: no cover - the last attempt returns or raises

    async def acall(self, binding: Binding | None, send: Callable[[Target, PreparedRequest | None], Awaitable[T]]) -> T:
        """Async variant of :meth:`call`."""
        targets = self.attempts(binding)
        for number, target in enumerate(targets, 1):
            with self.attempt(target, last=number == len(targets)):
                return await send(target, self._as_known_to(binding, target))
        raise RuntimeError("no target")  # pragma: no cover

    def plan(self, requests: Sequence[BatchItem], *, in_order: bool = True) -> list[Routed]:
        """A batch: route every request (counting those routed before it as load), then plan
        each target's share with its pilot. Routed requests come back in send order per
        target; each keeps its position in ``requests`` as ``prepared.batch_index``.
        ``in_order``: as :meth:`ContextPilot.plan`.

        Raises:
            InvalidBlockError, BlockTypeError, TypeError, DuplicateRequestError: for any bad
                request (naming its index); nothing is recorded then: all or nothing.
        """
        checked = [_checked(item, index) for index, item in enumerate(requests)]
        _check_request_ids(checked, list(self._group.pilots.values()))
        draft = _Draft()
        groups: dict[str, list[int]] = {}
        reasons: dict[int, str] = {}
        with self._lock:
            for index, item in enumerate(checked):
                cid, partition = item.request.conversation_id, item.request.partition
                target, reasons[index] = self._decide(item.blocks, cid, (), draft, partition)
                draft.add(target, item.blocks, cid, partition)
                groups.setdefault(target.name, []).append(index)
        routed: list[Routed] = []
        try:
            for name, indices in sorted(groups.items(), key=lambda item: -len(item[1])):
                for prepared in self.pilot(name).plan([checked[i].request for i in indices], in_order=in_order):
                    original = indices[prepared.batch_index]  # type: ignore[index]
                    prepared = replace(prepared, batch_index=original)
                    routed.append(
                        Routed(prepared, self._by_name[name], reasons[original], checked[original].kept_turns)
                    )
        except BaseException:
            for done in reversed(routed):  # a share planned before the failing one: undone
                self.withdraw(done)
            raise
        with self._lock:
            self._record(draft)
        return routed


@dataclass(frozen=True, slots=True)
class _Checked:
    """A batch request validated as the pilot would, before anything is recorded."""

    request: BatchRequest
    blocks: list[Block]
    kept_turns: frozenset[int] | None


def _checked(item: Any, index: int) -> _Checked:
    request = batch_request(item, index)
    try:
        blocks, _ = normalize_blocks(request.blocks)
        check_query(request.query)
        check_conversation_id(request.conversation_id)
        check_partition(request.partition)
        kept = check_kept_turns(request.kept_turns)
        if request.request_id is not None:
            check_request_id(request.request_id)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"request #{index}: {exc}") from exc
    return _Checked(request, blocks, kept)


def _check_request_ids(checked: Sequence[_Checked], pilots: Sequence[ContextPilot]) -> None:
    """Given request ids are unique in the batch and not live on any target."""
    given = [item.request.request_id for item in checked if item.request.request_id is not None]
    if len(set(given)) != len(given):
        raise DuplicateRequestError("request ids repeat within the batch")
    if given:
        live = {rid for pilot in pilots for rid in pilot.live_request_ids()}
        for index, item in enumerate(checked):
            if item.request.request_id in live:
                rid = item.request.request_id
                raise DuplicateRequestError(f"request #{index}: request id {rid!r} is already in the index")
