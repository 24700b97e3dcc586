"""The layout shows the architecture (issue 32): the shipped package's import graph has no
circle and no arrow up (``scripts/dev/import_graph.py`` defines the layers), the shared log
never imports the pilot, and ``ContextPilot`` stays a facade small enough to read in one
sitting, with the public members it had."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType

import pytest

import contextpilot_integrations
from contextpilot_integrations import ContextPilot

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(contextpilot_integrations.__file__).parent

PUBLIC_MEMBERS = {
    "add_observer", "adopt", "aplan", "aprepare", "check", "conversation_usage", "discard", "end_conversation",
    "evict", "index_nodes", "live_orders", "live_request_ids", "note_cache_plan", "note_restored", "observe_cached",
    "plan", "predicted_cached_blocks", "prepare", "record_provider_usage", "record_sent", "record_usage",
    "remove_observer", "repartition", "reset", "restore", "reusable_tokens", "shared_depths", "stats", "strategy",
    "truncate", "unshared",
}  # fmt: skip


def _graph_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "dev" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["import_graph"] = module
    spec.loader.exec_module(module)
    return module


def test_the_import_graph_has_no_circle_and_no_arrow_up(capsys: pytest.CaptureFixture[str]) -> None:
    status = _graph_script().main(["import_graph", str(PACKAGE)])
    report = capsys.readouterr().out
    assert "circles (modules): 0" in report, report
    assert "arrows up: 0" in report, report
    assert status == 0


def test_the_shared_log_never_imports_the_pilot() -> None:
    graph = _graph_script()
    arrows = graph._arrows(graph._modules(PACKAGE))
    shared = {name: targets for name, targets in arrows.items() if name.split(".")[0] == "shared"}
    assert shared, "no shared/ modules found"
    assert {target for targets in shared.values() for target in targets if target.split(".")[0] == "pilot"} == set()


def test_context_pilot_is_a_small_facade_with_its_public_members() -> None:
    source = inspect.getsource(inspect.getmodule(ContextPilot))  # type: ignore[arg-type]
    (cls,) = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "ContextPilot"]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 < 300
    assert {name for name in vars(ContextPilot) if not name.startswith("_")} == PUBLIC_MEMBERS
