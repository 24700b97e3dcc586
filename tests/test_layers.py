"""The layout shows the architecture (issue 32): the shipped package's import graph has no
circle and no arrow up (``scripts/dev/import_graph.py`` defines the layers), the shared log
never imports the pilot, and ``ContextPilot`` stays a facade small enough to read in one
sitting that plays the roles its users name: the ports they talk through (issue 43: the roles
are checked, not a frozen list of names)."""

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
from contextpilot_integrations.integration.hosted_feedback import UsageRecorder
from contextpilot_integrations.pilot.ports import BatchPlanner, Preparer
from contextpilot_integrations.pilot.wiring import EngineSettings
from contextpilot_integrations.shared.replica import Replica

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(contextpilot_integrations.__file__).parent

ROLES: dict[str, type] = {
    "prepares for an adapter": Preparer,
    "plans a micro-batch": BatchPlanner,
    "is kept in step by the shared log": Replica,
    "takes a hosted API's usage": UsageRecorder,
    "is told its engine's settings": EngineSettings,
}
"""Each role a user of the pilot names, by the port it types the pilot with."""


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


def _members(port: type) -> dict[str, inspect.Signature | None]:
    """A port's members: methods with their signatures, attributes and properties (``None``)."""
    names = {name for name in vars(port) if not name.startswith("__")} | set(getattr(port, "__annotations__", {}))
    return {
        name: inspect.signature(value) if inspect.isfunction(value := getattr(port, name, None)) else None
        for name in names
        if name not in {"_is_protocol", "_is_runtime_protocol"} and not name.startswith("_abc")
    }


@pytest.mark.parametrize("role", list(ROLES))
def test_context_pilot_plays_each_role_its_users_name(role: str) -> None:
    pilot = ContextPilot()
    for name, signature in _members(ROLES[role]).items():
        assert hasattr(pilot, name), f"ContextPilot {role}, but has no {name}"
        if signature is not None:  # callable the way the port's users call it, every argument given
            params = list(signature.parameters.values())
            args = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            kwargs = {p.name: None for p in params if p.kind is p.KEYWORD_ONLY}
            inspect.signature(getattr(ContextPilot, name)).bind(*args, **kwargs)


def test_context_pilot_is_a_small_facade_whose_methods_delegate() -> None:
    source = inspect.getsource(inspect.getmodule(ContextPilot))  # type: ignore[arg-type]
    (cls,) = [node for node in ast.parse(source).body if isinstance(node, ast.ClassDef) and node.name == "ContextPilot"]
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 < 300
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body  # less the docstring
            statements = sum(1 for inner in body for _ in ast.walk(inner) if isinstance(_, ast.stmt))
            assert statements <= 8, f"ContextPilot.{node.name} does the work itself: a part should"
