"""Executes notebooks/event_forecasting.ipynb (tiny configuration) in this interpreter's kernel.

The notebook is committed without outputs; this runs it top to bottom, so it cannot rot. It
trains briefly, streams a test sequence (asserting equality with the parallel pass) and plots.
"""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "event_forecasting.ipynb"
KERNEL = "aaren-jax-event-test"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec whose argv is this very interpreter, found first on JUPYTER_PATH."""
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "aaren_jax tests",
        "language": "python",
        "env": {"MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return KERNEL


def test_event_forecasting_notebook_runs(kernel_name):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(
        not cell.get("outputs") and cell.get("execution_count") is None
        for cell in nb.cells
        if cell.cell_type == "code"
    ), "the notebook must be committed without outputs"
    client = nbclient.NotebookClient(
        nb,
        kernel_name=kernel_name,
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.output_type == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
    assert "largest difference from the parallel pass" in text
    assert any("image/png" in out.get("data", {}) for out in outputs)
