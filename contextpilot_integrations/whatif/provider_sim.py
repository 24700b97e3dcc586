"""What a hosted API's prompt cache would bill for a trace, with and without ContextPilot.

``simulate --provider openai|anthropic|bedrock|gemini [--model M]`` runs each mode twice
through a model of the provider's cache (:mod:`.provider_cache`, rules from
:mod:`contextpilot_integrations.providers.rules`) and prices the tokens
(:data:`~contextpilot_integrations.providers.DEFAULT_PRICES`, writes included):

- **without ContextPilot** (the baseline): blocks in retrieval order, no order
  annotation, chat turns resend every block; on Anthropic and Bedrock the markers a user
  sends without us: ``system`` (a marker on the system prompt, which caches nothing when
  the system prompt is below the model's minimum) and ``auto`` (one marker on the last
  block, as Anthropic's automatic caching and LangChain's
  ``AnthropicPromptCachingMiddleware`` place it); OpenAI and Gemini cache automatically;
- **with ContextPilot**: the trie order, chat de-duplication, and the markers of
  :func:`~contextpilot_integrations.providers.plan_cache`. Online and in chat the pilot
  forgets a request one TTL after it was sent (``pilot.evict`` on a timer, as an
  application would); it does not take the provider's cached-token counts for eviction
  notices (``observe_cached``): a hosted API reads only where an entry was written
  (Anthropic, Bedrock) or rounds down to 128 tokens (OpenAI), so a short read is no sign of
  an eviction. Taken as one, they cost 8% more online on Anthropic and 13% on OpenAI (the
  bundled sample, before the TTL expiry was modelled), as the pilot stops ordering for
  prefixes the provider still holds.

Requests arrive at the trace's ``time`` stamps (online and chat, when every line has
one), else at :data:`DEFAULT_RATE` requests a second; the offline batch is sent at that
rate in its planned order. Entries expire after the provider's TTL since their last use.
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..core.prepared import PreparedRequest
from ..pilot import BatchRequest, ContextPilot
from ..providers import (
    DEFAULT_PRICES,
    PRICES_AS_OF,
    PROVIDERS,
    PriceTable,
    ProviderName,
    ProviderUsage,
    cost_of,
    plan_cache,
)
from ..providers.prices import Ttl
from ..providers.rules import CacheRules, cache_rules
from .provider_cache import AutoCache, MarkerCache, Served
from .replay import Mode, PromptShape, _Blocks, _round_robin, _system, _unit, arrival_order, prompt_units
from .simulate import BlockSpec
from .trace import TraceRequest, turns_in_order

__all__ = [
    "MARKINGS",
    "DEMO_PROVIDER",
    "DEFAULT_RATE",
    "Marking",
    "ProviderRun",
    "add_provider_options",
    "provider_runs",
    "provider_table",
    "provider_whatif",
    "simulate_provider",
]

Marking = Literal["plan", "system", "auto", "none"]
"""Which cache markers a pass sends on Anthropic and Bedrock: ``plan`` (ContextPilot's
:func:`~contextpilot_integrations.providers.plan_cache`), ``system`` (one on the system
prompt), ``auto`` (one on the last block) or ``none``."""
MARKINGS: tuple[Marking, ...] = ("plan", "system", "auto", "none")
DEFAULT_RATE = 1.0
"""Requests a second when the trace has no ``time`` stamps (one a second: a 5-minute TTL
then spans 300 requests)."""
TTL_SECONDS: dict[Ttl, float] = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True, slots=True)
class ProviderRun:
    """One pass of a trace through a provider's cache model."""

    label: str
    mode: str
    provider: ProviderName
    model: str
    requests: int
    prompt_tokens: int
    read_tokens: int
    write_tokens: int
    cost: float
    """USD for the prompt tokens (uncached, read, written), at the price table's prices."""
    markers: int = 0
    """Cache markers sent (explicit caching only)."""
    skipped: int = 0
    """Requests ContextPilot sent without a marker (below the minimum, nothing shared)."""

    @property
    def read_ratio(self) -> float:
        return self.read_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def write_ratio(self) -> float:
        return self.write_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Pass:
    trace: Sequence[TraceRequest]
    provider: ProviderName
    rules: CacheRules
    contextpilot: bool
    marking: Marking
    shape: PromptShape
    rate: float
    ttl: Ttl
    pilot: ContextPilot = field(init=False)
    cache: MarkerCache | AutoCache = field(init=False)
    blocks: _Blocks = field(default_factory=_Blocks)
    served: list[Served] = field(default_factory=list)
    markers: int = 0
    skipped: int = 0
    step: int = 0
    sent: deque[tuple[float, str]] = field(default_factory=deque)
    ttl_seconds: float = 0.0

    def __post_init__(self) -> None:
        strategy = "trie" if self.contextpilot else "retrieval"
        self.pilot = ContextPilot(strategy, annotate_order=self.contextpilot, max_live_requests=max(len(self.trace), 1))
        rules = self.rules
        ttl = TTL_SECONDS[self.ttl] if _ttl_priced(rules) else rules.ttl_seconds
        self.ttl_seconds = ttl
        if rules.explicit:
            markers = rules.max_breakpoints + rules.implicit_breakpoint
            self.cache = MarkerCache(rules.min_tokens, ttl, rules.lookback_blocks, markers)
        else:
            self.cache = AutoCache(rules.min_tokens, ttl, rules.granularity)

    def now(self, request: TraceRequest, timed: bool) -> float:
        """The request's arrival time; forgets in the pilot what the provider has let expire."""
        self.step += 1
        now = request.time if timed and request.time is not None else (self.step - 1) / self.rate
        expired = []
        while self.sent and self.sent[0][0] < now - self.ttl_seconds:
            expired.append(self.sent.popleft()[1])
        if expired:
            self.pilot.evict(expired)
        return now

    def serve(
        self, prepared: PreparedRequest, request: TraceRequest, now: float, history: Sequence[BlockSpec] = ()
    ) -> list[BlockSpec]:
        own, _, _ = prompt_units(prepared, request, self.shape)
        system = _system(self.shape)
        units = [*system, *history, *own]
        if isinstance(self.cache, MarkerCache):
            markers, managed = self._markers(prepared, system, history, len(units))
            self.markers += len(markers)
            served = self.cache.serve(units, markers, now, managed=managed)
        else:
            if self.contextpilot:
                plan = plan_cache(prepared, self.provider, self.rules.model, rules=self.rules)
                self.skipped += plan.skipped is not None
            served = self.cache.serve(units, now)
        self.served.append(served)
        if not prepared.turn:
            self.sent.append((now, prepared.request_id))
        return own

    def _markers(
        self, prepared: PreparedRequest, system: Sequence[BlockSpec], history: Sequence[BlockSpec], total: int
    ) -> tuple[list[int], bool]:
        """The markers to send, and whether the provider adds its managed one."""
        managed = self.rules.implicit_breakpoint
        if self.marking != "plan":
            if self.marking == "system":
                return ([len(system)] if system else []), managed
            return ([total] if self.marking == "auto" else []), managed
        plan = plan_cache(
            prepared,
            self.provider,
            self.rules.model,
            prefix_tokens=self.shape.system_tokens,
            history_tokens=sum(tokens for _, tokens in history),
            shared_depths=self.pilot.shared_depths(prepared),
            rules=self.rules,
        )
        self.pilot.note_cache_plan(plan)
        self.skipped += plan.skipped is not None
        start = len(system) + len(history)
        markers = [start + index + 1 for index in plan.block_breakpoints]
        if plan.mark_history:
            markers.append(start)
        if plan.mark_prefix:
            markers.append(len(system))
        return sorted(markers), managed and not plan.explicit_only

    def offline(self) -> None:
        batch = [
            BatchRequest(blocks=self.blocks.of(r), query=r.question or "", request_id=f"r{i}")
            for i, r in enumerate(self.trace)
        ]
        for prepared in self.pilot.plan(batch):
            request = self.trace[prepared.batch_index]  # type: ignore[index]
            self.serve(prepared, request, self.now(request, timed=False))

    def online(self, timed: bool) -> None:
        order = sorted(range(len(self.trace)), key=lambda i: self.trace[i].time or 0.0) if timed else None
        for index in order or arrival_order(self.trace, "interleave"):
            request = self.trace[index]
            now = self.now(request, timed)
            prepared = self.pilot.prepare(self.blocks.of(request), request.question or "", request_id=f"r{index}")
            self.serve(prepared, request, now)

    def chat(self, timed: bool, history_turns: int | None) -> None:
        conversations = list(turns_in_order(self.trace))
        history: dict[str, list[list[BlockSpec]]] = {name: [] for name, _ in conversations}
        order = _round_robin([[(name, i) for i in turns] for name, turns in conversations])
        if timed:
            order.sort(key=lambda item: self.trace[item[1]].time or 0.0)
        dedup = self.contextpilot
        for name, index in order:
            request = self.trace[index]
            now = self.now(request, timed)
            turns = history[name]
            window = request.history_turns if request.history_turns is not None else history_turns
            kept = list(range(0 if window is None else max(0, len(turns) - window), len(turns)))
            prepared = self.pilot.prepare(
                self.blocks.of(request),
                request.question or "",
                name if dedup else None,
                kept_turns=kept if dedup else None,
                request_id=f"r{index}",
            )
            sent = [unit for turn in kept for unit in turns[turn]]
            own = self.serve(prepared, request, now, sent)
            turns.append([*own, _unit("answer", prepared.request_id, self.shape.answer_tokens)])


