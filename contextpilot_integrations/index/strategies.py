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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from ..errors import UnknownStrategyError
from ..ordering import reorder, schedule_by_paths
from .agglomerate import agglomerate
from .cluster import ClusterTree
from .greedy import greedy_plan
from .prefix_trie import PrefixTrie

__all__ = ["STRATEGIES", "PaperStrategy", "RetrievalOrder", "Strategy", "TrieStrategy", "make_strategy"]

Batch = Sequence[tuple[str, Sequence[str]]]


class Strategy(ABC):
    """Decides send orders. Gets the pilot's live :class:`PrefixTrie` to read from."""

    name: ClassVar[str]

    def __init__(self, trie: PrefixTrie[str]) -> None:
        self.trie = trie

    @abstractmethod
    def order(self, request_id: str, keys: Sequence[str]) -> list[str]:
        """The send order of one request's blocks (given in retrieval order)."""

    def plan(self, batch: Batch, tokens: Mapping[str, int] | None = None) -> tuple[list[list[str]], list[int]]:
        """Each request's send order and the schedule (indices into ``batch``).

        ``tokens`` gives each block's token count, for strategies that weigh reuse by it.
        """
        orders = [self.order(rid, keys) for rid, keys in batch]
        return orders, list(range(len(batch)))

    def forget(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The engine no longer holds this request."""

    def reset(self) -> None:  # noqa: B027 - optional hook
        """The engine holds nothing."""


class RetrievalOrder(Strategy):
    """The baseline: keep the retriever's order and the input order."""

    name = "retrieval"

    def order(self, request_id: str, keys: Sequence[str]) -> list[str]:
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

    def __init__(self, trie: PrefixTrie[str], exact_limit: int = 4_000, merge_penalty: float = 0.05) -> None:
        super().__init__(trie)
        self.exact_limit = exact_limit
        self.merge_penalty = merge_penalty
        self._requested: dict[str, int] = {}  # block -> requests that carried it

    def _count(self, keys: Sequence[str]) -> None:
        requested = self._requested
        for key in keys:
            requested[key] = requested.get(key, 0) + 1

    def order(self, request_id: str, keys: Sequence[str]) -> list[str]:
        self._count(keys)
        head = self.trie.best_prefix(keys)
        taken = set(head)
        requested = self._requested
        tail = [key for key in keys if key not in taken]
        tail.sort(key=lambda key: -requested[key])  # stable: retrieval order among equals
        return head + tail

    def plan(self, batch: Batch, tokens: Mapping[str, int] | None = None) -> tuple[list[list[str]], list[int]]:
        requests = [keys for _, keys in batch]
        for keys in requests:
            self._count(keys)
        if len(batch) <= self.exact_limit:
            planned = agglomerate(requests, tokens, self.merge_penalty)
        else:
            planned = greedy_plan(requests)
        orders = [[keys[i] for i in positions] for keys, positions in zip(requests, planned.orders, strict=True)]
        return orders, planned.schedule


class PaperStrategy(Strategy):
    """The paper's method, faithfully: clustering tree, greedy search, Alg. 2 and 5."""

    name = "paper"

    def __init__(self, trie: PrefixTrie[str], **options: Any) -> None:
        super().__init__(trie)
        self.tree = ClusterTree(**options)
        self.last_paths: list[tuple[int, ...]] = []

    def order(self, request_id: str, keys: Sequence[str]) -> list[str]:
        order, _, _ = self.tree.insert(request_id, keys)
        return order  # type: ignore[return-value]

    def plan(self, batch: Batch, tokens: Mapping[str, int] | None = None) -> tuple[list[list[str]], list[int]]:
        built = self.tree.build(batch)
        self.last_paths = [path for _, path in built]
        orders = [reorder(order, keys) for (order, _), (_, keys) in zip(built, batch, strict=True)]
        return orders, schedule_by_paths(self.last_paths)  # type: ignore[return-value]

    def forget(self, request_id: str) -> None:
        self.tree.evict(request_id)

    def reset(self) -> None:
        self.tree.clear()


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
