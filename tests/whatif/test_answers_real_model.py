"""A real model's answers (Gemma 3 270M on llama-server, greedy: the same answers on every
run of one build): ContextPilot's defaults answer as many questions as the prompts sent
without it, within a stated margin, single-shot (fact lookups planned as one batch)
and in conversations. The full comparison, with intervals, is benchmarks/bench_answers.py;
this is its smallest slice, run in CI."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from contextpilot_integrations.testing.llama_server import LlamaServer, real_llama_server
from contextpilot_integrations.whatif.answers import ARMS, AnswerClient, compare, workload

MARGIN = 2
"""ContextPilot may answer at most this many of every 24 questions fewer than the prompts
without it (the benchmark's 95% intervals on 200-300 questions are the verdict; a few dozen
questions can only catch a large loss)."""
CASES = [("facts", 48, "offline"), ("facts-chat", 24, "default")]
"""Each workload with an arm that changes many of its prompts at this size: single-shot
questions online change few (a prompt keeps its own top block first, and 48 questions seldom
share one), the offline batch half of them; a conversation's later turns carry references."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    started = real_llama_server(tmp_path_factory.mktemp("real-model"), pytest.skip, threads=2)
    yield started
    started.stop()


@pytest.mark.timeout(1200)  # ~2 minutes a workload on 2 free cores; CI's machine may be busy
@pytest.mark.parametrize(("name", "size", "arm"), CASES, ids=[case[0] for case in CASES])
def test_contextpilot_answers_as_many_questions_as_without_it(
    server: LlamaServer, name: str, size: int, arm: str
) -> None:
    questions = workload(name, size, seed=0)
    with AnswerClient(server.url) as client:
        result = compare(questions, [ARMS["without"], ARMS[arm]], client, name, progress=False)
        again = client.answer(result.arms["without"].results[0].messages)
    rows = {row["arm"]: row for row in result.rows()}
    without, ours = (round(rows[a]["contains"] * size) for a in ("without", arm))
    assert without >= size // 3, f"the model answered only {without} of {size}: is it the real one?"
    assert ours >= without - MARGIN * size // 24, (
        f"{name}: {ours} answered with ContextPilot ({arm}), {without} without"
    )
    assert rows[arm]["changed"] > 0.3  # what was sent changed: the check says something
    assert again.text == result.arms["without"].results[0].answer.text  # greedy: the same answer again
    if name == "facts-chat":  # de-duplication still saves prompt tokens, the top document in full
        assert rows[arm]["references"] > 0 and rows[arm]["gold_referred"] == 0
        assert rows[arm]["new_tokens_ratio"] < 0.9
