"""Reordering inside a request (Alg. 2) and scheduling across a batch (Alg. 5)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

__all__ = ["reorder", "schedule_by_paths"]


def reorder(prefix: Sequence[Hashable], keys: Sequence[Hashable]) -> list[Hashable]:
    """Alg. 2: the matched prefix first, then the request's other blocks in retrieval order.

    Raises:
        ValueError: if the prefix holds a block the request does not.
    """
    head = list(prefix)
    taken = set(head)
    if not taken <= set(keys):
        raise ValueError("the matched prefix holds blocks the request does not carry")
    return head + [key for key in keys if key not in taken]


def schedule_by_paths(paths: Sequence[Sequence[int]]) -> list[int]:
    """Alg. 5: group requests by the first step of their search path, larger groups first;
    inside a group, longer paths first (ties by path, then input order).

    Returns:
        Indices into ``paths`` in send order.
    """
    groups: dict[int, list[int]] = defaultdict(list)
    for index, path in enumerate(paths):
        groups[path[0] if path else -1].append(index)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    schedule: list[int] = []
    for _, members in ordered:
        members.sort(key=lambda i: (-len(paths[i]), tuple(paths[i]), i))
        schedule.extend(members)
    return schedule
