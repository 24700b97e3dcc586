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

A conversation stays on one target (its history is cached there). A target that fails is
marked down for ``down_seconds`` and routed around; the request is prepared again for
another target and sent there, so it is never lost. A request larger than every target's
cache is sent anyway (to the least loaded) and recorded as cached nowhere.

:class:`RoutingClient` sends; thread-safe, sync and async.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..blocks import BlockLike, normalize_blocks
from ..errors import EngineUnavailable
from ..pilot import BatchRequest, ContextPilot
from ..prepared import PreparedRequest
from . import wire
from .client import ChatResult, OpenAICompatClient
from .feedback import Binding

T = TypeVar("T")

__all__ = ["CacheAwarePolicy", "Routed", "RoutedResult", "Router", "RoutingClient", "Target", "is_unreachable"]


def is_unreachable(exc: BaseException) -> bool:
    """A connection-level failure (route around the target), not an answer from it:
    httpx's, ours, or the OpenAI SDK's (which the framework adapters use)."""
    import httpx

    if isinstance(exc, (httpx.TransportError, EngineUnavailable)):
        return True
    try:
        import openai
    except ImportError:
        return False
    return isinstance(exc, openai.APIConnectionError)


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


@dataclass
class _State:
    pilot: ContextPilot
    in_flight: int = 0
    down_until: float = 0.0
    sent: int = 0
    failures: int = 0
    last_used: int = -1


class Router:
    """Per-target predicted cache state and the routing decision (no I/O of its own).

    Args:
        targets: where requests can go (distinct names).
        strategy: the ordering strategy of every target's pilot (``"retrieval"`` keeps the
            retriever's order, for a baseline that only routes).
        policy: thresholds of the cache-aware policy; ``routing="cache_aware"`` uses it,
            ``"round_robin"`` and ``"least_loaded"`` are there to compare with.
        down_seconds: how long a failed target is routed around.
        max_conversations: sticky conversations remembered (least recent forgotten).
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
        max_conversations: int = 10_000,
        **pilot_options: Any,
    ) -> None:
        names = [target.name for target in targets]
        if not targets or len(set(names)) != len(names):
            raise ValueError("give at least one target, each with its own name")
        if routing not in self.ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(self.ROUTINGS)}, got {routing!r}")
        self.targets = list(targets)
        self.policy = policy or CacheAwarePolicy()
        self.routing = routing
        self.down_seconds = down_seconds
        self.max_conversations = max_conversations
        self._states = {t.name: _State(ContextPilot(strategy, **pilot_options)) for t in targets}
        self._by_pilot = {id(state.pilot): t for t, state in zip(targets, self._states.values(), strict=True)}
        self._conversations: OrderedDict[str, str] = OrderedDict()
        self._next = 0
        self._uses = 0
        self._lock = threading.Lock()

    # ---- state ----------------------------------------------------------------------------
    def pilot(self, target: Target | str) -> ContextPilot:
        """The predicted cache state of one target."""
        return self._states[target if isinstance(target, str) else target.name].pilot

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

    def started(self, target: Target) -> None:
        with self._lock:
            state = self._states[target.name]
            state.in_flight += 1
            state.sent += 1
            state.last_used = self._uses
            self._uses += 1

    def finished(self, target: Target) -> None:
        with self._lock:
            self._states[target.name].in_flight -= 1

    def mark_down(self, target: Target) -> None:
        """The target failed: route around it for ``down_seconds``; its prediction is void."""
        with self._lock:
            state = self._states[target.name]
            state.down_until = time.monotonic() + self.down_seconds
            state.failures += 1
        state.pilot.reset()

    # ---- the decision ------------------------------------------------------------------------
    def choose(
        self,
        blocks: Sequence[BlockLike],
        conversation_id: str | None = None,
        exclude: Collection[str] = (),
        pending: dict[str, int] | None = None,
        pending_blocks: dict[str, set[str]] | None = None,
    ) -> tuple[Target, str]:
        """The target for these blocks, and why (see the module docstring).

        ``pending`` / ``pending_blocks``: requests (and their blocks) already routed to each
        target but not sent yet (a batch): load, and a prefix the batch plan will share.
        """
        normalized, _ = normalize_blocks(blocks)
        size = sum(block.token_count for block in normalized)
        now = time.monotonic()
        with self._lock:
            up = [t for t in self.targets if t.name not in exclude and self._states[t.name].down_until <= now]
            candidates = up or [t for t in self.targets if t.name not in exclude] or list(self.targets)
            if conversation_id is not None:
                name = self._conversations.get(conversation_id)
                sticky = next((t for t in candidates if t.name == name), None)
                if sticky is not None:
                    self._conversations.move_to_end(conversation_id)
                    return sticky, "conversation"
            extra = pending or {}
            loads = {t.name: self._states[t.name].in_flight + extra.get(t.name, 0) for t in candidates}
            if self.routing == "round_robin":
                target = candidates[self._next % len(candidates)]
                self._next += 1
                return self._stick(conversation_id, target), "fixed"
        least = min(candidates, key=lambda t: (loads[t.name], t.name))
        if self.routing == "least_loaded":
            return self._stick(conversation_id, least), "fixed"
        if all(t.capacity_tokens is not None and size > t.capacity_tokens for t in candidates):
            return self._stick(conversation_id, least), "oversized"
        busiest, idlest = max(loads.values()), min(loads.values())
        policy = self.policy
        if busiest - idlest > policy.balance_abs_threshold and busiest > idlest * policy.balance_rel_threshold:
            return self._stick(conversation_id, least), "balance"
        reuse = {t.name: self._states[t.name].pilot.reusable_tokens(normalized) for t in candidates}
        for t in candidates:
            batch_blocks = (pending_blocks or {}).get(t.name, set())
            shared = sum(block.token_count for block in normalized if block.id in batch_blocks)
            reuse[t.name] = max(reuse[t.name], shared)
        best = max(candidates, key=lambda t: (reuse[t.name], -loads[t.name]))
        if size and reuse[best.name] >= policy.cache_threshold * size:
            return self._stick(conversation_id, best), "cache"
        roomiest = min(candidates, key=lambda t: (loads[t.name], self._states[t.name].last_used))
        return self._stick(conversation_id, roomiest), "room"

    def _stick(self, conversation_id: str | None, target: Target) -> Target:
        if conversation_id is not None:
            with self._lock:
                self._conversations[conversation_id] = target.name
                self._conversations.move_to_end(conversation_id)
                while len(self._conversations) > self.max_conversations:
                    self._conversations.popitem(last=False)
        return target

    def prepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        exclude: Collection[str] = (),
    ) -> Routed:
        """Choose a target and prepare the request with its predicted cache state."""
        items = list(blocks)
        target, reason = self.choose(items, conversation_id, exclude)
        prepared = self.pilot(target).prepare(items, query, conversation_id, kept_turns=kept_turns)
        if reason == "oversized":
            self.pilot(target).evict([prepared.request_id])  # larger than the cache: cached nowhere
        return Routed(prepared, target, reason)

    async def aprepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        exclude: Collection[str] = (),
    ) -> Routed:
        """Async variant of :meth:`prepare` (it never blocks on I/O, so it runs inline)."""
        return self.prepare(blocks, query, conversation_id, kept_turns=kept_turns, exclude=exclude)

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
        was the ``last`` one left."""
        self.started(target)
        try:
            yield
        except Exception as exc:
            if last or not is_unreachable(exc):
                raise
            self.mark_down(target)
        finally:
            self.finished(target)

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

    def plan(self, requests: Sequence[BatchRequest]) -> list[Routed]:
        """A batch: route every request (counting those routed before it as load), then plan
        each target's share with its pilot. Routed requests come back in send order per
        target; each keeps its position in ``requests`` as ``prepared.batch_index``."""
        groups: dict[str, list[int]] = {}
        pending: dict[str, int] = {}
        pending_blocks: dict[str, set[str]] = {}
        reasons: dict[int, str] = {}
        for index, item in enumerate(requests):
            blocks, _ = normalize_blocks(item.blocks)
            target, reasons[index] = self.choose(
                blocks, item.conversation_id, pending=pending, pending_blocks=pending_blocks
            )
            groups.setdefault(target.name, []).append(index)
            pending[target.name] = pending.get(target.name, 0) + 1
            pending_blocks.setdefault(target.name, set()).update(block.id for block in blocks)
        by_name = {t.name: t for t in self.targets}
        routed: list[Routed] = []
        for name, indices in sorted(groups.items(), key=lambda item: -len(item[1])):
            for prepared in self.pilot(name).plan([requests[i] for i in indices]):
                original = indices[prepared.batch_index]  # type: ignore[index]
                routed.append(Routed(replace(prepared, batch_index=original), by_name[name], reasons[original]))
        return routed


