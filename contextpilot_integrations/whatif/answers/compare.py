"""Run arms over a workload on a served model, score the answers, and say what they show.

Each arm's prompts are prepared first (:mod:`.arms`), then sent: single-shot questions in
any order, a conversation's turns one after another with the history the arm itself built
(its own earlier prompts and the model's own answers). ``concurrency`` questions or
conversations are in flight at once (give the server as many slots).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from ..engine_compare import plain_prompt
from ..replay import SYSTEM_PROMPT
from .arms import Arm, Prompt
from .engine import Answer, AnswerClient
from .scoring import METRICS, Gap, Score, gap, score, verdict, wilson
from .tasks import Question

__all__ = ["ArmResult", "Result", "WorkloadResult", "compare"]

BASELINE = "without"


@dataclass(frozen=True, slots=True)
class Result:
    """One question as one arm sent it, and what came back."""

    index: int
    messages: tuple[dict[str, str], ...] = field(repr=False)
    answer: Answer
    score: Score
    changed: bool
    """The user message differs from the baseline's (reordered, annotated or referred)."""
    references: int
    """Location references in the user message sent."""
    new_tokens: int
    """Prompt tokens after the history the previous turn left (all of them for a first turn)."""
    gold_referred: bool = False
    """The document holding the answer went out as a reference, not in full."""


@dataclass
class ArmResult:
    arm: Arm
    results: list[Result]
    """By question index."""

    def values(self, metric: str) -> list[float]:
        return [result.score.get(metric) for result in self.results]

    def mean(self, metric: str) -> float:
        return statistics.fmean(self.values(metric))


@dataclass
class WorkloadResult:
    """Every arm's answers to one workload."""

    name: str
    questions: list[Question]
    arms: dict[str, ArmResult]
    margin: float = 0.05

    def clusters(self) -> list[str]:
        return [q.conversation or q.id for q in self.questions]

    def gap(self, name: str, metric: str = "contains") -> Gap:
        """Arm ``name`` minus the baseline, paired over the same questions."""
        return gap(self.arms[name].values(metric), self.arms[BASELINE].values(metric), self.clusters())

    def rows(self) -> list[dict[str, Any]]:
        """One summary per arm: accuracy with its interval, the gap to the baseline and its
        verdict, how much of what was sent changed, and the prompt tokens."""
        base = self.arms.get(BASELINE)
        rows = []
        for name, result in self.arms.items():
            n = len(result.results)
            right = sum(result.values("contains"))
            low, high = wilson(right, n)
            row: dict[str, Any] = {
                "arm": name,
                "description": result.arm.description,
                "questions": n,
                "contains": right / n,
                "contains_95": [low, high],
                "exact": result.mean("exact"),
                "f1": result.mean("f1"),
                "changed": sum(r.changed for r in result.results) / n,
                "references": sum(r.references for r in result.results),
                "gold_referred": sum(r.gold_referred for r in result.results),
                "gold_referred_contains": _mean([r.score.contains for r in result.results if r.gold_referred]),
                "prompt_tokens": sum(r.answer.prompt_tokens for r in result.results),
                "new_tokens": sum(r.new_tokens for r in result.results),
            }
            if base is not None and name != BASELINE:
                for metric in METRICS:
                    difference = self.gap(name, metric)
                    row[f"gap_{metric}"] = [difference.mean, difference.low, difference.high]
                row["discordant"] = self.gap(name).discordant
                row["verdict"] = verdict(self.gap(name), self.margin)
                base_new = sum(r.new_tokens for r in base.results)
                row["new_tokens_ratio"] = row["new_tokens"] / base_new if base_new else None
            rows.append(row)
        return rows

    def as_json(self) -> dict[str, Any]:
        return {"workload": self.name, "questions": len(self.questions), "margin": self.margin, "arms": self.rows()}

    def print(self, out: Callable[[str], None] = print) -> None:
        out(f"\n{self.name}: {len(self.questions)} questions; 'contains' = a gold answer in the answer; gap = arm - "
            f"without over the same questions (95% bootstrap); verdict at a {self.margin:.0%} margin")  # fmt: skip
        head = (f"{'arm':<14}{'contains':>9}{'95% interval':>15}{'exact':>7}{'F1':>6}{'gap':>8}{'95% interval':>17}"
                f"{'verdict':>11}{'changed':>9}{'refs':>6}{'new tokens':>12}")  # fmt: skip
        out(head)
        out("-" * len(head))
        for row in self.rows():
            low, high = row["contains_95"]
            line = (f"{row['arm']:<14}{row['contains']:>9.3f}{f'{low:.2f}-{high:.2f}':>15}{row['exact']:>7.2f}"
                    f"{row['f1']:>6.2f}")  # fmt: skip
            if "gap_contains" in row:
                mean, glow, ghigh = row["gap_contains"]
                line += f"{mean * 100:>+7.1f}p{f'{glow * 100:+.1f} to {ghigh * 100:+.1f}':>17}{row['verdict']:>11}"
            else:
                line += " " * 46
            ratio = row.get("new_tokens_ratio")
            tokens = f"{row['new_tokens']:,}" + (f" ({ratio:.2f})" if ratio else "")
            line += f"{row['changed']:>9.0%}{row['references']:>6}{tokens:>19}"
            out(line)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _messages(prompt: Prompt, history: list[dict[str, str]]) -> list[dict[str, str]]:
    if prompt.prepared is not None:  # a reference whose target is not in the history goes out in full
        return prompt.prepared.to_messages(SYSTEM_PROMPT, history)
    return [{"role": "system", "content": SYSTEM_PROMPT}, *history, {"role": "user", "content": prompt.text}]


