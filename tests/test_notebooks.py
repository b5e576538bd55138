"""Executes the notebooks with nbclient, in a kernel that runs this interpreter (the venv's).

Some notebooks are committed with the outputs of a run (so they read on GitHub without
running); the suite clears them and runs every notebook top to bottom, so none can rot. Each
runs its small default configuration; ``AAREN_NOTEBOOK_FULL=1`` selects a larger one where a
notebook has one (never in the suite).
"""

import json
import sys
import time
from pathlib import Path

import pytest

from examples.common.paths import default_data_root

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
KERNEL = "aaren-jax-test"


@pytest.fixture
def kernel_name(tmp_path, monkeypatch):
    """A kernelspec whose argv is this very interpreter, found first on JUPYTER_PATH."""
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "aaren_jax tests",
        "language": "python",
        "env": {"MPLBACKEND": "Agg", "JAX_PLATFORMS": "cpu", "AAREN_NOTEBOOK_FULL": "0"},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    return KERNEL


# Each notebook, and a line its own checks print when they pass (None: errors only).
EXPECTED = {
    "quickstart.ipynb": None,
    "event_forecasting.ipynb": "largest difference from the parallel pass",
    "forecasting.ipynb": "output rebuilt from the weights vs the layer's output",
    "rsa.ipynb": "P V, matrix form against the recurrence: largest difference",
    "streaming.ipynb": "reloaded step, 48 tokens: largest difference from the parallel pass",
    "offline_rl.ipynb": "largest difference from the parallel pass",
}

# Notebooks that read a file of ../shared/data: skipped, like the data tests, where it is absent.
NEEDS_DATA = {"forecasting.ipynb": Path("ETT") / "ETTh1.csv"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.slow
def test_notebook_runs(name, kernel_name):
    if name in NEEDS_DATA and not (data_file := default_data_root() / NEEDS_DATA[name]).exists():
        pytest.skip(f"{name} reads {data_file}, which is absent")
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # committed outputs are not evidence: run from scratch
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # A first cell, not saved, that reports which interpreter the kernel runs.
    nb.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(
        nb, kernel_name=kernel_name, timeout=600, resources={"metadata": {"path": str(NOTEBOOKS)}}
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    assert nb.cells[0].outputs[0]["text"].strip() == sys.executable
    errors = [
        out for cell in nb.cells for out in cell.get("outputs", []) if out.output_type == "error"
    ]
    assert not errors
    if EXPECTED[name] is not None:
        outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
        text = "".join(out.get("text", "") for out in outputs if out.output_type == "stream")
        assert EXPECTED[name] in text
        assert any("image/png" in out.get("data", {}) for out in outputs)
    print(f"{name}: {elapsed:.1f} s")
