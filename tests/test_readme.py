"""Every Python block of the three READMEs runs as written and on its own (a reader pastes
one block into a fresh interpreter), against a real llama-server standing in for the
documented ``http://127.0.0.1:30000`` server (the only substitution). The printed output is
what the comments say."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_support import LlamaServer, start_llama_server

ROOT = Path(__file__).resolve().parents[1]
READMES = [
    ROOT / "README.md",
    ROOT / "langchain-contextpilot" / "README.md",
    ROOT / "llama-index-postprocessor-contextpilot" / "README.md",
]
DOCUMENTED_SERVER = "http://127.0.0.1:30000"


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(tmp_path_factory.mktemp("llama-readme"))
    yield server
    server.stop()


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(readme: Path, llama: LlamaServer) -> None:
    blocks = python_blocks(readme)
    assert blocks, f"{readme} has no Python block"
    printed = io.StringIO()
    for number, block in enumerate(blocks, start=1):
        code = compile(block.replace(DOCUMENTED_SERVER, llama.url), f"{readme.name}, block {number}", "exec")
        with contextlib.redirect_stdout(printed):
            exec(code, {"__name__": f"readme_block_{number}"})  # a fresh namespace: each block alone
    if readme.name == "README.md" and readme.parent == ROOT:
        out = printed.getvalue()
        for documented in (
            "['545', '26', '700']",
            "['901']",
            "Context in priority order: [26] > [545] > [901].",
            "['545', '26', '901'] 2",
            "'cache_read'",
            "reports: 1\n",
        ):
            assert documented in out
        references = re.search(r"references: (\d+)", out)
        assert references and int(references.group(1)) > 0
