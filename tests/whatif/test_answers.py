"""The answer-quality harness: workloads, arms, scoring and the CLI, on a real llama-server
with the tiny random-weight model (the real model's test is
tests/whatif/test_answers_real_model.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest

from contextpilot_integrations.whatif.answers import (
    ARMS,
    AnswerClient,
    WorkloadError,
    compare,
    flatten,
    gap,
    normalize,
    score,
    verdict,
    wilson,
    workload,
)
from contextpilot_integrations.whatif.cli import main
from contextpilot_integrations.whatif.engine_compare import plain_prompt
from tests.engine_support import start_llama_server


def test_normalization_and_scores_follow_reading_comprehension_benchmarks() -> None:
    assert normalize("  The Zankor  Bridge, 1,812! ") == "zankor bridge 1812"
    right = score("It was 1,812 metres.", ["1812"])
    assert (right.exact, right.contains) == (0.0, 1.0) and 0 < right.f1 < 1
    assert score("1812", ["1812"]).exact == 1.0
    assert score("18120", ["1812"]).contains == 0.0  # word for word, not a substring
    assert score("Mira Castell", ["castell mira"]).f1 == 1.0
    assert score("", ["x"]) == score("nothing", [""])


def test_intervals_and_verdicts() -> None:
    low, high = wilson(80, 100)
    assert 0.70 < low < 0.80 < high < 0.88
    assert wilson(0, 0) == (0.0, 1.0)
    same = gap([1, 0, 1, 0] * 50, [1, 0, 1, 0] * 50, [str(i) for i in range(200)])
    assert (same.mean, same.low, same.high, same.discordant) == (0.0, 0.0, 0.0, 0)
    assert verdict(same) == "not worse"
    worse = gap([0.0] * 100, [1.0] * 30 + [0.0] * 70, [str(i) for i in range(100)])
    assert worse.mean == pytest.approx(-0.3) and worse.high < 0 and verdict(worse) == "worse"
    assert verdict(gap([1.0] * 100, [0.0] * 100, [str(i) for i in range(100)])) == "better"
    few = gap([1.0, 0.0], [0.0, 1.0], ["a", "b"])
    assert verdict(few) == "unclear"
    clustered = gap([1.0, 1.0, 0.0], [0.0, 0.0, 0.0], ["c", "c", "d"])  # a conversation resampled whole
    assert clustered.mean == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        gap([1.0], [1.0, 0.0], ["a"])


@pytest.mark.parametrize("name", ["facts", "facts-chat", "memory", "memory-chat", "multihop"])
def test_workloads_are_the_same_for_a_seed_and_hold_their_answers(name: str) -> None:
    questions = workload(name, 9, seed=3)
    assert questions == workload(name, 9, seed=3) and questions != workload(name, 9, seed=4)
    assert len(questions) == 9
    for question in questions:
        assert question.blocks and question.answers and question.question
        assert len({block.id for block in question.blocks}) == len(question.blocks)
        if question.gold is not None:  # a generated answer is in the document that holds it
            holder = {block.id: block for block in question.blocks}.get(question.gold)
            assert holder is not None and question.answers[0] in holder.text


@pytest.mark.parametrize("name", ["facts-chat", "memory-chat"])
def test_later_turns_ask_about_a_document_an_earlier_turn_sent(name: str) -> None:
    questions = workload(name, 30, seed=0)
    turns: dict[str, list[set[str]]] = {}
    asked_earlier = 0
    for question in questions:
        shown = turns.setdefault(question.conversation or "", [])
        if shown and any(question.gold in earlier for earlier in shown):
            asked_earlier += 1
        shown.append({block.id for block in question.blocks})
    assert all(len(shown) == 3 for shown in turns.values())
    assert asked_earlier == 20  # every later turn


def test_unknown_workloads_and_sizes_are_refused() -> None:
    with pytest.raises(WorkloadError, match="unknown workload"):
        workload("nope", 3)
    with pytest.raises(WorkloadError, match="at least 1"):
        workload("facts", 0)


def test_the_baseline_sends_what_a_user_sends_and_the_default_keeps_the_top_document_first() -> None:
    questions = workload("facts", 60, seed=1)
    baseline = ARMS["without"].prompts(questions)
    assert [p.text for p in baseline] == [plain_prompt(q.blocks, q.question) for q in questions]
    default = ARMS["default"].prompts(questions)
    assert sum(p.prepared.reordered for p in default if p.prepared) >= 5  # the arm changes something
    for prompt in default:
        assert prompt.prepared is not None
        assert prompt.prepared.blocks[0].id == questions[prompt.index].blocks[0].id
        assert "priority order" not in prompt.text  # no annotation by default
    anywhere = ARMS["top-anywhere"].prompts(questions)
    assert any(p.prepared and questions[p.index].blocks[0].id != p.prepared.blocks[0].id for p in anywhere)
    offline = ARMS["offline"].prompts(questions)
    assert sorted(p.index for p in offline) == list(range(60))


def test_in_conversations_the_default_never_refers_to_the_top_document() -> None:
    questions = workload("facts-chat", 60, seed=2)
    default = ARMS["default"].prompts(questions)
    anywhere = ARMS["refs-anywhere"].prompts(questions)
    references = [r for p in default if p.prepared for r in p.prepared.references]
    assert references  # de-duplication still refers to the other repeated documents
    for prompt in default:
        assert prompt.prepared is not None
        top = questions[prompt.index].blocks[0].id
        assert top not in {r.block.id for r in prompt.prepared.references}
    assert any(
        questions[p.index].blocks[0].id in {r.block.id for r in p.prepared.references} for p in anywhere if p.prepared
    )
    no_dedup = ARMS["no-dedup"].prompts(questions)
    assert not any(p.prepared and p.prepared.references for p in no_dedup)


def test_flatten_is_one_prompt_for_a_base_model() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": " A1 "},
        {"role": "user", "content": "U2"},
    ]
    assert flatten(messages) == "S\n\nU1\nAnswer: A1\n\nU2\nAnswer:"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real llama-server with the tiny random-weight model: its answers are noise, the wire,
    the token counts and the timings are real."""
    server = start_llama_server(tmp_path_factory.mktemp("answers"))
    yield server.url
    server.stop()


