"""Replay a retrieval trace through ContextPilot and the cache simulator.

This answers "how much would this save on my traffic?": every request of a trace is
planned (offline: the whole batch at once) or prepared one at a time with eviction
notices fed back (online), then served by :class:`RadixCacheSimulator` at a given
capacity. Results compare strategies on the same trace and capacity.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..blocks import Block
from ..errors import ContextPilotError
from ..pilot import BatchRequest, ContextPilot
from ..prepared import PreparedRequest
from .simulate import RadixCacheSimulator

__all__ = [
    "ReplayResult",
    "TraceError",
    "TraceRequest",
    "block_token_counts",
    "conversation_savings",
    "load_trace",
    "multihop_trace",
    "replay",
    "reuse_bound",
]

REFERENCE_TOKENS = 12
"""Approximate tokens of one location reference ("Please refer to [Doc_x] ...")."""


class TraceError(ContextPilotError, ValueError):
    """A trace file cannot be read; the message names the line."""


class TraceRequest(BaseModel):
    """One line of a trace: ``{"id", "blocks", "tokens"?, "conversation"?, "question"?}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    blocks: tuple[str, ...] = Field(min_length=1)
    tokens: tuple[int, ...] | None = None
    conversation: str | None = None
    question: str | None = None

    @field_validator("blocks")
    @classmethod
    def _distinct_blocks(cls, blocks: tuple[str, ...]) -> tuple[str, ...]:
        if any(not block for block in blocks):
            raise ValueError("block ids must be non-empty strings")
        if len(set(blocks)) != len(blocks):
            repeated = sorted({b for b in blocks if blocks.count(b) > 1})
            raise ValueError(f"block ids repeat within the request: {repeated}")
        return blocks

    @model_validator(mode="after")
    def _tokens_match_blocks(self) -> TraceRequest:
        if self.tokens is not None:
            if len(self.tokens) != len(self.blocks):
                raise ValueError(f"{len(self.tokens)} token counts for {len(self.blocks)} blocks")
            if any(count <= 0 for count in self.tokens):
                raise ValueError("token counts must be positive")
        return self

    def token_counts(self) -> tuple[int, ...]:
        return self.tokens if self.tokens is not None else (1,) * len(self.blocks)


MAX_LINE_BYTES = 16 * 1024 * 1024
"""A trace line longer than this is refused (a request with that much metadata is a mistake)."""


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """Read a JSON-lines trace (UTF-8, a byte-order mark is accepted).

    Args:
        limit: read only the first ``limit`` requests.

    Raises:
        TraceError: naming the file and the first bad line.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise TraceError(f"{path}: cannot open the trace ({exc.strerror})") from exc
    requests: list[TraceRequest] = []
    seen: set[str] = set()
    with handle:
        for number, raw in enumerate(iter(lambda: handle.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if limit is not None and len(requests) >= limit:
                break
            where = f"{path}:{number}"
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{where}: line longer than {MAX_LINE_BYTES:,} bytes")
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{where}: not UTF-8 (byte {exc.start + 1})") from None
            if not line.strip():
                continue
            request = _parse_line(line, where)
            if request.id in seen:
                raise TraceError(f"{where}: request id {request.id!r} repeats an earlier line")
            seen.add(request.id)
            requests.append(request)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    return requests


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from exc
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return TraceRequest.model_validate(data)
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        where_field = ".".join(str(part) for part in error["loc"]) or "line"
        raise TraceError(f"{where}: {where_field}: {error['msg']}") from exc


def multihop_trace(conversations: bool = False) -> list[TraceRequest]:
    """The bundled MultiHop-RAG BM25 top-15 trace (2,556 queries, real token counts).

    With ``conversations=True``, queries that share their first evidence article are
    grouped into one conversation (turns in trace order), a stand-in for a user who
    keeps asking about the same story.
    """
    from .datasets import load_multihop_rag

    data = load_multihop_rag()
    return [
        TraceRequest(
            id=f"q{query.qid}",
            blocks=query.retrieved,
            tokens=tuple(data.chunks[cid].token_count for cid in query.retrieved),
            question=query.text,
            conversation=(query.evidence_urls[0] if conversations and query.evidence_urls else None),
        )
        for query in data.queries
    ]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """One strategy, mode and capacity on one trace."""

    strategy: str
    mode: str
    capacity_tokens: int | None
    hit_tokens: int
    block_tokens: int
    pilot_seconds: float
    requests: int

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.block_tokens if self.block_tokens else 0.0


def reuse_bound(trace: Sequence[TraceRequest]) -> float:
    """Upper bound on any hit ratio: tokens of blocks some earlier request already sent."""
    seen: set[str] = set()
    repeated = total = 0
    for request in trace:
        for block, tokens in zip(request.blocks, request.token_counts(), strict=True):
            total += tokens
            if block in seen:
                repeated += tokens
            seen.add(block)
    return repeated / total if total else 0.0


def block_token_counts(trace: Sequence[TraceRequest]) -> dict[str, int]:
    """Token count of every distinct block of a trace."""
    sizes: dict[str, int] = {}
    for request in trace:
        sizes.update(zip(request.blocks, request.token_counts(), strict=True))
    return sizes


def working_set_tokens(trace: Sequence[TraceRequest]) -> int:
    """Tokens of all distinct blocks: a cache this big never has to evict."""
    return sum(block_token_counts(trace).values())


class _BlockCache:
    """One :class:`Block` per id, so a long trace does not build millions of them."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[str, int], Block] = {}

    def blocks(self, request: TraceRequest) -> list[Block]:
        out = []
        for block_id, tokens in zip(request.blocks, request.token_counts(), strict=True):
            block = self._blocks.get((block_id, tokens))
            if block is None:
                block = self._blocks[(block_id, tokens)] = Block(id=block_id, text=block_id, tokens=tokens)
            out.append(block)
        return out


