"""The repository's LlamaIndex example runs as documented: offline, and against a server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from contextpilot_integrations.testing.llama_server import LlamaServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llamaindex_chat_engine.py"


def run(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_example_runs_offline() -> None:
    out = run({k: v for k, v in os.environ.items() if k != "CONTEXTPILOT_ENGINE_URL"})
    assert "query engine sources" in out and "turn 1: 2 location references" in out  # the top in full


def test_example_against_a_real_server(llama: LlamaServer) -> None:
    out = run({**os.environ, "CONTEXTPILOT_ENGINE_URL": llama.url, "CONTEXTPILOT_MODEL": "tiny"})
    assert "turn 1:" in out and "cached tokens: None" not in out.split("turn 1:")[1].splitlines()[0]