def test_compare_sends_every_arm_greedy_and_keeps_the_history_of_a_conversation(engine: str) -> None:
    questions = workload("facts-chat", 6, seed=0)
    with AnswerClient(engine, max_tokens=4) as client:
        result = compare(questions, [ARMS["without"], ARMS["default"]], client, "facts-chat", 2, progress=False)
        first = result.arms["without"].results[0]
        assert client.answer(first.messages).text == first.answer.text  # greedy: the same answer again
    later = result.arms["default"].results[1]
    assert later.messages[1]["content"] == result.arms["default"].results[0].messages[-1]["content"]
    assert later.messages[2] == {"role": "assistant", "content": result.arms["default"].results[0].answer.text}
    served = result.arms["default"].results[0].answer
    assert served.prompt_tokens > 500 and served.prompt_ms is not None and served.computed_tokens is not None
    rows = {row["arm"]: row for row in result.rows()}
    assert rows["without"]["changed"] == 0 and rows["without"]["references"] == 0
    assert rows["default"]["references"] > 0 and rows["default"]["new_tokens_ratio"] < 1
    assert rows["default"]["verdict"] in ("better", "not worse", "worse", "unclear")
    quoted = 0
    for one in result.arms["default"].results:  # every reference sent names a text sent before it
        for opening in re.findall(r'Please refer to "(.+?)…"', one.messages[-1]["content"]):
            assert any(opening in message["content"] for message in one.messages[:-1])
            quoted += 1
    assert quoted == rows["default"]["references"]


def test_the_cli_runs_on_a_server_and_refuses_bad_arguments(engine: str, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = ["--workloads", "memory", "--questions", "4", "--arms", "default", "--max-tokens", "2", "--json"]
    code = main(["answers", "--engine", engine, *arguments])
    assert code == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert [row["arm"] for row in report["arms"]] == ["without", "default"]  # the baseline is always there
    assert main(["answers", "--engine", engine, "--questions", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err
    assert main(["answers", "--engine", "http://127.0.0.1:9", "--workloads", "memory", "--questions", "1"]) == 3
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["answers", "--engine", engine, "--arms", "nope"])