def replay(
    trace: Sequence[TraceRequest],
    strategy: str,
    mode: str,
    capacity_tokens: int | None,
    plan_out: list[dict[str, object]] | None = None,
) -> ReplayResult:
    """Run a trace through a fresh :class:`ContextPilot` and a fresh simulated cache.

    Args:
        mode: ``"offline"`` (plan the whole batch, then send in its order) or
            ``"online"`` (prepare one request at a time, in trace order, with the
            simulator's eviction notices fed back to the pilot).
        plan_out: if given, receives each request's sent blocks and references in
            send order.
    """
    if mode not in ("offline", "online"):
        raise ValueError(f"mode must be 'offline' or 'online', got {mode!r}")
    pilot = ContextPilot(strategy, max_live_requests=max(len(trace), 1))
    cache = RadixCacheSimulator(capacity_tokens)
    blocks = _BlockCache()
    hit = total = 0
    seconds = 0.0

    def serve(prepared: PreparedRequest, request: TraceRequest) -> None:
        nonlocal hit, total, seconds
        served = cache.request(prepared.request_id, [(b.id, b.token_count) for b in prepared.blocks])
        hit += served.hit_tokens
        total += served.block_tokens
        if plan_out is not None:
            plan_out.append(
                {
                    "id": request.id,
                    "request_id": prepared.request_id,
                    "blocks": [b.id for b in prepared.blocks],
                    "references": [r.block.id for r in prepared.references],
                }
            )
        if mode == "online" and served.evicted:
            start = time.perf_counter()
            for request_id, cached in served.evicted:
                pilot.truncate(request_id, cached)
            seconds += time.perf_counter() - start

    if mode == "offline":
        batch = [
            BatchRequest(
                blocks=blocks.blocks(r), query=r.question or "", conversation_id=r.conversation, request_id=r.id
            )
            for r in trace
        ]
        start = time.perf_counter()
        planned = pilot.plan(batch)
        seconds = time.perf_counter() - start
        for prepared in planned:
            serve(prepared, trace[prepared.batch_index])  # type: ignore[index]
    else:
        for request in trace:
            request_blocks = blocks.blocks(request)
            start = time.perf_counter()
            prepared = pilot.prepare(
                request_blocks, request.question or "", request.conversation, request_id=request.id
            )
            seconds += time.perf_counter() - start
            serve(prepared, request)
    return ReplayResult(strategy, mode, capacity_tokens, hit, total, seconds, len(trace))


@dataclass(frozen=True, slots=True)
class ConversationSavings:
    """Prefill tokens of the context blocks in multi-turn conversations."""

    conversations: int
    turns: int
    plain_tokens: int
    deduplicated_tokens: int

    @property
    def saved_ratio(self) -> float:
        return 1 - self.deduplicated_tokens / self.plain_tokens if self.plain_tokens else 0.0


def conversation_savings(trace: Iterable[TraceRequest], min_turns: int = 2) -> ConversationSavings:
    """Context tokens each turn must prefill, resending every block vs. de-duplicating.

    The conversation's history is a prefix the engine already holds, so what a turn
    prefills is its new context: every retrieved block (plain) or only the blocks not
    sent in an earlier turn plus a short location reference for each other one.
    """
    by_conversation: dict[str, list[TraceRequest]] = defaultdict(list)
    for request in trace:
        if request.conversation is not None:
            by_conversation[request.conversation].append(request)
    pilot = ContextPilot("retrieval", annotate_order=True)
    blocks = _BlockCache()
    plain = deduplicated = turns = conversations = 0
    for conversation_id, requests in by_conversation.items():
        if len(requests) < min_turns:
            continue
        conversations += 1
        for request in requests:
            turns += 1
            prepared = pilot.prepare(blocks.blocks(request), request.question or "", conversation_id)
            plain += sum(request.token_counts())
            deduplicated += prepared.block_tokens + REFERENCE_TOKENS * len(prepared.references)
    return ConversationSavings(conversations, turns, plain, deduplicated)
