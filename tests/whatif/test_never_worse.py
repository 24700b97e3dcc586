"""The simulator's sign (issue 21, item 4): on the bundled MultiHop-RAG sample ContextPilot
never makes the engine compute more prompt tokens than the prompt without it, from a cache
too small for one prompt to one that never evicts. The full sweep (0.2% .. 100%) is
``benchmarks/bench_never_worse.py``; these are a few of its points."""

from __future__ import annotations

import functools

import pytest

from contextpilot_integrations.whatif.replay import Mode, PromptShape, replay
from contextpilot_integrations.whatif.trace import TraceRequest, multihop_chats, multihop_trace, working_set_tokens


@functools.cache
def traces() -> tuple[list[TraceRequest], list[TraceRequest]]:
    chat = multihop_chats()
    chats = set(list(dict.fromkeys(r.conversation for r in chat))[:150])  # a fast test: the first 150
    return multihop_trace(), [r for r in chat if r.conversation in chats]


@pytest.mark.parametrize(
    ("mode", "fraction"),
    [("offline", 0.002), ("offline", 0.25), ("online", 0.002), ("online", 0.01), ("online", 0.25), ("chat", 0.01)],
)
def test_contextpilot_computes_no_more_than_the_prompt_without_it(mode: Mode, fraction: float) -> None:
    single, chat = traces()
    trace = chat if mode == "chat" else single
    shape = PromptShape()
    capacity = int(working_set_tokens(trace) * fraction)
    without = replay(trace, "retrieval", mode, capacity, shape=shape, deduplicate=False, history_turns=4)
    ours = replay(trace, "trie", mode, capacity, shape=shape, history_turns=4)
    assert ours.prefill_tokens <= without.prefill_tokens
    assert ours.hit_ratio >= without.hit_ratio


def test_the_baseline_prompt_and_a_conversations_turns_carry_no_labels() -> None:
    """Labels are prompt tokens: the baseline (the user's prompt) has none, and neither has a
    conversation's turn: its blocks are their text alone, later turns quote them (issue 29)."""
    single, chat = traces()
    trace = single[:200]
    without = replay(trace, "retrieval", "online", None)
    blocks = sum(sum(r.token_counts()) for r in trace)
    assert without.block_tokens == blocks
    plan: list[dict[str, object]] = []
    turns = replay(chat[:200], "trie", "chat", None, plan_out=plan)
    tokens = {block: count for r in chat[:200] for block, count in zip(r.blocks, r.token_counts(), strict=True)}
    sent = sum(tokens[block] for row in plan for block in row["blocks"])  # type: ignore[attr-defined]
    assert sent == turns.block_tokens and any(row["references"] for row in plan)
