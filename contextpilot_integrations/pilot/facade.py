"""ContextPilot: the one object the framework adapters (and users) call.

It is a facade over parts with one job each, under one lock: the predicted engine state
(:mod:`.state`: the live :class:`~..index.prefix_trie.PrefixTrie`, the ordering strategy,
the send orders), the planner (:mod:`.planner`: prepare, plan, the send decision), what
reports from the engine or a hosted API mean for the index (:mod:`.reports`) and the
counters (:mod:`.stats`). Preparing a request is a few dictionary look-ups per block, so the
lock is held for microseconds and the same instance can serve threads and asyncio tasks
alike; a batch is planned off the lock.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.annotations import DEFAULT_TEMPLATES, Templates, render_block
from ..core.blocks import CHARS_PER_TOKEN, BlockLike, normalize_blocks
from ..core.events import Observer
from ..core.gain import FORMS, Form, TokenCounter, estimate_tokens
from ..core.prepared import PreparedRequest
from ..core.usage import check_token_count, check_usage
from ..core.validation import check_count, check_partition, check_sizes
from ..providers.plan import CachePlan
from ..providers.usage import ProviderUsage
from .group import ALONE, Group
from .planner import BatchItem, Planner
from .reports import Reports
from .settings import PilotSettings, _SettingsAttributes
from .state import EngineState, checked_ids, checked_order
from .stats import PilotStats
from .wiring import share

if TYPE_CHECKING:
    from ..shared.client import SharedIndex

__all__ = ["Binding", "ContextPilot", "sent_in_parts"]

SENT_PART = 1_024
"""Blocks of another worker's request indexed under one hold of the pilot's lock."""


class ContextPilot(_SettingsAttributes):
    """Reorders, schedules and de-duplicates context blocks for prefix-cache reuse.

    Args:
        strategy: ``"trie"`` (default), ``"paper"`` or ``"retrieval"`` (no reordering).
        templates: prompt templates for blocks, references and annotations.
        annotate_order: restate the retriever's ranking after reordered blocks (the order annotation; off
            by default: on a real model it cost answers, see the README's answer-quality table).
        max_live_requests: bound on requests tracked in the index (oldest forgotten first).
        conversation_ttl: seconds after which an idle conversation is forgotten (``None``: never).
        max_conversations: bound on conversations tracked (least recently used go first).
        request_id_prefix: prefix of generated request ids.
        shared: share this index with other workers through a broker: a URL such as
            ``"nats://127.0.0.1:4222"`` or :class:`~contextpilot_integrations.shared.SharedOptions`
            (default: the ``CONTEXTPILOT_SHARED`` environment variable; unset: not shared).
        cache_tokens: the engine's prefix-cache size in tokens, if known (a larger request is not indexed).
        plain_prompts: send a request whose reordering does not pay as without ContextPilot
            (``False``: every block labelled, the paper's form).
        order_form: how an annotated request restates the ranking: ``"positions"`` (default: by position), ``"moved"``
            (only the blocks out of place) or ``"labels"`` (the paper's: every block labelled, ranked by label).
        token_counter: the engine's tokenizer (:class:`~.engines.EngineTokenCounter`): blocks without
            ``tokens``, labels and annotation are weighed in its units (default: four characters a token, or the
            engine's own once a client or adapter given the engine has read it: :mod:`~.engines.engine_info`).
        page_tokens: the engine's page in those units (:func:`~.core.gain.page_margin`; default: unknown, or read).
        keep_top: the retriever's top block goes out in full where a model reads it best (first alone, last after
            a history: :mod:`~contextpilot_integrations.core.reading`); ``False``: wherever reuse puts it (the paper's).
        **strategy_options: passed to the strategy (e.g. ``linkage_method`` for "paper").
    """

    def __init__(
        self,
        strategy: str = "trie",
        *,
        templates: Templates | None = None,
        annotate_order: bool = False,
        max_live_requests: int = 200_000,
        conversation_ttl: float | None = 3600.0,
        max_conversations: int = 10_000,
        request_id_prefix: str = "cp",
        shared: Any = None,
        cache_tokens: int | None = None,
        plain_prompts: bool = True,
        order_form: Form = "positions",
        token_counter: TokenCounter | None = None,
        page_tokens: int | None = None,
        keep_top: bool = True,
        _group: Group = ALONE,  # internal: a router's pilots share one lock and conversation store
        **strategy_options: Any,
    ) -> None:
        if max_live_requests < 1 or order_form not in FORMS:
            raise ValueError(f"max_live_requests must be at least 1 and order_form one of {FORMS}")
        check_sizes(cache_tokens, page_tokens)
        self.max_live_requests, self._engines_read = max_live_requests, OrderedDict[str, float]()  # see wiring
        self._state = EngineState.make(strategy, max_live_requests, request_id_prefix, **strategy_options)
        self._trie, self._strategy = self._state.trie, self._state.strategy
        self._lock, self._conversations = _group.lock(), _group.store(conversation_ttl, max_conversations)
        self._planner = Planner(self._state, self._conversations, PilotSettings())  # set below, as a user sets them
        self.cache_tokens, self.plain_prompts, self.order_form = cache_tokens, plain_prompts, order_form
        self.token_counter, self.page_tokens = token_counter or estimate_tokens, page_tokens
        self.templates, self.annotate_order, self.keep_top = templates or DEFAULT_TEMPLATES, annotate_order, keep_top
        self._reports = Reports(self._state, self._conversations, self._planner.outlook)
        self.shared: SharedIndex | None = share(self, shared)
        """The shared-state client when ``shared`` (or ``CONTEXTPILOT_SHARED``) is set."""

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer(event)`` under the lock (quick, never raising) as the index changes, in order: a ``Sent``,
        ``Evicted``, ``Truncated``, ``Restored`` or ``Reset`` of :mod:`~contextpilot_integrations.core.events`."""
        with self._lock:
            self._state.observers = [*self._state.observers, observer]

    def remove_observer(self, observer: Observer) -> None:
        with self._lock:
            self._state.observers = [o for o in self._state.observers if o is not observer]

    def unshared(self) -> AbstractContextManager[None]:
        """Meanwhile, what this thread tells the pilot is not shared (an unauthenticated source)."""
        return self._state.unshared()

    @property
    def strategy(self) -> str:
        return self._strategy.name

    def prepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        request_id: str | None = None,
        partition: str | None = None,
    ) -> PreparedRequest:
        """Order one request's blocks for cache reuse and record it in the index.

        Args:
            blocks: the retrieved blocks, best first (or with ``rank`` set).
            query: the user's question.
            conversation_id: blocks already sent in this conversation become location references
                (while the turn that carried them is kept).
            kept_turns: the earlier turns (0-based) still in the history you send; ``None``: all.
            request_id: your own id for the engine; generated when omitted.
            partition: the engine's cache partition it goes to (:func:`~contextpilot_integrations.cache_partition`:
                a tenant's ``cache_salt``, a LoRA adapter); reuse is predicted only within it.

        Raises:
            InvalidBlockError, BlockTypeError: a block is empty, not text, or an id is given twice
                with different texts. Nothing is recorded then.
        """
        return self._planner.prepare(self._lock, blocks, query, conversation_id, kept_turns, request_id, partition)

    async def aprepare(
        self,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None = None,
        *,
        kept_turns: Collection[int] | None = None,
        request_id: str | None = None,
        partition: str | None = None,
    ) -> PreparedRequest:
        """Async variant of :meth:`prepare` (it never blocks on I/O, so it runs inline)."""
        return self.prepare(
            blocks, query, conversation_id, kept_turns=kept_turns, request_id=request_id, partition=partition
        )

    def bound(self, prepared: PreparedRequest) -> Binding:
        """A request this pilot prepared or planned, bound to it (the :class:`~.ports.Preparer` port)."""
        return Binding(self, prepared)

    def plan(
        self, requests: Iterable[BatchItem], *, progress: bool = False, in_order: bool = True
    ) -> list[PreparedRequest]:
        """Offline mode: order every request of a batch and schedule the batch, off the lock.

        Returns the prepared requests in send order, each with its position in the input as ``batch_index``;
        a conversation's turns keep their order. ``in_order``: the caller sends them in that order
        (``False`` for concurrent callers; see :meth:`.Planner.plan`).

        Raises:
            InvalidBlockError, BlockTypeError, DuplicateRequestError: for any bad request
                (naming its index); nothing is recorded then: a batch is all or nothing.
        """
        return self._planner.plan(self._lock, requests, progress=progress, in_order=in_order)

    async def aplan(
        self, requests: Iterable[BatchItem], *, progress: bool = False, in_order: bool = True
    ) -> list[PreparedRequest]:
        """Async variant of :meth:`plan`, run in a worker thread."""
        return await asyncio.to_thread(self.plan, list(requests), progress=progress, in_order=in_order)

    def evict(self, request_ids: Iterable[str]) -> int:
        """The engine no longer holds these requests' prefixes; unknown ids are ignored.
        Returns how many of the ids were live."""
        ids = checked_ids(request_ids)
        with self._lock:
            return self._state.evict(ids, heard=True)

    def truncate(self, request_id: str, cached_blocks: int) -> bool:
        """The engine now holds only the first ``cached_blocks`` blocks of this request (0: none;
        its order is remembered, so :meth:`restore` can bring it back). Returns whether it was live."""
        check_count("cached_blocks", cached_blocks)
        with self._lock:
            return self._state.truncate(request_id, cached_blocks, heard=True)

    def restore(self, request_id: str, cached_blocks: int | None = None) -> bool:
        """The engine holds (again) the first ``cached_blocks`` blocks (``None``: all) of this request (eviction
        events can overtake the store events of the same blocks). Whether its order was known."""
        if cached_blocks is not None:
            check_count("cached_blocks", cached_blocks)
        with self._lock:
            return self._state.restore(request_id, cached_blocks)

    def reset(self) -> None:
        """The engine holds nothing any more (restart, ``/flush_cache``)."""
        with self._lock:
            self._state.reset()

    def adopt(self, prepared: PreparedRequest, *, fresh_id: bool = False) -> PreparedRequest:
        """A request prepared elsewhere is sent to this pilot's engine after all (failover), or again after a
        failed call was discarded (a retry): record its send order here. ``fresh_id``: a new request id (a
        retry must not reuse the failed call's). Returns it as this index predicts it."""
        with self._lock:
            return self._state.adopt(prepared, fresh_id)

    def record_sent(self, request_id: str, block_ids: Sequence[str]) -> bool:
        """Another worker sent this request (its index keys in send order) to this pilot's engine: index it
        as if prepared here (a long one in parts: :func:`sent_in_parts`). Idempotent. Whether it was new."""
        return sent_in_parts(self._lock, self._reports, request_id, checked_order(request_id, block_ids))

    def record_usage(
        self,
        prepared: PreparedRequest,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        *,
        cache_write_tokens: int | None = None,
    ) -> None:
        """Add the engine's token accounting for a served request to the statistics (``cache_write_tokens``: what
        a hosted API wrote to its cache). TypeError or ValueError, recording nothing, for a bad count."""
        check_usage(prompt_tokens, cached_tokens)
        if cache_write_tokens is not None:
            check_token_count("cache_write_tokens", cache_write_tokens)
        with self._lock:
            self._reports.record_usage(prepared, prompt_tokens, cached_tokens, cache_write_tokens, self.cache_tokens)

    def record_provider_usage(self, prepared: PreparedRequest, usage: ProviderUsage) -> None:
        """Add a hosted API's usage (:func:`~.providers.read_provider_usage`) as :meth:`record_usage` does, and by
        provider too (a usage without a provider counts under ``"unknown"``)."""
        if not isinstance(usage, ProviderUsage):
            raise TypeError(f"usage must be a ProviderUsage, got {type(usage).__name__}")
        with self._lock:
            self.record_usage(
                prepared, usage.prompt_tokens, usage.cache_read_tokens, cache_write_tokens=usage.cache_write_tokens
            )
            self._reports.count_provider(usage)

    def note_cache_plan(self, plan: CachePlan) -> None:
        """Count a request's planned cache markers, or why it got none."""
        with self._lock:
            self._reports.counters.count_cache_plan(plan)

    def observe_cached(self, prepared: PreparedRequest, cached_blocks: int) -> int:
        """The engine served only the first ``cached_blocks`` blocks of this request from its cache (reports of
        engines without KV events: :meth:`.Reports.observe_cached`). Returns how many live requests were shortened."""
        check_count("cached_blocks", cached_blocks)
        with self._lock:
            return self._reports.observe_cached(prepared, cached_blocks)

    def repartition(self, prepared: PreparedRequest, partition: str | None) -> PreparedRequest:
        """It goes out in cache ``partition`` after all (its call's body names one): indexed there instead."""
        check_partition(partition)
        with self._lock:
            return prepared if partition == prepared.partition else self._state.move(prepared, partition)

    def discard(self, prepared: PreparedRequest) -> None:
        """It never reached the engine: forget it in the index, and its turn (later turns resend its blocks)."""
        with self._lock:
            self._reports.discard(prepared)

    def note_restored(self, prepared: PreparedRequest, block_ids: Collection[str]) -> None:
        """These references went out in full after all (not in the messages): counted; later turns may refer here."""
        with self._lock:
            self._reports.note_restored(prepared, block_ids)

    def conversation_usage(self, conversation_id: str) -> tuple[int, int, int]:
        """(requests, prompt tokens, cached tokens) the engine reported for a conversation."""
        with self._lock:
            return self._reports.conversation_usage(conversation_id)

    def end_conversation(self, conversation_id: str) -> bool:
        """Forget a conversation's seen blocks; returns whether it was tracked."""
        with self._lock:
            return self._conversations.end(conversation_id)

    def shared_depths(self, prepared: PreparedRequest) -> tuple[int, ...]:
        """Prefix lengths (in blocks) of this request's send order where other live requests' shared part ends:
        where a hosted API's cache marker pays. Not held (a later turn): its predicted cached blocks."""
        with self._lock:
            return self._state.shared_depths(prepared)

    def predicted_cached_blocks(self, block_ids: Sequence[str], partition: str | None = None) -> int:
        """Leading blocks of this send order predicted held by the engine (in ``partition``; plain or labelled)."""
        check_partition(partition)
        with self._lock:
            return self._state.predicted_cached_blocks(list(block_ids), partition)

    def reusable_tokens(self, blocks: Iterable[BlockLike], partition: str | None = None) -> int:
        """Tokens of these blocks the engine could serve (in ``partition``) if this pilot prepared them now: the
        longest live prefix they can follow (plain or labelled). What a router compares across engines."""
        sizes = {block.id: block.token_count for block in normalize_blocks(blocks)[0]}
        check_partition(partition)
        with self._lock:
            return self._state.reusable_tokens(sizes, partition)

    def index_nodes(self) -> list[tuple[tuple[str, ...], int, frozenset[str]]]:
        """The predicted engine state pre-order: (index keys from the root, live requests through, ending here)."""
        with self._lock:
            return list(self._trie.iter_nodes())

    def live_orders(self) -> list[tuple[str, tuple[str, ...]]]:
        """(request id, block ids the engine is predicted to hold) per live request, oldest first."""
        with self._lock:
            return self._state.live_orders()

    def live_request_ids(self) -> list[str]:
        """Ids of the requests the index holds, oldest first."""
        with self._lock:
            return list(self._state.live)

    def stats(self) -> PilotStats:
        """Live index size, conversations tracked, hits predicted."""
        shared = self.shared.status() if self.shared is not None else {}
        with self._lock:
            return self._reports.stats(self.strategy, shared)

    def check(self) -> None:
        """Assert internal consistency (for tests): index, strategy and live ids agree."""
        with self._lock:
            self._state.check()


@dataclass(frozen=True, slots=True)
class Binding:
    """The prepared request behind one model call, and the pilot its engine report goes to."""

    pilot: ContextPilot
    prepared: PreparedRequest
    before_tokens: int = 0
    """Our estimate of the prompt tokens before its first block (system prompt, history)."""

    def located(self, text: str) -> Binding:
        """This binding with ``before_tokens`` estimated from the outgoing prompt ``text``."""
        prepared = self.prepared
        first = (
            text.find(render_block(prepared.blocks[0], prepared.templates, prepared.labels)) if prepared.blocks else -1
        )
        return Binding(self.pilot, prepared, max(first, 0) // CHARS_PER_TOKEN)


def sent_in_parts(lock: Any, reports: Reports, request_id: str, order: list[str]) -> bool:
    """Index another worker's request :data:`SENT_PART` blocks at a time, the pilot's lock let
    go between parts, so a ``prepare`` never waits for all of a long one (it is live from the
    first part; evicted, truncated or reset meanwhile, the rest is dropped). Whether it was new."""
    with lock:
        end = reports.sent_elsewhere(request_id, order, slice(0, SENT_PART))
    new = end is not None
    for start in range(SENT_PART, len(order) if new else 0, SENT_PART):
        time.sleep(0)  # a prepare waiting for the lock takes it now
        with lock:
            end = reports.sent_more(request_id, order, slice(start, start + SENT_PART), end)
        if end is None:
            break
    return new