def _send(
    client: AnswerClient, questions: Sequence[Question], prompts: Sequence[Prompt], tick: Callable[[], None]
) -> list[Result]:
    """One conversation's turns in order (or one single-shot question)."""
    history: list[dict[str, str]] = []
    results = []
    before = 0  # prompt and answer tokens of the previous turn
    for prompt in prompts:
        question = questions[prompt.index]
        messages = _messages(prompt, history)
        answer = client.answer(messages)
        sent = messages[-1]["content"]
        referred = [r.block.id for r in prompt.prepared.references if r.text in sent] if prompt.prepared else []
        changed = sent != plain_prompt(question.blocks, question.question)
        scored = score(answer.text, question.answers)
        new = max(0, answer.prompt_tokens - before)
        results.append(Result(prompt.index, tuple(messages), answer, scored, changed, len(referred), new,
                              question.gold in referred))  # fmt: skip
        if question.conversation:
            history = [*messages[1:], {"role": "assistant", "content": answer.text}]
            before = answer.prompt_tokens + answer.completion_tokens
        tick()
    return results


def compare(
    questions: Sequence[Question],
    arms: Sequence[Arm],
    client: AnswerClient,
    name: str = "workload",
    concurrency: int = 1,
    progress: bool = True,
    margin: float = 0.05,
) -> WorkloadResult:
    """Every arm over the same questions on one served model."""
    if not any(arm.name == BASELINE for arm in arms):
        raise ValueError(f"the arms must include the baseline {BASELINE!r}")
    results: dict[str, ArmResult] = {}
    bar = tqdm(total=len(questions) * len(arms), desc=name, unit="q", disable=not progress)

    def tick() -> None:
        bar.update(1)

    with bar, ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for one in arms:
            groups: dict[str, list[Prompt]] = {}
            for prompt in one.prompts(questions):
                question = questions[prompt.index]
                groups.setdefault(question.conversation or question.id, []).append(prompt)
            done = pool.map(lambda group: _send(client, questions, group, tick), groups.values())
            by_index = {result.index: result for group in done for result in group}
            results[one.name] = ArmResult(one, [by_index[i] for i in range(len(questions))])
    return WorkloadResult(name, list(questions), results, margin)


def dumps(results: Sequence[WorkloadResult]) -> str:
    return json.dumps([result.as_json() for result in results], indent=2)
