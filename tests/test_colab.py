"""nbtools.colab (Drive folder, mounting, with a fake google.colab) and the checkpoint mirror
(nbtools.checkpoint.DriveSync: background atomic copies)."""
import errno
import os
import sys
import threading
import time
import types

import pytest
import torch

from nbtools import colab
from nbtools.checkpoint import CheckpointConfig, CheckpointManager, DriveSync, copy_checkpoint
from nbtools.colab import DriveError, drive_dir

QUIET = CheckpointConfig(verbose=False, progress=False, chunk_bytes=4096, file_bytes=8192)


def test_drive_dir_outside_colab(tmp_path, monkeypatch):
    monkeypatch.setattr(colab, "in_colab", lambda: False)
    assert drive_dir("a/b", root=tmp_path) == tmp_path / "a" / "b" and (tmp_path / "a/b").is_dir()
    monkeypatch.setenv("NBTOOLS_DRIVE_DIR", str(tmp_path / "env"))
    assert drive_dir("x") == tmp_path / "env" / "x"


@pytest.fixture
def fake_colab(tmp_path, monkeypatch):
    """google.colab.drive that 'mounts' a directory and records flush_and_unmount."""
    calls = []
    mount_point = tmp_path / "content" / "drive"

    def mount(path):
        calls.append(("mount", path))
        (mount_point / "MyDrive").mkdir(parents=True, exist_ok=True)

    drive = types.SimpleNamespace(mount=mount,
                                  flush_and_unmount=lambda: calls.append(("flush_and_unmount",)))
    google = types.ModuleType("google")
    colab_mod = types.ModuleType("google.colab")
    colab_mod.drive = drive
    google.colab = colab_mod
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab_mod)
    monkeypatch.setattr(colab, "MOUNT_POINT", mount_point)
    monkeypatch.setattr(colab, "in_colab", lambda: True)
    return mount_point, calls


def test_drive_dir_mounts_in_colab(fake_colab):
    mount_point, calls = fake_colab
    with pytest.raises(DriveError, match="not mounted"):
        drive_dir("runs", mount=False)
    path = drive_dir("runs/w2v")
    assert path == mount_point / "MyDrive" / "runs" / "w2v" and path.is_dir()
    assert calls == [("mount", str(mount_point))]
    drive_dir("other")
    assert len(calls) == 1                          # mounted once


def test_finalize_flushes_drive_in_colab(fake_colab, tmp_path):
    mount_point, calls = fake_colab
    ck = CheckpointManager(tmp_path / "local", keep=2, mirror=drive_dir("runs"), config=QUIET)
    ck.save(1, x={"w": torch.arange(100.0)})
    ck.finalize()
    assert calls[-1] == ("flush_and_unmount",)
    assert (mount_point / "MyDrive" / "runs" / "step-000000001" / "MANIFEST").exists()


def _checkpoint(root, step, value=1.0):
    ck = CheckpointManager(root, keep=10, config=QUIET)
    return ck.save(step, x={"w": torch.full((3000,), value)})["path"]


def test_copy_never_renames_across_filesystems(tmp_path, monkeypatch):
    """Drive refuses renames from local disk (EXDEV): the copy renames only inside the target."""
    src = _checkpoint(tmp_path / "local", 3)
    target = tmp_path / "drive"
    real_rename = os.rename

    def fuse_rename(a, b):
        if os.path.dirname(os.path.abspath(a)) != os.path.dirname(os.path.abspath(b)):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(a, b)

    monkeypatch.setattr(os, "rename", fuse_rename)
    final = copy_checkpoint(src, target)
    assert final == target / "step-000000003"
    assert sorted(p.name for p in target.iterdir()) == ["step-000000003"]
    got = {}
    assert CheckpointManager(target, config=QUIET).restore(x=got) == 3


def test_background_copies_newest_and_reports_errors(tmp_path):
    paths = [_checkpoint(tmp_path / "local", s, float(s)) for s in (1, 2, 3)]
    sync = DriveSync(tmp_path / "drive")
    gate = threading.Event()
    sync.after_copy = gate.wait                     # hold the worker after its first copy
    for p in paths:
        sync.submit(p)
    assert set(map(str, sync.pending())) >= {paths[-1]}
    gate.set()
    sync.wait(timeout=30)
    copied = {os.path.basename(c["path"]) for c in sync.copied}
    assert "step-000000003" in copied               # the newest always arrives
    assert len(sync.copied) + len(sync.skipped) == 3
    sync.after_copy = None
    sync.submit(tmp_path / "local" / "missing")     # fails in the background ...
    with pytest.raises(DriveError, match="failed"):
        sync.wait(timeout=30)                       # ... and says so
    sync.submit(tmp_path / "local" / "missing")
    while sync.pending():
        time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match="local copy is intact"):
        sync.submit(paths[0])                       # the next submit warns about it
    sync.wait(timeout=30)                           # reported once, not again


# --- the notebooks' install cell ------------------------------------------------------------------

def _install_cells():
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    cells = {}
    for p in sorted((root / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text())
        code = [c for c in nb["cells"] if c["cell_type"] == "code"]
        cells[p.name] = "".join(code[0]["source"])
    return cells


def _run_install_cell(source, released, tmp_path, monkeypatch):
    """The cell as Colab runs it in a fresh runtime (nbtools not importable, no checkout),
    pip mocked: returns what it would %pip install."""
    import importlib.util
    import subprocess
    calls, installed = [], []

    def fake_run(args, **kw):
        calls.append(args)
        return types.SimpleNamespace(returncode=0 if released else 1,
                                     stdout="nbtools-offload (0.1.0)" if released else "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.chdir(tmp_path)
    lines = []
    for line in source.splitlines():
        if line.strip().startswith("%pip install"):
            indent = line[: len(line) - len(line.lstrip())]
            line = f"{indent}_installed.append(spec)"
        lines.append(line)
    exec("\n".join(lines), {"_installed": installed})
    assert calls and calls[0][-3:] == ["index", "versions", "nbtools-offload"]
    return installed


@pytest.mark.parametrize("released", [True, False])
def test_install_cell_picks_pypi_or_the_repository(released, tmp_path, monkeypatch):
    cells = _install_cells()
    assert len(cells) == 4 and len(set(cells.values())) == 1, "the four cells differ"
    got = _run_install_cell(next(iter(cells.values())), released, tmp_path, monkeypatch)
    want = colab.install_spec(run=lambda *a, **k: types.SimpleNamespace(
        returncode=0 if released else 1, stdout=""))
    assert got == [want]
    assert want == ("nbtools-offload[notebook]" if released else
                    "nbtools-offload[notebook] @ git+https://github.com/nbtools-dev/nbtools")


def test_badges_and_install_cell_name_the_same_repository():
    from pathlib import Path
    import re
    root = Path(__file__).resolve().parents[1]
    cell = next(iter(_install_cells().values()))
    assert f'REPO_URL = "{colab.REPO_URL}"' in cell
    for path in [root / "README.md", *sorted((root / "notebooks").glob("*.ipynb"))]:
        text = path.read_text()
        for url in re.findall(r"https://colab\.research\.google\.com/github/[^)\s\"\\]+", text):
            name = url.rsplit("/", 1)[-1]
            assert url == colab.badge_url(name), f"{path.name}: {url}"
