"""ContextPilot: the one object the framework adapters (and users) call.

It owns three pieces of state behind one lock: the live :class:`PrefixTrie` (what the
engine is predicted to hold), the ordering strategy, and the conversations. Preparing a
request is a few dictionary look-ups per block, so the lock is held for microseconds and
the same instance can serve threads and asyncio tasks alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import math
import os
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import BaseModel, ConfigDict
from tqdm.auto import tqdm

from .core.annotations import DEFAULT_TEMPLATES, Templates
from .core.blocks import Block, BlockLike, normalize_blocks
from .core.conversations import ConversationStore
from .core.gain import (
    FORMS,
    Balance,
    Chance,
    Choice,
    Cooccurrence,
    Form,
    Retention,
    TokenCounter,
    annotation_tokens,
    choose_order,
    estimate_tokens,
    index_keys,
    key_block,
    key_blocks,
    label_tokens,
    labelled_keys,
    plain_keys,
)
from .core.prepared import PreparedRequest, Reference, make_reference
from .core.usage import check_token_count, check_usage
from .core.validation import check_conversation_id, check_count, check_kept_turns, check_query, check_request_id
from .errors import DuplicateRequestError
from .index.prefix_trie import PrefixTrie
from .index.strategies import PlannedBatch, Strategy, make_strategy
from .providers.plan import CachePlan
from .providers.usage import ProviderTotals, ProviderUsage

__all__ = ["BatchRequest", "ContextPilot", "PilotStats"]


class PilotStats(BaseModel):
    """A snapshot of what the pilot holds and has done."""

    model_config = ConfigDict(frozen=True)

    strategy: str
    live_requests: int
    index_nodes: int
    conversations: int
    requests_prepared: int
    blocks_sent: int
    blocks_referenced: int
    tokens_sent: int
    tokens_referenced: int
    predicted_cached_blocks: int
    predicted_cached_tokens: int
    requests_evicted: int
    engine_requests: int = 0
    """Requests whose usage the engine reported (see :meth:`ContextPilot.record_usage`)."""
    engine_prompt_tokens: int = 0
    engine_cached_tokens: int = 0
    feedback_shortened: int = 0
    """Requests shortened because the engine reported less cached than predicted."""
    references_restored: int = 0
    """Location references sent as full text after all, because the messages that left for
    the engine did not carry the text they pointed to (see :meth:`ContextPilot.note_restored`)."""
    shared_connected: bool | None = None
    """Sharing across workers (``shared=``): whether the broker is reachable now; ``None``
    when sharing is off."""
    shared_unsent: int = 0
    """Entries of this worker waiting for the broker (sent once it is back)."""
    shared_applied: int = 0
    """Entries of other workers applied to this index."""
    engine_cache_write_tokens: int = 0
    """Prompt tokens a hosted API reported writing to its cache (part of the prompt tokens)."""
    provider_usage: dict[str, ProviderTotals] = {}
    """Hosted APIs' usage by provider (see :meth:`ContextPilot.record_provider_usage`)."""
    cache_markers_placed: int = 0
    """Cache markers planned for hosted APIs (see :meth:`ContextPilot.note_cache_plan`)."""
    cache_plans_skipped: dict[str, int] = {}
    """Requests planned without a marker, by reason (e.g. below the model's minimum)."""
    predicted_kept: float = 1.0
    """The share of the predicted cached tokens the engine reported serving (recent
    reports weigh most; 1.0 before any): predicted reuse counts this much when deciding
    whether labels and reordering pay (:mod:`.core.gain`)."""
    send_balance: float = 0.0
    """Recent reuse the sends bought beyond retrieval order's, less the tokens they added
    (:class:`~.core.gain.Balance`): while negative, no send bets on later reuse."""

    @property
    def engine_hit_ratio(self) -> float:
        """Cached prompt tokens over prompt tokens, as the engine reported them."""
        return self.engine_cached_tokens / self.engine_prompt_tokens if self.engine_prompt_tokens else 0.0

    @property
    def predicted_hit_ratio(self) -> float:
        """Predicted cached block tokens over block tokens sent."""
        return self.predicted_cached_tokens / self.tokens_sent if self.tokens_sent else 0.0


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One request of a batch for :meth:`ContextPilot.plan`."""

    blocks: Sequence[BlockLike]
    query: str
    conversation_id: str | None = None
    kept_turns: Collection[int] | None = None
    request_id: str | None = None


BatchItem = BatchRequest | tuple[Sequence[BlockLike], str] | Mapping[str, Any]


@dataclass(slots=True)
class _Counters:
    prepared: int = 0
    blocks_sent: int = 0
    blocks_referenced: int = 0
    tokens_sent: int = 0
    tokens_referenced: int = 0
    cached_blocks: int = 0
    cached_tokens: int = 0
    evicted: int = 0
    engine_requests: int = 0
    engine_prompt_tokens: int = 0
    engine_cached_tokens: int = 0
    feedback_shortened: int = 0
    references_restored: int = 0
    cache_write_tokens: int = 0
    provider_usage: dict[str, ProviderTotals] = field(default_factory=dict)
    cache_markers: int = 0
    plans_skipped: dict[str, int] = field(default_factory=dict)


_MAX_SKIP_REASONS = 64
"""Distinct reasons counted in ``PilotStats.cache_plans_skipped``; further ones count as "other"."""


class ContextPilot:
    """Reorders, schedules and de-duplicates context blocks for prefix-cache reuse.

    Args:
        strategy: ``"trie"`` (default), ``"paper"`` or ``"retrieval"`` (no reordering).
        templates: prompt templates for blocks, references and annotations.
        annotate_order: add the order annotation that restates the retriever's ranking.
        max_live_requests: bound on requests tracked in the index; the oldest are
            forgotten first (use eviction events to stay exact).
        conversation_ttl: seconds after which an idle conversation is forgotten
            (``None``: never).
        max_conversations: bound on conversations tracked (least recently used go first).
        request_id_prefix: prefix of generated request ids.
        shared: share this index with other workers through a broker: a URL such as
            ``"nats://127.0.0.1:4222"`` or :class:`~contextpilot_integrations.shared.SharedOptions`
            (default: the ``CONTEXTPILOT_SHARED`` environment variable; unset: not shared).
            See :mod:`contextpilot_integrations.shared`.
        cache_tokens: the engine's prefix-cache size in tokens, if known: a request larger
            than it is not indexed (see :mod:`.core.gain`).
        plain_prompts: send a request whose reordering does not pay as without ContextPilot
            (``False``: every block labelled, the paper's form).
        order_form: how a reordered request outside a conversation restates the ranking:
            ``"positions"`` (default: each block is its text alone, the ranking restated by
            position, so a block is the same text whether its request is reordered or not),
            ``"moved"`` (only the blocks out of place), or ``"labels"`` (the paper's: every
            block labelled, the ranking restated by label). A conversation always labels
            its blocks: later turns refer to them by label.
        token_counter: counts the tokens of a text (the engine's tokenizer), so labels and
            the annotation are weighed in the blocks' units; default: four characters a
            token, rounded up.
        **strategy_options: passed to the strategy (e.g. ``linkage_method`` for "paper").
    """

    def __init__(
        self,
        strategy: str = "trie",
        *,
        templates: Templates | None = None,
        annotate_order: bool = True,
        max_live_requests: int = 200_000,
        conversation_ttl: float | None = 3600.0,
        max_conversations: int = 10_000,
        request_id_prefix: str = "cp",
        shared: Any = None,
        cache_tokens: int | None = None,
        plain_prompts: bool = True,
        order_form: Form = "positions",
        token_counter: TokenCounter | None = None,
        **strategy_options: Any,
    ) -> None:
        if max_live_requests < 1:
            raise ValueError("max_live_requests must be at least 1")
        if cache_tokens is not None:
            check_count("cache_tokens", cache_tokens)
        self.cache_tokens = cache_tokens
        self.plain_prompts = plain_prompts
        if order_form not in FORMS:
            raise ValueError(f"order_form must be one of {FORMS}, got {order_form!r}")
        self.order_form: Form = order_form
        self.token_counter: TokenCounter = token_counter or estimate_tokens
        self.templates = templates or DEFAULT_TEMPLATES
        self.annotate_order = annotate_order
        self.max_live_requests = max_live_requests
        self._trie: PrefixTrie[str] = PrefixTrie()
        self._strategy: Strategy = make_strategy(strategy, self._trie, **strategy_options)
        self._conversations = ConversationStore(conversation_ttl, max_conversations)
        self._live: OrderedDict[str, int] = OrderedDict()  # request id -> when it entered, oldest first
        self._ticks = itertools.count()
        self._usage: OrderedDict[str, list[int]] = OrderedDict()  # conversation -> engine usage
        self._orders: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # send orders, for restore()
        self._reserved: set[str] = set()  # ids of a batch being planned
        self._lock = threading.RLock()
        self._counters = _Counters()
        self._retention = Retention()  # how much of the predicted reuse the engine delivers
        self._cooccurrence = Cooccurrence()  # what this traffic shows about later reuse
        self._balance = Balance()  # what the sends bought, less what they cost
        self._labelled_sends = 0  # requests sent labelled: a one-text request may follow their prefix
        self._id_prefix = f"{request_id_prefix}-{secrets.token_hex(4)}-"
        self._ids = itertools.count()
        self._observers: list[Callable[..., None]] = []
        self.shared: Any = None
        """The shared-state client when ``shared`` (or ``CONTEXTPILOT_SHARED``) is set."""
        shared = shared if shared is not None else os.environ.get("CONTEXTPILOT_SHARED") or None
        if shared is not None:
            from .shared import attach  # imported only when sharing is on: no broker client otherwise

            self.shared = attach(self, shared)

    def add_observer(self, observer: Callable[..., None]) -> None:
        """Call ``observer(kind, *details)`` whenever this pilot learns what the engine holds:
        ``("sent", request_id, block_ids, token_counts)``, ``("evicted", request_ids)``,
        ``("truncated", request_id, cached_blocks)``, ``("restored", request_id, cached_blocks)``,
        ``("reset",)``. It runs under the pilot's lock: it must be quick and must not raise
        (the shared-state client only queues the entry)."""
        with self._lock:
            self._observers = [*self._observers, observer]

    def remove_observer(self, observer: Callable[..., None]) -> None:
        with self._lock:
            self._observers = [o for o in self._observers if o is not observer]

    def _notify(self, kind: str, *details: Any) -> None:
        for observer in self._observers:
            observer(kind, *details)

    @property
    def strategy(self) -> str:
        return self._strategy.name

    # ---- one request ------------------------------------------------------------------
    def prepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        request_id: str | None = None,
    ) -> PreparedRequest:
        """Order one request's blocks for cache reuse and record it in the index.

        Args:
            blocks: the retrieved blocks, best first (or with ``rank`` set).
            query: the user's question.
            conversation_id: blocks already sent in this conversation become location
                references (while the turn that carried them is kept).
            kept_turns: the earlier turns (0-based) still in the history you send;
                ``None`` means all of them.
            request_id: your own id for the engine; generated when omitted.

        Raises:
            InvalidBlockError, BlockTypeError: a block is empty, not text, or an id is
                given twice with different texts. Nothing is recorded then.
        """
        normalized, merged = normalize_blocks(blocks)
        check_query(query)
        check_conversation_id(conversation_id)
        kept = check_kept_turns(kept_turns)
        with self._lock:
            return self._prepare_locked(normalized, merged, query, conversation_id, kept, request_id, None)

    async def aprepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        request_id: str | None = None,
    ) -> PreparedRequest:
        """Async variant of :meth:`prepare` (it never blocks on I/O, so it runs inline)."""
        return self.prepare(blocks, query, conversation_id, kept_turns=kept_turns, request_id=request_id)

    def _new_request_id(self, request_id: str | None) -> str:
        if request_id is None:
            return f"{self._id_prefix}{next(self._ids)}"
        check_request_id(request_id)
        if request_id in self._live or request_id in self._reserved:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the index")
        return request_id

    def _prepare_locked(
        self,
        blocks: list[Block],
        merged: list[str],
        query: str,
        conversation_id: str | None,
        kept_turns: Collection[int] | None,
        request_id: str | None,
        planned_order: list[str] | None,
        batch_index: int | None = None,
        chance: Chance | None = None,
        concurrent: bool = False,
    ) -> PreparedRequest:
        # decide everything first; record only once nothing can raise any more
        rid = self._new_request_id(request_id)
        by_id = {block.id: block for block in blocks}
        turn: int | None = None
        fresh = blocks
        references: tuple[Reference, ...] = ()
        dedup = None
        if conversation_id is not None:
            dedup = self._conversations.split(conversation_id, blocks, kept_turns)
            turn, fresh = dedup.turn, dedup.fresh
            references = tuple([make_reference(b, t, self.templates) for b, t in dedup.repeated])
        cached_blocks = cached_tokens = 0
        labels = True
        if turn:
            # later turns start with this conversation's own history, which no other
            # request shares: keep the retriever's order and leave the index alone
            sent = fresh
            if planned_order is not None:
                self._strategy.forget(rid)
        else:
            keys = list(by_id) if fresh is blocks else [block.id for block in fresh]
            plain_ok = conversation_id is None and self.plain_prompts
            if planned_order is None:
                followed = self._strategy.order(rid, self._strategy_keys(keys, plain_ok))
                planned_order = key_blocks(followed)
            choice = self._worth_it(planned_order, keys, blocks, by_id, plain_ok, query, chance, concurrent)
            order, labels = choice.order, choice.labels
            self._cooccurrence.record(order)
            self._balance.add(choice.bought)
            sent = list(map(by_id.__getitem__, order))
            indexed = labelled_keys(order) if labels else plain_keys(order)
            self._labelled_sends += labels
            if choice.cached:
                cached_blocks = self._trie.insert(rid, indexed)
                self._live[rid] = next(self._ticks)
                self._orders[rid] = tuple(indexed)
                self._enforce_bound()
                if self._observers:
                    self._notify("sent", rid, tuple(indexed), tuple([block.token_count for block in sent]))
            else:  # larger than the engine's cache: it reuses, but leaves nothing to predict
                cached_blocks = self._trie.match_length(indexed)
                self._strategy.forget(rid)
        sizes = [block.token_count for block in sent]
        if cached_blocks:
            cached_tokens = sum(sizes[:cached_blocks])
        if dedup is not None:
            self._conversations.record(dedup)
        counters = self._counters
        counters.prepared += 1
        counters.blocks_sent += len(sent)
        counters.tokens_sent += sum(sizes)
        if references:
            counters.blocks_referenced += len(references)
            counters.tokens_referenced += sum([r.block.token_count for r in references])
        counters.cached_blocks += cached_blocks
        counters.cached_tokens += cached_tokens
        prepared = PreparedRequest(
            request_id=rid,
            query=query,
            blocks=tuple(sent),
            references=references,
            ranking=tuple(blocks),
            conversation_id=conversation_id,
            turn=turn,
            cached_blocks=cached_blocks,
            cached_tokens=cached_tokens,
            merged_duplicates=tuple(merged),
            batch_index=batch_index,
            annotate_order=self.annotate_order,
            templates=self.templates,
            labels=labels,
            order_form=self.order_form,
        )
        return prepared

    def _strategy_keys(self, keys: list[str], plain_ok: bool) -> list[str]:
        """The index keys the strategy orders by: the text alone (one text per block) unless
        the blocks will carry labels (a conversation, the paper's form)."""
        return plain_keys(keys) if plain_ok and self.order_form != "labels" else labelled_keys(keys)

    def _worth_it(
        self,
        order: list[str],
        keys: list[str],
        ranking: list[Block],
        by_id: dict[str, Block],
        plain_ok: bool,
        query: str,
        chance: Chance | None,
        concurrent: bool = False,
    ) -> Choice:
        """The send that pays best for this request (:mod:`.core.gain`). A conversation's blocks
        keep their labels: later turns refer to them by label. ``chance``: that a later
        request carries a block after another (default: what this traffic showed, bet only
        from what earlier sends bought; given for a batch sent in order: partners are sure).
        ``concurrent``: part of a burst whose callers send at once: nothing is bet on before
        the engine has served a prediction (the requests it would follow are still in
        flight, and their order at the engine is nobody's)."""
        trie = self._trie
        one_text = plain_ok and self.order_form != "labels"
        count = self.token_counter
        annotation = 0
        if self.annotate_order and order != keys:
            form: Form = self.order_form if one_text else "labels"
            annotation = annotation_tokens(ranking, self.templates, [by_id[key] for key in order], form, count)
        labelled = None
        if one_text and self._labelled_sends:  # a conversation may have left labelled blocks cached
            head = key_blocks(trie.best_prefix(labelled_keys(keys)))
            if head:
                taken = set(head)
                onto = head + [key for key in order if key not in taken]
                cost = label_tokens(ranking, self.templates, count)
                if self.annotate_order and onto != keys:
                    cost += annotation_tokens(ranking, self.templates, None, "labels", count)
                labelled = (onto, cost)
        return choose_order(
            order,
            keys,
            {key: by_id[key].token_count for key in keys},
            matched=lambda keys, labelled: trie.match_length(labelled_keys(keys) if labelled else plain_keys(keys)),
            chance=chance or self._cooccurrence.chance,
            annotation_cost=annotation,
            label_cost=0 if one_text else label_tokens([by_id[key] for key in keys], self.templates, count),
            form=self.order_form,
            cache_tokens=self.cache_tokens,
            plain_ok=plain_ok,
            kept=self._retention.share_or(0.0 if concurrent else 1.0),
            budget=math.inf if chance is not None and not concurrent else self._balance.budget,
            retrieval_chance=self._cooccurrence.chance,
            prompt_tokens=count(self.templates.question.format(query=query)) if self.cache_tokens else 0,
            labelled=labelled,
        )

    # ---- a batch ------------------------------------------------------------------------
    def plan(
        self, requests: Iterable[BatchItem], *, progress: bool = False, in_order: bool = True
    ) -> list[PreparedRequest]:
        """Offline mode: order every request of a batch and schedule the batch.

        Returns the prepared requests in send order; each keeps its own query and its
        position in the input as ``batch_index``. Turns of one conversation keep their
        relative order (they take the schedule slots of that conversation, in turn order).

        ``in_order``: the caller sends them in that order, so a block that another request
        of the batch carries is sure to be reused (:mod:`.core.gain`). ``False`` for concurrent
        callers (:class:`~.core.batching.MicroBatcher`), whose requests reach the engine in
        whatever order their threads get there: on an engine that keeps only its last
        prompt, a partner reused on paper is then often lost.

        The batch is planned outside the lock, so concurrent :meth:`prepare` calls are not
        held up by a long plan; the planned requests then enter the index in small steps.

        Raises:
            InvalidBlockError, BlockTypeError, DuplicateRequestError: for any bad request
                (naming its index); nothing is recorded then: a batch is all or nothing.
        """
        items = [_batch_request(item, index) for index, item in enumerate(requests)]
        normalized = []
        kept_turns = []
        for index, item in enumerate(items):
            try:
                normalized.append(normalize_blocks(item.blocks))
                check_query(item.query)
                check_conversation_id(item.conversation_id)
                kept_turns.append(check_kept_turns(item.kept_turns))
                if item.request_id is not None:
                    check_request_id(item.request_id)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request #{index}: {exc}") from exc
        with self._lock:
            ids = []
            for index, item in enumerate(items):
                try:
                    ids.append(self._new_request_id(item.request_id))
                except DuplicateRequestError as exc:
                    raise DuplicateRequestError(f"request #{index}: {exc}") from exc
            if len(set(ids)) != len(ids):
                raise DuplicateRequestError("request ids repeat within the batch")
            self._reserved.update(ids)  # no concurrent prepare can take them meanwhile
        try:
            plain_ok = [item.conversation_id is None and self.plain_prompts for item in items]
            batch = [(rid, [block.id for block in blocks]) for rid, (blocks, _) in zip(ids, normalized, strict=True)]
            followed = [(rid, self._strategy_keys(keys, ok)) for (rid, keys), ok in zip(batch, plain_ok, strict=True)]
            tokens = {
                key: block.token_count
                for (_, keys), (blocks, _) in zip(followed, normalized, strict=True)
                for key, block in zip(keys, blocks, strict=True)
            }
            with _gc_paused():
                planned = self._strategy.plan(followed, tokens)
            orders = [key_blocks(order) for order in planned.orders]
            schedule = _keep_turn_order(planned.schedule, [item.conversation_id for item in items])
            sizes = [sum(block.token_count for block in blocks) for blocks, _ in normalized]
            chances: dict[int, Chance | None] = {}
            prepared: list[PreparedRequest] = []
            steps = tqdm(total=len(schedule), desc="planning", unit="req", disable=not progress)
            with steps:
                for start in range(0, max(len(schedule), 1), _COMMIT_STEP):
                    with self._lock:
                        if start == 0:
                            chances = self._batch_chances(batch, schedule, orders, sizes, in_order)
                            self._strategy.commit(planned, followed)
                        for index in schedule[start : start + _COMMIT_STEP]:
                            item, (blocks, merged) = items[index], normalized[index]
                            self._reserved.discard(ids[index])
                            prepared.append(
                                self._prepare_locked(
                                    blocks,
                                    merged,
                                    item.query,
                                    item.conversation_id,
                                    kept_turns[index],
                                    ids[index],
                                    orders[index],
                                    index,
                                    chances[index],
                                    not in_order,
                                )
                            )
                    steps.update(min(_COMMIT_STEP, len(schedule) - start))
            return prepared
        finally:
            with self._lock:
                self._reserved.difference_update(ids)

    def _batch_chances(
        self,
        batch: Sequence[tuple[str, list[str]]],
        schedule: Sequence[int],
        orders: Sequence[list[str]],
        sizes: Sequence[int],
        in_order: bool,
    ) -> dict[int, Chance | None]:
        """Per request of a batch about to be counted: that a later request carries a block.
        Sent in order, sure for a block a later request of the batch carries while the
        cache still holds it (the tokens sent in between fit, when the cache size is known);
        else what this traffic showed. ``None`` (bets paid from the balance only) for a
        concurrent burst: a partner's prefix may not be computed before it is needed."""
        if not in_order:
            return dict.fromkeys(range(len(batch)))
        room = self.cache_tokens
        shown = self._cooccurrence.chance
        chances: dict[int, Chance | None] = {}
        sent_after = 0  # tokens of the requests after the current one (scanning backwards)
        next_at: dict[str, int] = {}  # block -> tokens from the next request carrying it to the end
        for index in reversed(schedule):
            sure = frozenset(
                key
                for key in orders[index]
                if key in next_at and (room is None or sent_after - next_at[key] + sizes[index] <= room)
            )
            chances[index] = _sure_or(sure, shown)
            sent_after += sizes[index]
            for key in orders[index]:
                next_at[key] = sent_after
        return chances

    async def aplan(
        self, requests: Iterable[BatchItem], *, progress: bool = False, in_order: bool = True
    ) -> list[PreparedRequest]:
        """Async variant of :meth:`plan`, run in a worker thread."""
        return await asyncio.to_thread(self.plan, list(requests), progress=progress, in_order=in_order)

    # ---- engine state ---------------------------------------------------------------------
    def evict(self, request_ids: Iterable[str]) -> int:
        """The engine no longer holds these requests' prefixes; unknown ids are ignored.

        Returns:
            How many of the ids were live.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        request_ids = list(request_ids)
        for rid in request_ids:
            if not isinstance(rid, str):
                raise TypeError(f"request ids must be str, got {type(rid).__name__}")
        with self._lock:
            evicted = 0
            for rid in request_ids:
                self._orders.pop(rid, None)
                if rid in self._live:
                    del self._live[rid]
                    self._forget(rid)
                    evicted += 1
            self._counters.evicted += evicted
            if self._observers and request_ids:
                self._notify("evicted", tuple(request_ids))
            return evicted

    def truncate(self, request_id: str, cached_blocks: int) -> bool:
        """The engine now holds only the first ``cached_blocks`` blocks of this request.

        Partial evictions keep the rest of the request's prefix predictable; 0 drops it
        (its order is remembered, so :meth:`restore` can bring it back). Returns whether
        the request was live.
        """
        check_count("cached_blocks", cached_blocks)
        with self._lock:
            if self._observers:
                self._notify("truncated", request_id, cached_blocks)
            if request_id not in self._live:
                return False
            if cached_blocks == 0:
                del self._live[request_id]
                self._trie.evict(request_id)
                self._strategy.forget(request_id)
                self._counters.evicted += 1
                return True
            return self._trie.truncate(request_id, cached_blocks)

    def restore(self, request_id: str, cached_blocks: int | None = None) -> bool:
        """The engine holds (again) the first ``cached_blocks`` blocks of this request.

        Eviction events can overtake the store events of the same blocks; when the engine
        confirms a block is back, the prediction comes back too. ``None`` means all of
        them. Returns whether the request's order was known.
        """
        if cached_blocks is not None:
            check_count("cached_blocks", cached_blocks)
        with self._lock:
            if self._observers:
                self._notify("restored", request_id, cached_blocks)
            order = self._orders.get(request_id)
            if order is None:
                return False
            keep = len(order) if cached_blocks is None else min(cached_blocks, len(order))
            if request_id in self._live:
                if keep <= len(self._trie.order_of(request_id)):
                    return True
                self._trie.evict(request_id)
            elif keep == 0:
                return True
            else:
                self._live[request_id] = next(self._ticks)
            self._trie.insert(request_id, order[:keep])
            self._enforce_bound()
            return True

    def reset(self) -> None:
        """The engine holds nothing any more (restart, ``/flush_cache``)."""
        with self._lock:
            self._counters.evicted += len(self._live)
            self._live.clear()
            self._orders.clear()
            self._trie.clear()
            self._strategy.reset()
            if self._observers:
                self._notify("reset")

    def record_usage(
        self,
        prepared: PreparedRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        *,
        cache_write_tokens: int | None = None,
    ) -> None:
        """Add the engine's own token accounting for a served request to the statistics.

        Args:
            cache_write_tokens: prompt tokens a hosted API wrote to its cache.

        Raises:
            TypeError, ValueError: a count is not an int in 0..MAX_TOKENS, or the cached
                tokens exceed the prompt tokens (nothing is recorded).
        """
        check_usage(prompt_tokens, cached_tokens)
        if cache_write_tokens is not None:
            check_token_count("cache_write_tokens", cache_write_tokens)
        with self._lock:
            counters = self._counters
            counters.cache_write_tokens += cache_write_tokens or 0
            counters.engine_requests += 1
            counters.engine_prompt_tokens += prompt_tokens or 0
            counters.engine_cached_tokens += cached_tokens or 0
            if prepared.conversation_id is not None:
                usage = self._usage.setdefault(prepared.conversation_id, [0, 0, 0])
                self._usage.move_to_end(prepared.conversation_id)
                usage[0] += 1
                usage[1] += prompt_tokens or 0
                usage[2] += cached_tokens or 0
                while len(self._usage) > self._conversations.max_conversations:
                    self._usage.popitem(last=False)

    def record_provider_usage(self, prepared: PreparedRequest, usage: ProviderUsage) -> None:
        """Add a hosted API's usage (see :func:`~.providers.read_provider_usage`): prompt
        tokens and cache reads as :meth:`record_usage` does, cache writes, and both by
        provider (a usage without a provider counts under ``"unknown"``)."""
        if not isinstance(usage, ProviderUsage):
            raise TypeError(f"usage must be a ProviderUsage, got {type(usage).__name__}")
        with self._lock:
            self.record_usage(
                prepared, usage.prompt_tokens, usage.cache_read_tokens, cache_write_tokens=usage.cache_write_tokens
            )
            totals = self._counters.provider_usage
            name = usage.provider or "unknown"
            totals[name] = totals.get(name, ProviderTotals()).add(usage)

    def note_cache_plan(self, plan: CachePlan) -> None:
        """Count a request's planned cache markers, or why it got none."""
        if not isinstance(plan, CachePlan):
            raise TypeError(f"plan must be a CachePlan, got {type(plan).__name__}")
        with self._lock:
            counters = self._counters
            counters.cache_markers += plan.markers
            if plan.skipped is not None:
                reasons = counters.plans_skipped
                reason = plan.skipped if plan.skipped in reasons or len(reasons) < _MAX_SKIP_REASONS else "other"
                reasons[reason] = reasons.get(reason, 0) + 1

    def shared_depths(self, prepared: PreparedRequest) -> tuple[int, ...]:
        """Prefix lengths (in blocks) of this request's send order that the index says other
        live requests share (where each one's shared part ends): where a hosted API's cache
        marker pays off. A request the index does not hold (a later chat turn): its
        predicted cached blocks, if any."""
        with self._lock:
            if prepared.request_id in self._live:
                return tuple(self._trie.shared_depths(index_keys(prepared)))
        return (prepared.cached_blocks,) if prepared.cached_blocks else ()

    def adopt(self, prepared: PreparedRequest, *, fresh_id: bool = False) -> PreparedRequest:
        """A request prepared elsewhere (another engine's pilot) is sent to this pilot's
        engine after all (failover), or sent again after a failed call was discarded (a
        retry): record its send order here, as the engine will hold it.

        Args:
            fresh_id: give it a new request id (a retry must not reuse the failed call's id).

        Returns it as this pilot predicts it (its ``cached_blocks`` from this index).
        """
        order = index_keys(prepared)
        with self._lock:
            rid = prepared.request_id
            if fresh_id or rid in self._live or rid in self._reserved:
                rid = self._new_request_id(None)
            cached = 0
            if not prepared.turn:
                cached = self._trie.insert(rid, order)
                self._live[rid] = next(self._ticks)
                self._orders[rid] = tuple(order)
                self._enforce_bound()
                if self._observers:
                    self._notify("sent", rid, tuple(order), tuple([block.token_count for block in prepared.blocks]))
            adopted = replace(
                prepared,
                request_id=rid,
                cached_blocks=cached,
                cached_tokens=sum(block.token_count for block in prepared.blocks[:cached]),
            )
            return adopted

    def observe_cached(self, prepared: PreparedRequest, cached_blocks: int) -> int:
        """The engine served only the first ``cached_blocks`` blocks of this request from its
        cache, where the index predicted ``prepared.cached_blocks``.

        The blocks past those were gone from the engine, and with them every other request's
        path through them; serving this request computed its own path again. So each live
        request through the first lost block keeps only what it shares with this request.
        Later requests are then not ordered for a prefix that is gone. Engine feedback for
        engines without KV events (llama.cpp, hosted APIs): their cached-token reports.

        Returns:
            How many live requests were shortened.
        """
        check_count("cached_blocks", cached_blocks)
        if cached_blocks >= prepared.cached_blocks:
            with self._lock:
                self._retention.observe(prepared.cached_tokens, prepared.cached_tokens)
            return 0
        order = index_keys(prepared)
        shortened = 0
        with self._lock:
            held = sum(block.token_count for block in prepared.blocks[:cached_blocks])
            self._retention.observe(prepared.cached_tokens, held)
            self._balance.correct(held - prepared.cached_tokens)  # reuse counted as bought that never was
            stale = [rid for rid in self._trie.sharing_below(order, cached_blocks) if rid != prepared.request_id]
            # the engine evicts least recently used first: what entered before the newest
            # request of the lost path has most likely gone too (shared prefixes that newer
            # requests reused stay predicted through those newer requests)
            newest = max((self._live[rid] for rid in stale if rid in self._live), default=None)
            if newest is not None:
                older = list(itertools.takewhile(lambda item: item[1] <= newest, self._live.items()))
                self.evict([rid for rid, _ in older if rid not in stale and rid != prepared.request_id])
            for rid in stale:
                if rid not in self._live:
                    continue
                theirs = self._trie.order_of(rid)
                common = 0
                for mine, other in zip(order, theirs, strict=False):
                    if mine != other:
                        break
                    common += 1
                if common < len(theirs):
                    self.truncate(rid, common)
                    shortened += 1
            self._counters.feedback_shortened += shortened
        return shortened

    def conversation_usage(self, conversation_id: str) -> tuple[int, int, int]:
        """(requests, prompt tokens, cached tokens) the engine reported for a conversation."""
        with self._lock:
            requests, prompt, cached = self._usage.get(conversation_id, (0, 0, 0))
            return requests, prompt, cached

    def discard(self, prepared: PreparedRequest) -> None:
        """The request never reached the engine: forget it in the index and, in a
        conversation, forget that its turn showed any block (later turns resend them)."""
        with self._lock:
            self.evict([prepared.request_id])
            if prepared.conversation_id is not None and prepared.turn is not None:
                self._conversations.forget_turn(prepared.conversation_id, prepared.turn)

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's seen blocks; returns whether it was tracked."""
        with self._lock:
            return self._conversations.end(conversation_id)

    def predicted_cached_blocks(self, block_ids: Sequence[str]) -> int:
        """Leading blocks of this send order the index predicts the engine holds, sent as
        their text alone or labelled (whichever the engine holds more of)."""
        ids = list(block_ids)
        with self._lock:
            return max(self._trie.match_length(plain_keys(ids)), self._trie.match_length(labelled_keys(ids)))

    def reusable_tokens(self, blocks: Iterable[BlockLike]) -> int:
        """Tokens of these blocks the engine could serve from its cache if this pilot
        prepared them now: the longest live prefix they can follow (in retrieval order
        for the ``retrieval`` strategy, or sent without labels). What a router compares
        across engines."""
        normalized, _ = normalize_blocks(blocks)
        sizes = {block.id: block.token_count for block in normalized}
        keys = list(sizes)
        with self._lock:
            heads = []
            for indexed in (plain_keys(keys), labelled_keys(keys)):
                if self._strategy.name == "retrieval":
                    heads.append(keys[: self._trie.match_length(indexed)])
                else:
                    heads.append([key_block(key) for key in self._trie.best_prefix(indexed)])
        return max(sum(sizes[key] for key in head) for head in heads)

    def index_nodes(self) -> list[tuple[tuple[str, ...], int, frozenset[str]]]:
        """The predicted engine state, one entry per cached block position, pre-order:
        (block ids from the root, live requests through this node, requests ending here)."""
        with self._lock:
            return list(self._trie.iter_nodes())

    def note_restored(self, prepared: PreparedRequest, block_ids: Collection[str]) -> None:
        """These references of ``prepared`` went out as full text after all (the messages
        sent did not carry what they pointed to): count them, and in a conversation let
        later turns refer to this turn for them."""
        restored = [reference.block for reference in prepared.references if reference.block.id in set(block_ids)]
        if not restored:
            return
        with self._lock:
            self._counters.references_restored += len(restored)
            if prepared.conversation_id is not None and prepared.turn is not None:
                self._conversations.carry(prepared.conversation_id, prepared.turn, restored)

    def record_sent(self, request_id: str, block_ids: Sequence[str]) -> bool:
        """Another worker sent this request (its blocks in send order) to the engine this
        pilot models: index it as if this pilot had prepared it (what the shared log applies).
        Idempotent: a request already live keeps its place. Returns whether it was new."""
        check_request_id(request_id)
        order = list(block_ids)
        if not order or not all(isinstance(key, str) for key in order):
            raise TypeError("block_ids must be a non-empty sequence of str")
        with self._lock:
            if request_id in self._live or request_id in self._reserved:
                return False
            self._cooccurrence.record(key_blocks(order))
            if self._strategy.name == "trie":  # it learns the blocks' popularity (no ordering needed)
                self._strategy.commit(PlannedBatch([], []), [(request_id, order)])
            else:
                self._strategy.order(request_id, order)  # the paper's tree learns the request
            self._trie.insert(request_id, order)
            self._live[request_id] = next(self._ticks)
            self._orders[request_id] = tuple(order)
            self._enforce_bound()
            return True

    def live_orders(self) -> list[tuple[str, tuple[str, ...]]]:
        """(request id, block ids the engine is predicted to hold) per live request, oldest
        first: the index as a snapshot (see :meth:`record_sent`)."""
        with self._lock:
            return [(rid, tuple(self._trie.order_of(rid))) for rid in self._live]

    def live_request_ids(self) -> list[str]:
        """Ids of the requests the index holds, oldest first."""
        with self._lock:
            return list(self._live)

    def stats(self) -> PilotStats:
        """Live index size, conversations tracked, hits predicted."""
        shared = self.shared.status() if self.shared is not None else {}
        with self._lock:
            c = self._counters
            return PilotStats(
                strategy=self.strategy,
                live_requests=len(self._live),
                index_nodes=self._trie.node_count,
                conversations=len(self._conversations),
                requests_prepared=c.prepared,
                blocks_sent=c.blocks_sent,
                blocks_referenced=c.blocks_referenced,
                tokens_sent=c.tokens_sent,
                tokens_referenced=c.tokens_referenced,
                predicted_cached_blocks=c.cached_blocks,
                predicted_cached_tokens=c.cached_tokens,
                requests_evicted=c.evicted,
                engine_requests=c.engine_requests,
                engine_prompt_tokens=c.engine_prompt_tokens,
                engine_cached_tokens=c.engine_cached_tokens,
                feedback_shortened=c.feedback_shortened,
                references_restored=c.references_restored,
                **shared,
                engine_cache_write_tokens=c.cache_write_tokens,
                provider_usage=dict(c.provider_usage),
                cache_markers_placed=c.cache_markers,
                cache_plans_skipped=dict(c.plans_skipped),
                predicted_kept=self._retention.share_or(1.0),
                send_balance=self._balance.value,
            )

    def check(self) -> None:
        """Assert internal consistency (for tests): index, strategy and live ids agree."""
        with self._lock:
            self._trie.check()
            assert set(self._trie.request_ids()) == set(self._live), "index and live ids differ"

    # ---- internals -------------------------------------------------------------------------
    def _forget(self, rid: str) -> None:
        self._trie.evict(rid)
        self._strategy.forget(rid)

    def _enforce_bound(self) -> None:
        while len(self._live) > self.max_live_requests:
            oldest, _ = self._live.popitem(last=False)
            self._forget(oldest)
            self._orders.pop(oldest, None)
            self._counters.evicted += 1
        while len(self._orders) > self.max_live_requests:
            self._orders.popitem(last=False)


def _sure_or(sure: frozenset[str], shown: Chance) -> Chance:
    def chance(previous: str | None, key: str) -> float:
        return 1.0 if key in sure else shown(previous, key)

    return chance


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector during a bulk build.

    Index nodes link to their parents, so each one is tracked by the collector; building
    a big batch would otherwise trigger repeated full scans (a 12,000-request plan spent
    90% of its time there). Nothing cyclic becomes garbage meanwhile.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


_COMMIT_STEP = 64
"""Planned requests entered into the index per hold of the lock (about 2 ms)."""


def _batch_request(item: BatchItem, index: int) -> BatchRequest:
    if isinstance(item, BatchRequest):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        return BatchRequest(blocks=item[0], query=item[1])
    if isinstance(item, Mapping):
        try:
            return BatchRequest(**item)
        except TypeError as exc:
            raise TypeError(f"request #{index}: {exc}") from exc
    raise TypeError(f"request #{index}: expected BatchRequest, (blocks, query) or a mapping")


def _keep_turn_order(schedule: list[int], conversations: Sequence[str | None]) -> list[int]:
    """Let each conversation's requests take its schedule slots in input (turn) order."""
    by_conversation: dict[str, list[int]] = {}
    for index, cid in enumerate(conversations):
        if cid is not None:
            by_conversation.setdefault(cid, []).append(index)
    if not by_conversation:
        return schedule
    queues = {cid: iter(indices) for cid, indices in by_conversation.items()}
    return [index if conversations[index] is None else next(queues[conversations[index]]) for index in schedule]  # type: ignore[index]
