"""Ordering strategies, selectable by name.

A strategy decides the send order of each request's blocks (online, one request at a
time) and of a whole batch (offline). What the engine holds is tracked separately, in the
:class:`PrefixTrie` the pilot keeps for every strategy, so hit predictions are comparable.

* ``"trie"`` (default): the request follows the longest live block path it can reuse,
  then its other blocks by popularity; batches are planned by :func:`agglomerate`
  (up to ``exact_limit`` requests) or :func:`greedy_plan`.
* ``"paper"``: the ContextPilot paper's clustering index (Eq. 1, Alg. 1, 2, 4, 5).
* ``"retrieval"``: the retriever's order, unchanged (the baseline).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import _count_elements  # type: ignore[attr-defined]  # Counter.update's C loop
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import UnknownStrategyError
from .agglomerate import agglomerate
from .cluster import ClusterTree
from .greedy import greedy_plan
from .ordering import reorder, schedule_by_paths
from .prefix_trie import PrefixTrie

__all__ = [
    "STRATEGIES",
    "LiveView",
    "PaperStrategy",
    "PlannedBatch",
    "RetrievalOrder",
    "Strategy",
    "TrieStrategy",
    "make_strategy",
    "plan_under_first",
]

Batch = Sequence[tuple[str, Sequence[str]]]


@dataclass(frozen=True, slots=True)
class PlannedBatch:
    """What :meth:`Strategy.plan` returns: each request's send order and the schedule."""

    orders: list[list[str]]
    """Each request's block keys in send order (same positions as the batch)."""
    schedule: list[int]
    """Indices into the batch, in send order."""
    state: Any = None
    """Strategy-private result, handed back to :meth:`Strategy.commit`."""


@dataclass(frozen=True, slots=True)
class LiveView:
    """What a batch plan may follow from earlier traffic (:meth:`Strategy.live_view`), read
    under the pilot's lock: the plan itself runs off it, while the index changes."""

    heads: list[tuple[str, ...]]
    """Each request's deepest live path through its own blocks (after its first block, where
    the request keeps that first)."""
    popularity: Mapping[str, int]
    """How many requests carried each of the batch's blocks so far (absent: none)."""
    heard: bool = True
    """Whether the engine's evictions or cache reports keep the index true: only then do
    requests with a live head go first (an old prediction may be gone, and sending a request
    ahead for it only reshuffles what the engine keeps)."""

    def part(self, members: Sequence[int]) -> LiveView:
        """The view of these requests of the batch."""
        return LiveView([self.heads[index] for index in members], self.popularity, self.heard)


class Strategy(ABC):
    """Decides send orders. Gets the pilot's live :class:`PrefixTrie` to read from."""

    name: ClassVar[str]
    reorders: ClassVar[bool] = True
    """Whether it changes orders and schedules (the baseline keeps both as given)."""

    def __init__(self, trie: PrefixTrie[str]) -> None:
        self.trie = trie

    @abstractmethod
    def order(self, request_id: str, keys: Sequence[str], first: str | None = None) -> list[str]:
        """The send order of one request's blocks (given in retrieval order); ``first``: one
        of them that must go first (the pilot's ``keep_top``), where the strategy can honour it."""

    def plan(self, batch: Batch, tokens: Mapping[str, int] | None = None) -> PlannedBatch:
        """Each request's send order and the schedule, without changing shared state.

        The pilot calls it outside its lock (a big plan takes seconds), then
        :meth:`commit` under the lock. ``tokens`` gives each block's token count, for
        strategies that weigh reuse by it. The default keeps every request's order.
        """
        return PlannedBatch([list(keys) for _, keys in batch], list(range(len(batch))))

    def live_view(self, batch: Batch, keep_first: bool) -> LiveView | None:
        """What :meth:`plan_live` may follow from the live index, read under the pilot's lock
        (``keep_first``: each request keeps its first block first). ``None``: nothing."""
        return None

    def plan_live(
        self, batch: Batch, tokens: Mapping[str, int] | None = None, live: LiveView | None = None
    ) -> PlannedBatch:
        """:meth:`plan` for a batch after earlier traffic (``live``: :meth:`live_view`). The
        default plans the batch alone."""
        return self.plan(batch, tokens)

    def commit(self, planned: PlannedBatch, batch: Batch) -> None:  # noqa: B027 - optional hook
        """The planned batch enters the index (called under the pilot's lock)."""

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The engine no longer holds this request."""

    def popularity(self, key: str) -> int:
        """How many requests carried this block (0 where the strategy does not count)."""
        return 0

    def recurrence(self) -> float:
        """The share of blocks requested that an earlier request carried too (1.0 where the
        strategy does not count: assume blocks recur)."""
        return 1.0

    def reset(self) -> None:  # noqa: B027 - optional hook
        """The engine holds nothing."""


class RetrievalOrder(Strategy):
    """The baseline: keep the retriever's order and the input order."""

    name = "retrieval"
    reorders = False

    def order(self, request_id: str, keys: Sequence[str], first: str | None = None) -> list[str]:
        return list(keys)


