"""Retrieval traces: one JSON object a line, validated with errors that name the line.

``{"id", "blocks", "tokens"?, "texts"?, "question"?, "conversation"?, "turn"?,
"history_turns"?, "session"?, "time"?}``:

- ``blocks``: block ids in retrieval order (strings; integers are accepted and stringified),
  at most :data:`~contextpilot_integrations.core.validation.MAX_BLOCKS` (262,144) a line;
- ``tokens``: each block's token count (whole numbers > 0, together at most
  :data:`~contextpilot_integrations.core.usage.MAX_TOKENS`, 2**31 - 1). Without it, counts are estimated from ``texts``
  (about four characters a token, the estimate :class:`~contextpilot_integrations.Block`
  uses), and without texts each block counts as one token;
- ``texts``: each block's text (needed to send the trace to a real engine);
- ``conversation`` / ``turn``: a multi-turn chat. Turns are numbered 0, 1, 2... in file
  order; either every line of a conversation gives ``turn`` or none does (file order);
- ``history_turns``: earlier turns this turn's prompt keeps (at most the turns before it);
- ``session``: a user who sends requests one after another without chat history (online
  replays interleave sessions);
- ``time``: when the request arrived, in seconds (any origin); the provider what-if
  (``simulate --provider``) expires cache entries by it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..core.blocks import CHARS_PER_TOKEN
from ..core.usage import MAX_TOKENS
from ..core.validation import MAX_BLOCKS
from ..errors import ContextPilotError

__all__ = [
    "MAX_LINE_BYTES",
    "TraceError",
    "TraceRequest",
    "block_token_counts",
    "check_conversations",
    "estimate_tokens",
    "load_trace",
    "multihop_chats",
    "multihop_trace",
    "reuse_bound",
    "working_set_tokens",
]

MAX_LINE_BYTES = 16 * 1024 * 1024
"""A trace line longer than this is refused (a request with that much metadata is a mistake)."""


def estimate_tokens(text: str) -> int:
    """About four characters a token (what :class:`~contextpilot_integrations.Block` uses)."""
    return max(1, len(text) // CHARS_PER_TOKEN)


class TraceError(ContextPilotError, ValueError):
    """A trace file cannot be read; the message names the line."""


def _as_id(value: Any) -> Any:
    """Integer ids are common in exported traces: accept them as strings."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