@dataclass(frozen=True, slots=True)
class RoutedResult:
    """A served request: the answer, and where it went (after any failover)."""

    result: ChatResult
    target: Target
    reason: str
    attempts: int


@dataclass
class RoutingClient:
    """Prepares, routes and sends; a failed target is routed around and the request sent
    again elsewhere (prepared anew for that target's cache). Sync and async, thread-safe.

    Args:
        router: the routing state.
        model, timeout, deadline, api_key: for every target's
            :class:`~.client.OpenAICompatClient`.
        sinks: per target name, the event sink (``listener.sink``) of that engine, if any;
            targets without one get usage feedback from their cached-token reports.
    """

    router: Router
    model: str = "default"
    timeout: float = 60.0
    deadline: float | None = None
    api_key: str | None = None
    sinks: dict[str, Any] = field(default_factory=dict)

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
        """Prepare, route and send one request (``params`` go to :meth:`OpenAICompatClient.chat`)."""
        return self.send(self.router.prepare(blocks, query, conversation_id, kept_turns=kept_turns), **params)

    def send(self, routed: Routed, **params: Any) -> RoutedResult:
        """Send a routed request; on an unreachable target, prepare it again for another."""
        tried: list[str] = []
        while True:
            target = routed.target
            tried.append(target.name)
            with self.router.attempt(target, last=len(tried) >= len(self.router.targets)):
                result = self.client(target).chat(routed.prepared, **params)
                return RoutedResult(result, target, routed.reason, len(tried))
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
        return await self.asend(self.router.prepare(blocks, query, conversation_id, kept_turns=kept_turns), **params)

    async def asend(self, routed: Routed, **params: Any) -> RoutedResult:
        """Async variant of :meth:`send`."""
        tried: list[str] = []
        while True:
            target = routed.target
            tried.append(target.name)
            with self.router.attempt(target, last=len(tried) >= len(self.router.targets)):
                result = await self.client(target).achat(routed.prepared, **params)
                return RoutedResult(result, target, routed.reason, len(tried))
            routed = self._again(routed, tried)

    def _again(self, routed: Routed, tried: Sequence[str]) -> Routed:
        prepared = routed.prepared
        return self.router.prepare(list(prepared.ranking), prepared.query, prepared.conversation_id, exclude=tried)
