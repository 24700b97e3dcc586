"""Deciding what to send: prepare one request, plan a batch, and the send that pays best.

The :class:`Planner` orders a request's blocks for the strategy, weighs the send
(:mod:`contextpilot_integrations.core.gain`: labels, reordering, the annotation against the reuse they buy) and records
the result in the :class:`~.state.EngineState`. :meth:`Planner.prepare_locked` runs under
the pilot's lock (a few dictionary look-ups per block); :meth:`Planner.plan` plans a whole
batch off the lock and takes it only to reserve the ids and to enter the requests in steps.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from ..core.annotations import Templates
from ..core.blocks import Block, BlockLike, normalize_blocks
from ..core.conversations import ConversationStore, decide_turn, keep_in_full
from ..core.gain import (
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
    key_blocks,
    label_tokens,
    labelled_keys,
    plain_keys,
)
from ..core.prepared import PreparedRequest, Reference, make_reference
from ..core.reading import top_first, top_last
from ..core.units import TokenUnits
from ..core.validation import (
    check_conversation_id,
    check_kept_turns,
    check_partition,
    check_query,
    check_request_id,
)
from ..errors import DuplicateRequestError
from ..index.strategies import LiveView, plan_under_first
from .settings import PilotSettings
from .state import EngineState

__all__ = ["BatchItem", "BatchRequest", "Outlook", "Planner", "batch_request"]


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """One request of a batch for :meth:`ContextPilot.plan`."""

    blocks: Sequence[BlockLike]
    query: str
    conversation_id: str | None = None
    kept_turns: Collection[int] | None = None
    request_id: str | None = None
    partition: str | None = None


BatchItem = BatchRequest | tuple[Sequence[BlockLike], str] | Mapping[str, Any]
Lock = contextlib.AbstractContextManager[Any]
"""The pilot's lock, as the planner takes it around what must not interleave."""


@dataclass(slots=True)
class Outlook:
    """What the traffic has shown so far, which the send decision weighs."""

    retention: Retention = field(default_factory=Retention)  # how much of the predicted reuse the engine delivers
    cooccurrence: Cooccurrence = field(default_factory=Cooccurrence)  # what this traffic shows about later reuse
    balance: Balance = field(default_factory=Balance)  # what the sends bought, less what they cost