class TrieStrategy(Strategy):
    """Reuse the longest live prefix; order the rest by how often blocks were requested.

    Online, a request first follows the deepest path of the live trie made only of its
    own blocks (the most the engine can reuse now), then its other blocks in descending
    all-time request frequency, a canonical order that later requests carrying the same
    popular blocks follow too. Batches up to ``exact_limit`` requests are planned by
    :func:`agglomerate` (a tree of shared block sets, merged by shared tokens, sent
    depth-first: about 0.4 s for 2,500 requests, 1 s for 4,000); larger batches with the
    linear :func:`greedy_plan`.

    Args:
        exact_limit: the largest batch planned by agglomeration.
        merge_penalty: :func:`agglomerate`'s ``penalty`` (0.05 measured best on MultiHop-RAG
            and Zipf batches).
    """

    name = "trie"

    def __init__(
        self,
        trie: PrefixTrie[str],
        exact_limit: int = 4_000,
        merge_penalty: float = 0.05,
        max_tracked_blocks: int = 1_000_000,
    ) -> None:
        super().__init__(trie)
        if max_tracked_blocks < 1:
            raise ValueError("max_tracked_blocks must be at least 1")
        self.exact_limit = exact_limit
        self.merge_penalty = merge_penalty
        self.max_tracked_blocks = max_tracked_blocks
        self._requested: dict[str, int] = {}  # block -> requests that carried it (decayed)
        self._blocks_counted = self._blocks_recurring = 0

    def _count(self, keys: Sequence[str]) -> None:
        requested = self._requested
        known = len(requested)
        _count_elements(requested, keys)  # Counter.update's own C loop, without its checks
        self._blocks_counted += len(keys)
        self._blocks_recurring += len(keys) - (len(requested) - known)  # each key not new to the map
        if len(requested) > self.max_tracked_blocks:
            self._decay()

    def _decay(self) -> None:
        """Halve every count and drop the blocks left at zero: the map stays bounded, and
        recent popularity weighs more than old (amortised: runs once per many new blocks)."""
        self._requested = {key: count >> 1 for key, count in self._requested.items() if count > 1}
        if len(self._requested) > self.max_tracked_blocks // 2:  # all seen twice or more: keep the top half
            ranked = sorted(self._requested.items(), key=lambda item: -item[1])
            self._requested = dict(ranked[: self.max_tracked_blocks // 2])

    @property
    def tracked_blocks(self) -> int:
        """Blocks whose request frequency is remembered (at most ``max_tracked_blocks``)."""
        return len(self._requested)

    def order(self, request_id: str, keys: Sequence[str], first: str | None = None) -> list[str]:
        self._count(keys)
        head = self.trie.best_prefix(keys, first)
        requested = self._requested
        if len(head) == 1 and keys and head[0] == keys[0]:  # the usual case: only the top block
            tail = keys[1:] if isinstance(keys, list) else list(keys[1:])
        else:
            taken = set(head)
            tail = [key for key in keys if key not in taken]
        # most requested first; stable (reverse keeps it): retrieval order among equals
        try:
            tail.sort(key=requested.__getitem__, reverse=True)
        except KeyError:  # a block the decay just dropped counts 0 (the sort left the list as it was)
            tail.sort(key=lambda key: requested.get(key, 0), reverse=True)
        return head + tail

    def plan(self, batch: Batch, tokens: Mapping[str, int] | None = None) -> PlannedBatch:
        requests = [keys for _, keys in batch]
        if len(batch) <= self.exact_limit:
            planned = agglomerate(requests, tokens, self.merge_penalty)
        else:
            planned = greedy_plan(requests)
        orders = [[keys[i] for i in positions] for keys, positions in zip(requests, planned.orders, strict=True)]
        return PlannedBatch(orders, planned.schedule)

    def live_view(self, batch: Batch, keep_first: bool) -> LiveView | None:
        if not len(self.trie) and not self._requested:  # a first batch: nothing to follow
            return None
        best_prefix = self.trie.best_prefix
        heads = [
            tuple(best_prefix(keys, keys[0])[1:] if keep_first else best_prefix(keys)) if keys else ()
            for _, keys in batch
        ]
        requested = self._requested
        popularity = {key: requested[key] for _, keys in batch for key in keys if key in requested}
        return LiveView(heads, popularity)

    def plan_live(
        self, batch: Batch, tokens: Mapping[str, int] | None = None, live: LiveView | None = None
    ) -> PlannedBatch:
        """A micro-batch after earlier ones: a request whose live head weighs at least what
        it could share within the batch follows that head (the engine holds it now); the
        requests of one head are planned together on the rest of their blocks, given most
        popular first, so what a request shares with no other of the batch follows the
        canonical order later requests follow too. Where the engine's reports keep the
        index true (:attr:`LiveView.heard`), requests with a head go first, before the
        others' new blocks can evict it; else the groups go in the batch's order."""
        if live is None:
            return self.plan(batch, tokens)
        groups: dict[tuple[str, ...], list[int]] = {}
        for index, head in enumerate(_worth_following(batch, live.heads, tokens)):
            groups.setdefault(head, []).append(index)
        popularity = live.popularity.get
        orders: list[list[str]] = [[] for _ in batch]
        schedule: list[int] = []
        heads = sorted(groups, key=len, reverse=True) if live.heard else groups  # stable: batch order among equals
        for head in heads:
            members, taken = groups[head], set(head)
            rests = [
                (
                    batch[i][0],
                    sorted((k for k in batch[i][1] if k not in taken), key=lambda k: popularity(k, 0), reverse=True),
                )
                for i in members
            ]
            planned = self.plan(rests, tokens)
            for index, order in zip(members, planned.orders, strict=True):
                orders[index] = [*head, *order]
            schedule += [members[position] for position in planned.schedule]
        return PlannedBatch(orders, schedule)

    def commit(self, planned: PlannedBatch, batch: Batch) -> None:
        for _, keys in batch:
            self._count(keys)

    def popularity(self, key: str) -> int:
        return self._requested.get(key, 0)

    def recurrence(self) -> float:
        return self._blocks_recurring / self._blocks_counted if self._blocks_counted else 0.0

    def reset(self) -> None:
        self._requested = {}
        self._blocks_counted = self._blocks_recurring = 0


class PaperStrategy(Strategy):
    """The paper's method, faithfully: clustering tree, greedy search, Alg. 2 and 5."""

    name = "paper"

    def __init__(self, trie: PrefixTrie[str], **options: Any) -> None:
        super().__init__(trie)
        self.options = options
        self.tree = ClusterTree(**options)

    def order(self, request_id: str, keys: Sequence[str], first: str | None = None) -> list[str]:
        order, _, _ = self.tree.insert(request_id, keys)
        return order  # type: ignore[return-value]

    def plan(self, batch: Batch, tokens: Mapping[str, int] | None = None) -> PlannedBatch:
        tree = ClusterTree(**self.options)  # built aside, grafted into the live tree by commit()
        built = tree.build(batch)
        orders = [reorder(order, keys) for (order, _), (_, keys) in zip(built, batch, strict=True)]
        return PlannedBatch(orders, schedule_by_paths([path for _, path in built]), tree)  # type: ignore[arg-type]

    def commit(self, planned: PlannedBatch, batch: Batch) -> None:
        self.tree.graft(planned.state)

    def forget(self, request_id: str) -> None:
        self.tree.evict(request_id)

    def reset(self) -> None:
        self.tree.clear()


def _worth_following(
    batch: Batch, heads: Sequence[tuple[str, ...]], tokens: Mapping[str, int] | None
) -> list[tuple[str, ...]]:
    """Each request's live head where it weighs at least the request's blocks another
    request of the batch carries (the most it could share within the batch), else none."""
    carried: dict[str, int] = {}
    for _, keys in batch:
        _count_elements(carried, keys)

    def weight(keys: Iterable[str]) -> int:
        return sum(tokens.get(key, 1) for key in keys) if tokens is not None else sum(1 for _ in keys)

    return [
        head if head and weight(head) >= weight(key for key in keys if carried[key] > 1) else ()
        for (_, keys), head in zip(batch, heads, strict=True)
    ]


def plan_under_first(
    strategy: Strategy, batch: Batch, tokens: Mapping[str, int] | None = None, live: LiveView | None = None
) -> tuple[PlannedBatch, list[tuple[PlannedBatch, Batch]]]:
    """Plan a batch whose requests each keep their first block first (the pilot's
    ``keep_top``): requests share a prefix only under the same first block, so each group of
    them is planned on its own, on the rest of its blocks, and the groups go one after
    another. Returns the whole plan, and each group's plan with its part of the batch (for
    :meth:`Strategy.commit`). ``live``: :meth:`Strategy.live_view` of the batch, taken with
    ``keep_first``."""
    if not strategy.reorders:  # the input order, as without ContextPilot
        planned = strategy.plan(batch, tokens)
        return planned, [(planned, batch)]
    groups: dict[str | None, list[int]] = {}
    for index, (_, keys) in enumerate(batch):
        groups.setdefault(keys[0] if keys else None, []).append(index)
    orders = [list(keys) for _, keys in batch]
    schedule: list[int] = []
    parts: list[tuple[PlannedBatch, Batch]] = []
    for first, members in groups.items():
        rests = [(batch[i][0], list(batch[i][1])[1:]) for i in members]
        planned = strategy.plan_live(rests, tokens, live.part(members) if live is not None else None)
        for order, index in zip(planned.orders, members, strict=True):
            if first is not None:
                orders[index] = [first, *order]
        schedule += [members[position] for position in planned.schedule]
        parts.append((planned, [batch[i] for i in members]))
    return PlannedBatch(orders, schedule), parts


STRATEGIES: dict[str, Callable[..., Strategy]] = {
    TrieStrategy.name: TrieStrategy,
    PaperStrategy.name: PaperStrategy,
    RetrievalOrder.name: RetrievalOrder,
}
"""Registered strategies by name; add your own with ``STRATEGIES["name"] = factory``."""


def make_strategy(name: str, trie: PrefixTrie[str], **options: Any) -> Strategy:
    """Build a registered strategy bound to the pilot's live trie."""
    try:
        factory = STRATEGIES[name]
    except KeyError:
        known = ", ".join(sorted(STRATEGIES))
        raise UnknownStrategyError(f"unknown strategy {name!r}; known: {known}") from None
    return factory(trie, **options)
