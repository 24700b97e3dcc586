"""Replay a retrieval trace through ContextPilot and the cache simulator.

This answers "how much would this save on my traffic?". Every prompt is served whole by
:class:`~.simulate.RadixCacheSimulator`, and every prompt token counts: the system prompt,
the chat history, the blocks, the location references, the order annotation and the
question. Three modes:

- ``offline``: the whole batch planned and scheduled, then sent in the schedule's order;
- ``online``: one request at a time, in arrival order (``file``; ``interleave``, which
  round-robins sessions; or ``shuffle``), with what the engine really tells back
  (``feedback``: ``exact`` block-level eviction notices, ``request``-level ones as SGLang's
  events give without block boundaries, ``usage``: only each request's own cached-token
  count, as every OpenAI-compatible server reports it, or ``none``);
- ``chat``: conversations interleaved round-robin by turn (concurrent sessions sharing one
  cache). Turn t sends the system prompt, every earlier turn it keeps (that turn's prompt
  as sent, and an answer of ``answer_tokens``, cached after generation as SGLang does),
  then its own blocks, references, annotation and question.

Results compare strategies on the same trace and capacity. For chat, compare prefill
tokens (prompt tokens not served from the cache) with the baseline that sends every block
in retrieval order: hit ratios are not comparable once de-duplication shrinks prompts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, TypeVar

from ..core.annotations import DEFAULT_TEMPLATES, render_order
from ..core.blocks import Block
from ..core.gain import label_tokens
from ..core.prepared import PreparedRequest, Reference
from ..pilot import BatchRequest, ContextPilot
from .simulate import BlockSpec, RadixCacheSimulator, SimulatedRequest
from .trace import TraceRequest, estimate_tokens, turns_in_order

__all__ = [
    "ARRIVALS",
    "FEEDBACKS",
    "MODES",
    "PromptShape",
    "ReplayResult",
    "arrival_order",
    "prompt_units",
    "replay",
    "replay_routed",
    "reuse_bound_of_prompts",
    "serve_orders",
]

Mode = Literal["offline", "online", "chat"]
Arrival = Literal["file", "interleave", "shuffle"]
Feedback = Literal["exact", "request", "usage", "none"]
MODES: tuple[Mode, ...] = ("offline", "online", "chat")
ARRIVALS: tuple[Arrival, ...] = ("file", "interleave", "shuffle")
FEEDBACKS: tuple[Feedback, ...] = ("exact", "request", "usage", "none")
SYSTEM_PROMPT = "Answer the question using the context documents."


@dataclass(frozen=True, slots=True)
class PromptShape:
    """Token counts of the prompt parts a trace does not give."""

    system_tokens: int = estimate_tokens(SYSTEM_PROMPT)
    """The system prompt, shared by every request (0: none)."""
    question_tokens: int = 16
    """A question, for lines without ``question`` text (otherwise estimated from it)."""
    answer_tokens: int = 64
    """Each answer in a chat, cached after generation and resent in later turns."""
    annotate: bool = False
    """Whether ContextPilot restates the ranking of a reordered request (``annotate_order``;
    off by default, as in the library)."""
    questions: bool = True
    """Whether prompts carry the question (off only to measure block reuse alone)."""
    labels: bool = True
    """Whether blocks carry their labels (``[545] text``): ContextPilot's prompts do; the
    baseline, the prompt a user sends without ContextPilot, does not."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """One strategy, mode and capacity on one trace; token counts over whole prompts."""

    strategy: str
    mode: str
    capacity_tokens: int | None
    requests: int
    prompt_tokens: int
    """Every prompt token sent: system, history, blocks, references, annotation, question."""
    cached_tokens: int
    """Prompt tokens served from the cache."""
    block_tokens: int
    """Tokens of the blocks sent in full."""
    reference_tokens: int
    max_prompt_tokens: int
    pilot_seconds: float
    deduplicate: bool = True
    oversized_requests: int = 0
    """Prompts larger than the cache: never cached (nothing can be reused from them)."""
    held_tokens: int = 0
    """Tokens the cache held at the end (with no capacity: everything ever cached)."""
    routing: str | None = None
    """Across several engines (:func:`replay_routed`): how requests were routed."""
    requests_per_target: tuple[int, ...] = ()
    mean_latency: float | None = None
    """Modelled time to first token (queueing plus prefill), in prefill-token units."""
    p90_latency: float | None = None

    @property
    def max_load_share(self) -> float:
        """The busiest engine's requests over the mean (1.0: even; 1.0 for one engine)."""
        counts = self.requests_per_target
        return max(counts) * len(counts) / sum(counts) if counts and sum(counts) else 1.0

    @property
    def hit_ratio(self) -> float:
        """Cached prompt tokens over all prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the engine had to compute."""
        return self.prompt_tokens - self.cached_tokens


