"""The arms of an answer-quality comparison: what each one sends for the same questions.

The baseline is what an application without ContextPilot sends: the documents' texts in
retrieval order, no labels, no annotation, every document in full in every turn. Every other
arm is a :class:`~contextpilot_integrations.ContextPilot` with some settings, online
(``prepare`` one question after another, as they arrive), or offline (``plan`` the whole
workload as one batch). In a conversation, the pilot is given the conversation's id, so
documents an earlier turn carried may go out as location references (unless the arm is
``conversations=False``: each turn prepared on its own, every document in full).

Prompts are prepared before anything is sent: what the pilot decides does not depend on
the model's answers, so every arm's prompts are the same on every run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...core.prepared import PreparedRequest
from ...pilot import BatchRequest, ContextPilot
from ..engine_compare import plain_prompt
from .tasks import Question

__all__ = ["ARMS", "Arm", "Prompt", "arm"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One question as an arm sends it."""

    index: int
    """The question's position in the workload."""
    prepared: PreparedRequest | None
    """What ContextPilot prepared (None: the baseline's plain prompt)."""
    text: str
    """The user message before references are checked against the history sent."""


@dataclass(frozen=True)
class Arm:
    """One way of sending a workload (see the module docstring)."""

    name: str
    description: str
    options: Mapping[str, Any] | None = field(default_factory=dict)
    """``ContextPilot(**options)``; None: without ContextPilot (the baseline)."""
    batch: bool = False
    """Offline: plan every question as one batch (single-shot questions only)."""
    conversations: bool = True
    """Give the pilot each conversation's id (de-duplication with references)."""

    def prompts(self, questions: Sequence[Question]) -> list[Prompt]:
        """Every question's prompt, in the order this arm sends them (a conversation's
        turns in turn order)."""
        if self.options is None:
            return [Prompt(i, None, plain_prompt(q.blocks, q.question)) for i, q in enumerate(questions)]
        pilot = ContextPilot(**self.options)
        if self.batch and not any(q.conversation for q in questions):
            batch = [BatchRequest(list(q.blocks), q.question) for q in questions]
            planned = pilot.plan(batch)
            return [Prompt(p.batch_index or 0, p, p.render()) for p in planned]
        prompts = []
        for index, question in enumerate(questions):
            conversation = question.conversation if self.conversations else None
            prepared = pilot.prepare(list(question.blocks), question.question, conversation)
            prompts.append(Prompt(index, prepared, prepared.render()))
        return prompts


_ANNOTATED = {"annotate_order": True}
_PREVIOUS = {"keep_top": False, "annotate_order": True}

ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("without", "without ContextPilot: retrieval order, no annotation, every document in full", None),
        Arm("default", "ContextPilot with its defaults, online"),
        Arm("offline", "ContextPilot with its defaults, the workload planned as one batch", batch=True),
        Arm("annotated", 'online, the ranking restated by position after the documents ("#2 > #1 > #3")',
            _ANNOTATED),
        Arm("moved", 'online, the annotation naming only the documents out of place ("#3 ranks 1")',
            {**_ANNOTATED, "order_form": "moved"}),
        Arm("top-anywhere", "online, the top document wherever reuse puts it, the ranking restated by position",
            _PREVIOUS),
        Arm("labels", "online, the paper's form: every document labelled [Doc_k], the ranking restated by label, "
            "the top document anywhere", {**_PREVIOUS, "order_form": "labels", "plain_prompts": False}),
        Arm("refs-anywhere", "conversations: any repeated document referred to by quoting its opening words, "
            "the top one too", _PREVIOUS),
        Arm("label-refs", "conversations in the paper's form: documents labelled, any repeat referred to by label",
            {**_PREVIOUS, "plain_prompts": False}),
        Arm("no-dedup", "ContextPilot without de-duplication: every document in full every turn",
            conversations=False),
    )
}  # fmt: skip
"""The arms the benchmark knows, by name."""


def arm(name: str) -> Arm:
    """The arm called ``name`` (:data:`ARMS`)."""
    try:
        return ARMS[name]
    except KeyError:
        raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARMS)}") from None
