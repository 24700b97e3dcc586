"""What a report from outside means for the index and the statistics, in one place.

The pilot learns after the fact what happened to what it prepared: the engine's token
usage (:meth:`Reports.record_usage`), a hosted API's usage and cache plan, that the engine
served less from its cache than predicted (:meth:`Reports.observe_cached`), that a request
never reached the engine (:meth:`Reports.discard`), that references went out as text after
all (:meth:`Reports.note_restored`), or that another worker sent a request to the same
engine (:meth:`Reports.sent_elsewhere`); and what all of it adds up to (:meth:`Reports.stats`).
Every method runs under the pilot's lock.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

from ..core.conversations import ConversationStore
from ..core.gain import index_keys, key_blocks
from ..core.prepared import PreparedRequest
from ..providers.usage import ProviderTotals, ProviderUsage
from .planner import Outlook
from .state import EngineState
from .stats import PilotStats

__all__ = ["Reports"]


class Reports:
    """Applies reports about requests to one pilot's state, outlook and counters."""

    def __init__(self, state: EngineState, conversations: ConversationStore, outlook: Outlook) -> None:
        self.state = state
        self.conversations = conversations
        self.outlook = outlook
        self.counters = state.counters
        self.usage: OrderedDict[str, list[int]] = OrderedDict()  # conversation -> engine usage

    def record_usage(
        self,
        prepared: PreparedRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        cache_write: int | None,
        capacity: int | None = None,
    ) -> None:
        """The engine's own token accounting for a served request (checked by the caller); with
        the engine's cache size (``capacity``), what the request computed is what it holds
        there (:meth:`.EngineState.hold`)."""
        if capacity is not None and prompt_tokens is not None and cached_tokens is not None:
            self.state.hold(prepared.request_id, prompt_tokens - cached_tokens, capacity)
        counters = self.counters
        counters.cache_write_tokens += cache_write or 0
        counters.engine_requests += 1
        counters.engine_prompt_tokens += prompt_tokens or 0
        counters.engine_cached_tokens += cached_tokens or 0
        if prepared.partition is not None or counters.partitions:
            counts = counters.in_partition(prepared.partition)
            counts[2] += 1
            counts[3] += prompt_tokens or 0
            counts[4] += cached_tokens or 0
        if prepared.conversation_id is not None:
            usage = self.usage.setdefault(prepared.conversation_id, [0, 0, 0])
            self.usage.move_to_end(prepared.conversation_id)
            usage[0] += 1
            usage[1] += prompt_tokens or 0
            usage[2] += cached_tokens or 0
            while len(self.usage) > self.conversations.max_conversations:
                self.usage.popitem(last=False)

    def count_provider(self, usage: ProviderUsage) -> None:
        """A hosted API's usage by provider (its tokens counted by :meth:`record_usage`)."""
        totals = self.counters.provider_usage
        name = usage.provider or "unknown"
        totals[name] = totals.get(name, ProviderTotals()).add(usage)

    def conversation_usage(self, conversation_id: str) -> tuple[int, int, int]:
        requests, prompt, cached = self.usage.get(conversation_id, (0, 0, 0))
        return requests, prompt, cached

    def observe_cached(self, prepared: PreparedRequest, cached_blocks: int) -> int:
        """The engine served only the first ``cached_blocks`` blocks of ``prepared`` from its
        cache. The blocks past those were gone from the engine, and with them every other
        request's path through them; serving this request computed its own path again. So
        each live request through the first lost block keeps only what it shares with this
        request, and what entered before the newest of them is most likely gone too (the
        engine evicts least recently used first). Returns how many requests were shortened."""
        if cached_blocks >= prepared.cached_blocks:
            self.outlook.retention.observe(prepared.cached_tokens, prepared.cached_tokens)
            return 0
        state = self.state
        order = index_keys(prepared)
        shortened = 0
        held = sum(block.token_count for block in prepared.blocks[:cached_blocks])
        self.outlook.retention.observe(prepared.cached_tokens, held)
        self.outlook.balance.correct(held - prepared.cached_tokens)  # reuse counted as bought that never was
        stale = [rid for rid in state.trie.sharing_below(order, cached_blocks) if rid != prepared.request_id]
        # the engine evicts least recently used first: what entered before the newest
        # request of the lost path has most likely gone too (shared prefixes that newer
        # requests reused stay predicted through those newer requests)
        newest = max((state.live[rid] for rid in stale if rid in state.live), default=None)
        if newest is not None:
            older = list(itertools.takewhile(lambda item: item[1] <= newest, state.live.items()))
            state.evict([rid for rid, _ in older if rid not in stale and rid != prepared.request_id])
        for rid in stale:
            if rid not in state.live:
                continue
            theirs = state.trie.order_of(rid)
            common = 0
            for mine, other in zip(order, theirs, strict=False):
                if mine != other:
                    break
                common += 1
            if common < len(theirs):
                state.truncate(rid, common)
                shortened += 1
        self.counters.feedback_shortened += shortened
        return shortened

    def discard(self, prepared: PreparedRequest) -> None:
        """The request never reached the engine: out of the index, and its turn showed nothing."""
        self.state.evict([prepared.request_id])
        if prepared.conversation_id is not None and prepared.turn is not None:
            self.conversations.forget_turn(prepared.conversation_id, prepared.turn)

    def note_restored(self, prepared: PreparedRequest, block_ids: Collection[str]) -> None:
        """References of ``prepared`` that went out as full text: counted, and carried by its turn."""
        restored = [reference.block for reference in prepared.references if reference.block.id in set(block_ids)]
        if not restored:
            return
        self.counters.references_restored += len(restored)
        if prepared.conversation_id is not None and prepared.turn is not None:
            self.conversations.carry(prepared.conversation_id, prepared.turn, restored, prepared.labels)

    def sent_elsewhere(self, request_id: str, order: list[str], part: slice) -> object | None:
        """Another worker sent this request to the engine this pilot models: index it as if
        prepared here (no observer is told: the shared log is where it came from); ``part``:
        its first blocks, the rest through :meth:`sent_more`. A request already live keeps
        its place (``None``); else returns where its path ends."""
        state = self.state
        if request_id in state.live or request_id in state.reserved:
            return None
        head = order[part]
        self.outlook.cooccurrence.record(key_blocks(head))
        state.learn(request_id, order, part)
        state.record(request_id, head, None)
        return state.trie.end_of(request_id)

    def sent_more(self, request_id: str, order: list[str], part: slice, after: object) -> object | None:
        """The next ``part`` of a request :meth:`sent_elsewhere` took in parts (``after``: where
        its path ended); ``None`` when it changed meanwhile (evicted, truncated, reset)."""
        more = order[part]
        end = self.state.extend(request_id, more, after)
        if end is not None:
            previous = key_blocks(order[part.start - 1 : part.start])[0]
            self.outlook.cooccurrence.record(key_blocks(more), previous)
            self.state.learn(request_id, order, part)
        return end

    def stats(self, strategy: str, shared: dict[str, Any]) -> PilotStats:
        """The counters with what the index and the conversations hold now (``shared``: sharing's status)."""
        return self.counters.snapshot(
            strategy,
            len(self.state.live),
            self.state.trie.node_count,
            len(self.conversations),
            **shared,
            predicted_kept=self.outlook.retention.share_or(1.0),
            send_balance=self.outlook.balance.value,
        )
