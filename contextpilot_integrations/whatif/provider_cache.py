"""Models of hosted APIs' prompt caches, for what-if runs (no account needed).

A prompt is a list of units (a content block each: the system prompt, a history turn,
a retrieved block, the question...), as in :func:`~.replay.prompt_units`. Entries are
keyed by the prompt's prefix up to a unit boundary and expire ``ttl`` seconds after
their last use. The rules follow :mod:`contextpilot_integrations.providers.rules`:

- :class:`MarkerCache` (Anthropic ``cache_control``, Bedrock ``cachePoint``): an entry
  is written only at a marker whose prefix reaches the model's minimum; a request reads
  the longest live entry at a unit boundary at most ``lookback`` units before one of its
  markers (Anthropic: 20 content blocks) and refreshes it; it is billed as written for
  the tokens from there to its last qualifying marker (each token once, however many
  markers), and as uncached for the rest. OpenAI's GPT-5.6+ explicit breakpoints work the
  same with no look-back (exact matches); its own managed breakpoint at the end of the
  prompt (``managed``) finds the longest live entry anywhere along the prompt, as its
  implicit caching always has.
- :class:`AutoCache` (OpenAI, Gemini): every prompt of at least the minimum length is
  cached at every unit boundary; a request reads the longest live prefix it shares with
  any earlier prompt, at least the minimum, in multiples of ``granularity`` beyond it
  (OpenAI: 1,024 + 128k tokens). One cache for all requests: OpenAI routes requests
  that share their first 256 tokens (and ``prompt_cache_key``) to the same machines, and
  requests that do not share them share no prefix either; the spill of a key sent more
  than about 15 times a minute onto other machines is not modelled.

Writes on automatic caches cost the input price (no surcharge), so they are not counted.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import accumulate

__all__ = ["AutoCache", "MarkerCache", "Served"]

Unit = tuple[Hashable, int]  # (unit key, tokens): a BlockSpec of .simulate


@dataclass(frozen=True, slots=True)
class Served:
    """One request's prompt tokens as the provider bills them."""

    prompt_tokens: int
    read_tokens: int
    write_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.read_tokens - self.write_tokens


def _prefix_keys(units: Sequence[Unit]) -> list[int]:
    """keys[k]: an id of the first k units (k = 0..len)."""
    keys = [0]
    for key, _ in units:
        keys.append(hash((keys[-1], key)))
    return keys


class _Entries:
    """Prefix key -> expiry time, pruned as time passes (bounded by what is live)."""

    def __init__(self) -> None:
        self.expiry: dict[int, float] = {}
        self._pruned_at = 0.0

    def live(self, key: int, now: float) -> bool:
        until = self.expiry.get(key)
        return until is not None and until >= now

    def touch(self, key: int, until: float) -> None:
        self.expiry[key] = max(until, self.expiry.get(key, until))

    def prune(self, now: float, every: float) -> None:
        if now - self._pruned_at >= every:
            self.expiry = {key: until for key, until in self.expiry.items() if until >= now}
            self._pruned_at = now


class MarkerCache:
    """Explicit caching: entries only at markers (Anthropic, Bedrock)."""

    def __init__(self, min_tokens: int, ttl: float, lookback: int = 20, max_markers: int = 4) -> None:
        self.min_tokens, self.ttl, self.lookback, self.max_markers = min_tokens, ttl, lookback, max_markers
        self.entries = _Entries()

    def serve(self, units: Sequence[Unit], markers: Sequence[int], now: float, managed: bool = False) -> Served:
        """``markers``: unit counts (a marker right after the first k units), at most 4;
        ``managed``: the provider adds its own at the end (one of the 4), which looks back
        along the whole prompt."""
        markers = [*markers, len(units)] if managed and len(units) not in markers else list(markers)
        if len(markers) > self.max_markers:
            raise ValueError(f"{len(markers)} markers, the provider takes at most {self.max_markers}")
        if any(not 0 <= marker <= len(units) for marker in markers):
            raise ValueError(f"markers must be unit counts in 0..{len(units)}, got {list(markers)}")
        self.entries.prune(now, self.ttl)
        ends = [0, *accumulate(tokens for _, tokens in units)]
        keys = _prefix_keys(units)
        read = 0
        for marker in markers:
            reach = marker if managed and marker == len(units) else self.lookback
            for k in range(marker, max(0, marker - reach) - 1, -1):
                if k <= read:
                    break
                if ends[k] >= self.min_tokens and self.entries.live(keys[k], now):
                    read = k
                    break
        if read:
            self.entries.touch(keys[read], now + self.ttl)
        written = [m for m in markers if m > read and ends[m] >= self.min_tokens]
        for marker in written:
            self.entries.touch(keys[marker], now + self.ttl)
        write = ends[max(written)] - ends[read] if written else 0
        return Served(ends[-1], ends[read], write)


class AutoCache:
    """Automatic caching: every long-enough prompt, every prefix (OpenAI, Gemini)."""

    def __init__(self, min_tokens: int, ttl: float, granularity: int = 1) -> None:
        self.min_tokens, self.ttl, self.granularity = min_tokens, ttl, granularity
        self.entries = _Entries()

    def serve(self, units: Sequence[Unit], now: float) -> Served:
        self.entries.prune(now, self.ttl)
        ends = [0, *accumulate(tokens for _, tokens in units)]
        keys = _prefix_keys(units)
        shared = 0
        for k in range(len(units), 0, -1):
            if self.entries.live(keys[k], now):
                shared = ends[k]
                break
        read = 0
        if shared >= self.min_tokens:
            read = self.min_tokens + (shared - self.min_tokens) // self.granularity * self.granularity
        if ends[-1] >= self.min_tokens:
            for k in range(1, len(units) + 1):
                self.entries.touch(keys[k], now + self.ttl)
        return Served(ends[-1], read, 0)
