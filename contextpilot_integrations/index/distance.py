"""The paper's position-aware context distance (§4.1, Eq. 1), scalar and vectorised.

d(i, j) = 1 - |S| / max(|Ci|, |Cj|) + alpha * mean over s in S of |pos_i(s) - pos_j(s)|,
where S is the set of blocks the two contexts share. Pairs that share nothing are at
distance exactly 1, so only pairs found through an inverted index (block -> contexts)
are computed; the others are filled in at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

__all__ = ["ALPHA", "condensed_distances", "context_distance"]

ALPHA = 0.001
"""Weight of the position term, as in the paper."""


def context_distance(a: Sequence[Hashable], b: Sequence[Hashable], alpha: float = ALPHA) -> float:
    """Eq. 1 for two block sequences (each without repeats)."""
    if not a or not b:
        return 1.0
    position = {key: i for i, key in enumerate(a)}
    shifts = [abs(position[key] - j) for j, key in enumerate(b) if key in position]
    if not shifts:
        return 1.0
    return 1.0 - len(shifts) / max(len(a), len(b)) + alpha * (sum(shifts) / len(shifts))


def condensed_distances(contexts: Sequence[Sequence[int]], alpha: float = ALPHA) -> np.ndarray:
    """Eq. 1 for all pairs, as a condensed matrix (the layout scipy's ``linkage`` takes).

    Work is proportional to the number of (pair, shared block) incidences plus the size of
    the output: pairs are enumerated per block posting list, grouped by list length so
    each group is one numpy operation.

    Args:
        contexts: each context's block numbers (dense ints) in retrieval order.
    """
    m = len(contexts)
    size = m * (m - 1) // 2
    if size == 0:
        return np.zeros(0, dtype=np.float64)
    lengths = np.fromiter((len(c) for c in contexts), dtype=np.int64, count=m)
    owner = np.repeat(np.arange(m, dtype=np.int64), lengths)
    block = np.fromiter((k for c in contexts for k in c), dtype=np.int64, count=int(lengths.sum()))
    position = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]) if m else owner
    by_block = np.lexsort((owner, block))
    owner, block, position = owner[by_block], block[by_block], position[by_block]
    starts = np.flatnonzero(np.r_[True, block[1:] != block[:-1]])
    counts = np.diff(np.r_[starts, block.size])

    keys: list[np.ndarray] = []
    shifts: list[np.ndarray] = []
    for n in np.unique(counts[counts >= 2]):
        first = starts[counts == n]
        members = first[:, None] + np.arange(n)  # (lists, n) indices into the postings
        ii, jj = np.triu_indices(int(n), 1)
        i = owner[members[:, ii]].ravel()
        j = owner[members[:, jj]].ravel()
        d = np.abs(position[members[:, ii]] - position[members[:, jj]]).ravel()
        keys.append(m * i - i * (i + 1) // 2 + (j - i - 1))  # i < j: owners are sorted
        shifts.append(d)
    key = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    shared = np.bincount(key, minlength=size).astype(np.float64)
    shift = np.bincount(key, weights=np.concatenate(shifts) if shifts else None, minlength=size)

    longest = _pairwise_max(lengths)
    distance = np.ones(size, dtype=np.float64)
    hit = shared > 0
    distance[hit] = 1.0 - shared[hit] / longest[hit] + alpha * (shift[hit] / shared[hit])
    return distance


def _pairwise_max(lengths: np.ndarray) -> np.ndarray:
    """max(len_i, len_j) for every pair i < j, in condensed order."""
    m = lengths.size
    out = np.empty(m * (m - 1) // 2, dtype=np.float64)
    start = 0
    for i in range(m - 1):
        stop = start + m - 1 - i
        np.maximum(lengths[i], lengths[i + 1 :], out=out[start:stop], casting="unsafe")
        start = stop
    return out
