"""Scoring answers against gold answers, and intervals that say how far to trust a gap.

Answers are compared after the usual normalization of reading-comprehension benchmarks
(lower case, no punctuation, no articles, single spaces): ``exact`` (the answer is a gold
answer), ``contains`` (a gold answer appears in it, word for word: a base model often
says a little more than the answer) and token ``f1`` (SQuAD's). An arm's accuracy gets a
Wilson 95% interval; its gap to the baseline a paired bootstrap interval over the same
questions, resampled by conversation (turns of one conversation are not independent).

A form is **not worse** than the baseline when the interval of its gap lies above
``-margin`` (a non-inferiority test at a 5-point margin by default): the benchmark must be
large enough to rule out a loss of that size, not merely fail to see one.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Gap", "METRICS", "Score", "gap", "normalize", "score", "verdict", "wilson"]

METRICS = ("contains", "exact", "f1")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation + "\u201c\u201d\u2018\u2019\u2026")  # and curly quotes


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def _f1(prediction: list[str], gold: list[str]) -> float:
    common = sum((Counter(prediction) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(prediction), common / len(gold)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True, slots=True)
class Score:
    """One answer scored against its gold answers (the best over them)."""

    exact: float
    contains: float
    f1: float

    def get(self, metric: str) -> float:
        return float(getattr(self, metric))


def score(answer: str, gold: Sequence[str]) -> Score:
    """``answer`` scored against each gold answer; the best of each metric."""
    said = normalize(answer)
    words = said.split()
    best = Score(0.0, 0.0, 0.0)
    for one in gold:
        right = normalize(one)
        if not right:
            continue
        contains = float(f" {right} " in f" {said} ")
        best = Score(max(best.exact, float(said == right)), max(best.contains, contains),
                     max(best.f1, _f1(words, right.split()) if words else 0.0))  # fmt: skip
    return best


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% by default)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True, slots=True)
class Gap:
    """An arm's mean minus the baseline's over the same questions, with a 95% interval."""

    mean: float
    low: float
    high: float
    discordant: int
    """Questions one arm answered and the other did not (what the gap is made of)."""


def gap(
    ours: Sequence[float], baseline: Sequence[float], clusters: Sequence[str], resamples: int = 4000, seed: int = 0
) -> Gap:
    """The paired gap ``mean(ours) - mean(baseline)`` and its bootstrap 95% interval,
    resampling whole clusters (a conversation's turns together)."""
    if not (len(ours) == len(baseline) == len(clusters)) or not ours:
        raise ValueError("gap needs the same non-empty questions for both arms")
    names = sorted(set(clusters))
    index = {name: i for i, name in enumerate(names)}
    diff = np.zeros(len(names))
    size = np.zeros(len(names))
    for value, base, cluster in zip(ours, baseline, clusters, strict=True):
        diff[index[cluster]] += value - base
        size[index[cluster]] += 1
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(names), size=(resamples, len(names)))
    means = diff[draws].sum(axis=1) / size[draws].sum(axis=1)
    low, high = np.quantile(means, [0.025, 0.975])
    discordant = sum(1 for a, b in zip(ours, baseline, strict=True) if a != b)
    return Gap(float(diff.sum() / size.sum()), float(low), float(high), discordant)


def verdict(difference: Gap, margin: float = 0.05) -> str:
    """``better`` (the interval is above 0), ``not worse`` (above ``-margin``), ``worse``
    (below 0), else ``unclear`` (too few questions to rule out a loss of ``margin``)."""
    if difference.low > 0:
        return "better"
    if difference.high < 0:
        return "worse"
    if difference.low > -margin:
        return "not worse"
    return "unclear"
