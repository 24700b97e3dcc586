"""What the what-if runs print: a table, JSON, and a plot of reuse against cache size."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .replay import ReplayResult

__all__ = ["PLOT_NAME", "PLOT_SUFFIXES", "Row", "as_json", "plot", "print_table"]

PLOT_NAME = "reuse_vs_capacity.png"
"""The plot's name in a folder given as ``--out``."""
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""The formats a plot file named by ``--out`` can take (from its suffix)."""
LOAD = "load: the busiest engine's requests over the mean (1.00: even)"

PROMPT_TOKENS = (
    "prompt tokens = system prompt + chat history + blocks + location references + order annotation + question"
)


@dataclass(frozen=True, slots=True)
class Row:
    """One replay at one cache size."""

    fraction: float
    label: str
    result: ReplayResult
    baseline: bool = False


def _millions(tokens: int) -> str:
    return f"{tokens / 1e6:.2f}M" if tokens >= 100_000 else f"{tokens:,}"


def _timing(result: ReplayResult) -> str:
    if result.routing is not None:
        return "-"
    if result.mode == "offline":
        return f"{result.pilot_seconds:.2f} s"
    return f"{result.pilot_seconds / max(result.requests, 1) * 1e6:.0f} us/req"


def print_table(title: str, header: Sequence[str], rows: Sequence[Row], notes: Sequence[str]) -> None:
    """Single-shot modes by hit ratio against retrieval order; chat by prefill tokens saved
    against resending every block in retrieval order."""
    print(f"\n{title}")
    for line in header:
        print(line)
    print(PROMPT_TOKENS + "; hit ratio = cached / prompt tokens\n")
    single = [row for row in rows if row.result.mode != "chat"]
    routed = any(row.result.routing for row in single)  # the load column only where engines share traffic
    if single:
        width = max([18] + [len(row.label) + 1 for row in single])
        head = (
            f"{'mode':<8}{'capacity':>9}  {'strategy':<{width}}{'hit ratio':>10}{'vs retrieval':>14}"
            f"{'prefill':>10}{'pilot time':>14}" + (f"{'load':>7}" if routed else "")
        )
        print(head)
        print("-" * len(head))
        previous = None
        for row in single:
            r = row.result
            base = _baseline(rows, row)
            versus = f"{r.hit_ratio / base.hit_ratio:.1f}x" if base and base.hit_ratio else "-"
            lead = f"{r.mode:<8}{row.fraction:>9.0%}" if (r.mode, row.fraction) != previous else " " * 17
            prefill = _millions(r.prefill_tokens)
            load = f"{f'{r.max_load_share:.2f}' if r.routing else '-':>7}" if routed else ""
            print(f"{lead}  {row.label:<{width}}{r.hit_ratio:>10.1%}{versus:>14}{prefill:>10}{_timing(r):>14}{load}")
            previous = (r.mode, row.fraction)
        if routed:
            print(LOAD)
    chat = [row for row in rows if row.result.mode == "chat"]
    if chat:
        head = (
            f"\n{'chat':<8}{'capacity':>9}  {'strategy':<34}{'prefill':>10}{'saved':>8}{'hit ratio':>11}"
            f"{'max prompt':>12}{'pilot time':>13}"
        )
        print(head)
        print("-" * len(head.strip("\n")))
        last: float | None = None
        for row in chat:
            r = row.result
            base = _baseline(rows, row)
            saved = f"{1 - r.prefill_tokens / base.prefill_tokens:.1%}" if base and base.prefill_tokens else "-"
            lead = f"{'':<8}{row.fraction:>9.0%}" if row.fraction != last else " " * 17
            print(
                f"{lead}  {row.label:<34}{_millions(r.prefill_tokens):>10}{saved:>8}{r.hit_ratio:>11.1%}"
                f"{r.max_prompt_tokens:>12,}{_timing(r):>13}"
            )
            last = row.fraction
        print("saved: prefill tokens saved against resending every block in retrieval order (first row)")
    for note in notes:
        print(f"note: {note}")


def _baseline(rows: Sequence[Row], row: Row) -> ReplayResult | None:
    for other in rows:
        if other.baseline and other.result.mode == row.result.mode and other.fraction == row.fraction:
            return other.result
    return None


def as_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        r = row.result
        base = _baseline(rows, row)
        out.append(
            {
                "mode": r.mode,
                "capacity_fraction": row.fraction,
                "capacity_tokens": r.capacity_tokens,
                "strategy": r.strategy,
                "label": row.label,
                "deduplicate": r.deduplicate,
                "baseline": row.baseline,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "prefill_tokens": r.prefill_tokens,
                "block_tokens": r.block_tokens,
                "reference_tokens": r.reference_tokens,
                "hit_ratio": r.hit_ratio,
                "vs_baseline_hit": r.hit_ratio / base.hit_ratio if base and base.hit_ratio else None,
                "prefill_saved": 1 - r.prefill_tokens / base.prefill_tokens if base and base.prefill_tokens else None,
                "max_prompt_tokens": r.max_prompt_tokens,
                "oversized_requests": r.oversized_requests,
                "routing": r.routing,
                "requests_per_target": list(r.requests_per_target) or None,
                "max_load_share": r.max_load_share if r.routing else None,
                "modelled_mean_latency": r.mean_latency,
                "pilot_seconds": r.pilot_seconds,
            }
        )
    return out


def plot(rows: Sequence[Row], path: Path, title: str) -> Path | None:
    """Hit ratio (single-shot) and prefill saved (chat) against cache size, one panel a mode,
    written to ``path`` (its folder made if missing; the format from its suffix); the path, or
    None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import PercentFormatter
    except ImportError:
        print("note: install matplotlib (pip install 'contextpilot-integrations[plot]') for the plot", file=sys.stderr)
        return None
    modes = list(dict.fromkeys(row.result.mode for row in rows))
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 4.2), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        chat = mode == "chat"
        for label in dict.fromkeys(row.label for row in rows if row.result.mode == mode):
            points = []
            for row in rows:
                if row.result.mode != mode or row.label != label:
                    continue
                base = _baseline(rows, row)
                if chat:
                    value = 1 - row.result.prefill_tokens / base.prefill_tokens if base and base.prefill_tokens else 0.0
                else:
                    value = row.result.hit_ratio
                points.append((row.fraction, value))
            points.sort()
            style = "--" if label.startswith("retrieval") else "-"
            ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=label)
        ax.set_title(mode)
        ax.set_xlabel("cache capacity (share of the working set)")
        ax.set_ylabel("prefill tokens saved vs resending every block" if chat else "hit ratio (cached / prompt tokens)")
        ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_ylim(0, 1.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"ContextPilot on {title}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
