"""The hosted-API cache models and ``simulate --provider``: costs with and without ContextPilot."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from contextpilot_integrations.whatif.cli import main
from contextpilot_integrations.whatif.provider_cache import AutoCache, MarkerCache
from contextpilot_integrations.whatif.provider_sim import provider_runs, simulate_provider
from contextpilot_integrations.whatif.trace import TraceRequest


def _units(*keys: str, tokens: int = 500) -> list[tuple[str, int]]:
    return [(key, tokens) for key in keys]


def test_marker_cache_writes_at_markers_and_reads_them_back() -> None:
    cache = MarkerCache(min_tokens=1024, ttl=300)
    first = cache.serve(_units("a", "b", "c", "q1"), [3], now=0)
    assert (first.read_tokens, first.write_tokens, first.uncached_tokens) == (0, 1500, 500)
    second = cache.serve(_units("a", "b", "c", "q2"), [3], now=10)
    assert (second.read_tokens, second.write_tokens) == (1500, 0)
    # an entry only where a marker was: a request sharing two blocks finds nothing at 2
    third = cache.serve(_units("a", "b", "x", "q3"), [2], now=20)
    assert (third.read_tokens, third.write_tokens) == (0, 0)  # 1,000 tokens: below the minimum
    fourth = cache.serve(_units("a", "b", "c", "y", "q4"), [4], now=30)  # reads 3, writes the 4th
    assert (fourth.read_tokens, fourth.write_tokens) == (1500, 500)


def test_marker_cache_bills_a_write_once_however_many_markers() -> None:
    cache = MarkerCache(min_tokens=1024, ttl=300)
    served = cache.serve(_units("a", "b", "c", "d", "q"), [2, 3, 4], now=0)
    assert served.write_tokens == 2000 and served.prompt_tokens == 2500
    with pytest.raises(ValueError, match="at most 4"):
        cache.serve(_units("a", "b", "c", "d", "e", "q"), [1, 2, 3, 4, 5], now=1)


def test_marker_cache_looks_back_20_blocks_only() -> None:
    blocks = _units(*(f"b{i}" for i in range(40)), tokens=100)
    for marker, found in ((31, 1100), (32, 0)):  # the entry after 11 blocks: 20 and 21 blocks back
        cache = MarkerCache(min_tokens=1024, ttl=300, lookback=20)
        cache.serve([*blocks[:11], ("q", 100)], [11], now=0)
        assert cache.serve(blocks, [marker], now=1).read_tokens == found, marker
    with pytest.raises(ValueError, match="unit counts"):
        cache.serve(blocks, [41], now=2)


def test_marker_cache_minimum_and_ttl() -> None:
    cache = MarkerCache(min_tokens=4096, ttl=300)
    assert cache.serve(_units("a", "b", "q"), [2], now=0).write_tokens == 0  # 1,000 tokens: not cached
    cache = MarkerCache(min_tokens=1024, ttl=300)
    cache.serve(_units("a", "b", "c", "q"), [3], now=0)
    assert cache.serve(_units("a", "b", "c", "q"), [3], now=299).read_tokens == 1500  # refreshed at 299
    assert cache.serve(_units("a", "b", "c", "q"), [3], now=598).read_tokens == 1500
    assert cache.serve(_units("a", "b", "c", "q"), [3], now=899).read_tokens == 0  # expired


def test_auto_cache_granularity_and_minimum() -> None:
    cache = AutoCache(min_tokens=1024, ttl=300, granularity=128)
    cache.serve(_units("a", "b", "c", "q1"), now=0)  # 2,000 tokens: cached
    served = cache.serve(_units("a", "b", "c", "q2"), now=1)
    assert served.read_tokens == 1024 + (1500 - 1024) // 128 * 128  # 1,408 of 1,500 shared
    assert cache.serve(_units("a", "z", "q3"), now=2).read_tokens == 0  # 500 shared < 1,024
    small = AutoCache(min_tokens=1024, ttl=300)
    small.serve(_units("a", "q"), now=0)  # 1,000 tokens: never cached
    assert small.serve(_units("a", "q", "more"), now=1).read_tokens == 0


def _trace(times: bool = False) -> list[TraceRequest]:
    """Requests drawing 6 of 10 popular blocks in different retrieval orders."""
    rng = random.Random(0)
    requests = []
    for i in range(60):
        ids = rng.sample([f"b{j}" for j in range(10)], 6)
        requests.append(
            TraceRequest(id=f"r{i}", blocks=ids, tokens=[700] * len(ids), question=f"question {i}?",
                         time=float(i * 1000) if times else None)
        )  # fmt: skip
    return requests


@pytest.mark.parametrize("provider", ["anthropic", "bedrock", "openai", "gemini"])
def test_contextpilot_costs_less_than_retrieval_order(provider: str) -> None:
    trace = _trace()
    runs = provider_runs(trace, trace, provider, None, ["offline", "online"])  # type: ignore[arg-type]
    for mode in ("offline", "online"):
        ours = next(r for r in runs if r.mode == mode and r.label == "ContextPilot")
        theirs = [r for r in runs if r.mode == mode and r.label != "ContextPilot"]
        assert theirs and ours.cost < min(r.cost for r in theirs), (mode, ours, theirs)
        assert ours.read_tokens > 0


def test_requests_further_apart_than_the_ttl_share_nothing() -> None:
    spaced = simulate_provider(_trace(times=True), "anthropic", mode="online")
    assert spaced.read_tokens == 0
    assert simulate_provider(_trace(), "anthropic", mode="online").read_tokens > 0


def test_chat_costs_less_with_contextpilot() -> None:
    trace = [
        TraceRequest(id=f"c{c}t{t}", blocks=[f"d{c}", f"d{c + 1}", f"e{t}"], tokens=[900, 900, 400],
                     question="next?", conversation=f"c{c}")
        for c in range(4) for t in range(4)
    ]  # fmt: skip
    ours = simulate_provider(trace, "anthropic", mode="chat")
    theirs = simulate_provider(trace, "anthropic", mode="chat", contextpilot=False, markers="auto")
    assert ours.cost < theirs.cost and ours.prompt_tokens < theirs.prompt_tokens


def test_simulate_provider_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(r.model_dump_json(exclude_none=True) + "\n" for r in _trace()), encoding="utf-8")
    assert main(["simulate", "--trace", str(path), "--provider", "anthropic", "--model", "claude-haiku-4-5"]) == 0
    out = capsys.readouterr().out
    for text in ("Prompt-cache cost on anthropic claude-haiku-4-5: minimum 4,096 tokens",
                 "retrieval order, system marker", "retrieval order, marker on last block", "ContextPilot",
                 "as of 2026-11-25", "1 request/s"):  # fmt: skip
        assert text in out, text
    assert main(["simulate", "--trace", str(path), "--provider", "openai", "--json", "--rate", "0.01"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["provider"] == "openai" and report["model"] == "gpt-5"
    labels = {(run["mode"], run["run"]) for run in report["runs"]}
    assert labels == {(m, r) for m in ("offline", "online") for r in ("retrieval order", "ContextPilot")}
    assert all(run["cost_usd"] > 0 for run in report["runs"])


def test_simulate_provider_cli_rejects_bad_options(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(_trace()[0].model_dump_json(exclude_none=True) + "\n", encoding="utf-8")
    for bad in (["--provider", "azure"], ["--provider", "openai", "--rate", "0"], ["--cache-ttl", "2h"]):
        with pytest.raises(SystemExit):
            main(["simulate", "--trace", str(path), *bad])


def test_a_managed_breakpoint_finds_entries_anywhere_along_the_prompt() -> None:
    blocks = _units(*(f"b{i}" for i in range(40)), tokens=100)
    cache = MarkerCache(min_tokens=1024, ttl=1800, lookback=0, max_markers=4)
    cache.serve([*blocks[:11], ("q", 100)], [11], now=0)
    assert cache.serve(blocks, [12], now=1).read_tokens == 0  # explicit: exact matches only (writes 12)
    other = [*blocks[:20], ("x", 100), *blocks[21:]]  # shares 20 blocks: the entries at 11 and 12
    assert cache.serve(other, [], now=2, managed=True).read_tokens == 1200  # managed: looks along it all


def test_gpt_5_6_writes_cost_more_and_explicit_breakpoints_pay() -> None:
    trace = _trace()
    runs = {r.label: r for r in provider_runs(trace, trace, "openai", "gpt-5.6-terra", ["offline"])}
    assert set(runs) == {"retrieval order", "ContextPilot"}
    assert runs["retrieval order"].write_ratio == 1.0  # the managed breakpoint writes every prompt
    assert runs["ContextPilot"].cost < runs["retrieval order"].cost


def test_simulate_provider_cli_reports_what_it_cannot_price(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(r.model_dump_json(exclude_none=True) + "\n" for r in _trace()[:5]), encoding="utf-8")
    base = ["simulate", "--trace", str(path), "--provider"]
    assert main([*base, "openai", "--model", "my-fine-tune"]) == 2
    assert "no price for openai model 'my-fine-tune'" in capsys.readouterr().err
    assert main([*base, "bedrock", "--model", "amazon.nova-pro-v1:0", "--cache-ttl", "1h"]) == 2
    assert "no 1-hour cache write price" in capsys.readouterr().err


@pytest.mark.parametrize(("provider", "published_pass"), [("anthropic", True), ("bedrock", True), ("gemini", False)])
def test_provider_runs_adds_the_published_proxys_marking_where_the_user_places_markers(
    provider: str, published_pass: bool
) -> None:
    trace = _trace()
    plain = provider_runs(trace, trace, provider, None, ["offline"])  # type: ignore[arg-type]
    runs = provider_runs(trace, trace, provider, None, ["offline"], published=True)  # type: ignore[arg-type]
    extra = [run for run in runs if run not in plain]
    if not published_pass:  # automatic caching: there is no marker to place
        assert runs == plain
        return
    published = simulate_provider(trace, provider, mode="offline", contextpilot=True, markers="system")  # type: ignore[arg-type]
    assert extra == [published]
    assert [run.label for run in runs] == [*(run.label for run in plain[:-1]), published.label, plain[-1].label]