@dataclass
class _Tally:
    prompt: int = 0
    cached: int = 0
    blocks: int = 0
    references: int = 0
    longest: int = 0
    oversized: int = 0
    seconds: float = 0.0

    def add(self, served: SimulatedRequest, blocks: int, references: int) -> None:
        self.prompt += served.block_tokens
        self.cached += served.hit_tokens
        self.blocks += blocks
        self.references += references
        self.longest = max(self.longest, served.block_tokens)
        self.oversized += served.oversized


class _Blocks:
    """One :class:`Block` per id (a long trace does not build millions of them)."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, int], Block] = {}

    def of(self, request: TraceRequest) -> list[Block]:
        out = []
        for block_id, tokens in zip(request.blocks, request.token_counts(), strict=True):
            block = self._blocks.get((block_id, tokens))
            if block is None:
                block = self._blocks[(block_id, tokens)] = Block(id=block_id, text=f"[{block_id}]", tokens=tokens)
            out.append(block)
        return out


def _unit(kind: str, request_id: str, tokens: int, key: Hashable = None) -> BlockSpec:
    """A request-specific part of a prompt: never shared with another request."""
    return ((kind, request_id, key), tokens)


def prompt_units(
    prepared: PreparedRequest, request: TraceRequest, shape: PromptShape
) -> tuple[list[BlockSpec], int, int]:
    """A request's own prompt as cache units: blocks (shared by id), then its references,
    annotation and question (its own). Returns (units, block tokens, reference tokens)."""
    rid = prepared.request_id
    labelled = shape.labels and prepared.labels
    units: list[BlockSpec] = []
    block_tokens = reference_tokens = 0
    for part in prepared.sequence:  # as read: references in their blocks' places, or after them
        if isinstance(part, Reference):
            tokens = estimate_tokens(part.text)
            reference_tokens += tokens
            units.append(_unit("reference", rid, tokens, part.block.id))
        elif labelled:
            tokens = part.token_count + label_tokens([part], prepared.templates)
            block_tokens += tokens
            units.append((("block", part.id), tokens))
        else:  # as sent without ContextPilot: the text alone (not the same prefix as a labelled block)
            block_tokens += part.token_count
            units.append((("plain", part.id), part.token_count))
    if shape.annotate and prepared.order_annotation:  # none when the retriever's order is kept
        units.append(_unit("annotation", rid, estimate_tokens(prepared.order_annotation)))
    if shape.questions:
        question = estimate_tokens(request.question) if request.question else shape.question_tokens
        units.append(_unit("question", rid, question))
    return units, block_tokens, reference_tokens


def _system(shape: PromptShape) -> list[BlockSpec]:
    return [(("system",), shape.system_tokens)] if shape.system_tokens > 0 else []


def arrival_order(trace: Sequence[TraceRequest], arrival: Arrival, seed: int = 0) -> list[int]:
    """Indices of the trace in arrival order: ``file``; ``interleave`` (round-robin over
    sessions, conversations taken as sessions; lines without either keep file order);
    ``shuffle`` (seeded)."""
    if arrival == "file":
        return list(range(len(trace)))
    if arrival == "shuffle":
        order = list(range(len(trace)))
        random.Random(seed).shuffle(order)
        return order
    if arrival != "interleave":
        raise ValueError(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    queues: dict[str, list[int]] = {}
    for index, request in enumerate(trace):
        key = request.session or request.conversation
        queues.setdefault(key if key is not None else f"\x00{index}", []).append(index)
    if all(len(queue) == 1 for queue in queues.values()):
        return list(range(len(trace)))
    return _round_robin(list(queues.values()))


T = TypeVar("T")


def _round_robin(queues: list[list[T]]) -> list[T]:
    """The first of every queue, then the second of every queue, and so on."""
    order: list[T] = []
    depth = 0
    while True:
        row = [queue[depth] for queue in queues if depth < len(queue)]
        if not row:
            return order
        order.extend(row)
        depth += 1


def _feedback(
    pilot: ContextPilot,
    served: SimulatedRequest,
    feedback: Feedback,
    offsets: dict[str, tuple[int, int]],
    prepared: PreparedRequest,
) -> None:
    """Tell the pilot what the engine evicted, as much as ``feedback`` allows.

    Eviction notices count the units of a request's path; ``offsets`` gives each indexed
    request's (units before its blocks, block count). ``usage`` sees no notices, only how
    much of this request the engine served from its cache.
    """
    if feedback == "none":
        return
    if served.oversized and feedback != "usage" and prepared.request_id in offsets:
        # the engine stored nothing of it: no store events came (the events say so), so the
        # index must not predict its blocks for later requests
        pilot.evict([prepared.request_id])
        offsets.pop(prepared.request_id, None)
    if feedback == "usage":
        layout = offsets.get(prepared.request_id)
        if layout is not None:
            before, blocks = layout
            pilot.observe_cached(prepared, max(0, min(blocks, served.hit_blocks - before)))
        return
    for request_id, cached_units in served.evicted:
        layout = offsets.get(request_id)
        if layout is None:
            continue
        before, blocks = layout
        if feedback == "request":  # no block boundaries: any loss drops the whole request
            pilot.evict([request_id])
            offsets.pop(request_id, None)
        else:
            pilot.truncate(request_id, max(0, min(blocks, cached_units - before)))


def replay(
    trace: Sequence[TraceRequest],
    strategy: str,
    mode: Mode,
    capacity_tokens: int | None,
    *,
    arrival: Arrival = "interleave",
    feedback: Feedback = "request",
    shape: PromptShape | None = None,
    history_turns: int | None = None,
    deduplicate: bool = True,
    plan_out: list[dict[str, object]] | None = None,
    seed: int = 0,
    on_request: Callable[[], object] | None = None,
    keep_top: bool = True,
    window: int = 1,
) -> ReplayResult:
    """Run a trace through a fresh :class:`ContextPilot` and a fresh simulated cache.

    Args:
        mode: ``"offline"``, ``"online"`` or ``"chat"`` (see the module docstring).
        arrival: online order of arrival (chat always interleaves conversations by turn).
        feedback: what the engine tells the pilot about evictions (online and chat).
        history_turns: chat: earlier turns each prompt keeps (``None``: all; a line's own
            ``history_turns`` wins).
        deduplicate: chat: blocks an earlier kept turn sent become location references
            (``False``: every block is sent again, the baseline).
        plan_out: receives each request's sent blocks and references, in send order.
        on_request: called after each request (progress bars).
        keep_top: the pilot's ``keep_top`` (``False``: the reuse the top block's place costs).
        window: online: every ``window`` arriving requests are planned together
            (:meth:`ContextPilot.plan`, sent in its schedule, as a caller that micro-batches
            them sends them); 1: one at a time (:meth:`ContextPilot.prepare`).
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if feedback not in FEEDBACKS:
        raise ValueError(f"feedback must be one of {FEEDBACKS}, got {feedback!r}")
    shape = shape or PromptShape()
    if strategy == "retrieval" and not (mode == "chat" and deduplicate):  # the prompt without ContextPilot
        shape = replace(shape, labels=False)
    pilot = ContextPilot(
        strategy,
        max_live_requests=max(len(trace), 1),
        cache_tokens=capacity_tokens,
        annotate_order=shape.annotate,
        keep_top=keep_top,
    )
    cache = RadixCacheSimulator(capacity_tokens)
    run = _Run(trace, pilot, cache, shape, plan_out, on_request)
    if mode == "offline":
        run.offline()
    elif mode == "online":
        run.online(arrival_order(trace, arrival, seed), feedback, window)
    else:
        run.chat(feedback, history_turns, deduplicate)
    tally = run.tally
    return ReplayResult(
        strategy=strategy,
        mode=mode,
        capacity_tokens=capacity_tokens,
        requests=len(trace),
        prompt_tokens=tally.prompt,
        cached_tokens=tally.cached,
        block_tokens=tally.blocks,
        reference_tokens=tally.references,
        max_prompt_tokens=tally.longest,
        pilot_seconds=tally.seconds,
        deduplicate=deduplicate if mode == "chat" else False,
        oversized_requests=tally.oversized,
        held_tokens=cache.used_tokens,
    )


