"""``contextpilot-integrations``: measure context reuse on a trace, no GPU needed.

contextpilot-integrations demo                      # bundled MultiHop-RAG sample
contextpilot-integrations simulate --trace my.jsonl # your own trace
contextpilot-integrations simulate --synthetic NAME # a generated workload (whatif.synthetic)
contextpilot-integrations generate NAME trace.jsonl # write one as a trace
contextpilot-integrations listen                    # the eviction callback server, standalone
contextpilot-integrations answers --engine URL      # your model's answers with and without ContextPilot
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from .. import __version__
from ..core.usage import MAX_TOKENS
from ..engines.router import Router
from ..index.cluster import SCIPY_MISSING, scipy_missing
from ..index.strategies import STRATEGIES
from ..pilot import ContextPilot
from .answers.cli import add_answers_command, run_answers
from .engine_compare import EngineComparison, EngineComparisonError, engine_unreachable
from .provider_sim import add_provider_options, provider_whatif
from .replay import ARRIVALS, FEEDBACKS, MODES, Mode, PromptShape, replay, replay_routed, reuse_bound_of_prompts
from .report import PLOT_NAME, PLOT_SUFFIXES, Row, as_json, plot, print_table
from .synthetic import FAMILIES, SyntheticError, family, generate
from .trace import TraceError, TraceRequest, load_trace, multihop_chats, multihop_trace, working_set_tokens
from .workers import worker_rows

DEFAULT_STRATEGY = inspect.signature(ContextPilot).parameters["strategy"].default
DEFAULT_CAPACITIES = (0.1, 0.25, 0.5, 1.0)
ROUTINGS = Router.ROUTINGS
PAPER_LIMIT = 10_000
FEEDBACK_HELP = (
    "what the engine tells back about evictions (online and chat): exact (block-level), request "
    "(a lost block drops the request: SGLang's KV events without block boundaries; the default), "
    "usage (each request's own cached tokens: llama.cpp, vLLM or hosted APIs without events), none"
)


def strategy_names() -> list[str]:
    """The registered strategies, the baseline (retrieval order) first."""
    return sorted(STRATEGIES, key=lambda name: (name != "retrieval", name))


def label(strategy: str) -> str:
    if strategy == "retrieval":
        return "retrieval order"
    return f"{strategy} (default)" if strategy == DEFAULT_STRATEGY else strategy


# ---- argument types -------------------------------------------------------------------------
def _capacities(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("capacities are fractions like 0.1,0.25,1") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError("each capacity must be a fraction in (0, 1]")
    return values


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def _count(minimum: int) -> type:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text:.20}")
        if value > MAX_TOKENS:
            raise argparse.ArgumentTypeError(f"must be at most {MAX_TOKENS:,}, got {text:.20}")
        return value

    return parse  # type: ignore[return-value]


def _names(choices: Sequence[str], what: str) -> type:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"name at least one {what}, from: {', '.join(choices)}")
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what}: {', '.join(unknown)} (known: {', '.join(choices)})")
        return list(dict.fromkeys(names))

    return parse  # type: ignore[return-value]


def _family(text: str) -> str:
    if text not in FAMILIES:
        raise argparse.ArgumentTypeError(f"unknown synthetic family: {text} (known: {', '.join(FAMILIES)})")
    return text


def plot_file(out: Path) -> Path:
    """Where ``--out`` puts the plot: the file itself when it names one (a suffix, and not a
    folder already there), else :data:`PLOT_NAME` in that folder."""
    return out if out.suffix and not out.is_dir() else out / PLOT_NAME


def _check_writable(path: Path, directory: bool) -> str | None:
    """Fail before hours of replays, not after: can we write there?"""
    folder = path if directory else path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if directory:
            probe = folder / ".contextpilot-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        else:
            with path.open("a", encoding="utf-8"):
                pass
    except OSError as exc:
        return f"cannot write {path}: {exc.strerror or exc}"
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="contextpilot-integrations",
        description="Measure how much prefix-cache reuse ContextPilot gets on a retrieval trace.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    listen = commands.add_parser(
        "listen",
        help="run the eviction callback server (for checking an SGLang setup)",
        description="Run the eviction callback server with its own index and print what arrives.",
    )
    listen.add_argument("--host", default="127.0.0.1", help="interface (127.0.0.1; others need --token)")
    listen.add_argument("--port", type=_port, default=8765)
    listen.add_argument("--token", help="shared secret the publisher must send (CONTEXTPILOT_EVENTS_TOKEN)")
    listen.add_argument("--page-size", type=_count(1), help="the engine's --page-size, if known")
    listen.add_argument("--seconds", type=float, help="stop after this long (default: until Ctrl-C)")
    make = commands.add_parser(
        "generate",
        help="write a synthetic workload as a trace (JSON lines simulate --trace reads)",
        description="Write a synthetic workload as a trace. "
        + "; ".join(f"{name}: {spec.description}" for name, spec in FAMILIES.items()),
    )
    make.add_argument("family", type=_family, help=", ".join(FAMILIES))
    make.add_argument("path", type=Path, help="the trace file to write")
    make.add_argument("--requests", type=_count(1), help="how many requests (default: the family's)")
    make.add_argument("--seed", type=_count(0), default=0, help="the same seed gives the same trace (0)")
    make.add_argument("--texts", action="store_true", help="give every block a text (to send it to a server)")
    make.add_argument("--quiet", action="store_true", help="no progress bar")
    add_answers_command(commands)
    for name, help_text in (
        ("demo", "run the bundled MultiHop-RAG sample (2,556 real queries, BM25 top-15; grouped into chats)"),
        ("simulate", "run your own JSON-lines trace, or a generated workload (--synthetic)"),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        if name == "simulate":
            source = command.add_mutually_exclusive_group(required=True)
            source.add_argument("--trace", type=Path, help="JSON lines: id, blocks, tokens?, texts?, question?, ...")
            source.add_argument(
                "--synthetic",
                type=_family,
                metavar="NAME",
                help=f"a generated workload instead of a trace: {', '.join(FAMILIES)}",
            )
            command.add_argument(
                "--limit", type=_count(1), help="read only the first N requests of the trace (--synthetic: generate N)"
            )
            command.add_argument("--seed", type=_count(0), default=0, help="--synthetic: the seed (0)")
            command.add_argument(
                "--plan-out",
                type=Path,
                help="write the default strategy's plan (offline, else chat): per request, blocks sent and references",
            )
        command.add_argument(
            "--capacity",
            type=_capacities,
            default=list(DEFAULT_CAPACITIES),
            help="cache sizes as fractions of the working set (default 0.1,0.25,0.5,1)",
        )
        command.add_argument(
            "--strategies",
            type=_names(strategy_names(), "strategy"),
            help=f"comma-separated, from: {', '.join(strategy_names())} (default: all; paper needs the [paper] extra, "
            "and is left out without it)",
        )
        command.add_argument(
            "--modes",
            type=_names(MODES, "mode"),
            help="comma-separated, from: offline, online, chat (default: offline,online,chat for the demo; "
            "chat for a trace with conversations, else offline,online)",
        )
        command.add_argument("--arrival", choices=ARRIVALS, default="interleave", help="online arrival order")
        command.add_argument(
            "--targets",
            type=_count(1),
            default=1,
            help="online: route across this many engines, each its own cache of the capacity divided among them",
        )
        command.add_argument(
            "--routing",
            type=_names(ROUTINGS, "routing"),
            default=["round_robin", "cache_aware"],
            help=f"online with --targets > 1: from {', '.join(ROUTINGS)} (default: round_robin,cache_aware)",
        )
        command.add_argument(
            "--workers",
            type=_count(1),
            default=1,
            help="online: deal requests round-robin to this many application workers on one engine, each with its "
            "own index (what uvicorn --workers N does)",
        )
        command.add_argument(
            "--shared",
            action="store_true",
            help="online with --workers: also the workers sharing one index (what [shared] does), side by side",
        )
        command.add_argument("--feedback", choices=FEEDBACKS, default="request", help=FEEDBACK_HELP)
        command.add_argument(
            "--history-turns",
            type=_count(0),
            default=4 if name == "demo" else None,
            help="chat: earlier turns each prompt keeps (default: " + ("4)" if name == "demo" else "all)"),
        )
        command.add_argument("--answer-tokens", type=_count(0), default=64, help="chat: tokens of each answer (64)")
        command.add_argument(
            "--system-tokens", type=_count(0), default=PromptShape().system_tokens, help="tokens of the system prompt"
        )
        command.add_argument(
            "--question-tokens", type=_count(1), default=16, help="tokens of a question for lines without its text (16)"
        )
        command.add_argument(
            "--paper-limit",
            type=_count(1),
            default=PAPER_LIMIT,
            help=f"skip the paper strategy above this many requests: its batch plan is quadratic ({PAPER_LIMIT:,})",
        )
        command.add_argument(
            "--engine",
            metavar="URL",
            help="also compare on this OpenAI-compatible server (needs block texts): SGLang, or vLLM with "
            "VLLM_SERVER_DEV_MODE=1, flushed before every pass",
        )
        command.add_argument(
            "--engine-cmd",
            metavar="CMD",
            help="start the server from this command line ({port} is replaced by a free port): SGLang and vLLM "
            "once, flushed before every pass; others (llama-server) afresh for every pass",
        )
        command.add_argument("--engine-requests", type=_count(1), default=200, help="requests sent per pass (200)")
        command.add_argument(
            "--engine-modes", type=_names(MODES, "mode"), default=list(MODES), help="modes compared on the server"
        )
        command.add_argument("--engine-block-chars", type=_count(1), help="cut each block to this many characters")
        command.add_argument(
            "--engine-passes", type=int, choices=(4, 2), default=4, help="passes a mode: 4 (A B B A) or 2 (A B)"
        )
        command.add_argument("--model", default="default", help="the model name the server expects")
        command.add_argument("--json", action="store_true", help="print results as JSON")
        command.add_argument(
            "--out",
            type=Path,
            default=Path("contextpilot-out"),
            help=f"where the plot goes: a file named with its format ({', '.join(PLOT_SUFFIXES)}), its folder made "
            f"if missing; any other path is a folder that gets {PLOT_NAME} (default: contextpilot-out)",
        )
        command.add_argument("--no-plot", action="store_true", help="do not write the plot")
        command.add_argument("--quiet", action="store_true", help="no progress bar")
        add_provider_options(command)
    return parser


@dataclass(frozen=True)
class Workload:
    title: str
    single: list[TraceRequest]
    chat: list[TraceRequest]


def _workload(args: argparse.Namespace) -> Workload:
    if args.command == "demo":
        texts = bool(args.engine or args.engine_cmd)
        return Workload(
            "MultiHop-RAG sample (bundled; ODC-BY 1.0)", multihop_trace(texts=texts), multihop_chats(texts=texts)
        )
    if args.synthetic:
        spec = family(args.synthetic)
        if args.limit:
            spec = spec.with_requests(args.limit)
        texts = bool(args.engine or args.engine_cmd)
        trace = generate(spec, seed=args.seed, texts=texts)
        return Workload(f"synthetic {spec.name} (seed {args.seed}): {spec.description}", trace, trace)
    trace = load_trace(args.trace, limit=args.limit)
    return Workload(str(args.trace), trace, trace)


def _chat_working_set(trace: Sequence[TraceRequest], shape: PromptShape, history_turns: int | None) -> int:
    """What the baseline (every block resent) would leave in a cache that never evicts:
    every conversation's prompts and answers, shared prefixes counted once."""
    return replay(
        trace, "retrieval", "chat", None, shape=shape, history_turns=history_turns, deduplicate=False
    ).held_tokens


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "listen":
        return _listen(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "answers":
        return run_answers(args)
    try:
        workload = _workload(args)
    except (TraceError, SyntheticError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    notes: list[str] = []
    has_chat = any(r.conversation is not None for r in workload.chat)
    every = args.command == "demo" or (getattr(args, "synthetic", None) and has_chat)
    modes = args.modes or (list(MODES) if every else (["chat"] if has_chat else ["offline", "online"]))
    if not args.modes and not every and has_chat:
        notes.append(_why_chat_only(workload.chat))
    problem = _strategies(args, notes) or _check_outputs(args, modes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    shape = PromptShape(args.system_tokens, args.question_tokens, args.answer_tokens)
    if args.provider:  # the hosted API's bill only
        try:
            lines, provider_report = provider_whatif(args, workload.single, workload.chat, modes, shape)
        except (KeyError, ValueError) as exc:
            print(f"error: {str(exc).strip(chr(39))}", file=sys.stderr)
            return 2
        print(json.dumps(provider_report, indent=2) if args.json else "\n".join(lines))
        return 0
    strategies = list(args.strategies)
    if "paper" in strategies and len(workload.single) > args.paper_limit:
        strategies.remove("paper")
        notes.append(
            f"paper skipped: {len(workload.single):,} requests > --paper-limit {args.paper_limit:,} "
            "(its batch plan is quadratic in time and memory; raise the limit to run it)"
        )
    runs = _runs(workload, modes, args.capacity, strategies, shape, args.history_turns)
    plan: list[dict[str, object]] = []
    plan_key = _plan_key(runs, args) if args.command == "simulate" and args.plan_out else None
    rows = []
    total = sum(
        len(trace)
        * (len(args.routing) if mode == "online" and args.targets > 1 else 1)
        * (1 + args.shared if mode == "online" and args.workers > 1 else 1)
        for trace, mode, *_ in runs
    )
    with tqdm(total=total, desc="replaying", unit="req", disable=args.quiet or args.json) as bar:
        for trace, mode, fraction, capacity, strategy, dedup, baseline in runs:
            bar.set_postfix_str(f"{mode} {fraction:.0%} {strategy}", refresh=False)
            if mode == "online" and args.workers > 1:
                rows += worker_rows(
                    trace, strategy, capacity, fraction, workers=args.workers, shared=args.shared,
                    name=label(strategy), baseline=baseline, feedback=args.feedback, shape=shape, arrival=args.arrival,
                )  # fmt: skip
                bar.update(len(trace) * (2 if args.shared else 1))
                continue
            if mode == "online" and args.targets > 1:
                for routing in args.routing:
                    result = replay_routed(
                        trace,
                        strategy,
                        capacity // args.targets,
                        targets=args.targets,
                        routing=routing,
                        feedback=args.feedback,
                        shape=shape,
                        arrival=args.arrival,
                    )
                    first = baseline and routing == args.routing[0]
                    rows.append(Row(fraction, f"{label(strategy)}, {routing.replace('_', '-')}", result, first))
                bar.update(len(trace))
                continue
            result = replay(
                trace,
                strategy,
                mode,
                capacity,
                arrival=args.arrival,
                feedback=args.feedback,
                shape=shape,
                history_turns=args.history_turns,
                deduplicate=dedup,
                plan_out=plan if (mode, fraction, strategy, dedup) == plan_key else None,
                on_request=bar.update,
            )
            text = label(strategy) if mode != "chat" else _chat_label(strategy, dedup)
            rows.append(Row(fraction, text, result, baseline))
    notes += _notes(workload, rows)
    if plan_key is not None:
        args.plan_out.write_text("".join(json.dumps(row) + "\n" for row in plan), encoding="utf-8")
    plot_path = None if args.no_plot else plot(rows, plot_file(args.out), workload.title)
    engine: EngineComparison | None = None
    if args.engine or args.engine_cmd:
        outcome = _run_engine(args, workload)
        if isinstance(outcome, int):
            return outcome
        engine = outcome
    if args.json:
        report: dict[str, object] = {
            "title": workload.title,
            "requests": len(workload.single),
            "chat_turns": len(workload.chat) if "chat" in modes else None,
            "prompt_tokens": "system + chat history + blocks + references + annotation + question",
            "arrival": args.arrival,
            "feedback": args.feedback,
            "history_turns": args.history_turns,
            "reuse_bound": reuse_bound_of_prompts(workload.single, shape),
            "results": as_json(rows),
            "notes": notes,
            "plot": str(plot_path) if plot_path else None,
        }
        if engine is not None:
            report["engine"] = engine.as_json()
        if args.command == "demo":
            report["provider"] = provider_whatif(args, workload.single, workload.chat, modes, shape)[1]
        print(json.dumps(report, indent=2))
        return 0
    print_table(workload.title, _header(args, workload, modes, shape), rows, notes)
    if plan_key is not None:
        print(f"plan ({label(DEFAULT_STRATEGY)}, {plan_key[0]}, send order): {args.plan_out}")
    if plot_path:
        print(f"plot: {plot_path.resolve()}")
    if engine is not None:
        engine.print()
    if args.command == "demo":  # one hosted API's bill (simulate --provider for others)
        print("\n".join(["", *provider_whatif(args, workload.single, workload.chat, modes, shape)[0]]))
    return 0


Run = tuple[list[TraceRequest], Mode, float, int, str, bool, bool]


def _runs(
    workload: Workload,
    modes: Sequence[Mode],
    fractions: Sequence[float],
    strategies: Sequence[str],
    shape: PromptShape,
    history_turns: int | None,
) -> list[Run]:
    """(trace, mode, fraction, capacity, strategy, de-duplicate, baseline) for every replay."""
    runs: list[Run] = []
    for mode in modes:
        trace = workload.chat if mode == "chat" else workload.single
        base = _chat_working_set(trace, shape, history_turns) if mode == "chat" else working_set_tokens(trace)
        for fraction in fractions:
            capacity = int(base * fraction)
            if mode == "chat":
                runs.append((trace, mode, fraction, capacity, "retrieval", False, True))
            for strategy in strategies:
                runs.append(
                    (trace, mode, fraction, capacity, strategy, True, strategy == "retrieval" and mode != "chat")
                )
    return runs


def _why_chat_only(trace: Sequence[TraceRequest]) -> str:
    """The note that says why a trace runs in chat mode alone (it is chosen, not asked for)."""
    conversations = len({r.conversation for r in trace if r.conversation is not None})
    inside = sum(1 for r in trace if r.conversation is not None)
    alone = len(trace) - inside
    which = "one conversation" if conversations == 1 else f"{conversations:,} conversations"
    rest = f"; the other {alone:,} lines are replayed as chats of one turn" if alone else ""
    return (
        f"chat mode only: {inside:,} of the trace's {len(trace):,} lines belong to {which}{rest}. "
        "--modes offline,online replays every line on its own, without its history"
    )


def _strategies(args: argparse.Namespace, notes: list[str]) -> str | None:
    """Fill in ``args.strategies`` (all by default); the paper strategy needs scipy."""
    asked = args.strategies is not None
    args.strategies = list(args.strategies or strategy_names())
    if "paper" in args.strategies and scipy_missing():
        if asked:
            return SCIPY_MISSING
        args.strategies.remove("paper")
        notes.append(f"paper left out: {SCIPY_MISSING}")
    return None


def _chat_label(strategy: str, dedup: bool) -> str:
    return f"{label(strategy)} + de-dup" if dedup else "retrieval order, every block resent"


def _check_outputs(args: argparse.Namespace, modes: Sequence[str]) -> str | None:
    if args.command == "simulate" and args.plan_out:
        if DEFAULT_STRATEGY not in args.strategies:
            return f"--plan-out writes the {DEFAULT_STRATEGY} strategy's plan: add it to --strategies"
        if not {"offline", "chat"} & set(modes):
            return "--plan-out writes an offline or chat plan: add offline or chat to --modes"
    checks = []
    if not args.no_plot:
        target = plot_file(args.out)
        if target.suffix.lower() not in PLOT_SUFFIXES:
            return (
                f"--out {args.out}: a plot file ends in {', '.join(PLOT_SUFFIXES)}; a folder has no suffix "
                "(or is there already)"
            )
        checks.append((target.parent, True))  # the file itself is written only if matplotlib is there
    if args.command == "simulate" and args.plan_out:
        checks.append((args.plan_out, False))
    for path, directory in checks:
        problem = _check_writable(path, directory)
        if problem:
            return problem
    if args.engine and args.engine_cmd:
        return "give --engine URL or --engine-cmd CMD, not both"
    if args.workers > 1 and args.targets > 1:
        return "give --workers (one engine, several workers) or --targets (several engines), not both"
    if args.engine:  # before the replays, which can take minutes
        return engine_unreachable(args.engine)
    return None


def _plan_key(runs: Sequence[Run], args: argparse.Namespace) -> tuple[str, float, str, bool] | None:
    for _, mode, fraction, _, strategy, dedup, _ in runs:
        if strategy == DEFAULT_STRATEGY and mode in ("offline", "chat") and dedup:
            return mode, fraction, strategy, dedup
    return None


def _header(args: argparse.Namespace, workload: Workload, modes: Sequence[str], shape: PromptShape) -> list[str]:
    lines = []
    if {"offline", "online"} & set(modes):
        trace = workload.single
        blocks = sum(len(r.blocks) for r in trace)
        lines.append(
            f"single-shot: {len(trace):,} requests, {blocks:,} blocks, "
            f"{working_set_tokens(trace):,} distinct block tokens (capacity is a share of these)"
        )
        bound = reuse_bound_of_prompts(trace, shape)
        lines.append(
            f"reuse bound (system prompt and blocks an earlier request sent, of all prompt tokens): {bound:.1%}"
        )
    if "online" in modes:
        spread = f"; across {args.targets} engines, each 1/{args.targets} of the cache" if args.targets > 1 else ""
        lines.append(f"online: arrival {args.arrival}, feedback {args.feedback}{spread}")
    if "chat" in modes:
        conversations = len({r.conversation or r.id for r in workload.chat})
        history = "all turns" if args.history_turns is None else f"the last {args.history_turns} turns"
        own = [r.history_turns for r in workload.chat if r.history_turns is not None]
        if own:  # a line's own history_turns wins
            history += f" (lines that give history_turns: theirs, up to {max(own)})"
        lines.append(
            f"chat: {conversations:,} conversation{'' if conversations == 1 else 's'}, {len(workload.chat):,} turns, "
            "interleaved by turn; "
            f"history {history}; answers of {shape.answer_tokens} tokens; feedback {args.feedback}; capacity is a "
            "share of what resending every block would leave in a cache that never evicts"
        )
    return lines


def _notes(workload: Workload, rows: Sequence[Row]) -> list[str]:
    notes = []
    guessed = sum(1 for r in workload.single if r.tokens is None)
    if guessed:
        from_text = sum(1 for r in workload.single if r.tokens is None and r.texts is not None)
        notes.append(
            f"{guessed:,} lines give no tokens: {from_text:,} estimated from texts (4 characters a token), "
            f"the other {guessed - from_text:,} count each block as one token"
        )
    for row in rows:
        r = row.result
        if r.oversized_requests and not row.baseline:
            notes.append(
                f"{r.mode} at {row.fraction:.0%} ({r.capacity_tokens:,} tokens): {r.oversized_requests:,} prompts are "
                "larger than the cache, and a request larger than the cache is never cached (no engine runs "
                "there: vLLM and SGLang refuse a prompt longer than their KV cache; ordering can lose there by chance)"
            )
    return list(dict.fromkeys(notes))


def _generate(args: argparse.Namespace) -> int:
    """Write a synthetic workload as a trace file ``simulate --trace`` reads back."""
    spec = family(args.family)
    if args.requests:
        spec = spec.with_requests(args.requests)
    problem = _check_writable(args.path, directory=False)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    with tqdm(total=spec.requests, desc=f"generating {spec.name}", unit="req", disable=args.quiet) as bar:
        trace = generate(spec, seed=args.seed, texts=args.texts, on_request=bar.update)
    with args.path.open("w", encoding="utf-8") as out:
        for request in trace:
            out.write(request.model_dump_json(exclude_none=True) + "\n")
    print(f"{len(trace):,} requests of {spec.name} (seed {args.seed}): {args.path}")
    return 0


def _listen(args: argparse.Namespace) -> int:
    import time

    from ..engines import EvictionListener

    try:
        listener = EvictionListener(ContextPilot(), args.host, args.port, token=args.token, page_size=args.page_size)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    config = json.dumps({"publisher": "contextpilot_http", "endpoint": listener.kv_events_url})
    print(f"listening on {listener.url} (GET /health, GET /stats, POST /kv-events, POST /evict)")
    print(f"start SGLang with:  --enable-cache-report --kv-events-config '{config}'", flush=True)
    deadline = time.monotonic() + args.seconds if args.seconds else None
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        stats = listener.sink.stats()
        listener.stop()
    print(f"received {stats.batches} batches, {stats.events} events, {stats.sequence_gaps} gaps")
    return 0


def _run_engine(args: argparse.Namespace, workload: Workload) -> EngineComparison | int:
    """The same workload on a real server, every pass on a clean cache."""
    try:
        return EngineComparison.run(args, workload.single, workload.chat)
    except EngineComparisonError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
