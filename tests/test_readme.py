"""Every Python block of the three READMEs and of the documentation pages (``docs/*.md``)
runs as written and on its own (a reader pastes one block into a fresh interpreter), against
a real llama-server standing in for the documented ``http://127.0.0.1:30000`` server (the only
substitution). The printed output is what the comments say."""

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
PAGES = sorted((ROOT / "docs").glob("*.md"))
DOCUMENTED_SERVER = "http://127.0.0.1:30000"
# what the blocks of a page print, as their comments say (checked on the page that holds them)
DOCUMENTED_OUTPUT = {
    ROOT / "README.md": (
        "['545', '26', '700']",
        "['901', '26']",
        'Please refer to "FTX founder on trial…" in the previous conversation.\n\nThe defence argued...\n\n'
        "Jury selection began on Tuesday...",
        "['545', '26', '902'] 2",
        "['26', '545', '901'] 0",
    ),
    ROOT / "docs" / "frameworks.md": ("'cache_read'", "reports: 1\n"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(tmp_path_factory.mktemp("llama-readme"))
    yield server
    server.stop()


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def run_blocks(path: Path, server: LlamaServer) -> str:
    """Run every Python block of ``path``, each in a fresh namespace; what they printed."""
    printed = io.StringIO()
    for number, block in enumerate(python_blocks(path), start=1):
        code = compile(block.replace(DOCUMENTED_SERVER, server.url), f"{path.name}, block {number}", "exec")
        with contextlib.redirect_stdout(printed):
            exec(code, {"__name__": f"readme_block_{number}"})  # a fresh namespace: each block alone
    return printed.getvalue()


def check_documented_output(path: Path, out: str) -> None:
    for documented in DOCUMENTED_OUTPUT.get(path, ()):
        assert documented in out
    if path == ROOT / "docs" / "frameworks.md":
        references = re.search(r"references: (\d+)", out)
        assert references and int(references.group(1)) > 0


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs(readme: Path, llama: LlamaServer) -> None:
    assert python_blocks(readme), f"{readme} has no Python block"
    check_documented_output(readme, run_blocks(readme, llama))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_of_the_docs_pages_runs(page: Path, llama: LlamaServer) -> None:
    check_documented_output(page, run_blocks(page, llama))


def test_the_pages_that_print_what_they_document_have_blocks() -> None:
    assert PAGES, "docs/ has no page"
    for path, documented in DOCUMENTED_OUTPUT.items():
        assert python_blocks(path) and documented, f"{path} lost its Python blocks"
