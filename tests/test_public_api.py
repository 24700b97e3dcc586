"""The public API is pinned, the core imports no framework, and the pre-release import paths
are gone."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import contextpilot_integrations

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
    "content_id",
    "parse_order_annotation",
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
