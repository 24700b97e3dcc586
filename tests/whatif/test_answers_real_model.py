"""A real model's answers (Gemma 3 270M on llama-server, greedy: the same answers on every
run of one build): ContextPilot's defaults answer as many questions as the prompts sent
without it, within a stated margin, single-shot (fact lookups, a memory's short snippets)
and in conversations. The full comparison, with intervals, is benchmarks/bench_answers.py;
this is its smallest slice, run in CI."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contextpilot_integrations.testing.llama_server import LlamaServer, real_llama_server
from contextpilot_integrations.whatif.answers import ARMS, AnswerClient, compare, workload

MARGIN = 2
"""The default may answer at most this many of a workload's 24 questions fewer than the
prompts without ContextPilot (the benchmark's 95% intervals on 300 questions are the verdict;
24 questions can only catch a large loss)."""
QUESTIONS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    started = real_llama_server(tmp_path_factory.mktemp("real-model"), pytest.skip, threads=2)
    yield started
    started.stop()


@pytest.mark.timeout(1200)  # ~2 minutes a workload on 2 free cores; CI's machine may be busy
@pytest.mark.parametrize("name", ["facts", "memory", "facts-chat"])
def test_the_default_answers_as_many_questions_as_without_contextpilot(server: LlamaServer, name: str) -> None:
    questions = workload(name, QUESTIONS, seed=0)
    with AnswerClient(server.url) as client:
        result = compare(questions, [ARMS["without"], ARMS["default"]], client, name, progress=False)
        again = client.answer(result.arms["without"].results[0].messages)
    rows = {row["arm"]: row for row in result.rows()}
    without, default = (round(rows[arm]["contains"] * QUESTIONS) for arm in ("without", "default"))
    assert without >= QUESTIONS // 2, f"the model answered only {without} of {QUESTIONS}: is it the real one?"
    assert default >= without - MARGIN, f"{name}: {default} answered with ContextPilot, {without} without"
    assert rows["default"]["changed"] > 0.3  # the default changed what was sent: the check says something
    assert again.text == result.arms["without"].results[0].answer.text  # greedy: the same answer again
    if name == "facts-chat":  # de-duplication still saves prompt tokens, the top document in full
        assert rows["default"]["references"] > 0 and rows["default"]["gold_referred"] == 0
        assert rows["default"]["new_tokens_ratio"] < 0.9
