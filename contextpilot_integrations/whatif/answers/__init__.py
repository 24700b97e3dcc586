"""Answer quality: does a model answer as well with ContextPilot as without it?

``contextpilot-integrations answers --engine URL`` (:mod:`.cli`) runs it on your server;
``benchmarks/bench_answers.py`` on the real model the tests use (Gemma 3 270M).
:mod:`.tasks` makes the questions, :mod:`.arms` what each arm sends, :mod:`.engine` asks the
model, :mod:`.scoring` scores answers and the gaps between arms, :mod:`.compare` runs it all.
"""

from .arms import ARMS, Arm, Prompt, arm
from .compare import ArmResult, Result, WorkloadResult, compare
from .engine import Answer, AnswerClient, flatten
from .scoring import Gap, Score, gap, normalize, score, verdict, wilson
from .tasks import WORKLOADS, Question, WorkloadError, bm25_rank, workload

__all__ = [
    "ARMS",
    "WORKLOADS",
    "Answer",
    "AnswerClient",
    "Arm",
    "ArmResult",
    "Gap",
    "Prompt",
    "Question",
    "Result",
    "Score",
    "WorkloadError",
    "WorkloadResult",
    "arm",
    "bm25_rank",
    "compare",
    "flatten",
    "gap",
    "normalize",
    "score",
    "verdict",
    "wilson",
    "workload",
]
