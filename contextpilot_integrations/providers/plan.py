"""Where a request's cache markers go, per provider: :func:`plan_cache`.

ContextPilot sends the shared blocks first; a provider with explicit caching (Anthropic
``cache_control``, Bedrock ``cachePoint``) then needs a marker exactly where the shared
prefix ends, because an entry is only written at a marker and a later request only finds
entries at block boundaries up to 20 blocks before one of its own markers
(see :mod:`.rules`). The plan, in priority order, within the provider's 4 markers:

1. the end of the resent chat history (``mark_history``), which the conversation's next
   turn reads;
2. the end of the prefix predicted to be shared (the deepest of ``shared_depths``: by
   default ``prepared.cached_blocks``, what the index says earlier live requests sent):
   this request reads it;
3. the end of all blocks (``write_ahead``; by default only in a conversation, whose next
   turn resends them): the next turn reads it. Writes are billed once for the tokens up
   to the last marker, so further markers cost nothing more. Outside a conversation a
   write ahead costs 1.25x for tokens that are rarely read back: on the bundled
   MultiHop-RAG sample it raised the simulated Anthropic cost by 16% online, while in chat
   it saved 5% (``simulate --provider``); ``speculate_blocks`` past the shared prefix
   instead (by default 1 for a request prepared online, whose followers are unknown; 0
   for one planned in a batch, whose followers the index already holds): on that sample
   1 block saved 0.8% online over none, 2 nothing, 3 and 5 cost 1% and 6% more;
4. the other shared depths (where other live requests branch off this path), deepest
   first; then, where two markers are more than the look-back (20 blocks) apart, one in
   between, so a later request that shares only part of the span still finds an entry;
5. markers left over split the widest unmarked spans (``ladder``): a later request that
   follows this order only partway then finds an entry within its look-back;
6. the end of the tools/system prefix (``mark_prefix``) when no block marker qualifies.

A marker whose prefix is below the model's minimum is left out; when none is left the
plan says why in ``skipped``. OpenAI caches automatically: the plan carries a
``prompt_cache_key`` (see :mod:`.cache_key`), and from GPT-5.6 on also explicit
breakpoints (``prompt_cache_breakpoint``), planned as above with up to 3 markers (the
managed breakpoint takes the fourth write) and no look-back: an entry is matched only
exactly. Outside a conversation the plan asks for explicit mode (``explicit_only``: no
managed breakpoint, which would write the whole prompt, question included, at 1.25x)
and takes all 4 markers: on the bundled MultiHop-RAG sample that cut the simulated
GPT-5.6 cost by 11% offline and 14% online; in chat the managed breakpoint stays (the
next turn finds the previous prompt through it: without it reads fell from 30% to 0.4%).
Gemini caches implicitly: ordering is all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise

from ..core.prepared import PreparedRequest
from ..core.validation import check_count
from .cache_key import prompt_cache_key
from .names import ProviderName, check_provider
from .rules import CacheRules, cache_rules

__all__ = ["CachePlan", "plan_cache"]


@dataclass(frozen=True)
class CachePlan:
    """Where to put one request's cache markers (and OpenAI's routing key)."""

    provider: ProviderName
    block_breakpoints: tuple[int, ...]
    """Indices into ``prepared.blocks`` (send order): a marker goes right after each of
    these blocks; ``()`` when none."""
    mark_history: bool
    """Also mark the end of the resent chat history (counts toward the limit of 4)."""
    prompt_cache_key: str | None
    """OpenAI: derived from the leading blocks of the send order; ``None`` otherwise."""
    skipped: str | None
    """Why no marker was placed (e.g. "below minimum 1024 tokens for claude-sonnet-4-5"),
    or why caching will not happen (OpenAI, Gemini); ``None`` otherwise."""
    mark_prefix: bool = False
    """Also mark the end of the tools/system prefix (counts toward the limit of 4)."""
    explicit_only: bool = False
    """OpenAI GPT-5.6+: send ``prompt_cache_options={"mode": "explicit"}``, so that only
    the planned breakpoints write to the cache (no managed breakpoint)."""

    @property
    def markers(self) -> int:
        """Markers the request carries."""
        return len(self.block_breakpoints) + self.mark_history + self.mark_prefix


def plan_cache(
    prepared: PreparedRequest,
    provider: ProviderName,
    model: str | None = None,
    *,
    prefix_tokens: int = 0,
    history_tokens: int = 0,
    max_breakpoints: int = 4,
    shared_depths: Sequence[int] | None = None,
    write_ahead: bool | None = None,
    ladder: bool = True,
    speculate_blocks: int | None = None,
    rules: CacheRules | None = None,
) -> CachePlan:
    """Plan the cache markers of one prepared request for ``provider``.

    Args:
        prefix_tokens: tokens sent before the history and the blocks (tools, system).
        history_tokens: tokens of the chat history resent before the blocks.
        max_breakpoints: markers you allow (at most the provider's 4); fewer when you
            place some yourself.
        shared_depths: block counts (prefix lengths of the send order) shared with other
            requests, e.g. :meth:`ContextPilot.shared_depths`; default
            ``(prepared.cached_blocks,)``.
        write_ahead: mark the end of the blocks too, for requests that come later
            (``None``: only in a conversation, whose next turn resends them).
        ladder: spend markers left over on the widest unmarked spans of the blocks.
        speculate_blocks: also mark this many blocks past the shared prefix (``None``: 1
            for a request prepared alone, 0 for one planned in a batch).
        rules: the cache rules to obey (default: :func:`cache_rules` of provider, model).
    """
    provider = check_provider(provider)
    rules = rules or cache_rules(provider, model)
    check_count("prefix_tokens", prefix_tokens)
    check_count("history_tokens", history_tokens)
    check_count("max_breakpoints", max_breakpoints)
    sizes = [block.token_count for block in prepared.blocks]
    before = prefix_tokens + history_tokens
    total = before + sum(sizes)
    below = f"below minimum {rules.min_tokens} tokens for {rules.model}"
    if not rules.explicit:
        key = prompt_cache_key(prepared.blocks, before) if provider == "openai" else None
        skipped = None
        if total < rules.min_tokens:
            skipped = below
        elif not sizes and not before:
            skipped = "nothing shared"
        return CachePlan(provider, (), False, key, skipped)
    depths = _shared(prepared, shared_depths, len(sizes))
    ends = [before, *(before + tokens for tokens in accumulate(sizes))]  # ends[d]: tokens of the first d blocks
    explicit_only = rules.implicit_breakpoint and prepared.conversation_id is None
    budget = min(max_breakpoints, rules.max_breakpoints + explicit_only)
    mark_history = history_tokens > 0 and before >= rules.min_tokens and budget > 0
    budget -= mark_history
    wanted: list[int] = []
    if depths:
        wanted.append(depths[-1])
    if write_ahead is None:
        write_ahead = prepared.conversation_id is not None
    if write_ahead and sizes:
        wanted.append(len(sizes))
    if speculate_blocks is None:
        speculate_blocks = 0 if prepared.batch_index is not None else 1
    check_count("speculate_blocks", speculate_blocks)
    if speculate_blocks and sizes:
        wanted.append(min(len(sizes), (depths[-1] if depths else 0) + speculate_blocks))
    wanted.extend(reversed(depths[:-1]))
    chosen: list[int] = []
    for depth in wanted:
        if len(chosen) < budget and depth not in chosen and ends[depth] >= rules.min_tokens:
            chosen.append(depth)
    _fill_lookback(chosen, budget, rules, ends)
    if ladder:
        _fill_ladder(chosen, budget, rules, ends)
    mark_prefix = not chosen and not mark_history and prefix_tokens >= rules.min_tokens and budget > 0
    skipped = None
    if not chosen and not mark_history and not mark_prefix:
        skipped = below if (wanted or before) else "nothing shared"
    key = prompt_cache_key(prepared.blocks, before) if provider == "openai" else None
    breakpoints = tuple(sorted(depth - 1 for depth in chosen))
    explicit_only = explicit_only and bool(breakpoints)
    return CachePlan(provider, breakpoints, mark_history, key, skipped, mark_prefix, explicit_only)


def _shared(prepared: PreparedRequest, shared_depths: Sequence[int] | None, blocks: int) -> list[int]:
    given = (prepared.cached_blocks,) if shared_depths is None else shared_depths
    for depth in given:
        check_count("shared_depths", depth)
    return sorted({depth for depth in given if 0 < depth <= blocks})


def _fill_lookback(chosen: list[int], budget: int, rules: CacheRules, ends: Sequence[int]) -> None:
    """Add markers where consecutive ones are more than the look-back apart (in blocks)."""
    if not rules.lookback_blocks or not chosen:
        return
    while len(chosen) < budget:
        marks = sorted({0, *chosen})
        gaps = [(b - a, a) for a, b in pairwise(marks) if b - a > rules.lookback_blocks]
        if not gaps:
            return
        _, start = max(gaps)
        depth = start + rules.lookback_blocks
        if ends[depth] < rules.min_tokens:
            return
        chosen.append(depth)


def _fill_ladder(chosen: list[int], budget: int, rules: CacheRules, ends: Sequence[int]) -> None:
    """Split the widest unmarked spans (in blocks) while markers are left; a split point
    below the minimum length is no use, nor is anything before it."""
    if not chosen:
        return
    while len(chosen) < budget:
        marks = sorted({0, *chosen})
        spans = sorted(((b - a, a) for a, b in pairwise(marks) if b - a >= 2), reverse=True)
        for width, start in spans:
            depth = start + width // 2
            if ends[depth] >= rules.min_tokens:
                chosen.append(depth)
                break
        else:
            return