@dataclass
class _Run:
    trace: Sequence[TraceRequest]
    pilot: ContextPilot
    cache: RadixCacheSimulator
    shape: PromptShape
    plan_out: list[dict[str, object]] | None
    on_request: Callable[[], object] | None
    tally: _Tally = field(default_factory=_Tally)
    blocks: _Blocks = field(default_factory=_Blocks)
    offsets: dict[str, tuple[int, int]] = field(default_factory=dict)

    def serve(
        self,
        prepared: PreparedRequest,
        request: TraceRequest,
        history: Sequence[BlockSpec] = (),
        answer: Sequence[BlockSpec] = (),
    ) -> tuple[SimulatedRequest, list[BlockSpec]]:
        own, block_tokens, reference_tokens = prompt_units(prepared, request, self.shape)
        before = _system(self.shape) + list(history)
        prompt = before + own
        served = self.cache.request(prepared.request_id, prompt, answer)
        self.tally.add(served, block_tokens, reference_tokens)
        if not prepared.turn or not history:  # indexed (later turns with history are not): feedback applies
            self.offsets[prepared.request_id] = (len(before), len(prepared.blocks))
        if self.plan_out is not None:
            row: dict[str, object] = {
                "id": request.id,
                "request_id": prepared.request_id,
                "blocks": [b.id for b in prepared.blocks],
                "references": [r.block.id for r in prepared.references],
            }
            if prepared.conversation_id is not None:
                row["conversation"] = request.conversation
                row["turn"] = prepared.turn
            self.plan_out.append(row)
        if self.on_request is not None:
            self.on_request()
        return served, own

    def batch(self, indices: Iterable[int]) -> list[BatchRequest]:
        """These requests of the trace as one batch (``batch_index``: position in ``indices``)."""
        return [
            BatchRequest(blocks=self.blocks.of(self.trace[i]), query=self.trace[i].question or "", request_id=f"r{i}")
            for i in indices
        ]

    def offline(self) -> None:
        batch = self.batch(range(len(self.trace)))
        start = time.perf_counter()
        planned = self.pilot.plan(batch)
        self.tally.seconds = time.perf_counter() - start
        for prepared in planned:
            self.serve(prepared, self.trace[prepared.batch_index])  # type: ignore[index]

    def online(self, order: list[int], feedback: Feedback, window: int = 1) -> None:
        if window > 1:
            self.windows(order, feedback, window)
            return
        for index in order:
            request = self.trace[index]
            blocks = self.blocks.of(request)
            start = time.perf_counter()
            prepared = self.pilot.prepare(blocks, request.question or "", request_id=f"r{index}")
            self.tally.seconds += time.perf_counter() - start
            served, _ = self.serve(prepared, request)
            start = time.perf_counter()
            _feedback(self.pilot, served, feedback, self.offsets, prepared)
            self.tally.seconds += time.perf_counter() - start

    def windows(self, order: list[int], feedback: Feedback, window: int) -> None:
        """Online in micro-batches: each ``window`` arriving requests planned together and
        sent in the plan's schedule, the engine's feedback applied after each."""
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            batch = self.batch(chunk)
            started = time.perf_counter()
            planned = self.pilot.plan(batch)
            self.tally.seconds += time.perf_counter() - started
            for prepared in planned:
                served, _ = self.serve(prepared, self.trace[chunk[prepared.batch_index]])  # type: ignore[index]
                started = time.perf_counter()
                _feedback(self.pilot, served, feedback, self.offsets, prepared)
                self.tally.seconds += time.perf_counter() - started

    def chat(self, feedback: Feedback, history_turns: int | None, deduplicate: bool) -> None:
        conversations = list(turns_in_order(self.trace))
        history: dict[str, list[list[BlockSpec]]] = {name: [] for name, _ in conversations}
        for name, index in _round_robin([[(name, i) for i in turns] for name, turns in conversations]):
            request = self.trace[index]
            turns = history[name]
            window = request.history_turns if request.history_turns is not None else history_turns
            kept = list(range(0 if window is None else max(0, len(turns) - window), len(turns)))
            blocks = self.blocks.of(request)
            start = time.perf_counter()
            prepared = self.pilot.prepare(
                blocks,
                request.question or "",
                name if deduplicate and request.conversation is not None else None,
                kept_turns=kept if deduplicate else None,
                request_id=f"r{index}",
            )
            self.tally.seconds += time.perf_counter() - start
            for reference in prepared.references:
                if reference.turn not in kept:
                    raise RuntimeError(f"{request.id}: a reference to turn {reference.turn}, outside the history sent")
            sent_history = [unit for turn in kept for unit in turns[turn]]
            answer = [_unit("answer", prepared.request_id, self.shape.answer_tokens)]
            served, own = self.serve(prepared, request, sent_history, answer)
            turns.append(own + answer)
            start = time.perf_counter()
            _feedback(self.pilot, served, feedback, self.offsets, prepared)
            self.tally.seconds += time.perf_counter() - start


