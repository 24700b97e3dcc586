"""What the command line tells someone running it for the first time: an engine that is not
there, where the plot goes, why a trace runs in chat mode alone, the load column, and a
strategy whose extra is not installed."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from contextpilot_integrations.whatif.cli import main
from tests.engine_support import free_port, serve_quietly

SMALL = ["simulate", "--synthetic", "passages", "--limit", "30", "--quiet"]


def test_an_engine_nobody_serves_is_named_before_any_replay(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://user:secret@127.0.0.1:{free_port()}"
    assert main([*SMALL, "--no-plot", "--engine", url]) == 2
    captured = capsys.readouterr()
    assert f"error: cannot reach the engine at http://127.0.0.1:{url.rsplit(':', 1)[1]}" in captured.err
    assert "flush" not in captured.err and "secret" not in captured.err and captured.out == ""


class _CannotFlush(BaseHTTPRequestHandler):
    """An OpenAI-compatible server without a cache flush (llama-server's answer to it)."""

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "m", "owned_by": "llamacpp"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()


def test_an_engine_that_answers_but_cannot_flush_is_refused_as_such(capsys: pytest.CaptureFixture[str]) -> None:
    with serve_quietly(_CannotFlush) as url:
        assert main([*SMALL, "--no-plot", "--modes", "offline", "--engine", url]) == 3
    err = capsys.readouterr().err
    assert f"refusing to compare: {url} did not flush its cache" in err and "cannot reach" not in err


def test_out_is_the_plot_file_when_it_names_one_else_its_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*SMALL, "--modes", "offline", "--capacity", "0.5", "--strategies", "retrieval,trie"]
    for out, written in (
        (tmp_path / "new" / "reuse.png", tmp_path / "new" / "reuse.png"),  # its folder made
        (tmp_path / "plots", tmp_path / "plots" / "reuse_vs_capacity.png"),
        (tmp_path / "figure.svg", tmp_path / "figure.svg"),
    ):
        assert main([*args, "--out", str(out)]) == 0
        assert written.is_file() and f"plot: {written.resolve()}" in capsys.readouterr().out
    assert (tmp_path / "new" / "reuse.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "figure.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")
    folder = tmp_path / "runs.v2"  # a folder already there keeps being one, whatever its name
    folder.mkdir()
    assert main([*args, "--out", str(folder)]) == 0
    assert (folder / "reuse_vs_capacity.png").is_file()
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "table.txt")]) == 2
    assert "a plot file ends in .png, .pdf, .svg" in capsys.readouterr().err
    assert not (tmp_path / "table.txt").exists()


def _trace(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return path


def test_a_trace_that_runs_in_chat_mode_alone_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = [
        {"id": f"t{turn}", "blocks": ["shared", f"t{turn}"], "tokens": [300, 200], "conversation": "alice"}
        for turn in range(4)
    ]
    args = ["--no-plot", "--quiet", "--capacity", "1"]
    assert main(["simulate", "--trace", str(_trace(tmp_path / "one.jsonl", one)), *args]) == 0
    out = capsys.readouterr().out
    assert "chat: 1 conversation, 4 turns" in out
    assert "note: chat mode only: 4 of the trace's 4 lines belong to one conversation" in out
    assert "--modes offline,online replays every line on its own" in out
    single = [{"id": f"r{n}", "blocks": [f"b{n}", "b0"], "tokens": [50, 50]} for n in range(1, 6)]
    mixed = _trace(tmp_path / "mixed.jsonl", single + one)
    assert main(["simulate", "--trace", str(mixed), *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {row["mode"] for row in report["results"]} == {"chat"}
    assert any("the other 5 lines are replayed as chats of one turn" in note for note in report["notes"])
    assert main(["simulate", "--trace", str(mixed), *args, "--modes", "offline", "--json"]) == 0
    assert not any("chat mode only" in note for note in json.loads(capsys.readouterr().out)["notes"])


def test_the_load_column_is_shown_only_where_engines_share_the_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    args = [*SMALL, "--no-plot", "--modes", "online", "--capacity", "0.5", "--strategies", "retrieval,trie"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "load" not in out.split("mode     capacity")[1].splitlines()[0]
    assert main([*args, "--targets", "2"]) == 0
    out = capsys.readouterr().out
    header, _, *rows = out.split("mode     capacity")[1].splitlines()[:6]
    assert header.rstrip().endswith("load") and "load: the busiest engine's requests over the mean" in out
    shares = [float(row.split()[-1]) for row in rows if "round-robin" in row or "cache-aware" in row]
    assert len(shares) == 4 and all(share >= 1.0 for share in shares)


def test_without_scipy_the_paper_strategy_is_left_out_or_refused_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)  # as an install without the [paper] extra
    assert main([*SMALL, "--no-plot", "--modes", "offline", "--capacity", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {row["strategy"] for row in report["results"]} == {"retrieval", "trie"}
    extra = "pip install 'contextpilot-integrations[paper]'"
    assert any(note.startswith("paper left out") and extra in note for note in report["notes"])
    assert main([*SMALL, "--no-plot", "--strategies", "paper"]) == 2
    assert extra in capsys.readouterr().err
    from contextpilot_integrations import ContextPilot

    with pytest.raises(ImportError, match=r"contextpilot-integrations\[paper\]"):
        ContextPilot(strategy="paper")
