"""The routing decision alone: what each target could reuse and how loaded it is in, a target out.

No locks, no pilots, no I/O: the router gathers the numbers under its lock and records the
choice (:mod:`.router`). The ``cache_aware`` policy is SGLang's router's:

1. if the load is imbalanced (the busiest target has ``balance_abs_threshold`` more
   requests in flight than the idlest, and ``balance_rel_threshold`` times as many), the
   least loaded target;
2. else the target whose cache holds the longest prefix of the request's blocks, if that
   prefix is at least ``cache_threshold`` of the request's block tokens;
3. else the least recently used target (its cache holds the oldest prefixes: room for a
   new one), which also spreads new prefixes evenly.

Before any of it, a conversation stays on its target, and a request larger than every
target's cache goes to the least loaded (``oversized``). ``round_robin`` and
``least_loaded`` are there to compare with.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from .targets import Target

__all__ = ["ROUTINGS", "CacheAwarePolicy", "select"]

ROUTINGS = ("cache_aware", "round_robin", "least_loaded")
"""The routings :func:`select` knows."""


@dataclass(frozen=True, slots=True)
class CacheAwarePolicy:
    """SGLang's router ``cache_aware`` policy, in requests in flight and block tokens."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5


def select(
    targets: Sequence[Target],
    *,
    up: Collection[str],
    loads: Mapping[str, int],
    last_used: Mapping[str, int],
    size: int,
    reuse: Callable[[Target], int],
    routing: str = "cache_aware",
    policy: CacheAwarePolicy | None = None,
    exclude: Collection[str] = (),
    sticky: str | None = None,
    turn: int = 0,
) -> tuple[Target, str]:
    """The target for a request, and why (``conversation``, ``fixed``, ``oversized``,
    ``balance``, ``cache`` or ``room``).

    Args:
        targets: every target, in their order.
        up: names of the targets not routed around (breaker closed, or half-open and free).
        loads: requests in flight per target name (those of a batch routed so far included).
        last_used: per target name, when it was last sent to (higher: more recent).
        size: the request's block tokens.
        reuse: tokens of the request a target's cache could serve (asked only when the
            cache decides, once per candidate).
        routing: one of :data:`ROUTINGS`.
        policy: the ``cache_aware`` thresholds (default: :class:`CacheAwarePolicy`'s).
        exclude: names not to choose unless nothing else is left (tried already).
        sticky: the name of the target the request's conversation stays on, if any.
        turn: ``round_robin``'s turn (the caller counts the turns taken).
    """
    allowed = [t for t in targets if t.name not in exclude]
    candidates = [t for t in allowed if t.name in up] or allowed or list(targets)
    if sticky is not None:
        stuck = next((t for t in candidates if t.name == sticky), None)
        if stuck is not None:
            return stuck, "conversation"
    load = {t.name: loads[t.name] for t in candidates}
    if routing == "round_robin":
        return candidates[turn % len(candidates)], "fixed"
    least = min(candidates, key=lambda t: (load[t.name], t.name))
    if routing == "least_loaded":
        return least, "fixed"
    if all(t.capacity_tokens is not None and size > t.capacity_tokens for t in candidates):
        return least, "oversized"
    busiest, idlest = max(load.values()), min(load.values())
    policy = policy or CacheAwarePolicy()
    if busiest - idlest > policy.balance_abs_threshold and busiest > idlest * policy.balance_rel_threshold:
        return least, "balance"
    reused = {t.name: reuse(t) for t in candidates}
    best = max(candidates, key=lambda t: (reused[t.name], -load[t.name]))
    if size and reused[best.name] >= policy.cache_threshold * size:
        return best, "cache"
    return min(candidates, key=lambda t: (load[t.name], last_used[t.name])), "room"
