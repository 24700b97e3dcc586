"""Every Python block of the three READMEs and of the documentation pages (``docs/*.md``)
runs as written and on its own (a reader pastes one block into a fresh interpreter), against
a real llama-server standing in for the documented ``http://127.0.0.1:30000`` server, and the
bundled fake of Anthropic's API where a block reaches it through the environment its SDKs
read (the hosted API cannot be reached from the tests). The printed output is what the
comments say. The adapters' READMEs are their package descriptions: their blocks import only
what the wheel and its extras install, and their links work off the repository."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path
from unittest import mock

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from contextpilot_integrations.testing.fake_providers import fake_anthropic
from tests.engine_support import LlamaServer, start_llama_server

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

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
    ROOT / "docs" / "frameworks.md": ("'cache_read'", "reports: 1\n", "prepared: 3 predicted cached blocks: "),
    # the pages' blocks that run without a server
    ROOT / "docs" / "engines.md": ("predicted cached blocks: 2\n", "after the eviction: 0\n"),
    ROOT / "docs" / "routing.md": ("r0 room | r0 cache 3\n", "4 4\n"),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start_llama_server(tmp_path_factory.mktemp("llama-readme"))
    yield server
    server.stop()


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


@contextlib.contextmanager
def anthropic_from_the_environment() -> Iterator[None]:
    """Anthropic's API where the blocks' SDKs look for it (``ANTHROPIC_BASE_URL``, read by
    ``anthropic`` and ``langchain-anthropic``): the bundled fake, with a key it accepts."""
    with fake_anthropic() as fake, mock.patch.dict(os.environ, {"ANTHROPIC_BASE_URL": fake.url}):
        os.environ["ANTHROPIC_API_KEY"] = "fake"
        os.environ.pop("ANTHROPIC_API_URL", None)  # LangChain reads it first
        yield


def run_blocks(path: Path, server: LlamaServer) -> str:
    """Run every Python block of ``path``, each in a fresh namespace; what they printed."""
    printed = io.StringIO()
    with anthropic_from_the_environment():
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


ADAPTERS = {
    "langchain-contextpilot": "langchain_contextpilot",
    "llama-index-postprocessor-contextpilot": "llama_index.postprocessor.contextpilot",
}
CORE = "contextpilot_integrations"


def _installed_with(requirements: list[str], extras: frozenset[str] = frozenset()) -> set[str]:
    """The distributions ``pip install`` of ``requirements`` brings (as installed here)."""
    found: set[str] = set()
    pending = [(Requirement(text), extras) for text in requirements]
    while pending:
        requirement, wanted = pending.pop()
        marker = requirement.marker
        if marker is not None and not any(marker.evaluate({"extra": extra}) for extra in (wanted or {""})):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue  # not installed here: nothing imported from it can be checked anyway
        pending += [(Requirement(text), frozenset(requirement.extras)) for text in requires]
    return found


def _owners(module: str) -> set[str]:
    """The installed distributions that hold ``module`` (a namespace package's own part)."""
    top = module.split(".")[0]
    candidates = packages_distributions().get(top, [])
    path = module.replace(".", "/")
    holding = {
        name
        for name in candidates
        if any(str(file).startswith(path + "/") or str(file) == path + ".py" for file in distribution(name).files or ())
    }
    return {canonicalize_name(name) for name in holding or candidates}


def _imported(block: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("folder", ADAPTERS, ids=str)
def test_an_adapters_description_imports_only_what_its_wheel_and_extras_install(folder: str) -> None:
    project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project.get("optional-dependencies", {})
    requirements = [*project["dependencies"], *(text for texts in extras.values() for text in texts)]
    installed = _installed_with(requirements)
    readme = ROOT / folder / "README.md"
    imported = {module for block in python_blocks(readme) for module in _imported(block)}
    assert imported, f"{readme} imports nothing"
    outside = {}
    for module in sorted(imported):
        top = module.split(".")[0]
        if top in sys.stdlib_module_names or module.startswith(ADAPTERS[folder]):
            continue
        if top == CORE:
            if module.startswith(f"{CORE}.testing"):  # the test kit is not in the wheel
                outside[module] = {"the repository's test kit"}
            continue
        owners = _owners(module)
        if not owners & installed:
            outside[module] = owners
    assert outside == {}, f"{readme}: imports that pip install {folder}[{','.join(extras)}] does not bring"


@pytest.mark.parametrize("folder", ADAPTERS, ids=str)
def test_an_adapters_description_links_work_off_the_repository(folder: str) -> None:
    text = (ROOT / folder / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links and [link for link in links if not link.startswith("https://")] == []
    urls = tomllib.loads((ROOT / folder / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    assert {"Homepage", "Repository"} <= set(urls) and all(url.startswith("https://") for url in urls.values())