class Planner:
    """Prepares requests and plans batches against one :class:`~.state.EngineState`."""

    def __init__(self, state: EngineState, conversations: ConversationStore, settings: PilotSettings) -> None:
        self.state = state
        self.conversations = conversations
        self.settings = settings
        """The pilot's settings, read at each decision: a pilot's attribute set later swaps in new ones."""
        self.outlook = Outlook()
        self.counters = state.counters
        self._units: TokenUnits | None = None

    @property
    def templates(self) -> Templates:
        return self.settings.templates

    @property
    def annotate_order(self) -> bool:
        return self.settings.annotate_order

    @property
    def plain_prompts(self) -> bool:
        return self.settings.plain_prompts

    @property
    def order_form(self) -> Form:
        return self.settings.order_form

    @property
    def units(self) -> TokenUnits | None:
        """The pilot's token counter with a memory per text (None: the default estimate)."""
        counter = self.settings.token_counter
        if counter is estimate_tokens:
            return None
        units = self._units
        if units is None or units.counter is not counter:
            self._units = units = TokenUnits(counter)
        return units

    @property
    def token_counter(self) -> TokenCounter:
        """What the decisions count labels and the annotation with, under the lock: the
        estimate, or the counter's remembered counts (:meth:`.TokenUnits.known`)."""
        units = self.units
        return estimate_tokens if units is None else units.known

    def counted(self, blocks: list[Block], query: str, conversation_id: str | None) -> list[Block]:
        """Off the lock: blocks without a given count counted with the pilot's counter, and
        the pieces their decision weighs (question, annotation items; labels where they may
        be weighed) with them. A piece missed here is estimated under the lock
        (:meth:`.TokenUnits.known`)."""
        units = self.units
        if units is None:
            return blocks
        blocks = units.blocks(blocks)
        labels = self.order_form == "labels" or not self.plain_prompts
        units.request(blocks, query, self.templates, labels, quotes=conversation_id is not None and self.plain_prompts)
        return blocks

    @property
    def cache_tokens(self) -> int | None:
        return self.settings.cache_tokens

    def prepare(
        self,
        lock: Lock,
        blocks: Iterable[BlockLike],
        query: str,
        conversation_id: str | None,
        kept_turns: Collection[int] | None,
        request_id: str | None,
        partition: str | None = None,
    ) -> PreparedRequest:
        """Check one request, then prepare it under ``lock`` (nothing recorded when it is refused);
        the time it took goes to the latency histogram (``PilotStats.prepare_seconds_buckets``)."""
        started = time.perf_counter()
        normalized, merged = normalize_blocks(blocks)
        check_query(query)
        check_conversation_id(conversation_id)
        check_partition(partition)
        kept = check_kept_turns(kept_turns)
        normalized = self.counted(normalized, query, conversation_id)
        with lock:
            prepared = self.prepare_locked(
                normalized, merged, query, conversation_id, kept, request_id, None, partition=partition
            )
            self.counters.count_prepare_seconds(time.perf_counter() - started)
            return prepared

    def prepare_locked(
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
        partition: str | None = None,
    ) -> PreparedRequest:
        # decide everything first; record only once nothing can raise any more
        rid = self.state.new_request_id(request_id)
        by_id = {block.id: block for block in blocks}
        turn: int | None = None
        fresh = blocks
        references: tuple[Reference, ...] = ()
        dedup = None
        if conversation_id is not None:
            question = self.templates.question.format(query=query)  # a quote must not name it either
            dedup = self.conversations.split(conversation_id, blocks, kept_turns, (question,), self.templates.separator)
            if self.settings.keep_top and blocks:
                dedup = keep_in_full(dedup, blocks[0].id)
            if dedup.turn and self.plain_prompts:  # references only where they cost less
                dedup = decide_turn(dedup, blocks, self.templates, self.token_counter)
            turn, fresh = dedup.turn, dedup.fresh
            quotes = dedup.quotes
            references = tuple(
                [make_reference(b, t, self.templates, labelled, quotes.get(b.id)) for b, t, labelled in dedup.repeated]
            )
        cached_blocks = cached_tokens = 0
        labels, read_top_last = True, False
        if turn and (kept_turns is None or kept_turns):
            # later turns start with this conversation's own history, which no other
            # request shares: keep the retriever's order and leave the index alone (a turn
            # sent without history starts like any request: indexed, as a first turn is)
            sent = fresh
            labels = dedup is None or dedup.labelled
            # after a whole history, a turn that refers back reads its top block best last; a turn
            # that refers to nothing is the prompt without ContextPilot, and after a window that
            # left the first turn, a turn will one day lead a prompt itself: the retriever's order
            whole = kept_turns is None or 0 in kept_turns
            read_top_last = self.settings.keep_top and not labels and whole and bool(references)
            if read_top_last:
                sent = list(map(by_id.__getitem__, top_last([block.id for block in sent], blocks[0].id)))
            if planned_order is not None:
                self.state.strategy.forget(rid)
        else:
            keys = list(by_id) if fresh is blocks else [block.id for block in fresh]
            top = keys[0] if self.settings.keep_top and keys else None  # first, where a model reads best
            if planned_order is None:
                first = self.strategy_keys([top], partition)[0] if top is not None else None
                planned_order = key_blocks(self.state.strategy.order(rid, self.strategy_keys(keys, partition), first))
            if top is not None:
                planned_order = top_first(planned_order, top)
            bets = conversation_id is None or not self.plain_prompts
            choice = self.worth_it(planned_order, keys, blocks, by_id, query, chance, concurrent, bets, partition)
            order, labels = choice.order, choice.labels
            if dedup is not None:
                dedup = replace(dedup, labelled=labels)
            self.outlook.cooccurrence.record(order)
            self.outlook.balance.add(choice.bought)
            sent = list(map(by_id.__getitem__, order))
            indexed = labelled_keys(order, partition) if labels else plain_keys(order, partition)
            if choice.cached:
                cached_blocks = self.state.record(rid, indexed, sent)
            else:  # larger than the engine's cache: it reuses, but leaves nothing to predict
                cached_blocks = self.state.trie.match_length(indexed)
                self.state.strategy.forget(rid)
        sizes = [block.token_count for block in sent]
        if cached_blocks:
            cached_tokens = sum(sizes[:cached_blocks])
        if dedup is not None:
            self.conversations.record(dedup)
        self.counters.count_prepared(sizes, references, cached_blocks, cached_tokens, partition)
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
            top_last=read_top_last,
            partition=partition,
        )
        return prepared

    @property
    def one_text(self) -> bool:
        """Whether a block is its text alone whichever way its request goes out (else the
        paper's form: labelled)."""
        return self.plain_prompts and self.order_form != "labels"

    def strategy_keys(self, keys: list[str], partition: str | None = None) -> list[str]:
        """The index keys the strategy orders by (in the request's cache partition): the text
        alone (one text per block) unless the blocks will carry labels (the paper's form)."""
        return plain_keys(keys, partition) if self.one_text else labelled_keys(keys, partition)

    def worth_it(
        self,
        order: list[str],
        keys: list[str],
        ranking: list[Block],
        by_id: dict[str, Block],
        query: str,
        chance: Chance | None,
        concurrent: bool = False,
        bets: bool = True,
        partition: str | None = None,
    ) -> Choice:
        """The send that pays best for this request (:mod:`.gain`). ``chance``: that a later
        request carries a block after another (default: what this traffic showed, bet only
        from what earlier sends bought; given for a batch sent in order: partners are sure).
        ``concurrent``: part of a burst whose callers send at once: nothing is bet on before
        the engine has served a prediction (the requests it would follow are still in
        flight, and their order at the engine is nobody's). ``bets``: False for a
        conversation's first turn, reordered only where that pays now (its later turns
        follow their own history, which the index does not see)."""
        trie = self.state.trie
        one_text = self.one_text
        count = self.token_counter
        annotation = 0
        if self.annotate_order and order != keys:
            form: Form = self.order_form if one_text else "labels"
            # in the positions form any permutation has the same annotation: no need to map the order
            order_blocks = ranking if form == "positions" else [by_id[key] for key in order]
            annotation = annotation_tokens(ranking, self.templates, order_blocks, form, count)
        budget = math.inf if chance is not None and not concurrent else self.outlook.balance.budget
        as_is = partition is None and "\x00" not in "".join(keys)  # ids are their own index keys (the usual case)

        def matched(order: Sequence[str], labelled: bool) -> int:
            if labelled:
                return trie.match_length(labelled_keys(order, partition))
            return trie.match_length(order if as_is else plain_keys(order, partition))

        return choose_order(
            order,
            keys,
            {key: by_id[key].token_count for key in keys},
            matched=matched,
            chance=chance or self.outlook.cooccurrence,
            annotation_cost=annotation,
            label_cost=0 if one_text else label_tokens([by_id[key] for key in keys], self.templates, count),
            form=self.order_form,
            cache_tokens=self.cache_tokens,
            page_tokens=self.settings.page_tokens or 1,
            plain_ok=self.plain_prompts,
            kept=self.outlook.retention.share_or(0.0 if concurrent else 1.0),
            budget=budget if bets else 0.0,
            retrieval_chance=self.outlook.cooccurrence,
            prompt_tokens=count(self.templates.question.format(query=query)) if self.cache_tokens else 0,
            follow_cost=annotation if chance is not None and not concurrent else 0,
        )

    def plan(
        self, lock: Lock, requests: Iterable[BatchItem], *, progress: bool, in_order: bool
    ) -> list[PreparedRequest]:
        """Offline mode: order every request of a batch and schedule the batch.

        Returns the prepared requests in send order; each keeps its own query and its
        position in the input as ``batch_index``. Turns of one conversation keep their
        relative order (they take the schedule slots of that conversation, in turn order).

        ``in_order``: the caller sends them in that order, so a block that another request
        of the batch carries is sure to be reused (:mod:`.gain`). ``False`` for concurrent
        callers (:class:`~.batching.MicroBatcher`), whose requests reach the engine in
        whatever order their threads get there: on an engine that keeps only its last
        prompt, a partner reused on paper is then often lost.

        The batch is planned outside the lock, so concurrent :meth:`prepare` calls are not
        held up by a long plan; the planned requests then enter the index in small steps.

        Raises:
            InvalidBlockError, BlockTypeError, DuplicateRequestError: for any bad request
                (naming its index); nothing is recorded then: a batch is all or nothing.
        """
        items = [batch_request(item, index) for index, item in enumerate(requests)]
        normalized = []
        kept_turns = []
        for index, item in enumerate(items):
            try:
                normalized.append(normalize_blocks(item.blocks))
                check_query(item.query)
                check_conversation_id(item.conversation_id)
                check_partition(item.partition)
                kept_turns.append(check_kept_turns(item.kept_turns))
                if item.request_id is not None:
                    check_request_id(item.request_id)
            except (ValueError, TypeError) as exc:
                raise type(exc)(f"request #{index}: {exc}") from exc
        normalized = [
            (self.counted(blocks, item.query, item.conversation_id), merged)
            for item, (blocks, merged) in zip(items, normalized, strict=True)
        ]
        with lock:
            ids = []
            for index, item in enumerate(items):
                try:
                    ids.append(self.state.new_request_id(item.request_id))
                except DuplicateRequestError as exc:
                    raise DuplicateRequestError(f"request #{index}: {exc}") from exc
            if len(set(ids)) != len(ids):
                raise DuplicateRequestError("request ids repeat within the batch")
            self.state.reserved.update(ids)  # no concurrent prepare can take them meanwhile
        try:
            batch = [(rid, [block.id for block in blocks]) for rid, (blocks, _) in zip(ids, normalized, strict=True)]
            partitions = [item.partition for item in items]
            followed = [(rid, self.strategy_keys(keys, p)) for (rid, keys), p in zip(batch, partitions, strict=True)]
            tokens = {
                key: block.token_count
                for (_, keys), (blocks, _) in zip(followed, normalized, strict=True)
                for key, block in zip(keys, blocks, strict=True)
            }
            live = self.live_view(lock, followed)
            with _gc_paused():  # each request's top block first (keep_top): planned under it
                if self.settings.keep_top:
                    planned, parts = plan_under_first(self.state.strategy, followed, tokens, live)
                else:
                    planned = self.state.strategy.plan_live(followed, tokens, live)
                    parts = [(planned, followed)]
            orders = [key_blocks(order) for order in planned.orders]
            schedule = _keep_turn_order(planned.schedule, [item.conversation_id for item in items])
            sizes = [sum(block.token_count for block in blocks) for blocks, _ in normalized]
            chances: dict[int, Chance | None] = {}
            prepared: list[PreparedRequest] = []
            steps = tqdm(total=len(schedule), desc="planning", unit="req", disable=not progress)
            with steps:
                for start in range(0, max(len(schedule), 1), _COMMIT_STEP):
                    with lock:
                        if start == 0:
                            chances = self.batch_chances(batch, schedule, orders, sizes, in_order, partitions)
                            for part, part_batch in parts:
                                self.state.strategy.commit(part, part_batch)
                        for index in schedule[start : start + _COMMIT_STEP]:
                            item, (blocks, merged) = items[index], normalized[index]
                            self.state.reserved.discard(ids[index])
                            prepared.append(
                                self.prepare_locked(
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
                                    item.partition,
                                )
                            )
                    steps.update(min(_COMMIT_STEP, len(schedule) - start))
            return prepared
        finally:
            with lock:
                self.state.reserved.difference_update(ids)

    def live_view(self, lock: Lock, followed: Sequence[tuple[str, list[str]]]) -> LiveView | None:
        """What a batch plan may follow from earlier traffic (:meth:`.Strategy.live_view`),
        read under ``lock`` a few requests at a time: each read sees the index whole, and a
        big batch does not hold up concurrent :meth:`prepare` calls."""
        heads: list[tuple[str, ...]] = []
        popularity: dict[str, int] = {}
        seen = heard = False
        for start in range(0, len(followed), _COMMIT_STEP):
            part = followed[start : start + _COMMIT_STEP]
            with lock:
                view = self.state.strategy.live_view(part, self.settings.keep_top)
                heard = self.state.hears_evictions or self.outlook.retention.tested
            if view is None:  # nothing to follow (yet)
                heads += [()] * len(part)
                continue
            seen = True
            heads += view.heads
            popularity.update(view.popularity)
        return LiveView(heads, popularity, heard) if seen else None

    def batch_chances(
        self,
        batch: Sequence[tuple[str, list[str]]],
        schedule: Sequence[int],
        orders: Sequence[list[str]],
        sizes: Sequence[int],
        in_order: bool,
        partitions: Sequence[str | None] = (),
    ) -> dict[int, Chance | None]:
        """Per request of a batch about to be counted: that a later request carries a block.
        Sent in order, sure for a block a later request of the batch carries while the
        cache still holds it (the tokens sent in between fit, when the cache size is known);
        else what this traffic showed (a partner in another cache partition reuses nothing).
        ``None`` (bets paid from the balance only) for a concurrent burst: a partner's
        prefix may not be computed before it is needed."""
        if not in_order:
            return dict.fromkeys(range(len(batch)))
        room = self.cache_tokens
        shown = self.outlook.cooccurrence.chance
        chances: dict[int, Chance | None] = {}
        sent_after = 0  # tokens of the requests after the current one (scanning backwards)
        next_at: dict[tuple[str | None, str], int] = {}  # block -> tokens from the next request carrying it to the end
        for index in reversed(schedule):
            partition = partitions[index] if partitions else None
            sure = frozenset(
                key
                for key in orders[index]
                if (at := next_at.get((partition, key))) is not None
                and (room is None or sent_after - at + sizes[index] <= room)
            )
            chances[index] = _sure_or(sure, shown)
            sent_after += sizes[index]
            for key in orders[index]:
                next_at[partition, key] = sent_after
        return chances


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


def batch_request(item: BatchItem, index: int) -> BatchRequest:
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
