"""The repository's LangChain example runs as documented: offline, and against a server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from contextpilot_integrations.testing.llama_server import LlamaServer

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "langchain_rag_chain.py"


def run(env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_example_prints_the_prompts_offline() -> None:
    env = {k: v for k, v in os.environ.items() if k != "CONTEXTPILOT_ENGINE_URL"}
    out = run(env)
    assert "predicted_cached_blocks=2" in out  # question 1 sent in the conversation's first-turn order
    assert "turn 0: cached prompt tokens None; 0 location references" in out
    assert "turn 1: cached prompt tokens None; 2 location references" in out  # refers back (the top in full)


def test_example_against_a_real_server(llama: LlamaServer) -> None:
    out = run({**os.environ, "CONTEXTPILOT_ENGINE_URL": llama.url, "CONTEXTPILOT_MODEL": "tiny"})
    assert "turn 1: cached prompt tokens" in out and "location references" in out