def serve_orders(
    trace: Sequence[TraceRequest],
    send_orders: Sequence[tuple[int, Sequence[str]]],
    capacity_tokens: int | None,
    shape: PromptShape | None = None,
) -> ReplayResult:
    """Serve send orders computed elsewhere (another library's plan) with the same prompts:
    ``send_orders`` is (index into the trace, its block ids in send order), in send order."""
    shape = shape or PromptShape()
    cache = RadixCacheSimulator(capacity_tokens)
    blocks = _Blocks()
    tally = _Tally()
    for index, order in send_orders:
        request = trace[index]
        by_id = {b.id: b for b in blocks.of(request)}
        if sorted(order) != sorted(by_id):
            raise ValueError(f"{request.id}: the send order is not a permutation of the request's blocks")
        ranking = tuple(by_id.values())
        sent = tuple(by_id[b] for b in order)  # as ContextPilot sends them: text alone, ranked by position
        prepared = PreparedRequest(
            f"r{index}", request.question or "", sent, ranking=ranking, labels=False, annotate_order=shape.annotate
        )
        own, block_tokens, _ = prompt_units(prepared, request, shape)
        prompt = _system(shape) + own
        tally.add(cache.request(prepared.request_id, prompt), block_tokens, 0)
    return ReplayResult(
        "external", "offline", capacity_tokens, len(send_orders), tally.prompt, tally.cached, tally.blocks, 0,
        tally.longest, 0.0, False, tally.oversized,
    )  # fmt: skip