class TraceRequest(BaseModel):
    """One line of a trace (see the module docstring for the fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    blocks: tuple[str, ...] = Field(min_length=1, max_length=MAX_BLOCKS)
    tokens: tuple[Annotated[int, Field(strict=True)], ...] | None = None
    texts: tuple[str, ...] | None = None
    question: str | None = None
    conversation: str | None = Field(default=None, min_length=1)
    turn: int | None = Field(default=None, ge=0, strict=True)
    history_turns: int | None = Field(default=None, ge=0, strict=True)
    session: str | None = Field(default=None, min_length=1)
    time: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("id", "conversation", "session", mode="before")
    @classmethod
    def _string_ids(cls, value: Any) -> Any:
        return _as_id(value)

    @field_validator("blocks", mode="before")
    @classmethod
    def _string_block_ids(cls, value: Any) -> Any:
        return [_as_id(v) for v in value] if isinstance(value, (list, tuple)) else value

    @field_validator("blocks")
    @classmethod
    def _distinct_blocks(cls, blocks: tuple[str, ...]) -> tuple[str, ...]:
        if any(not block for block in blocks):
            raise ValueError("block ids must be non-empty strings")
        if len(set(blocks)) != len(blocks):  # counted once (a line may hold a million ids)
            repeated = sorted(block for block, count in Counter(blocks).items() if count > 1)
            more = f" and {len(repeated) - 10:,} more" if len(repeated) > 10 else ""
            raise ValueError(f"block ids repeat within the request: {repeated[:10]}{more}")
        return blocks

    @field_validator("tokens")
    @classmethod
    def _tokens_fit_a_prompt(cls, tokens: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if tokens is None:
            return None
        if any(count <= 0 for count in tokens):
            raise ValueError("token counts must be positive")
        if sum(tokens) > MAX_TOKENS:
            raise ValueError(f"the blocks add up to more than {MAX_TOKENS:,} tokens, more than any prompt holds")
        return tokens

    @model_validator(mode="after")
    def _lengths_match_blocks(self) -> TraceRequest:
        for name in ("tokens", "texts"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.blocks):
                raise ValueError(f"{len(values)} {name} for {len(self.blocks)} blocks")
        if (self.turn is not None or self.history_turns is not None) and self.conversation is None:
            raise ValueError("turn and history_turns need a conversation")
        return self

    def token_counts(self) -> tuple[int, ...]:
        """Given counts, else estimates from the texts, else one token a block."""
        if self.tokens is not None:
            return self.tokens
        if self.texts is not None:
            return tuple(estimate_tokens(text) for text in self.texts)
        return (1,) * len(self.blocks)


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
    lines: list[int] = []
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
            lines.append(number)
    if not requests:
        raise TraceError(f"{path}: the trace has no requests")
    problem = check_conversations(requests)
    if problem is not None:
        index, message = problem
        raise TraceError(f"{path}:{lines[index]}: {message}")
    return requests


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from exc
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    except ValueError:  # an integer of 4,300+ digits: Python refuses to parse it
        raise TraceError(f"{where}: a JSON number too long to read (over 4,300 digits)") from None
    if not isinstance(data, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(data).__name__}")
    blocks = data.get("blocks")
    if isinstance(blocks, list) and len(blocks) > MAX_BLOCKS:  # refused before a model holds them
        raise TraceError(f"{where}: blocks: {len(blocks):,} blocks, more than {MAX_BLOCKS:,} a request")
    try:
        return TraceRequest.model_validate(data)
    except RecursionError:
        raise TraceError(f"{where}: JSON nested too deeply") from None
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"]) or "line"
        raise TraceError(f"{where}: {field}: {error['msg']}") from exc


def check_conversations(trace: Sequence[TraceRequest]) -> tuple[int, str] | None:
    """The first line (index, message) whose conversation has no usable turn order, or None.

    A conversation's lines either all give ``turn`` or none does; given turns must be
    0, 1, 2... in file order; ``history_turns`` can keep at most the turns before.
    """
    numbered: dict[str, bool] = {}
    count: dict[str, int] = {}
    for index, request in enumerate(trace):
        conversation = request.conversation
        if conversation is None:
            continue
        has_turn = request.turn is not None
        first = numbered.setdefault(conversation, has_turn)
        if first != has_turn:
            return index, (
                f"conversation {conversation!r} gives turn numbers on some lines and not on this one: "
                "give every line its turn, or none (file order)"
            )
        expected = count.get(conversation, 0)
        if has_turn and request.turn != expected:
            return index, f"conversation {conversation!r}: turn {request.turn} out of order (expected turn {expected})"
        if request.history_turns is not None and request.history_turns > expected:
            return index, (
                f"conversation {conversation!r}: history_turns {request.history_turns} but turn {expected} "
                f"has only {expected} earlier turn{'s' if expected != 1 else ''}"
            )
        count[conversation] = expected + 1
    return None


def multihop_trace(conversations: bool = False, *, texts: bool = False) -> list[TraceRequest]:
    """The bundled MultiHop-RAG BM25 top-15 trace (2,556 queries, real token counts).

    With ``conversations=True``, queries that share their first evidence article are
    grouped into one conversation (turns in trace order), a stand-in for a user who keeps
    asking about the same story. ``texts=True`` carries the chunk texts.
    """
    from .datasets import load_multihop_rag

    data = load_multihop_rag()
    return [
        TraceRequest(
            id=f"q{query.qid}",
            blocks=query.retrieved,
            tokens=tuple(data.chunks[cid].token_count for cid in query.retrieved),
            texts=tuple(data.chunks[cid].text for cid in query.retrieved) if texts else None,
            question=query.text,
            conversation=(query.evidence_urls[0] if conversations and query.evidence_urls else None),
        )
        for query in data.queries
    ]


def multihop_chats(*, texts: bool = False) -> list[TraceRequest]:
    """The demo's chat workload: :func:`multihop_trace` grouped into conversations, those of
    two turns or more (a single turn has nothing to de-duplicate), turns in trace order."""
    grouped = multihop_trace(conversations=True, texts=texts)
    sizes = Counter(request.conversation for request in grouped)
    return [r for r in grouped if r.conversation is not None and sizes[r.conversation] >= 2]


def block_token_counts(trace: Sequence[TraceRequest]) -> dict[str, int]:
    """Token count of every distinct block of a trace."""
    sizes: dict[str, int] = {}
    for request in trace:
        sizes.update(zip(request.blocks, request.token_counts(), strict=True))
    return sizes


def working_set_tokens(trace: Sequence[TraceRequest]) -> int:
    """Tokens of all distinct blocks: a cache this big never has to evict a block."""
    return sum(block_token_counts(trace).values())


def reuse_bound(trace: Sequence[TraceRequest]) -> float:
    """Upper bound on the share of block tokens any ordering can reuse: tokens of blocks
    some earlier request already sent, over all block tokens."""
    seen: set[str] = set()
    repeated = total = 0
    for request in trace:
        for block, tokens in zip(request.blocks, request.token_counts(), strict=True):
            total += tokens
            if block in seen:
                repeated += tokens
            seen.add(block)
    return repeated / total if total else 0.0


def turns_in_order(trace: Sequence[TraceRequest]) -> Iterator[tuple[str, list[int]]]:
    """(conversation, indices of its turns in order), conversations by first appearance;
    a line without a conversation is a conversation of one turn, named by its id."""
    groups: dict[str, list[int]] = {}
    for index, request in enumerate(trace):
        key = request.conversation if request.conversation is not None else f"\x00{request.id}"
        groups.setdefault(key, []).append(index)
    yield from groups.items()
