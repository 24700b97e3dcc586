"""Route each request to the engine that holds its prefix: llama-server slots or replicas.

A prefix cache only helps a request sent where its prefix lives. With one slot, a prefix
kept in host RAM costs a restore about as large as the reuse; with several slots or
replicas, the engine's own placement rarely picks the one holding it. So the
:class:`Router` keeps one predicted cache state per target (a :class:`ContextPilot` each,
kept true by that target's events or cached-token reports) and, like SGLang's router
``cache_aware`` policy:

1. if the load is imbalanced (the busiest target has ``balance_abs_threshold`` more
   requests in flight than the idlest, and ``balance_rel_threshold`` times as many), the
   least loaded target;
2. else the target whose cache holds the longest prefix of the request's blocks, if that
   prefix is at least ``cache_threshold`` of the request's block tokens;
3. else the least recently used target (its cache holds the oldest prefixes: room for a
   new one), which also spreads new prefixes evenly.

A conversation stays on one target (its history is cached there), but its turns are one
conversation whichever target serves each: the history is what the caller sends, so the
targets' pilots share one conversation store and number a conversation's turns once
(``kept_turns`` means the same turns on every target, and a reference only ever names a
turn the caller keeps). A target that cannot be reached (refused, reset) is marked down
for ``down_seconds`` and routed around; the request is prepared again for another target,
with the same ``kept_turns``, and sent there, so it is never lost. A slow answer (a
timeout, the ``deadline``) is not a dead target: the call raises, and the target keeps
its place and its predicted cache. But a target that fails ``breaker_failures`` times in
a row (timeouts, 5xx, broken answers: one that accepts connections and never answers) is
a circuit breaker opened: routed around for ``down_seconds``, its predicted cache kept;
then one request probes it (half-open), and its success closes the breaker, its failure
opens it again. :meth:`Router.stats` shows each target's failures and breaker. A request
larger than every target's cache is sent anyway (to the least loaded) and recorded as cached
nowhere. A call that raises, bad input included, leaves the routing state as it was.

:class:`RoutingClient` sends; thread-safe, sync and async.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from pydantic import BaseModel

from ..core.blocks import Block, BlockLike, normalize_blocks
from ..core.conversations import ConversationStore
from ..core.gain import in_partition
from ..core.partitions import partition_of_body
from ..core.prepared import PreparedRequest
from ..core.validation import (
    check_conversation_id,
    check_kept_turns,
    check_partition,
    check_query,
    check_request_id,
)
from ..errors import DuplicateRequestError, EngineError, EngineTimeout, EngineUnavailable
from ..pilot import BatchItem, BatchRequest, ContextPilot, batch_request, join
from ..pilot.ports import Broadcast
from . import wire
from .client import ChatResult, OpenAICompatClient
from .deadline import deadline
from .feedback import Binding

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


def is_unreachable(exc: BaseException) -> bool:
    """A connection-level failure (route around the target), not an answer from it:
    httpx's, ours, or the OpenAI SDK's (which the framework adapters use).

    A timeout is not one: the server took the request and is slow, which says nothing about
    the next request (and its cache still holds what it held). Only a connection that could
    not be made (refused, reset, a connect timeout) or broke marks a target unreachable.
    """
    import httpx

    openai = sys.modules.get("openai")  # only its own errors matter, so only if it is loaded
    sdk_timeouts = (openai.APITimeoutError,) if openai is not None else ()
    if _timed_out(exc, sdk_timeouts):
        return False
    if isinstance(exc, (httpx.TransportError, EngineUnavailable)):
        return True
    return openai is not None and isinstance(exc, openai.APIConnectionError)


def send_outcome(exc: BaseException) -> str:
    """What a failed send says about its target: ``unreachable``, ``timeout``, ``failed``
    (a 5xx, or an answer that broke or was malformed), ``ok`` (a 4xx: the target answered;
    the request was at fault) or ``other`` (not the target's doing)."""
    if is_unreachable(exc):
        return "unreachable"
    openai = sys.modules.get("openai")
    if _timed_out(exc, (openai.APITimeoutError,) if openai is not None else ()):
        return "timeout"
    status = getattr(exc, "status_code", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return "failed" if status >= 500 else "ok"
    return "failed" if isinstance(exc, EngineError) else "other"


def _timed_out(exc: BaseException, sdk_timeouts: tuple[type[BaseException], ...]) -> bool:
    """Whether ``exc`` (or the error it was raised from) is a timeout of a request the
    server took; a connect timeout is not one (the server never got the request)."""
    import httpx

    timeouts = (EngineTimeout, httpx.TimeoutException, TimeoutError, asyncio.TimeoutError, *sdk_timeouts)
    found = False
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, httpx.ConnectTimeout):
            return False
        found = found or isinstance(link, timeouts)
        link = link.__cause__
    return found


@dataclass(frozen=True, slots=True)
class Target:
    """Where a request can go: a server, or one slot of a llama-server (``id_slot``)."""

    name: str
    base_url: str
    slot: int | None = None
    """llama-server slot to pin (``id_slot``); ``None``: the server places it."""
    engine: str = "sglang"
    """``sglang``, ``vllm``, ``llamacpp`` or ``openai`` (see :data:`wire.ENGINES`)."""
    capacity_tokens: int | None = None
    """Its KV-cache size in tokens, if known: a larger request is cached nowhere."""

    def __post_init__(self) -> None:
        if self.engine not in wire.ENGINES:
            raise ValueError(f"target {self.name!r}: engine must be one of {', '.join(wire.ENGINES)}")


@dataclass(frozen=True, slots=True)
class CacheAwarePolicy:
    """SGLang's router ``cache_aware`` policy, in requests in flight and block tokens."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5


@dataclass(frozen=True, slots=True)
class Routed:
    """A prepared request and the target it was prepared for."""

    prepared: PreparedRequest
    target: Target
    reason: str
    """``balance``, ``cache``, ``room``, ``conversation``, ``oversized`` or ``fixed``."""
    kept_turns: frozenset[int] | None = None
    """The caller's ``kept_turns``: a failover prepares the request again with them."""


class TargetStats(BaseModel):
    """One target's traffic, failures and circuit breaker (see :meth:`Router.stats`)."""

    sent: int
    in_flight: int
    failures: int
    """Sends that failed on the target's side: timeouts, unreachable, 5xx, broken answers."""
    timeouts: int
    unreachable: int
    consecutive_failures: int
    breaker: Literal["closed", "open", "half_open"]
    """``open``: routed around; ``half_open``: the cool-down is over, one request probes it."""
    breaker_opened: int
    """Times the breaker opened (a failed probe included)."""
    open_for_s: float
    """Seconds before an open breaker lets a probe through (0 unless open)."""


@dataclass
class _State:
    pilot: ContextPilot
    in_flight: int = 0
    down_until: float = 0.0
    tripped: bool = False
    """The breaker is open (before ``down_until``) or half-open (after it)."""
    probing: bool = False
    """A half-open breaker's probe is in flight: no other request goes there meanwhile."""
    sent: int = 0
    failures: int = 0
    timeouts: int = 0
    unreachable: int = 0
    consecutive: int = 0
    opened: int = 0
    last_used: int = -1

    def available(self, now: float) -> bool:
        """Routed to: closed, or half-open with no probe in flight."""
        return not self.tripped or (now >= self.down_until and not self.probing)

    def trip(self, until: float) -> None:
        """Open the breaker until ``until`` (counted once: not again for a send that was
        already in flight when it opened)."""
        self.opened += not self.tripped or self.probing
        self.tripped, self.probing, self.down_until = True, False, until


class _SharedConversations(ConversationStore):
    """The conversation store every target's pilot uses (under their one shared lock)."""

    def release_turn(self, conversation_id: str, turn: int) -> None:
        """A turn never reached the model: forget what it carried and, if no later turn was
        recorded meanwhile, give its number back (the caller's next turn takes it)."""
        self.forget_turn(conversation_id, turn)
        conversation = self._conversations.get(conversation_id)
        if conversation is not None and conversation.turns == turn + 1:
            conversation.turns = turn


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

    ROUTINGS = ("cache_aware", "round_robin", "least_loaded")

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
        from ..shared.switch import per_target  # no broker client unless sharing is on

        pilots = [ContextPilot(strategy, shared=per_target(shared, t.name), **pilot_options) for t in targets]
        self._pilot_lock = threading.RLock()
        # one conversation store, decided and recorded under one lock
        self._turns = join(pilots, self._pilot_lock, lambda ttl: _SharedConversations(ttl, max_conversations))
        self._states = {t.name: _State(pilot) for t, pilot in zip(targets, pilots, strict=True)}
        self._by_pilot = {id(pilot): t for t, pilot in zip(targets, pilots, strict=True)}
        self._conversations: OrderedDict[str, str] = OrderedDict()  # conversation -> target name
        self._next = 0
        self._uses = 0
        self._lock = threading.Lock()
        for pilot in pilots:
            sharing: Broadcast | None = pilot.shared
            if sharing is not None:  # other replicas' conversations, as they place them
                sharing.on("stick", self._stick)

    def _stick(self, conversation_id: str, name: str) -> None:
        """Another replica placed this conversation on target ``name``."""
        if not isinstance(conversation_id, str) or name not in self._states:
            return
        with self._lock:
            self._conversations[conversation_id] = name
            self._conversations.move_to_end(conversation_id)
            while len(self._conversations) > self.max_conversations:
                self._conversations.popitem(last=False)

    # ---- state ----------------------------------------------------------------------------
    def pilot(self, target: Target | str) -> ContextPilot:
        """The predicted cache state of one target."""
        return self._states[target if isinstance(target, str) else target.name].pilot

    def bound(self, routed: Routed) -> Binding:
        """A request this router prepared or planned, bound to its target's pilot (the
        :class:`~..pilot.ports.Preparer` port)."""
        return Binding(self.pilot(routed.target), routed.prepared)

    def target_of(self, pilot: ContextPilot) -> Target | None:
        """The target whose state ``pilot`` is."""
        return self._by_pilot.get(id(pilot))

    def loads(self) -> dict[str, int]:
        """Requests in flight per target."""
        with self._lock:
            return {name: state.in_flight for name, state in self._states.items()}

    def sent(self) -> dict[str, int]:
        """Requests sent per target, in all."""
        with self._lock:
            return {name: state.sent for name, state in self._states.items()}

    def is_down(self, target: Target | str) -> bool:
        """Whether the target is being routed around (unreachable lately, or its breaker is
        open, or half-open with its probe in flight)."""
        name = target if isinstance(target, str) else target.name
        with self._lock:
            return not self._states[name].available(time.monotonic())

    def stats(self) -> dict[str, TargetStats]:
        """Per target name: requests sent and in flight, failures, and the circuit breaker."""
        now = time.monotonic()
        with self._lock:
            return {
                name: TargetStats(
                    sent=state.sent,
                    in_flight=state.in_flight,
                    failures=state.failures,
                    timeouts=state.timeouts,
                    unreachable=state.unreachable,
                    consecutive_failures=state.consecutive,
                    breaker=("open" if now < state.down_until else "half_open") if state.tripped else "closed",
                    breaker_opened=state.opened,
                    open_for_s=max(0.0, state.down_until - now) if state.tripped else 0.0,
                )
                for name, state in self._states.items()
            }

    def conversation_target(self, conversation_id: str) -> str | None:
        """The name of the target a conversation stays on, if it is remembered."""
        with self._lock:
            return self._conversations.get(conversation_id)

    def started(self, target: Target) -> None:
        """A send to ``target`` begins; past an open breaker's cool-down it is the probe."""
        with self._lock:
            state = self._states[target.name]
            state.in_flight += 1
            state.sent += 1
            state.last_used = self._uses
            self._uses += 1
            if state.tripped and time.monotonic() >= state.down_until:
                state.probing = True

    def finished(self, target: Target, outcome: str = "ok") -> None:
        """A send to ``target`` ended: ``ok`` (it answered, an HTTP 4xx included: it is up),
        ``failed``, ``timeout`` or ``unreachable`` (counted towards its breaker), or
        ``other`` (the caller's error or cancellation; ``down``: already counted by
        :meth:`mark_down`). See :func:`send_outcome`."""
        with self._lock:
            state = self._states[target.name]
            state.in_flight -= 1
            if outcome == "ok":
                state.consecutive, state.tripped, state.probing = 0, False, False
                return
            if outcome not in ("failed", "timeout", "unreachable"):
                state.probing = False  # another request may probe
                return
            state.failures += 1
            state.timeouts += outcome == "timeout"
            state.unreachable += outcome == "unreachable"
            state.consecutive += 1
            if state.probing or (not state.tripped and state.consecutive >= self.breaker_failures):
                state.trip(time.monotonic() + self.down_seconds)  # slow, not gone: prediction kept

    def mark_down(self, target: Target) -> None:
        """The target is unreachable: route around it for ``down_seconds`` (its breaker
        open); its prediction is void (it may have restarted empty)."""
        with self._lock:
            state = self._states[target.name]
            state.trip(time.monotonic() + self.down_seconds)
            state.failures += 1
            state.unreachable += 1
            state.consecutive += 1
        state.pilot.reset()

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation: where it lives and what its turns showed. Returns whether
        it was tracked."""
        with self._lock:
            stuck = self._conversations.pop(conversation_id, None) is not None
        with self._pilot_lock:
            return self._turns.end(conversation_id) or stuck

    def withdraw(self, routed: Routed) -> None:
        """The request never reached the model (its send failed): its target's state forgets
        it, and its conversation turn, if it is still the latest, gives its number back, so
        the caller's next try (or next turn) is numbered as if it had never been made."""
        prepared = routed.prepared
        with self._pilot_lock:
            self.pilot(routed.target).discard(prepared)
            if prepared.conversation_id is not None and prepared.turn is not None:
                self._turns.release_turn(prepared.conversation_id, prepared.turn)

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
        """The target for these blocks, and why (see the module docstring); a conversation
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
        """The decision, with the lock held; it records nothing (``draft`` counts the round-robin
        turn it takes)."""
        now = time.monotonic()
        up = [t for t in self.targets if t.name not in exclude and self._states[t.name].available(now)]
        candidates = up or [t for t in self.targets if t.name not in exclude] or list(self.targets)
        if conversation_id is not None:
            name = draft.sticks.get(conversation_id) or self._conversations.get(conversation_id)
            sticky = next((t for t in candidates if t.name == name), None)
            if sticky is not None:
                return sticky, "conversation"
        loads = {t.name: self._states[t.name].in_flight + draft.pending.get(t.name, 0) for t in candidates}
        if self.routing == "round_robin":
            draft.turned += 1
            return candidates[(self._next + draft.turned - 1) % len(candidates)], "fixed"
        least = min(candidates, key=lambda t: (loads[t.name], t.name))
        if self.routing == "least_loaded":
            return least, "fixed"
        size = sum(block.token_count for block in blocks)
        if all(t.capacity_tokens is not None and size > t.capacity_tokens for t in candidates):
            return least, "oversized"
        busiest, idlest = max(loads.values()), min(loads.values())
        policy = self.policy
        if busiest - idlest > policy.balance_abs_threshold and busiest > idlest * policy.balance_rel_threshold:
            return least, "balance"
        reuse = {t.name: self._states[t.name].pilot.reusable_tokens(blocks, partition) for t in candidates}
        keys = in_partition([block.id for block in blocks], partition)
        for t in candidates:
            batch_blocks = draft.pending_blocks.get(t.name, set())
            shared = sum(block.token_count for block, key in zip(blocks, keys, strict=True) if key in batch_blocks)
            reuse[t.name] = max(reuse[t.name], shared)
        best = max(candidates, key=lambda t: (reuse[t.name], -loads[t.name]))
        if size and reuse[best.name] >= policy.cache_threshold * size:
            return best, "cache"
        roomiest = min(candidates, key=lambda t: (loads[t.name], self._states[t.name].last_used))
        return roomiest, "room"

    def _record(self, draft: _Draft) -> None:
        """Record decisions (with the lock held): round-robin turns taken, and where each
        conversation lives (most recent last; the least recent beyond the bound forgotten)."""
        self._next += draft.turned
        for conversation_id, name in draft.sticks.items():
            shared: Broadcast | None = self._states[name].pilot.shared
            if shared is not None and self._conversations.get(conversation_id) != name:
                shared.publish("stick", conversation_id, name)
            self._conversations[conversation_id] = name
            self._conversations.move_to_end(conversation_id)
        while len(self._conversations) > self.max_conversations:
            self._conversations.popitem(last=False)

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
        _check_request_ids(checked, [state.pilot for state in self._states.values()])
        draft = _Draft()
        groups: dict[str, list[int]] = {}
        reasons: dict[int, str] = {}
        with self._lock:
            for index, item in enumerate(checked):
                cid, partition = item.request.conversation_id, item.request.partition
                target, reasons[index] = self._decide(item.blocks, cid, (), draft, partition)
                draft.add(target, item.blocks, cid, partition)
                groups.setdefault(target.name, []).append(index)
        by_name = {t.name: t for t in self.targets}
        routed: list[Routed] = []
        try:
            for name, indices in sorted(groups.items(), key=lambda item: -len(item[1])):
                for prepared in self.pilot(name).plan([checked[i].request for i in indices], in_order=in_order):
                    original = indices[prepared.batch_index]  # type: ignore[index]
                    prepared = replace(prepared, batch_index=original)
                    routed.append(Routed(prepared, by_name[name], reasons[original], checked[original].kept_turns))
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


@dataclass(frozen=True, slots=True)
class RoutedResult:
    """A served request: the answer, and where it went (after any failover)."""

    result: ChatResult
    target: Target
    reason: str
    attempts: int
    prepared: PreparedRequest
    """The request as finally sent (prepared again on failover): its ``turn`` is the
    conversation turn recorded, what the caller's later ``kept_turns`` refer to."""


@dataclass
class RoutingClient:
    """Prepares, routes and sends; an unreachable target is routed around and the request
    sent again elsewhere (prepared anew for that target's cache, with the same
    ``kept_turns``). Sync and async, thread-safe.

    A timeout (``timeout`` between chunks, or the ``deadline``) raises
    :class:`~contextpilot_integrations.errors.EngineTimeout` without trying elsewhere: the
    target is slow, not gone, and keeps its place and its predicted cache. A call that
    raises leaves no trace of its request: its turn of a conversation is given back.

    Args:
        router: the routing state.
        model: for every target's :class:`~.client.OpenAICompatClient`.
        timeout: for every target's client.
        deadline: for every target's client; it bounds a whole call, every failover included.
        api_key: for every target's client.
        sinks: per target name, the event sink (``listener.sink``) of that engine, if any;
            targets without one get usage feedback from their cached-token reports.
        discover: each target's pilot reads its engine's page size, KV pool and tokenizer
            before the first request there (see :mod:`.engine_info`; ``False``: never).
    """

    router: Router
    model: str = "default"
    timeout: float = 60.0
    deadline: float | None = None
    api_key: str | None = None
    sinks: dict[str, Any] = field(default_factory=dict)
    discover: bool | None = None

    def __post_init__(self) -> None:
        self._clients = {
            t.name: OpenAICompatClient(
                t.base_url,
                self.router.pilot(t),
                model=self.model,
                api_key=self.api_key,
                timeout=self.timeout,
                deadline=self.deadline,
                engine=t.engine,
                extra_body={"id_slot": t.slot} if t.slot is not None else None,
                listener=self.sinks.get(t.name),
                discover=self.discover,
            )
            for t in self.router.targets
        }

    def client(self, target: Target) -> OpenAICompatClient:
        return self._clients[target.name]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()

    def __enter__(self) -> RoutingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(
        self,
        blocks: Sequence[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        **params: Any,
    ) -> RoutedResult:
        """Prepare, route and send one request (``params`` go to :meth:`OpenAICompatClient.chat`,
        e.g. the ``history`` of the turns in ``kept_turns``)."""
        partition = partition_of_body(params)  # a cache_salt among the body fields: routed within its partition
        routed = self.router.prepare(blocks, query, conversation_id, kept_turns=kept_turns, partition=partition)
        return self.send(routed, **params)

    def send(self, routed: Routed, **params: Any) -> RoutedResult:
        """Send a routed request; on an unreachable target, prepare it again for another
        (every try within the one ``deadline``)."""
        with deadline(self.deadline):
            return self._send(routed, **params)

    def _send(self, routed: Routed, **params: Any) -> RoutedResult:
        tried: list[str] = []
        while True:
            target = routed.target
            tried.append(target.name)
            with self.router.attempt(target, last=len(tried) >= len(self.router.targets)), self._withdrawn(routed):
                result = self.client(target).chat(routed.prepared, **params)
                return RoutedResult(result, target, routed.reason, len(tried), routed.prepared)
            routed = self._again(routed, tried)

    async def achat(
        self,
        blocks: Sequence[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        **params: Any,
    ) -> RoutedResult:
        """Async variant of :meth:`chat`."""
        partition = partition_of_body(params)
        routed = self.router.prepare(blocks, query, conversation_id, kept_turns=kept_turns, partition=partition)
        return await self.asend(routed, **params)

    async def asend(self, routed: Routed, **params: Any) -> RoutedResult:
        """Async variant of :meth:`send`."""
        with deadline(self.deadline):
            return await self._asend(routed, **params)

    async def _asend(self, routed: Routed, **params: Any) -> RoutedResult:
        tried: list[str] = []
        while True:
            target = routed.target
            tried.append(target.name)
            with self.router.attempt(target, last=len(tried) >= len(self.router.targets)), self._withdrawn(routed):
                result = await self.client(target).achat(routed.prepared, **params)
                return RoutedResult(result, target, routed.reason, len(tried), routed.prepared)
            routed = self._again(routed, tried)

    @contextmanager
    def _withdrawn(self, routed: Routed) -> Iterator[None]:
        """A send that fails (or is cancelled) withdraws its request before anything else:
        the next try then takes the same conversation turn."""
        try:
            yield
        except BaseException:
            self.router.withdraw(routed)
            raise

    def _again(self, routed: Routed, tried: Sequence[str]) -> Routed:
        """The request prepared anew for a target not tried yet: the same blocks, question,
        conversation and ``kept_turns`` (the history the caller sends is the same)."""
        prepared = routed.prepared
        again = self.router.prepare(
            prepared.ranking,
            prepared.query,
            prepared.conversation_id,
            kept_turns=routed.kept_turns,
            exclude=tried,
            partition=prepared.partition,
        )
        return replace(again, prepared=replace(again.prepared, merged_duplicates=prepared.merged_duplicates))