def simulate_provider(
    trace: Sequence[TraceRequest],
    provider: ProviderName,
    model: str | None = None,
    mode: Mode = "offline",
    *,
    contextpilot: bool = True,
    markers: Marking | None = None,
    shape: PromptShape | None = None,
    history_turns: int | None = None,
    rate: float = DEFAULT_RATE,
    prices: PriceTable | None = None,
    ttl: Ttl = "5m",
) -> ProviderRun:
    """Bill ``trace`` through ``provider``'s cache model, with ContextPilot or without it.

    Args:
        contextpilot: order (and in chat de-duplicate) with ContextPilot; otherwise the
            retriever's order, every block resent.
        markers: on explicit caches (see :data:`Marking`); default ``plan`` with
            ContextPilot, ``system`` without.
        rate: requests a second when the trace has no ``time`` stamps.
        ttl: Anthropic and Bedrock: the cache TTL asked for (``1h`` writes cost 2x).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    marking: Marking = markers or ("plan" if contextpilot else "system")
    if marking not in MARKINGS:
        raise ValueError(f"markers must be one of {MARKINGS}, got {markers!r}")
    rules = cache_rules(provider, model)
    run = _Pass(trace, provider, rules, contextpilot, marking, shape or PromptShape(), rate, ttl)
    timed = bool(trace) and all(request.time is not None for request in trace)
    if mode == "offline":
        run.offline()
    elif mode == "online":
        run.online(timed)
    elif mode == "chat":
        run.chat(timed, history_turns)
    else:
        raise ValueError(f"mode must be offline, online or chat, got {mode!r}")
    prompt = sum(s.prompt_tokens for s in run.served)
    read = sum(s.read_tokens for s in run.served)
    write = sum(s.write_tokens for s in run.served)
    usage = ProviderUsage(prompt, read, write, provider)
    cost = cost_of(usage, rules.model, prices=prices, ttl=ttl if _ttl_priced(rules) else "5m")
    label = _label(rules, contextpilot, marking)
    return ProviderRun(
        label, mode, provider, rules.model, len(run.served), prompt, read, write, cost, run.markers, run.skipped
    )


def _ttl_priced(rules: CacheRules) -> bool:
    """Whether the provider prices writes by the TTL asked for (Anthropic, Bedrock)."""
    return rules.explicit and not rules.implicit_breakpoint


def _label(rules: CacheRules, contextpilot: bool, marking: Marking) -> str:
    order = "ContextPilot" if contextpilot else "retrieval order"
    if not rules.explicit or (contextpilot and marking == "plan"):
        return order
    if rules.implicit_breakpoint and marking == "none":
        return order
    text = {"plan": "planned markers", "system": "system marker", "auto": "marker on last block", "none": "no marker"}
    return f"{order}, {text[marking]}"


def provider_runs(
    single: Sequence[TraceRequest],
    chat: Sequence[TraceRequest],
    provider: ProviderName,
    model: str | None,
    modes: Sequence[Mode],
    *,
    shape: PromptShape | None = None,
    history_turns: int | None = None,
    rate: float = DEFAULT_RATE,
    prices: PriceTable | None = None,
    ttl: Ttl = "5m",
    published: bool = False,
) -> list[ProviderRun]:
    """Every mode without ContextPilot (each baseline that applies), then with it.

    With ``published``, on a provider whose markers the user places, also ContextPilot's
    order with only the system prompt marked (what the published proxy marks), before the
    planned markers.

    Raises:
        KeyError, ValueError: no price for the model (or for its 1-hour writes), before
            any pass runs.
    """
    rules = cache_rules(provider, model)
    cost_of(ProviderUsage(1, 0, 1, provider), rules.model, prices=prices, ttl=ttl if _ttl_priced(rules) else "5m")
    baselines: tuple[Marking, ...] = ("system", "auto") if rules.explicit else ("none",)
    if rules.implicit_breakpoint:
        baselines = ("none",)
    passes: list[tuple[bool, Marking]] = [(False, marking) for marking in baselines]
    if published and baselines != ("none",):
        passes.append((True, "system"))
    passes.append((True, "plan"))
    runs = []
    for mode in modes:
        trace = chat if mode == "chat" else single
        for contextpilot, marking in passes:
            run = simulate_provider(
                trace,
                provider,
                model,
                mode,
                contextpilot=contextpilot,
                markers=marking,
                shape=shape,
                history_turns=history_turns,
                rate=rate,
                prices=prices,
                ttl=ttl,
            )
            runs.append(run)
    return runs


def provider_table(
    runs: Sequence[ProviderRun],
    *,
    rate: float = DEFAULT_RATE,
    timed: bool = False,
    prices: PriceTable | None = None,
    ttl: Ttl = "5m",
) -> list[str]:
    """The runs as a table: per mode, the cost of each run and what ContextPilot saves
    against the cheapest baseline, writes included."""
    if not runs:
        return []
    first = runs[0]
    rules = cache_rules(first.provider, first.model)
    price = (prices or DEFAULT_PRICES).price(first.provider, first.model)
    write_price = price.cache_write
    if ttl == "1h" and rules.explicit and not rules.implicit_breakpoint and price.cache_write_1h is not None:
        write_price = price.cache_write_1h
    if rules.implicit_breakpoint:
        how = (
            f"explicit breakpoints: at most {rules.max_breakpoints} (matched exactly) and one managed near the "
            f"last message, TTL ~{rules.ttl_seconds / 60:.0f} min (assumed)"
        )
    elif rules.explicit:
        ttl_text = "1 h" if ttl == "1h" else "5 min"
        how = f"markers: at most {rules.max_breakpoints}, look-back {rules.lookback_blocks} blocks, TTL {ttl_text}"
    else:
        how = f"automatic, {rules.granularity}-token increments, TTL ~{rules.ttl_seconds / 60:.0f} min"
    arrivals = "trace time stamps" if timed else f"{rate:g} request/s (no time stamps in the trace)"
    lines = [
        f"Prompt-cache cost on {first.provider} {first.model}: minimum {rules.min_tokens:,} tokens, {how}",
        f"prices (USD per million tokens, as of {PRICES_AS_OF}, overridable): input {price.input:g}, "
        f"cache write {write_price:g}, cache read {price.cache_read:g}; arrivals: {arrivals}",
        f"{'mode':<8} {'run':<38} {'prompt Mtok':>11} {'read':>6} {'written':>8} {'cost $':>10} {'saved':>7}",
    ]
    for mode in dict.fromkeys(run.mode for run in runs):
        group = [run for run in runs if run.mode == mode]
        baselines = [run for run in group if not run.label.startswith("ContextPilot")]
        reference = min((run.cost for run in baselines), default=None)
        for run in group:
            saved = ""
            if run.label.startswith("ContextPilot") and reference:
                saved = f"{1 - run.cost / reference:.1%}"
            lines.append(
                f"{mode:<8} {run.label:<38} {run.prompt_tokens / 1e6:>11.2f} {run.read_ratio:>6.1%} "
                f"{run.write_ratio:>8.1%} {run.cost:>10.2f} {saved:>7}"
            )
    lines.append("saved: ContextPilot's cost below the cheaper run without it (retrieval order), writes included")
    return lines


DEMO_PROVIDER: ProviderName = "anthropic"
"""The provider whose table the demo prints (``--provider`` picks another)."""


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def add_provider_options(command: argparse.ArgumentParser) -> None:
    """The ``--provider`` options of ``demo`` and ``simulate``."""
    command.add_argument(
        "--provider",
        choices=PROVIDERS,
        help="price the trace on this hosted API's prompt cache, with and without ContextPilot "
        "(--model then names the provider's model; default: a mid-priced one)",
    )
    command.add_argument(
        "--rate",
        type=_rate,
        default=DEFAULT_RATE,
        help=f"--provider: requests a second when the trace has no time stamps ({DEFAULT_RATE:g})",
    )
    command.add_argument(
        "--cache-ttl", choices=("5m", "1h"), default="5m", help="--provider anthropic/bedrock: the cache TTL (5m)"
    )


def provider_whatif(
    args: argparse.Namespace,
    single: Sequence[TraceRequest],
    chat: Sequence[TraceRequest],
    modes: Sequence[Mode],
    shape: PromptShape,
) -> tuple[list[str], dict[str, object]]:
    """The provider table and its JSON for the CLI (``args.provider``, or the demo's).

    Raises:
        KeyError: no price for the model; ValueError: no 1-hour write price.
    """
    provider: ProviderName = args.provider or DEMO_PROVIDER
    # --model names the provider's model only with --provider (else it is the --engine server's)
    model = args.model if args.provider and args.model not in (None, "default") else None
    runs = provider_runs(
        single, chat, provider, model, modes, shape=shape, history_turns=args.history_turns, rate=args.rate,
        ttl=args.cache_ttl,
    )  # fmt: skip
    used = [*(single if any(m != "chat" for m in modes) else ()), *(chat if "chat" in modes else ())]
    timed = bool(used) and all(request.time is not None for request in used)
    lines = provider_table(runs, rate=args.rate, timed=timed, ttl=args.cache_ttl)
    report: dict[str, object] = {
        "provider": provider,
        "model": runs[0].model if runs else model,
        "prices_as_of": PRICES_AS_OF,
        "runs": [
            {
                "mode": run.mode,
                "run": run.label,
                "requests": run.requests,
                "prompt_tokens": run.prompt_tokens,
                "cache_read_tokens": run.read_tokens,
                "cache_write_tokens": run.write_tokens,
                "cost_usd": round(run.cost, 6),
            }
            for run in runs
        ],
    }
    return lines, report
