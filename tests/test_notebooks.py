"""The notebooks in `notebooks/`: executed end to end (tiny offline mode) so they cannot rot, and kept in the
repository without outputs.

Execution uses a `python3` Jupyter kernel running this interpreter (a kernelspec written to a temporary folder at
the front of `JUPYTER_PATH`), with `TRL_BANDPO_NOTEBOOK_TINY=1`: the quickstart trains the tiny local model on CPU
and nothing downloads. Both notebooks together take 30-55 s on 2 busy CPU cores.
"""

import json
import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
# Text each executed notebook must show: the metrics the quickstart points users to, the band notebook's checks.
EXPECTED_OUTPUT = {
    "quickstart.ipynb": ["OFFLINE_TINY=True", "bounds/upper_mean", "clip_ratio/high_tail_share", "dgpo/frac_LN"],
    "band_bounds.ipynb": ["7.809846290", "w=1.3416  (expected 1.3416)"],
}
NOTEBOOKS = sorted(EXPECTED_OUTPUT)
CELL_TIMEOUT_S = 300  # per cell; the slowest (a 2-step training run) takes a few seconds


def test_every_notebook_is_tested():
    assert sorted(path.name for path in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_saved_without_outputs(name):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"
    code_cells = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code_cells
    for index, cell in enumerate(code_cells):
        assert cell.outputs == [], f"{name}: code cell {index} has saved outputs; strip them"
        assert cell.execution_count is None, f"{name}: code cell {index} has an execution count; strip it"


@pytest.fixture
def python3_kernel_env(tmp_path, monkeypatch):
    """A `python3` kernelspec for this interpreter first on JUPYTER_PATH, and the notebooks' environment."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    def prepend(variable, path):
        monkeypatch.setenv(variable, os.pathsep.join(filter(None, [str(path), os.environ.get(variable)])))

    prepend("JUPYTER_PATH", tmp_path / "jupyter")
    prepend("PYTHONPATH", REPO)  # the checkout under test, whatever else is installed
    monkeypatch.setenv("TRL_BANDPO_NOTEBOOK_TINY", "1")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("WANDB_DISABLED", "true")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # the quickstart's tiny-mode outputs go to a temp folder
    workdir = tmp_path / "cwd"
    workdir.mkdir()
    return workdir


def _output_text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
            parts.append(output.data.get("text/html", ""))
    return "".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name, python3_kernel_env):
    nb = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    # One extra cell at the end shows which interpreter ran the notebook.
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint('KERNEL_EXECUTABLE=' + sys.executable)"))
    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        allow_errors=False,  # a failing cell raises CellExecutionError with its traceback
        resources={"metadata": {"path": str(python3_kernel_env)}},
    )
    client.execute()

    text = "\n".join(_output_text(cell) for cell in nb.cells if cell.cell_type == "code")
    assert f"KERNEL_EXECUTABLE={sys.executable}" in text
    for expected in EXPECTED_OUTPUT[name]:
        assert expected in text, f"{name}: expected {expected!r} in the outputs"