def reuse_bound_of_prompts(trace: Sequence[TraceRequest], shape: PromptShape | None = None) -> float:
    """Upper bound on a single-shot hit ratio over whole prompts: the system prompt after
    the first request, plus the tokens of blocks an earlier request already sent."""
    shape = shape or PromptShape()
    seen: set[str] = set()
    reusable = total = 0
    for n, request in enumerate(trace):
        question = estimate_tokens(request.question) if request.question else shape.question_tokens
        prompt = shape.system_tokens + (question if shape.questions else 0)
        if shape.annotate:
            ranking = [Block(id=b, text=b) for b in request.blocks]
            prompt += estimate_tokens(render_order(ranking, DEFAULT_TEMPLATES))
        reusable += shape.system_tokens if n else 0
        for block, tokens in zip(request.blocks, request.token_counts(), strict=True):
            prompt += tokens
            if block in seen:
                reusable += tokens
            seen.add(block)
        total += prompt
    return reusable / total if total else 0.0


def replay_routed(
    trace: Sequence[TraceRequest],
    strategy: str,
    capacity_tokens: int | None,
    *,
    targets: int,
    routing: str = "cache_aware",
    feedback: Feedback = "usage",
    shape: PromptShape | None = None,
    load: float = 0.7,
    arrival: Arrival = "interleave",
) -> ReplayResult:
    """Requests arriving one at a time, routed across ``targets`` engines.

    Each target is a :class:`RadixCacheSimulator` of ``capacity_tokens`` and serves its
    queue in order; a request's service time is its prefill (prompt tokens not cached)
    plus a fixed 32-token overhead, and requests arrive at a steady pace that would keep
    the targets ``load`` busy without any cache. Routing is the
    :class:`~contextpilot_integrations.engines.router.Router`'s (``cache_aware``,
    ``round_robin`` or ``least_loaded``), with what each target tells back (``feedback``).
    """
    from ..engines.router import Router, Target

    shape = shape or PromptShape()
    if strategy == "retrieval":  # the prompt without ContextPilot
        shape = replace(shape, labels=False)
    router = Router(
        [Target(f"engine-{n}", f"simulated://{n}") for n in range(targets)],
        strategy=strategy,
        routing=routing,
        max_live_requests=max(len(trace), 1),
    )
    caches = {t.name: RadixCacheSimulator(capacity_tokens) for t in router.targets}
    blocks = _Blocks()
    offsets: dict[str, dict[str, tuple[int, int]]] = {t.name: {} for t in router.targets}
    mean_prompt = sum(sum(r.token_counts()) for r in trace) / max(len(trace), 1)
    gap = (mean_prompt + 32) / (targets * load)
    busy_until = dict.fromkeys(caches, 0.0)
    finishing: list[tuple[float, Target]] = []  # (end time, target) of requests in flight
    latencies: list[float] = []
    tally = _Tally()
    for step, index in enumerate(arrival_order(trace, arrival)):
        now = step * gap
        for end, done in finishing:
            if end <= now:
                router.finished(done)
        finishing = [(end, t) for end, t in finishing if end > now]
        request = trace[index]
        routed = router.prepare(blocks.of(request), request.question or "")
        target, prepared = routed.target, routed.prepared
        own, own_blocks, _ = prompt_units(prepared, request, shape)
        system = _system(shape)
        served = caches[target.name].request(prepared.request_id, system + own)
        tally.add(served, own_blocks, 0)
        offsets[target.name][prepared.request_id] = (len(system), len(prepared.blocks))
        _feedback(router.pilot(target), served, feedback, offsets[target.name], prepared)
        start = max(now, busy_until[target.name])
        end = start + 32 + served.block_tokens - served.hit_tokens
        busy_until[target.name] = end
        latencies.append(end - now)
        router.started(target)
        finishing.append((end, target))
    latencies.sort()
    sent = router.sent()
    return ReplayResult(
        strategy=strategy,
        mode="online",
        capacity_tokens=capacity_tokens,
        requests=len(trace),
        prompt_tokens=tally.prompt,
        cached_tokens=tally.cached,
        block_tokens=tally.blocks,
        reference_tokens=0,
        max_prompt_tokens=tally.longest,
        pilot_seconds=0.0,
        deduplicate=False,
        oversized_requests=tally.oversized,
        routing=routing,
        requests_per_target=tuple(sent[t.name] for t in router.targets),
        mean_latency=sum(latencies) / max(len(latencies), 1),
        p90_latency=latencies[int(0.9 * (len(latencies) - 1))] if latencies else 0.0,
    )
