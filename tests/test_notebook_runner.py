"""scripts/run_notebook.py (notebooks run without Jupyter) and the outputs notebooks/ ships.

Needs no jupyter, nbclient or nbformat: the runner reads and writes nbformat v4 JSON itself, and
these tests read it with json."""
import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "scripts" / "run_notebook.py"
NOTEBOOKS = ROOT / "notebooks"
NAMES = ("word2vec", "recommender", "dashboard", "disk")
MAX_BYTES = 5 << 20          # a shipped notebook, outputs included


def _notebook(path: Path, *sources: str) -> Path:
    cells = [{"cell_type": "markdown", "id": "title", "metadata": {}, "source": ["# a title"]}]
    cells += [{"cell_type": "code", "id": f"code-{i}", "metadata": {}, "execution_count": None,
               "outputs": [], "source": s.splitlines(True)} for i, s in enumerate(sources)]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def _run(src: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), str(src), "-o", str(out), "--quiet",
                           *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg",
                               "HOME": str(out.parent)})


def _code(nb) -> list:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _text(cell, name="stdout") -> str:
    return "".join("".join(o["text"]) for o in cell["outputs"]
                   if o["output_type"] == "stream" and o["name"] == name)


def test_runs_cells_in_one_namespace_and_keeps_their_outputs(tmp_path):
    pytest.importorskip("matplotlib")
    src = _notebook(
        tmp_path / "tiny.ipynb",
        "SMOKE = True                 # the setting\nN = 2 if SMOKE else 3\n",
        "import sys\nprint('n is', N)\nprint('to stderr', file=sys.stderr)\n"
        "print('10%\\r50%\\r100%')\n",
        "import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\nax.plot([1, 2, 3])\n"
        "plt.show()\n",
        "%time total = sum(range(N))\n{'total': total}",
        "'not shown';   # a trailing semicolon",
    )
    before = src.read_bytes()
    got = _run(src, tmp_path / "out.ipynb", "--set", "SMOKE=False", "--label", "full")
    assert got.returncode == 0, got.stderr
    assert src.read_bytes() == before, "the runner wrote to the notebook it ran"
    nb = json.loads((tmp_path / "out.ipynb").read_text())
    config, prints, figure, timed, quiet = _code(nb)
    assert _text(config) == "set for this run: SMOKE = False\n"
    # the saved source is the notebook's own, its default setting kept
    assert "".join(config["source"]).startswith("SMOKE = True")
    assert _text(prints) == "n is 3\n100%\n" and _text(prints, "stderr") == "to stderr\n"
    (png,) = [o for o in figure["outputs"] if "image/png" in o.get("data", {})]
    assert base64.b64decode(png["data"]["image/png"]).startswith(b"\x89PNG")
    assert "Wall time:" in _text(timed)
    (result,) = [o for o in timed["outputs"] if o["output_type"] == "execute_result"]
    assert "".join(result["data"]["text/plain"]) == "{'total': 3}"
    assert quiet["outputs"] == []
    assert [c["execution_count"] for c in _code(nb)] == [1, 2, 3, 4, 5]
    meta = nb["metadata"]["nbtools"]
    assert meta["run"] == "full" and meta["completed"] is True
    assert meta["parameters"] == {"SMOKE": "False"}
    assert {"gpu", "gpu_memory_gib", "date", "commit", "seconds"} <= set(meta)
    try:                              # where nbformat is installed (not needed to run notebooks)
        import nbformat
    except ImportError:
        return
    nbformat.validate(nbformat.read(tmp_path / "out.ipynb", as_version=4))


def test_a_cell_that_raises_stops_the_run_and_is_named(tmp_path):
    src = _notebook(tmp_path / "bad.ipynb", "x = 1\nprint('before')", "y = x / 0",
                    "print('never')")
    got = _run(src, tmp_path / "out.ipynb")
    assert got.returncode == 1
    assert "cell 2 (code cell 2) raised ZeroDivisionError" in got.stderr, got.stderr
    nb = json.loads((tmp_path / "out.ipynb").read_text())
    first, bad, never = _code(nb)
    assert _text(first) == "before\n"
    (error,) = bad["outputs"]
    assert error["output_type"] == "error" and error["ename"] == "ZeroDivisionError"
    assert never["outputs"] == [] and never["execution_count"] is None
    assert nb["metadata"]["nbtools"]["completed"] is False
    assert nb["metadata"]["nbtools"]["run"] == "smoke"


def test_refuses_a_setting_no_cell_makes_and_unknown_magics(tmp_path):
    src = _notebook(tmp_path / "a.ipynb", "A = 1")
    got = _run(src, tmp_path / "out.ipynb", "--set", "B=2")
    assert got.returncode == 1 and "--set B: no cell assigns it" in got.stderr, got.stderr
    got = _run(src, tmp_path / "out.ipynb", "--set", "A=some words")
    assert got.returncode != 0 and "not a Python expression" in got.stderr, got.stderr
    src = _notebook(tmp_path / "b.ipynb", "!ls /")
    got = _run(src, tmp_path / "out.ipynb")
    assert got.returncode == 1 and "'!ls' is IPython syntax" in got.stderr, got.stderr


# --- what notebooks/ ships -----------------------------------------------------------------------

def _shipped(name: str) -> dict:
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))


def _full(nb) -> bool:
    return nb["metadata"].get("nbtools", {}).get("run") == "full"


# Notebooks whose full-size GPU run is still to be made: they ship clean (no outputs at all).
# Every other one ships a whole full-size run's outputs. The set only shrinks: a notebook listed
# here that ships outputs fails, as does one not listed that ships none.
NOT_RUN_YET: set = set()


@pytest.mark.parametrize("name", NAMES)
def test_shipped_notebook_has_a_full_size_gpu_runs_outputs(name):
    """benchmarks/notebooks_gpu.sh makes the outputs on a GPU machine, and its
    $OUT/<name>.ipynb replaces notebooks/<name>.ipynb."""
    nb = _shipped(name)
    meta = nb["metadata"].get("nbtools", {})
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    if name in NOT_RUN_YET:
        assert not meta and not any(c.get("outputs") for c in code), (
            f"{name}.ipynb ships outputs: take it out of NOT_RUN_YET (its run is then checked)")
        return
    assert meta.get("run") == "full", (
        f"{name}.ipynb has no full-size run's outputs: run benchmarks/notebooks_gpu.sh on a GPU "
        f"machine and copy its {name}.ipynb here")
    assert meta.get("completed") is True, f"{name}.ipynb: its run stopped at a cell"
    assert meta.get("gpu") and meta.get("gpu_memory_gib"), f"{name}.ipynb: not run on a GPU: {meta}"
    assert "past_t4" not in str(meta.get("parameters", {})), \
        f"{name}.ipynb ships the past-the-GPU run; notebooks/ ships the full-size one"
    with_outputs = [c for c in code if c.get("outputs")]
    figures = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(with_outputs) >= 3, f"{name}.ipynb: {len(with_outputs)} cells with outputs"
    assert figures, f"{name}.ipynb: no figure"
    assert not [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    size = (NOTEBOOKS / f"{name}.ipynb").stat().st_size
    assert size < MAX_BYTES, f"{name}.ipynb is {size / 2**20:.1f} MiB"
