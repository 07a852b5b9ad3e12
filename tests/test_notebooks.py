"""Execute the Colab notebooks end to end in smoke mode, as a user would (Run all)."""
import os
import shutil
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _execute(name: str, drive: Path):
    """Run ``notebooks/{name}.ipynb`` with cwd = notebooks/; return the executed notebook."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    # smoke runs must start fresh: a checkpoint left by an earlier run would skip training
    run_dir = NOTEBOOKS / "runs" / f"{name}-smoke"
    shutil.rmtree(run_dir, ignore_errors=True)
    env = {**os.environ, "NBTOOLS_DRIVE_DIR": str(drive), "MPLBACKEND": "Agg"}
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=300,
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    try:
        client.execute(env=env)     # keyword arguments go to the kernel manager
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if run_dir.parent.is_dir() and not any(run_dir.parent.iterdir()):
            run_dir.parent.rmdir()
    return nb


def _outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", "") or str(out.get("data", {}).get("text/plain", "")))
    return "\n".join(text)


def _check_thin(nb):
    """The notebook rules: a title and a Colab badge first, no def/class in code cells,
    committed without outputs (checked on the file, before execution)."""
    first = nb.cells[0].source
    assert first.startswith("# ") and "colab.research.google.com/github/" in first
    for cell in nb.cells:
        if cell.cell_type == "code":
            lines = cell.source.splitlines()
            assert not any(ln.lstrip().startswith(("def ", "class ")) for ln in lines), cell.source


@pytest.mark.parametrize("name", ["word2vec", "recommender"])
def test_notebook_is_committed_clean(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    _check_thin(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "commit without outputs"
    sources = "\n".join(c.source for c in nb.cells)
    assert "SMOKE = True" in sources and f"{name}.ipynb" in nb.cells[0].source


@pytest.mark.slow
def test_word2vec_notebook_runs(tmp_path):
    nb = _execute("word2vec", tmp_path)
    out = _outputs(nb)
    assert "pairs" in out and "is to" in out
    # quality on the bundled made-up sets, offline: three scores with their coverage
    scores = out.split("nbtools (this run):")[1].splitlines()[0]
    assert all(k in scores for k in ("WS353", "SimLex", "analogy", "coverage")), scores
    assert any((tmp_path / "nbtools" / "word2vec-smoke").glob("step-*")), "no checkpoint on 'Drive'"


@pytest.mark.slow
def test_recommender_notebook_runs(tmp_path):
    nb = _execute("recommender", tmp_path)
    out = _outputs(nb)
    rmse, baseline = (float(x) for x in
                      out.split("test RMSE ")[1].split(")")[0].replace("(predicting the mean:", "")
                      .split())
    assert rmse < baseline, out
    assert any((tmp_path / "nbtools" / "recommender-smoke").glob("step-*"))
