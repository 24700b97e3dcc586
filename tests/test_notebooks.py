"""Every notebook runs top to bottom, offline, in under two minutes (executed with nbclient)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_three_notebooks_committed_without_outputs() -> None:
    assert len(NOTEBOOKS) == 3
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONTEXTPILOT_ENGINE_URL", raising=False)
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend shows the plots
    notebook = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    assert time.monotonic() - start < 120
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert text, "the notebook printed nothing"
    errors = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.get("name") == "stderr")
    assert "Warning" not in errors, errors[:500]
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, "the notebook drew no plot"
    assert os.environ.get("CONTEXTPILOT_ENGINE_URL") is None


def test_notebooks_print_no_warnings_and_read_no_private_state(tmp_path: Path) -> None:
    for path in NOTEBOOKS:
        source = "".join(cell.source for cell in nbformat.read(path, as_version=4).cells)
        assert "._" not in source.replace("__", ""), f"{path.name} reads private state"
