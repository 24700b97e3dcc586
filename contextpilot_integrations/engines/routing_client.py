"""Send through a router: prepare, route, send, and on an unreachable target prepare again elsewhere.

:class:`RoutingClient` holds one :class:`~.client.OpenAICompatClient` per target and sends
each request where the router (:class:`~.router.Router`) prepared it; it needs of the router
only :class:`Routes`, so the router can re-export it. Thread-safe, sync and async.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..core.blocks import BlockLike
from ..core.partitions import partition_of_body
from ..core.prepared import PreparedRequest
from ..pilot import ContextPilot
from .client import ChatResult, OpenAICompatClient
from .deadline import deadline
from .targets import Routed, Target

__all__ = ["RoutedResult", "Routes", "RoutingClient"]


class Routes(Protocol):
    """What a :class:`RoutingClient` needs of its router (a :class:`~.router.Router` is one)."""

    @property
    def targets(self) -> Sequence[Target]:
        """Where requests can go."""

    def pilot(self, target: Target | str) -> ContextPilot:
        """The predicted cache state of one target."""

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
        """Choose a target and prepare the request for it."""

    def attempt(self, target: Target, *, last: bool) -> AbstractContextManager[None]:
        """One try at ``target``: an unreachable one swallowed unless ``last``."""

    def withdraw(self, routed: Routed) -> None:
        """The request never reached the model: forget it and give its turn back."""


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
        router: the routing state (a :class:`~.router.Router`).
        model: for every target's :class:`~.client.OpenAICompatClient`.
        timeout: for every target's client.
        deadline: for every target's client; it bounds a whole call, every failover included.
        api_key: for every target's client.
        sinks: per target name, the event sink (``listener.sink``) of that engine, if any;
            targets without one get usage feedback from their cached-token reports.
        discover: each target's pilot reads its engine's page size, KV pool and tokenizer
            before the first request there (see :mod:`.engine_info`; ``False``: never).
    """

    router: Routes
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
