from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from contextpilot_integrations.whatif.cli import main


def test_demo_prints_a_table_and_writes_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--capacity", "0.25", "--out", str(tmp_path), "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    for text in (
        "retrieval order",
        "paper",
        "trie (default)",
        "offline",
        "online",
        "reuse bound",
        "prompt tokens = system prompt + chat history + blocks + location references + order annotation + question",
        "retrieval order, every block resent",
        "trie (default) + de-dup",
        "online: arrival interleave, feedback request",
        "Prompt-cache cost on anthropic claude-sonnet-4-5",  # the demo's hosted-API table
    ):
        assert text in out, text
    plot = tmp_path / "reuse_vs_capacity.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(plot.resolve()) in out


def test_simulate_json_and_plan_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {"id": f"r{i}", "blocks": [f"b{j}" for j in range(i % 5, i % 5 + 4)], "tokens": [50] * 4} for i in range(40)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    plan = tmp_path / "plan.jsonl"
    code = main(
        ["simulate", "--trace", str(trace), "--json", "--plan-out", str(plan), "--no-plot", "--capacity", "0.5,1"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 40 and len(report["results"]) == 2 * 2 * 3
    assert all(0 <= row["hit_ratio"] <= 1 and row["prompt_tokens"] > row["block_tokens"] for row in report["results"])
    rows = [json.loads(line) for line in plan.read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(line["id"] for line in lines)
    by_id = {line["id"]: line for line in lines}
    assert all(sorted(r["blocks"]) == sorted(by_id[r["id"]]["blocks"]) for r in rows)


def test_a_conversational_trace_runs_in_chat_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "chat.jsonl"
    lines = [
        {"id": f"{c}-{t}", "blocks": ["shared", f"{c}-{t}", f"{c}-{t - 1}"], "tokens": [300, 200, 200],
         "conversation": c, "question": f"question {t} of {c}"}
        for c in ("alice", "bob") for t in range(4)
    ]  # fmt: skip
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    plan = tmp_path / "plan.jsonl"
    args = ["simulate", "--trace", str(trace), "--json", "--no-plot", "--capacity", "1", "--plan-out", str(plan)]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    chat = [row for row in report["results"] if row["mode"] == "chat"]
    assert {row["mode"] for row in report["results"]} == {"chat"} and chat[0]["baseline"]
    ours = next(row for row in chat if row["strategy"] == "trie")
    assert ours["prefill_saved"] > 0 and ours["prefill_tokens"] < chat[0]["prefill_tokens"]
    assert ours["hit_ratio"] > 0  # the history is a cached prefix
    rows = [json.loads(line) for line in plan.read_text().splitlines()]
    alice = [row for row in rows if row["conversation"] == "alice"]
    assert [row["turn"] for row in alice] == [0, 1, 2, 3]
    assert alice[1]["references"] == ["alice-0"]  # "shared", the top block, in full


def test_small_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and "contextpilot-integrations 0.1.0" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--strategies", ","])
    assert "name at least one strategy" in capsys.readouterr().err
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": 1, "blocks": [1, 2]}\n{"id": 2, "blocks": [2, 3]}\n', encoding="utf-8")
    plan = tmp_path / "plan.jsonl"
    for extra, message in (
        (["--strategies", "retrieval"], "add it to --strategies"),
        (["--modes", "online"], "add offline or chat to --modes"),
    ):
        assert main(["simulate", "--trace", str(trace), "--no-plot", "--plan-out", str(plan), *extra]) == 2
        assert message in capsys.readouterr().err and not plan.exists()
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet", "--capacity", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "count each block as one token" in out and "a request larger than the cache is never cached" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"id": "a", "blocks": ["x"]}\n{"id": "b", "blocks": []}\n', "t.jsonl:2: blocks"),
        ('{"id": "a", "blocks": ["x"], "extra": 1}\n', "t.jsonl:1: extra"),
        ('{"id": "a", "blocks": ["x"], "tokens": [0]}\n', "t.jsonl:1: "),
        ("nope\n", "t.jsonl:1: not valid JSON"),
    ],
)
def test_bad_traces_exit_non_zero_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(content, encoding="utf-8")
    assert main(["simulate", "--trace", str(trace), "--no-plot"]) == 2
    assert message in capsys.readouterr().err


def test_missing_trace_and_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot open" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--capacity", "2"])
    with pytest.raises(SystemExit):
        main(["demo", "--strategies", "magic", "--no-plot"])
    assert "unknown strategy: magic" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"id": "a", "blocks": ["x"]}\n{"id": "b", "blocks": ["\xff"]}\n', "t.jsonl:2: not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "t.jsonl:1: JSON nested too deeply"),
        (b'{"id": "a", "blocks": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n", "t.jsonl:1:"),
        (b"[1, 2]\n", "t.jsonl:1: expected a JSON object"),
    ],
)
def test_hostile_trace_lines_are_named_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(content)
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_a_byte_order_mark_is_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b'\xef\xbb\xbf{"id": "a", "blocks": ["x", "y"]}\n{"id": "b", "blocks": ["y", "x"]}\n')
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--json", "--capacity", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 2


