"""Synthetic retrieval traffic: a family of workloads the defaults were not tuned on.

The bundled MultiHop-RAG sample is one kind of traffic (15 blocks of ~600 tokens a
request). Users bring others: short memory snippets over long chats, scattered passages,
heavy-tailed popularity. :func:`generate` draws a trace of :class:`TraceRequest` lines
(the simulator's own input, written and read back as JSON lines) from a :class:`Family`
of parameters:

- block sizes, log-uniform between ``block_tokens`` (20-2,000 tokens in the family);
- ``blocks`` per request (5-30);
- popularity skew: blocks of a topic drawn by a Zipf law of exponent ``zipf`` (0.6-1.4);
- topic locality: a session stays on its topic with chance ``locality``, else moves to a
  topic drawn by the same Zipf law; ``private`` topics belong to one session (a user's
  own memory), shared ones to everybody;
- ``sessions`` interleaved at random in file order, each a run of conversations of
  ``turns`` (2-200) turns, each turn keeping at most ``history`` earlier turns.

The same seed always gives the same trace. :data:`FAMILIES` names the members the
benchmark and the README report (``contextpilot-integrations simulate --synthetic NAME``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..errors import ContextPilotError
from .trace import TraceRequest

__all__ = ["FAMILIES", "Family", "SyntheticError", "family", "generate"]

_WORDS = ("cache", "prefix", "block", "token", "engine", "query", "answer", "memory", "user", "topic", "report",
          "market", "model", "court", "vote", "launch", "season", "study", "price", "river")  # fmt: skip


class SyntheticError(ContextPilotError, ValueError):
    """A family's parameters are out of range, or its name is unknown; the message says which."""


@dataclass(frozen=True, slots=True)
class Family:
    """Parameters of one synthetic workload (see the module docstring)."""

    name: str
    description: str = ""
    requests: int = 1000
    sessions: int = 10
    block_tokens: tuple[int, int] = (200, 400)
    blocks: tuple[int, int] = (10, 15)
    zipf: float = 1.0
    topics: int = 20
    topic_blocks: int = 100
    """Blocks a topic holds."""
    locality: float = 0.7
    private: bool = False
    turns: tuple[int, int] | None = None
    """Turns a conversation has (``None``: single-shot requests, sessions only)."""
    history: int = 4
    question_tokens: tuple[int, int] = (8, 24)

    def __post_init__(self) -> None:
        problems = []
        for name, (low, high), floor in (
            ("block_tokens", self.block_tokens, 1),
            ("blocks", self.blocks, 1),
            ("question_tokens", self.question_tokens, 1),
            *((("turns", self.turns, 1),) if self.turns is not None else ()),
        ):
            if not floor <= low <= high:
                problems.append(f"{name} must be a range {floor} <= low <= high, got {low}..{high}")
        if self.requests < 1 or self.sessions < 1 or self.topics < 1 or self.history < 0:
            problems.append("requests, sessions and topics must be at least 1, history at least 0")
        if self.topic_blocks < self.blocks[1]:
            problems.append(f"topic_blocks ({self.topic_blocks}) must hold a whole request ({self.blocks[1]} blocks)")
        if not 0.0 < self.zipf <= 4.0 or not 0.0 <= self.locality <= 1.0:
            problems.append(f"zipf must be in (0, 4] and locality in [0, 1], got {self.zipf} and {self.locality}")
        if problems:
            raise SyntheticError(f"family {self.name!r}: " + "; ".join(problems))

    def with_requests(self, requests: int) -> Family:
        return replace(self, requests=requests)


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "memory-snippets",
            "10 users' chat memories: 20 snippets of 20-60 tokens a request from the user's own "
            "memory, conversations of 2-200 turns",
            requests=2000, sessions=10, block_tokens=(20, 60), blocks=(20, 20), zipf=1.0, topics=8,
            topic_blocks=60, locality=0.8, private=True, turns=(2, 200),
        ),
        Family(
            "passages",
            "multi-turn questions over shared passages: 15 passages of 200-350 tokens, conversations of 2-10 turns",
            requests=1500, sessions=30, block_tokens=(200, 350), blocks=(15, 15), zipf=0.8, topics=40,
            topic_blocks=120, locality=0.7, turns=(2, 10),
        ),
        Family(
            "scattered",
            "little reuse: 5-30 blocks of 20-2,000 tokens from a wide corpus, mild skew, topics change often",
            requests=1000, sessions=50, block_tokens=(20, 2000), blocks=(5, 30), zipf=0.6, topics=200,
            topic_blocks=200, locality=0.2,
        ),
        Family(
            "long-chat",
            "few long conversations (50-200 turns) on one topic each, 5-10 blocks of 50-400 tokens, strong skew",
            requests=1200, sessions=6, block_tokens=(50, 400), blocks=(5, 10), zipf=1.4, topics=12,
            topic_blocks=80, locality=0.95, turns=(50, 200),
        ),
        Family(
            "tiny-facts",
            "a fact base read in small pieces: 20 facts of 3-12 tokens a request, shared topics, "
            "conversations of 2-20 turns",
            requests=1500, sessions=20, block_tokens=(3, 12), blocks=(20, 20), zipf=1.0, topics=30,
            topic_blocks=80, locality=0.7, turns=(2, 20),
        ),
        Family(
            "multihop-like",
            "like the bundled MultiHop-RAG sample: 15 blocks of 400-800 tokens, shared news topics, "
            "conversations of 2-6 turns",
            requests=1500, sessions=40, block_tokens=(400, 800), blocks=(15, 15), zipf=1.0, topics=60,
            topic_blocks=60, locality=0.5, turns=(2, 6),
        ),
    )
}  # fmt: skip
"""The named members of the family (``simulate --synthetic NAME``)."""


