"""Execute the Colab notebooks end to end in smoke mode, as a user would (Run all)."""
import os
import shutil
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# Notebooks after which their kernel runs the next one: they set nothing process-wide (the
# disk notebook sets a host budget, so its kernel ends with it).
REUSE_AFTER = {"word2vec", "recommender"}
# Between two notebooks in one kernel: the names, figures and objects of the one before gone.
RESET = ("%reset -f\n"
         "import gc, sys\n"
         "if 'matplotlib.pyplot' in sys.modules: sys.modules['matplotlib.pyplot'].close('all')\n"
         "gc.collect()")


class Kernel:
    """The Jupyter kernel the notebook tests of a process share, one notebook after another
    (they are one pytest-xdist group, tests/conftest.py): starting a kernel and importing
    torch, nbtools and matplotlib in it was ~5 s of each notebook's run. Every notebook still
    runs whole, from its first cell, after a ``%reset -f`` of the one before; a kernel that
    died, or that ran a notebook not in REUSE_AFTER, is replaced by a new one."""

    def __init__(self, drive: Path):
        # the notebooks' "Google Drive": each writes under nbtools/<its name>-smoke there
        self.drive = drive
        self.env = {**os.environ, "NBTOOLS_DRIVE_DIR": str(drive), "MPLBACKEND": "Agg"}
        # as a user's machine runs them: the fused kernels in Triton's interpreter are the kernel
        # tests' (tests/conftest.py sets TRITON_INTERPRET on a CPU), not the notebooks' (10x
        # slower)
        self.env.pop("TRITON_INTERPRET", None)
        self.km = None

    def _client(self, nb):
        return nbclient.NotebookClient(nb, km=self.km, kernel_name="python3", timeout=300,
                                       resources={"metadata": {"path": str(NOTEBOOKS)}})

    def _run(self, nb) -> None:
        client = self._client(nb)
        try:
            client.execute(env=self.env)    # starts the kernel (cwd = notebooks/) if not yet
        finally:
            if client.kc is not None:
                client.kc.stop_channels()

    def execute(self, name: str):
        """Run ``notebooks/{name}.ipynb`` with cwd = notebooks/; return the executed notebook,
        a copy in memory: the file, and the full-size outputs it ships, stay as they are."""
        shipped = (NOTEBOOKS / f"{name}.ipynb").read_bytes()
        nb = nbformat.reads(shipped.decode("utf-8"), as_version=4)
        if self.km is not None and not _sync(self.km.is_alive)():
            self.shutdown()
        if self.km is None:
            self.km = self._client(nb).create_kernel_manager()
        else:
            self._run(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(RESET)]))
        # smoke runs must start fresh: a checkpoint left by an earlier run would skip training
        run_dir = NOTEBOOKS / "runs" / f"{name}-smoke"
        shutil.rmtree(run_dir, ignore_errors=True)
        try:
            self._run(nb)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            if run_dir.parent.is_dir() and not any(run_dir.parent.iterdir()):
                run_dir.parent.rmdir()
            if name not in REUSE_AFTER:
                self.shutdown()
        assert (NOTEBOOKS / f"{name}.ipynb").read_bytes() == shipped, \
            f"the smoke run changed notebooks/{name}.ipynb"
        return nb

    def shutdown(self) -> None:
        if self.km is None:
            return
        km, self.km = self.km, None
        if _sync(km.is_alive)():
            _sync(km.shutdown_kernel)(now=True)
        _sync(km.cleanup_resources)()


def _sync(method):
    """A kernel manager's method, called as a plain function (nbclient's managers are async)."""
    from jupyter_core.utils import ensure_async, run_sync

    async def call(*args, **kwargs):
        return await ensure_async(method(*args, **kwargs))
    return run_sync(call)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    shared = Kernel(tmp_path_factory.mktemp("drive"))
    yield shared
    shared.shutdown()


