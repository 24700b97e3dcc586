"""The test kit (``contextpilot_integrations.testing``: fakes of hosted APIs, engine harnesses)
stays out of the wheel, and nothing the wheel ships imports it."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import contextpilot_integrations

PACKAGE = Path(contextpilot_integrations.__file__).parent
ROOT = PACKAGE.parent
KIT = "contextpilot_integrations.testing"


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, relative imports resolved."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join([*base, *([node.module] if node.module else [])])
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def test_nothing_the_wheel_ships_imports_the_test_kit() -> None:
    shipped = [path for path in PACKAGE.rglob("*.py") if "testing" not in path.relative_to(PACKAGE).parts]
    assert len(shipped) > 40
    offenders = {
        str(path.relative_to(ROOT)): sorted(name for name in _imports(path) if name.startswith(KIT)) for path in shipped
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_wheel_leaves_the_test_kit_out(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(PACKAGE, source / PACKAGE.name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=source,
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "contextpilot_integrations/whatif/cli.py" in names
    assert "contextpilot_integrations/whatif/server_process.py" in names  # what `demo --engine-cmd` starts engines with
    assert [name for name in names if "/testing/" in name or "/fake_" in name] == []
