from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextpilot_integrations.whatif import (
    PromptShape,
    TraceError,
    TraceRequest,
    load_trace,
    multihop_trace,
    replay,
    reuse_bound,
    reuse_bound_of_prompts,
    serve_orders,
    working_set_tokens,
)
from contextpilot_integrations.whatif.replay import arrival_order


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD = [
    '{"id": "a", "blocks": ["x", "y", "z"], "tokens": [10, 20, 30], "question": "q?"}',
    '{"id": "b", "blocks": ["z", "y", "w"], "tokens": [30, 20, 5], "conversation": "c1"}',
    '{"id": "c", "blocks": ["y", "z"], "tokens": [20, 30], "conversation": "c1"}',
]


def test_load_trace(tmp_path: Path) -> None:
    trace = load_trace(write(tmp_path, GOOD))
    assert [r.id for r in trace] == ["a", "b", "c"] and trace[1].conversation == "c1"
    assert reuse_bound(trace) == pytest.approx((30 + 20 + 20 + 30) / 165)
    assert working_set_tokens(trace) == 65


def test_integer_ids_and_token_estimates(tmp_path: Path) -> None:
    lines = ['{"id": 7, "blocks": [1, 2], "texts": ["abcdefgh", "abcd"]}', '{"id": 8, "blocks": [2], "turn": null}']
    trace = load_trace(write(tmp_path, lines))
    assert trace[0].id == "7" and trace[0].blocks == ("1", "2")
    assert trace[0].token_counts() == (2, 1) and trace[1].token_counts() == (1,)  # texts: 4 chars a token


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r":2: not valid JSON"),
        ('{"id": "b", "blocks": ["x"], "colour": "red"}', r":2: colour: Extra inputs are not permitted"),
        ('{"id": "b", "blocks": []}', r":2: blocks: .*at least 1"),
        ('{"id": "b", "blocks": ["x", "y"], "tokens": [1, 0]}', r":2: tokens: .*positive"),
        ('{"id": "b", "blocks": ["x", "y"], "tokens": [-3, 2]}', r":2: tokens: .*positive"),
        ('{"id": "b", "blocks": ["x"], "tokens": [1, 2]}', r":2: .*2 tokens for 1 blocks"),
        ('{"id": "b", "blocks": ["x"], "texts": ["a", "b"]}', r":2: .*2 texts for 1 blocks"),
        ('{"id": "b", "blocks": ["x", "x"]}', r":2: blocks: .*repeat"),
        ('{"blocks": ["x"]}', r":2: id: Field required"),
        ('{"id": "a", "blocks": ["x"]}', r":2: request id 'a' repeats"),
        ('{"id": "b", "blocks": ["x"], "turn": 0}', r":2: .*turn and history_turns need a conversation"),
    ],
)
def test_bad_lines_are_named(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, [GOOD[0], line]))


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"id": "1", "blocks": ["x"], "conversation": "c", "turn": 0}',
          '{"id": "2", "blocks": ["y"], "conversation": "c"}'],
         r"trace.jsonl:2: conversation 'c' gives turn numbers on some lines and not on this one"),
        (['{"id": "1", "blocks": ["x"], "conversation": "c", "turn": 0}',
          '{"id": "2", "blocks": ["y"], "conversation": "c", "turn": 2}'],
         r"trace.jsonl:2: conversation 'c': turn 2 out of order \(expected turn 1\)"),
        (['{"id": "1", "blocks": ["x"], "conversation": "c"}',
          '{"id": "2", "blocks": ["y"], "conversation": "c", "history_turns": 3}'],
         r"trace.jsonl:2: conversation 'c': history_turns 3 but turn 1 has only 1 earlier turn"),
    ],
)  # fmt: skip
def test_conversations_need_a_turn_order(tmp_path: Path, lines: list[str], message: str) -> None:
    with pytest.raises(TraceError, match=message):
        load_trace(write(tmp_path, lines))


def test_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write(tmp_path, [""]))


SHAPE = PromptShape(system_tokens=5, question_tokens=7, answer_tokens=11, annotate=False)


def test_every_prompt_token_is_counted() -> None:
    trace = [
        TraceRequest(id="1", blocks=("a", "b"), tokens=(100, 50)),
        TraceRequest(id="2", blocks=("b", "a"), tokens=(50, 100)),
        TraceRequest(id="3", blocks=("a", "b"), tokens=(100, 50)),
    ]
    result = replay(trace, "trie", "online", None, shape=SHAPE, keep_top=False)
    # prompts: system 5 + blocks 150 + question 7. The first shares nothing: sent as without
    # ContextPilot. The second is reordered onto the first's prefix (one text per block: no
    # labels; annotation off in this shape; keep_top=False: its top block need not stay
    # first). The third is the first's order: it reuses it too
    assert (result.prompt_tokens, result.cached_tokens) == (162 + 162 + 162, 0 + 155 + 155)
    assert result.block_tokens == 150 + 150 + 150 and result.max_prompt_tokens == 162
    baseline = replay(trace, "retrieval", "online", None, shape=SHAPE)
    assert (baseline.prompt_tokens, baseline.cached_tokens) == (3 * 162, 0 + 5 + 155)  # no labels
    # a fourth request is reordered onto the shared prefix: its annotation is tokens too
    trace.append(TraceRequest(id="4", blocks=("d", "b", "a"), tokens=(100, 50, 100)))
    without = replay(trace, "trie", "online", None, shape=SHAPE, keep_top=False)
    with_annotation = replay(trace, "trie", "online", None, shape=PromptShape(5, 7, 11, annotate=True), keep_top=False)
    assert without.cached_tokens == with_annotation.cached_tokens == 310 + 5 + 150  # system, a, b
    assert with_annotation.prompt_tokens > without.prompt_tokens


