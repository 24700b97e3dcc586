"""The public API is pinned, the core imports no framework, and the pre-release import paths
are gone."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import contextpilot_integrations
import contextpilot_integrations.engines as engines

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "api"

EXPECTED_ALL = [
    "STRATEGIES",
    "BatchRequest",
    "Block",
    "BlockTypeError",
    "ContextPilot",
    "ContextPilotError",
    "DuplicateBlockError",
    "DuplicateRequestError",
    "InvalidBlockError",
    "MicroBatcher",
    "PilotStats",
    "PreparedRequest",
    "Reference",
    "Templates",
    "UnknownStrategyError",
    "__version__",
    "cache_partition",
    "content_id",
    "parse_order_annotation",
    "partition_of_body",
    "render_block",
]


def test_all_is_pinned() -> None:
    assert sorted(contextpilot_integrations.__all__) == sorted(EXPECTED_ALL)


def test_the_core_and_engines_import_no_framework() -> None:
    modules = "contextpilot_integrations, contextpilot_integrations.engines, contextpilot_integrations.whatif.cli"
    frameworks = "('langchain_core', 'llama_index', 'sglang', 'zmq')"
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.split('.')[0] in {frameworks}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_public_class_and_function_is_in_the_api_reference() -> None:
    """The core's and the engines' public names (errors: through ``contextpilot_integrations.errors``)."""
    reference = " ".join(page.read_text(encoding="utf-8") for page in REFERENCE.glob("*.md"))
    assert "::: contextpilot_integrations.errors" in reference
    missing = [
        f"{module.__name__}.{name}"
        for module in (contextpilot_integrations, engines)
        for name in module.__all__
        if callable(thing := getattr(module, name))
        and not (inspect.isclass(thing) and issubclass(thing, BaseException))
        and f"::: {module.__name__}.{name}\n" not in reference
    ]
    assert missing == []


def test_importing_the_core_leaves_scipy_unloaded() -> None:
    """scipy is a second of start-up and ~140 MB, for the paper strategy's batch plans only
    (the ``[paper]`` extra): the CLI and every other strategy start without it."""
    modules = "contextpilot_integrations, contextpilot_integrations.engines, contextpilot_integrations.whatif.cli"
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'scipy'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys, contextpilot_integrations as c; c.ContextPilot(strategy='paper'); print('scipy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # found, not imported, until a batch is planned


@pytest.mark.parametrize(
    "old",
    [
        "contextpilot_integrations.backends",
        "contextpilot_integrations.langchain",
        "contextpilot_integrations.llamaindex",
    ],
)
def test_pre_release_paths_are_gone(old: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_the_api_reference_shows_roles_as_code_and_no_private_base() -> None:
    """The site's Griffe extension (``mkdocs.yml``): what the reference renders from the docstrings."""
    import griffe

    root = REFERENCE.parents[1]
    extensions = griffe.load_extensions(str(root / "docs" / "_griffe" / "sphinx_roles.py"))
    paths = [root, root / "llama-index-postprocessor-contextpilot"]
    role = re.compile(r":(class|meth|func|mod|data|attr|exc|obj):`")
    with_roles, bases = [], {}
    for package in ("contextpilot_integrations", "llama_index.postprocessor.contextpilot"):
        stack = [griffe.load(package, search_paths=paths, extensions=extensions, resolve_aliases=False)]
        while stack:
            obj = stack.pop()
            stack += [member for member in obj.members.values() if not member.is_alias]
            if obj.docstring is not None and role.search(obj.docstring.value):
                with_roles.append(obj.path)
            if isinstance(obj, griffe.Class):
                bases[obj.path] = [str(base) for base in obj.bases]
    assert with_roles == []
    assert bases["llama_index.postprocessor.contextpilot.llms.ContextPilotLLM"] == ["LLM"]  # not _Reports
    stats = griffe.load("contextpilot_integrations.pilot.stats", search_paths=paths, extensions=extensions)
    assert "`ContextPilot.stats()` hands out" in stats.docstring.value  # :meth:`ContextPilot.stats` hands out
