"""``contextpilot-integrations``: measure context reuse on a trace, no GPU needed.

contextpilot-integrations demo                      # bundled MultiHop-RAG sample
contextpilot-integrations simulate --trace my.jsonl # your own trace
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from ..index.strategies import STRATEGIES
from ..pilot import ContextPilot
from .engine_compare import EngineRun
from .replay import (
    ReplayResult,
    TraceError,
    TraceRequest,
    conversation_savings,
    load_trace,
    multihop_trace,
    replay,
    reuse_bound,
    working_set_tokens,
)

DEFAULT_STRATEGY = inspect.signature(ContextPilot).parameters["strategy"].default


def strategy_names() -> list[str]:
    """The registered strategies, the baseline (retrieval order) first."""
    return sorted(STRATEGIES, key=lambda name: (name != "retrieval", name))


def label(strategy: str) -> str:
    if strategy == "retrieval":
        return "retrieval order"
    return f"{strategy} (default)" if strategy == DEFAULT_STRATEGY else strategy


DEFAULT_CAPACITIES = (0.1, 0.25, 0.5, 1.0)


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


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


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
    commands = parser.add_subparsers(dest="command", required=True)
    listen = commands.add_parser(
        "listen",
        help="run the eviction callback server (for checking an SGLang setup)",
        description="Run the eviction callback server with its own index and print what arrives.",
    )
    listen.add_argument("--host", default="127.0.0.1", help="interface (127.0.0.1; others need --token)")
    listen.add_argument("--port", type=_port, default=8765)
    listen.add_argument("--token", help="shared secret the publisher must send (CONTEXTPILOT_EVENTS_TOKEN)")
    listen.add_argument("--page-size", type=_positive, help="the engine's --page-size, if known")
    listen.add_argument("--seconds", type=float, help="stop after this long (default: until Ctrl-C)")
    for name, help_text in (
        ("demo", "run the bundled MultiHop-RAG sample (2,556 real queries, BM25 top-15)"),
        ("simulate", "run your own JSON-lines trace"),
    ):
        command = commands.add_parser(name, help=help_text, description=help_text)
        if name == "simulate":
            command.add_argument("--trace", required=True, type=Path, help="JSON lines: id, blocks, tokens?, ...")
            command.add_argument("--plan-out", type=Path, help="write the offline plan of the default strategy")
            command.add_argument("--limit", type=_positive, help="read only the first N requests of the trace")
        else:
            command.add_argument(
                "--engine", metavar="URL", help="also send the workload to this OpenAI-compatible server"
            )
            command.add_argument("--engine-requests", type=int, default=200, help="queries sent to the server (200)")
            command.add_argument(
                "--engine-block-chars", type=int, default=None, help="cut each chunk to this many characters"
            )
            command.add_argument("--model", default="default", help="the model name the server expects")
        command.add_argument(
            "--capacity",
            type=_capacities,
            default=list(DEFAULT_CAPACITIES),
            help="cache sizes as fractions of the trace's distinct block tokens (default 0.1,0.25,0.5,1)",
        )
        command.add_argument(
            "--strategies",
            default=",".join(strategy_names()),
            help=f"comma-separated, from: {', '.join(strategy_names())} (default: all)",
        )
        command.add_argument("--modes", default="offline,online", help="offline, online or both")
        command.add_argument("--json", action="store_true", help="print results as JSON")
        command.add_argument("--out", type=Path, default=Path("contextpilot-out"), help="where the plot goes")
        command.add_argument("--no-plot", action="store_true", help="do not write the PNG plot")
        command.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "listen":
        return _listen(args)
    try:
        if args.command == "demo":
            trace = multihop_trace()
            title = "MultiHop-RAG sample (bundled; ODC-BY 1.0)"
            conversations = multihop_trace(conversations=True)
        else:
            trace = load_trace(args.trace, limit=args.limit)
            title = str(args.trace)
            conversations = trace
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [s for s in strategies if s not in STRATEGIES] + [m for m in modes if m not in ("offline", "online")]
    if unknown:
        print(f"error: unknown strategy or mode: {', '.join(unknown)}", file=sys.stderr)
        return 2

    checks = [] if args.no_plot else [(args.out, True)]
    if args.command == "simulate" and args.plan_out:
        checks.append((args.plan_out, False))
    for path, directory in checks:
        problem = _check_writable(path, directory)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2

    working_set = working_set_tokens(trace)
    runs = [(mode, fraction, strategy) for mode in modes for fraction in args.capacity for strategy in strategies]
    results: list[tuple[float, ReplayResult]] = []
    plan: list[dict[str, object]] = []
    progress = tqdm(runs, desc="replaying", unit="run", leave=False, disable=args.quiet or args.json)
    for mode, fraction, strategy in progress:
        wants_plan = args.command == "simulate" and args.plan_out and mode == "offline" and strategy == "trie"
        capture = plan if wants_plan and not plan else None
        capacity = int(working_set * fraction)
        results.append((fraction, replay(trace, strategy, mode, capacity, plan_out=capture)))

    bound = reuse_bound(trace)
    savings = conversation_savings(conversations)
    plot_path = None if args.no_plot else _plot(results, bound, args.out, title)
    if args.command == "simulate" and args.plan_out:
        args.plan_out.write_text("".join(json.dumps(row) + "\n" for row in plan), encoding="utf-8")
    engine = _run_engine(args) if args.command == "demo" and args.engine else None
    if engine is not None and not isinstance(engine, tuple):
        return engine
    if args.json:
        report = _as_json(trace, results, bound, savings, plot_path)
        if engine:
            report["engine"] = [_engine_json(run) for run in engine]
        print(json.dumps(report, indent=2))
    else:
        _print_table(title, trace, working_set, results, bound, savings, plot_path)
        if args.command == "simulate" and args.plan_out:
            print(f"plan (default strategy, offline, send order): {args.plan_out}")
        if engine:
            _print_engine(args.engine, engine)
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


def _run_engine(args: argparse.Namespace) -> tuple[EngineRun, EngineRun] | int:
    """Send the demo workload to the server: (baseline, ContextPilot), or an exit status."""
    from ..engines.client import EngineError
    from .datasets import load_multihop_rag
    from .engine_compare import compare_on_engine

    data = load_multihop_rag()
    requests = []
    for query in data.queries[: args.engine_requests]:
        blocks = data.blocks_for(query)
        if args.engine_block_chars:
            blocks = [b.model_copy(update={"text": b.text[: args.engine_block_chars]}) for b in blocks]
        requests.append((blocks, query.text))
    try:
        return compare_on_engine(args.engine, requests, model=args.model, progress=not (args.quiet or args.json))
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


def _engine_json(run: EngineRun) -> dict[str, object]:
    return {
        "name": run.name,
        "requests": len(run.ttft_s),
        "mean_ttft_s": run.mean_ttft_s,
        "p90_ttft_s": run.p90_ttft_s,
        "prompt_tokens": run.prompt_tokens,
        "cached_tokens": run.cached_tokens,
    }


def _print_engine(url: str, runs: tuple[EngineRun, EngineRun]) -> None:
    baseline, ours = runs
    print(f"\nserver {url}: {len(baseline.ttft_s)} requests, server-reported numbers")
    print(f"{'':<18}{'mean TTFT':>12}{'p90 TTFT':>12}{'cached / prompt tokens':>28}")
    for run in runs:
        tokens = f"{run.cached_tokens:,} / {run.prompt_tokens:,} ({run.cached_ratio:.0%})"
        print(f"{run.name:<18}{run.mean_ttft_s * 1e3:>10.0f}ms{run.p90_ttft_s * 1e3:>10.0f}ms{tokens:>28}")
    if ours.mean_ttft_s:
        print(f"mean TTFT {baseline.mean_ttft_s / ours.mean_ttft_s:.2f}x lower with ContextPilot")


def _baseline(results: list[tuple[float, ReplayResult]], mode: str, fraction: float) -> float | None:
    for f, r in results:
        if r.mode == mode and f == fraction and r.strategy == "retrieval":
            return r.hit_ratio
    return None


def _print_table(
    title: str,
    trace: list[TraceRequest],
    working_set: int,
    results: list[tuple[float, ReplayResult]],
    bound: float,
    savings: object,
    plot_path: Path | None,
) -> None:
    blocks = sum(len(r.blocks) for r in trace)
    print(f"\n{title}: {len(trace):,} requests, {blocks:,} blocks, {working_set:,} distinct block tokens")
    print(f"reuse bound (tokens of blocks an earlier request already sent): {bound:.1%}\n")
    header = (
        f"{'mode':<8}{'capacity':>9}  {'strategy':<16}{'hit ratio':>10}{'vs retrieval':>14}"
        f"{'of bound':>10}{'pilot time':>13}"
    )
    print(header)
    print("-" * len(header))
    previous = None
    for fraction, r in results:
        key = (r.mode, fraction)
        base = _baseline(results, r.mode, fraction)
        versus = f"{r.hit_ratio / base:.1f}x" if base else "-"
        per = r.pilot_seconds / max(r.requests, 1) * 1e6
        timing = f"{r.pilot_seconds:.2f} s" if r.mode == "offline" else f"{per:.0f} us/req"
        lead = f"{r.mode:<8}{fraction:>9.0%}" if key != previous else " " * 17
        of_bound = r.hit_ratio / bound if bound else 0.0
        print(f"{lead}  {label(r.strategy):<16}{r.hit_ratio:>10.1%}{versus:>14}{of_bound:>10.1%}{timing:>13}")
        previous = key
    if savings.turns:  # type: ignore[attr-defined]
        s = savings
        print(
            f"\nmulti-turn: {s.conversations:,} conversations, {s.turns:,} turns; context prefill "  # type: ignore[attr-defined]
            f"{s.plain_tokens:,} tokens resending every block vs {s.deduplicated_tokens:,} with "  # type: ignore[attr-defined]
            f"de-duplication ({s.saved_ratio:.1%} saved)"  # type: ignore[attr-defined]
        )
    if plot_path:
        print(f"\nplot: {plot_path.resolve()}")


def _as_json(
    trace: list[TraceRequest],
    results: list[tuple[float, ReplayResult]],
    bound: float,
    savings: object,
    plot_path: Path | None,
) -> dict[str, object]:
    rows = []
    for fraction, r in results:
        base = _baseline(results, r.mode, fraction)
        rows.append(
            {
                "mode": r.mode,
                "capacity_fraction": fraction,
                "capacity_tokens": r.capacity_tokens,
                "strategy": r.strategy,
                "hit_ratio": r.hit_ratio,
                "hit_tokens": r.hit_tokens,
                "block_tokens": r.block_tokens,
                "vs_retrieval": r.hit_ratio / base if base else None,
                "of_bound": r.hit_ratio / bound if bound else None,
                "pilot_seconds": r.pilot_seconds,
            }
        )
    return {
        "requests": len(trace),
        "reuse_bound": bound,
        "results": rows,
        "conversations": {
            "conversations": savings.conversations,  # type: ignore[attr-defined]
            "turns": savings.turns,  # type: ignore[attr-defined]
            "plain_tokens": savings.plain_tokens,  # type: ignore[attr-defined]
            "deduplicated_tokens": savings.deduplicated_tokens,  # type: ignore[attr-defined]
        },
        "plot": str(plot_path) if plot_path else None,
    }


def _plot(results: list[tuple[float, ReplayResult]], bound: float, out: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: install matplotlib (pip install 'contextpilot-integrations[plot]') for the plot", file=sys.stderr)
        return None
    modes = list(dict.fromkeys(r.mode for _, r in results))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4.2), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for strategy in strategy_names():
            points = sorted((f, r.hit_ratio) for f, r in results if r.mode == mode and r.strategy == strategy)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label(strategy))
        ax.axhline(bound, color="grey", linestyle="--", linewidth=1, label="reuse bound")
        ax.set_title(mode)
        ax.set_xlabel("cache capacity (share of distinct block tokens)")
        ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("prefix-cache hit ratio (tokens)")
    axes[0][0].yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False)
    fig.suptitle(f"ContextPilot on {title}")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hit_ratio_vs_capacity.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
