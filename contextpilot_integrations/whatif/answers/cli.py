"""``contextpilot-integrations answers``: does your model answer as well with ContextPilot?

Sends the same questions to your server once per arm (without ContextPilot, the defaults,
each annotation and reference form), greedy, and prints each arm's accuracy with its 95%
interval and its gap to the baseline, paired over the same questions. Theirs is the verdict
that matters: a 270M model is not your model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ...errors import EngineError
from .arms import ARMS, arm
from .compare import compare, dumps
from .engine import AnswerClient
from .tasks import WORKLOADS, WorkloadError, workload

__all__ = ["add_answers_command", "run_answers"]

SINGLE_ARMS = ("without", "default", "offline", "annotated", "moved", "labels")
CHAT_ARMS = ("without", "default", "refs-anywhere", "label-refs", "no-dedup")


def _names(choices: Any, what: str) -> Any:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(choices)}")
        return names

    return parse


def add_answers_command(commands: Any) -> None:
    """The ``answers`` subcommand on the CLI's subparsers."""
    text = "ask your model the same questions with and without ContextPilot and compare its answers"
    command = commands.add_parser("answers", help=text, description=text)
    command.add_argument("--engine", metavar="URL", required=True, help="your OpenAI-compatible server")
    command.add_argument(
        "--api",
        choices=("completion", "chat"),
        default="completion",
        help="completion: one flattened prompt (base models; default); chat: the model's chat template",
    )
    command.add_argument("--model", default="default", help="the model name the server expects")
    command.add_argument(
        "--workloads",
        type=_names(WORKLOADS, "workload"),
        default=["facts", "facts-chat"],
        help="comma-separated: " + "; ".join(f"{name}: {spec[2]}" for name, spec in WORKLOADS.items()),
    )
    command.add_argument(
        "--arms",
        type=_names(ARMS, "arm"),
        help=f"comma-separated (default: {','.join(SINGLE_ARMS)} single-shot, {','.join(CHAT_ARMS)} in chats); "
        + "; ".join(f"{name}: {one.description}" for name, one in ARMS.items()),
    )
    command.add_argument("--questions", type=int, default=200, help="questions a workload (200)")
    command.add_argument("--seed", type=int, default=0, help="the same seed asks the same questions (0)")
    command.add_argument(
        "--concurrency", type=int, default=1, help="questions in flight (give the server as many slots)"
    )
    command.add_argument("--max-tokens", type=int, default=24, help="tokens an answer may take (24)")
    command.add_argument("--margin", type=float, default=0.05, help="the loss a 'not worse' verdict rules out (0.05)")
    command.add_argument("--json", action="store_true", help="print the results as JSON")
    command.add_argument("--out", type=Path, help="also write the JSON results to this file")
    command.add_argument("--quiet", action="store_true", help="no progress bar")


def run_answers(args: argparse.Namespace) -> int:
    """Run ``answers``; 0, 2 (bad arguments) or 3 (the server failed)."""
    if args.questions < 1 or args.concurrency < 1 or args.max_tokens < 1 or not 0 < args.margin < 1:
        print("error: --questions, --concurrency and --max-tokens must be at least 1, --margin in (0, 1)",
              file=sys.stderr)  # fmt: skip
        return 2
    results = []
    try:
        with AnswerClient(args.engine, args.api, args.model, args.max_tokens) as client:
            for name in args.workloads:
                questions = workload(name, args.questions, args.seed)
                chat = WORKLOADS[name][1]
                names = args.arms or (CHAT_ARMS if chat else SINGLE_ARMS)
                if "without" not in names:
                    names = ["without", *names]
                arms = [arm(n) for n in names if not (chat and arm(n).batch)]
                result = compare(questions, arms, client, name, args.concurrency, not (args.quiet or args.json),
                                 args.margin)  # fmt: skip
                results.append(result)
                if not args.json:
                    result.print()
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(dumps(results))
    if args.out:
        args.out.write_text(dumps(results), encoding="utf-8")
    return 0
