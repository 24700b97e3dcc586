"""The public API is pinned, the core imports no framework, and old import paths still work
for one release, with a DeprecationWarning."""

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
    ("old", "name", "new"),
    [
        ("contextpilot_integrations.backends", "OpenAICompatClient", "contextpilot_integrations.engines"),
        ("contextpilot_integrations.langchain", "ContextPilotRetriever", "langchain_contextpilot"),
        ("contextpilot_integrations.llamaindex", "ContextPilotChatEngine", "llama_index.postprocessor.contextpilot"),
    ],
)
def test_old_paths_warn_and_re_export(old: str, name: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match="deprecated"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(new), name)