def family(name: str) -> Family:
    """A named family; :class:`SyntheticError` naming the known ones otherwise."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise SyntheticError(f"unknown synthetic family {name!r} (known: {', '.join(FAMILIES)})") from None


def generate(
    spec: Family,
    *,
    seed: int = 0,
    texts: bool = False,
    on_request: Callable[[], object] | None = None,
) -> list[TraceRequest]:
    """Draw ``spec.requests`` trace lines; the same ``seed`` gives the same trace.

    Args:
        texts: give every block a text of its token count (about four characters a
            token), to send the trace to a real engine.
        on_request: called after each line (progress bars).
    """
    rng = random.Random(f"{spec.name}:{seed}")
    zipf_topics = _zipf(spec.topics, spec.zipf)
    zipf_blocks = _zipf(spec.topic_blocks, spec.zipf)
    sizes: dict[str, int] = {}

    def size(block: str) -> int:
        tokens = sizes.get(block)
        if tokens is None:
            low, high = spec.block_tokens
            tokens = sizes[block] = round(math.exp(rng.uniform(math.log(low), math.log(high))))
        return tokens

    quotas = _split(spec.requests, spec.sessions, rng)
    sessions = [_Session(f"s{n}", rng.choices(range(spec.topics), zipf_topics)[0]) for n in range(len(quotas))]
    remaining = list(quotas)
    lines: list[TraceRequest] = []
    while len(lines) < spec.requests:
        who = rng.choices(range(len(sessions)), remaining)[0]  # sessions interleaved, busier ones more often
        remaining[who] -= 1
        session = sessions[who]
        if rng.random() >= spec.locality:
            session.topic = rng.choices(range(spec.topics), zipf_topics)[0]
        space = f"{session.name}." if spec.private else ""
        count = rng.randint(*spec.blocks)
        picked = _weighted_sample(rng, spec.topic_blocks, zipf_blocks, count)
        blocks = tuple(f"{space}t{session.topic}.b{rank}" for rank in picked)
        tokens = tuple(size(b) for b in blocks)
        question_tokens = rng.randint(*spec.question_tokens)
        conversation, turn, history = session.next_turn(spec, rng, remaining[who])
        lines.append(
            TraceRequest(
                id=f"{spec.name}-{len(lines)}",
                blocks=blocks,
                tokens=tokens,
                texts=tuple(_text(b, t) for b, t in zip(blocks, tokens, strict=True)) if texts else None,
                question=_text(f"q{len(lines)}", question_tokens),
                conversation=conversation,
                turn=turn,
                history_turns=history,
                session=session.name,
            )
        )
        if on_request is not None:
            on_request()
    return lines


@dataclass
class _Session:
    name: str
    topic: int
    conversation: int = -1
    turn: int = 0
    turns: int = 0

    def next_turn(self, spec: Family, rng: random.Random, left: int) -> tuple[str | None, int | None, int | None]:
        """(conversation, turn, history_turns) of this session's next line."""
        if spec.turns is None:
            return None, None, None
        if self.turn >= self.turns:
            self.conversation += 1
            self.turn, self.turns = 0, rng.randint(*spec.turns)
            if left + 1 - self.turns < spec.turns[0]:  # no short conversation left over at the end
                self.turns = left + 1
        turn = self.turn
        self.turn += 1
        return f"{self.name}.c{self.conversation}", turn, min(turn, spec.history)


def _zipf(n: int, exponent: float) -> list[float]:
    return [1.0 / (rank**exponent) for rank in range(1, n + 1)]


def _split(total: int, parts: int, rng: random.Random) -> list[int]:
    """``total`` requests among at most ``parts`` sessions, unevenly, none empty."""
    parts = min(parts, total)
    weights = [rng.uniform(0.5, 1.5) for _ in range(parts)]
    quotas = [max(1, int(total * w / sum(weights))) for w in weights]
    quotas[0] += total - sum(quotas)
    while quotas[0] < 1:  # rounding took too much from the first: take it back from the largest
        largest = max(range(1, parts), key=quotas.__getitem__)
        quotas[largest] -= 1
        quotas[0] += 1
    return quotas


def _weighted_sample(rng: random.Random, n: int, weights: Sequence[float], k: int) -> list[int]:
    """``k`` distinct ranks out of ``n``, drawn by weight, in draw order (Efraimidis-Spirakis):
    the likelier a block, the earlier it tends to come, as a retriever ranks popular ones."""
    keys = sorted(((rng.random() ** (1.0 / weights[i]), i) for i in range(n)), reverse=True)
    return [i for _, i in keys[:k]]


def _text(seed: str, tokens: int) -> str:
    """A text of about ``tokens`` tokens (four characters each), the same for the same seed."""
    rng = random.Random(seed)
    words: list[str] = [f"[{seed}]"]
    length = len(words[0])
    target = tokens * 4
    while length < target:
        word = rng.choice(_WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)[:target].ljust(target, ".")