def test_chat_by_hand() -> None:
    """Turn 1 resends turn 0 (prompt and answer) as history and refers to its blocks."""
    trace = [
        TraceRequest(id="t0", blocks=("a", "b"), tokens=(100, 100), conversation="c"),
        TraceRequest(id="t1", blocks=("c", "b"), tokens=(100, 100), conversation="c"),
    ]
    plan: list[dict[str, object]] = []
    ours = replay(trace, "trie", "chat", None, shape=SHAPE, plan_out=plan)
    baseline = replay(trace, "retrieval", "chat", None, shape=SHAPE, deduplicate=False)
    # baseline: 5+200+7 = 212; then 212 + answer 11 + 200 + 7 = 430, of which 223 are cached
    assert (baseline.prompt_tokens, baseline.cached_tokens) == (212 + 430, 223)
    # ours: turn 0 is the baseline's; turn 1 quotes b in b's place
    reference = ours.reference_tokens
    assert reference > 0 and ours.prompt_tokens == 212 + 212 + 11 + reference + 100 + 7
    assert ours.cached_tokens == 223 and ours.prefill_tokens < baseline.prefill_tokens
    assert plan[1] == {
        "id": "t1",
        "request_id": "r1",
        "blocks": ["c"],
        "references": ["b"],
        "conversation": "c",
        "turn": 1,
    }


def test_chat_references_stay_inside_the_history_window() -> None:
    trace = [
        TraceRequest(id=f"t{i}", blocks=(f"own{i}", "a"), tokens=(50, 50), conversation="c", turn=i) for i in range(5)
    ]
    plan: list[dict[str, object]] = []
    replay(trace, "trie", "chat", None, shape=SHAPE, history_turns=1, plan_out=plan)
    # "a" is referred to only while the turn that carried it is the one kept; then it is resent
    assert [row["references"] for row in plan] == [[], ["a"], [], ["a"], []]
    assert all(  # a turn that refers to nothing goes out as without ContextPilot: the retriever's order
        row["blocks"] == ([f"own{i}"] if row["references"] else [f"own{i}", "a"]) for i, row in enumerate(plan)
    )


def test_offline_plan_can_be_checked_with_another_simulator() -> None:
    trace = multihop_trace()[:300]
    plan: list[dict[str, object]] = []
    result = replay(trace, "trie", "offline", 200_000, plan_out=plan)
    by_id = {r.id: i for i, r in enumerate(trace)}
    for row in plan:
        assert sorted(row["blocks"]) == sorted(trace[by_id[row["id"]]].blocks)  # type: ignore[arg-type, index]
    # the written plan, served on its own with the same prompts: the same hits
    again = serve_orders(trace, [(by_id[str(row["id"])], row["blocks"]) for row in plan], 200_000)  # type: ignore[misc]
    assert (again.prompt_tokens, again.cached_tokens) == (result.prompt_tokens, result.cached_tokens)
    assert 0 < result.hit_ratio <= reuse_bound_of_prompts(trace)


def test_reordering_beats_retrieval_order_on_multihop() -> None:
    trace = multihop_trace()[:600]
    capacity = working_set_tokens(trace) // 4
    baseline = replay(trace, "retrieval", "offline", capacity).hit_ratio
    assert replay(trace, "trie", "offline", capacity).hit_ratio > 5 * baseline
    assert replay(trace, "trie", "online", capacity).hit_ratio > 2 * baseline


def test_feedback_modes_differ_as_the_engine_would() -> None:
    trace = multihop_trace()[:600]
    capacity = working_set_tokens(trace) // 10
    feedbacks = ("exact", "request", "usage", "none")
    # keep_top=False: the most reuse to lose, so the modes' differences show
    hits = {f: replay(trace, "trie", "online", capacity, feedback=f, keep_top=False).hit_ratio for f in feedbacks}
    assert hits["exact"] >= hits["request"] and hits["exact"] > hits["none"]
    assert hits["usage"] > hits["none"]  # cached-token reports alone recover most of it


def test_interleaved_arrival_round_robins_sessions() -> None:
    trace = [TraceRequest(id=f"{s}{i}", blocks=("x",), session=s) for s in "ab" for i in range(3)]
    assert [trace[i].id for i in arrival_order(trace, "interleave")] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert [trace[i].id for i in arrival_order(trace, "file")] == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert sorted(arrival_order(trace, "shuffle")) == list(range(6))


def test_multihop_conversations_group_by_evidence() -> None:
    trace = multihop_trace(conversations=True)
    assert len({r.conversation for r in trace}) > 100
    assert json.dumps(trace[0].model_dump())  # serialisable, like a user's trace line