def test_unwritable_outputs_fail_before_any_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "blocks": ["x"]}\n', encoding="utf-8")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder", encoding="utf-8")
    for extra in (["--plan-out", str(blocker / "plan.jsonl"), "--no-plot"], ["--out", str(blocker / "plots")]):
        assert main(["simulate", "--trace", str(trace), "--quiet", *extra]) == 2
        err = capsys.readouterr().err
        assert "cannot write" in err and "replaying" not in err


def test_port_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["listen", "--port", "70000"])
    assert exited.value.code == 2 and "port must be in 0..65535" in capsys.readouterr().err


def test_limit_reads_only_the_first_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"id": "r{i}", "blocks": ["x{i}"]}}\n' for i in range(50)), encoding="utf-8")
    assert main(["simulate", "--trace", str(trace), "--limit", "7", "--no-plot", "--json", "--capacity", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 7


def test_online_routing_across_engines(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--modes", "online", "--capacity", "0.25", "--targets", "3", "--no-plot", "--json"]
    assert main([*args, "--strategies", "retrieval,trie"]) == 0
    rows = {(r["strategy"], r["routing"]): r for r in json.loads(capsys.readouterr().out)["results"]}
    assert set(rows) == {(s, r) for s in ("retrieval", "trie") for r in ("round_robin", "cache_aware")}
    ours, baseline = rows[("trie", "cache_aware")], rows[("retrieval", "round_robin")]
    assert ours["hit_ratio"] > 5 * baseline["hit_ratio"] and ours["max_load_share"] <= 1.5
    assert len(ours["requests_per_target"]) == 3 and sum(ours["requests_per_target"]) == 2_556


def test_a_long_line_with_a_repeated_block_is_refused_quickly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """80,000 block ids with one repeat: the check counts once (it took 41 s per line)."""
    ids = [f"b{n}" for n in range(80_000)]
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"id": "a", "blocks": [*ids, "b7"]}) + "\n", encoding="utf-8")
    start = time.perf_counter()
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet"]) == 2
    assert time.perf_counter() - start < 5.0
    err = capsys.readouterr().err
    assert "t.jsonl:1: blocks: " in err and "block ids repeat within the request: ['b7']" in err
    # every id repeated: the message names the first ten and counts the rest
    trace.write_text(json.dumps({"id": "a", "blocks": ids[:40_000] * 2}) + "\n", encoding="utf-8")
    start = time.perf_counter()
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet"]) == 2
    assert time.perf_counter() - start < 5.0
    err = capsys.readouterr().err
    first_ten = sorted(ids[:40_000])[:10]
    assert f"block ids repeat within the request: {first_ten} and 39,990 more" in err


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ("[1000000000000000000000000000000, 1]", "t.jsonl:2: tokens: Value error, the blocks add up to more than"),
        ("[2000000000, 2000000000]", "t.jsonl:2: tokens: Value error, the blocks add up to more than 2,147,483,647"),
        ("[true, 1]", "t.jsonl:2: tokens.0: Input should be a valid integer"),
        ("[1.0, 1]", "t.jsonl:2: tokens.0: Input should be a valid integer"),
        ("[1" + "0" * 5000 + ", 1]", "t.jsonl:2: a JSON number too long to read"),
    ],
)
def test_token_counts_no_prompt_can_hold_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tokens: str, message: str
) -> None:
    """10**30 or ``true`` tokens used to be read (and broke the table); FILE:LINE, exit 2."""
    trace = tmp_path / "t.jsonl"
    good = '{"id": "a", "blocks": ["x", "y"], "tokens": [3, 4]}\n'
    trace.write_text(good + '{"id": "b", "blocks": ["y", "x"], "tokens": ' + tokens + "}\n", encoding="utf-8")
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_a_turn_given_as_true_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "blocks": ["x"], "conversation": "c", "turn": true}\n', encoding="utf-8")
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet"]) == 2
    assert "t.jsonl:1: turn: Input should be a valid integer" in capsys.readouterr().err


def test_token_options_beyond_any_prompt_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--answer-tokens", str(10**30)])
    assert exited.value.code == 2 and "must be at most 2,147,483,647" in capsys.readouterr().err


def test_a_request_over_max_blocks_is_refused_naming_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A line of 300,000 block ids (issue 31, item 8; one of 1M took the CLI to 1.4 GB and
    minutes): refused with ``file:line`` and exit 2, as every hostile line; one at the bound
    is read."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"id": "a", "blocks": ["x"]}\n' + json.dumps({"id": "b", "blocks": list(range(300_000))}) + "\n")
    start = time.perf_counter()
    assert main(["simulate", "--trace", str(trace), "--no-plot", "--quiet"]) == 2
    assert time.perf_counter() - start < 5.0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "t.jsonl:2: blocks: 300,000 blocks, more than 262,144" in err
    from contextpilot_integrations.core.validation import MAX_BLOCKS
    from contextpilot_integrations.whatif.trace import load_trace

    trace.write_text(json.dumps({"id": "b", "blocks": list(range(MAX_BLOCKS))}) + "\n")
    assert len(load_trace(trace)[0].blocks) == MAX_BLOCKS