def _outputs(nb) -> str:
    """Every cell's outputs as text: a cell's stdout whole (its chunks joined as printed: a
    line may arrive in two when stderr writes between them), then its other outputs."""
    text = []
    for cell in nb.cells:
        outs = cell.get("outputs", [])
        text.append("".join(o.get("text", "") for o in outs
                            if o.get("output_type") == "stream" and o.get("name") == "stdout"))
        for out in outs:
            if not (out.get("output_type") == "stream" and out.get("name") == "stdout"):
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


@pytest.mark.parametrize("name", ["word2vec", "recommender", "disk"])
def test_notebook_is_committed_clean(name):
    """Committed without outputs, or with a whole full-size run's (scripts/run_notebook.py
    records it in metadata.nbtools; tests/test_notebook_runner.py checks those outputs)."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    _check_thin(nb)
    if nb.metadata.get("nbtools", {}).get("run") != "full":
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, \
                    "commit without outputs, or with those of a full-size run"
    sources = "\n".join(c.source for c in nb.cells)
    assert "SMOKE = True" in sources and f"{name}.ipynb" in nb.cells[0].source


@pytest.mark.slow
def test_word2vec_notebook_runs(kernel):
    nb = kernel.execute("word2vec")
    out = _outputs(nb)
    assert "pairs" in out and "is to" in out
    # quality on the bundled made-up sets, offline: three scores with their coverage
    scores = out.split("nbtools (this run):")[1].splitlines()[0]
    assert all(k in scores for k in ("WS353", "SimLex", "analogy", "coverage")), scores
    assert any((kernel.drive / "nbtools" / "word2vec-smoke").glob("step-*")), \
        "no checkpoint on 'Drive'"


@pytest.mark.slow
def test_recommender_notebook_runs(kernel):
    nb = kernel.execute("recommender")
    out = _outputs(nb)
    rmse, baseline = (float(x) for x in
                      out.split("test RMSE ")[1].split(")")[0].replace("(predicting the mean:", "")
                      .split())
    assert rmse < baseline, out
    # ranking: the model's HR@10 on the held-out items well above popularity's
    hr = {name: float(out.split(f"\n{name}")[1].split("HR@10 ")[1].split()[0])
          for name in ("nbtools MF", "popularity")}
    assert hr["nbtools MF"] > hr["popularity"] + 0.05, hr
    assert any((kernel.drive / "nbtools" / "recommender-smoke").glob("step-*"))


@pytest.mark.slow
def test_disk_notebook_runs(kernel):
    """The smoke run sizes a table 5x its 4 MiB host budget, which placement="auto" puts on
    disk; it trains (loss down, accuracy and the planted topics up from chance) and nbtools
    stays within the budget, the table's file out of the page cache."""
    nb = kernel.execute("disk")
    out = _outputs(nb)
    assert "= 5.0x the host budget (4.0 MiB)" in out, out
    assert "placement='auto' -> disk" in out and "placement: disk" in out, out
    loss, accuracy = out.split("\nloss ")[1].split(" (the first")[0].split(", accuracy ")
    loss0, loss1 = (float(x) for x in loss.split(" -> "))
    acc0, acc1 = (float(x.rstrip("%")) / 100 for x in accuracy.split(" -> "))
    assert loss1 < loss0 - 0.2 and acc1 > acc0 + 0.1, (loss, accuracy)
    top = [line for line in out.splitlines() if line.startswith("popularity ranks 0-999:")]
    assert len(top) == 2, out                       # before training, then after
    (before, chance), (after, _) = [
        (float(x.split("%")[0]) / 100 for x in (line.split(": ")[1], line.split("chance ")[1]))
        for line in top]
    assert before < 3 * chance and after > max(0.5, 5 * chance), top
    assert "of host RAM (RAM caches, row maps, tables): within its 4.0 MiB budget" in out, out
    cached = out.split("in the page cache: ")[1].split(" of ")[0]
    if "file (O_DIRECT)" in out:
        assert cached == "0 B", out

