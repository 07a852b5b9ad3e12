"""Colab and Google Drive: a folder that outlives the runtime, and forcing Drive to upload.

Drive in Colab is a FUSE mount that uploads late: after a disconnect, files written shortly
before can be missing or empty, and ``os.replace`` from local disk into the mount fails (EXDEV).
So nbtools writes checkpoints to local disk first and mirrors each finished one into the Drive
folder (:class:`nbtools.checkpoint.DriveSync`: temporary name, fsync, rename *inside* the Drive
folder); :func:`flush_drive` (``drive.flush_and_unmount()``) at the end forces the upload.

Outside Colab the same calls work on plain directories (``~/nbtools-drive`` by default, or
``$NBTOOLS_DRIVE_DIR``), so everything here is testable on any machine.

>>> import tempfile
>>> d = drive_dir("runs/demo", root=tempfile.mkdtemp())
>>> d.is_dir()
True
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from . import NbtoolsError

MOUNT_POINT = Path("/content/drive")          # where Colab mounts Google Drive
# The repository the notebooks' Colab badges open, and where their install cell installs from
# until a release is on PyPI (the cell holds the same URL: tests/test_colab.py checks both).
REPO_URL = "https://github.com/nbtools-dev/nbtools"
DISTRIBUTION = "nbtools-offload"              # the PyPI name (nbtools is another project's)
MY_DRIVE = "MyDrive"


class DriveError(NbtoolsError, RuntimeError):
    """Drive could not be mounted, or a background copy to it failed."""


def in_colab() -> bool:
    """True inside a Google Colab runtime.

    >>> isinstance(in_colab(), bool)
    True
    """
    if "google.colab" in sys.modules or os.environ.get("COLAB_RELEASE_TAG"):
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):
        return False


def _mount() -> None:
    from google.colab import drive   # only exists in Colab

    drive.mount(str(MOUNT_POINT))


def drive_dir(subdir: str = "nbtools", *, mount: bool = True, root=None) -> Path:
    """A directory that survives a new runtime: on Google Drive in Colab, local elsewhere.

    Args:
        subdir: path below My Drive (Colab) or below ``root`` (elsewhere); created if needed.
        mount: in Colab, mount Drive at /content/drive when it is not mounted yet (asks for
            permission once). With ``mount=False`` an unmounted Drive is an error.
        root: the base directory outside Colab; default ``$NBTOOLS_DRIVE_DIR`` or
            ``~/nbtools-drive``. Ignored in Colab.

    Returns:
        ``pathlib.Path`` of the directory.
    """
    if in_colab():
        base = MOUNT_POINT / MY_DRIVE
        if not base.is_dir():
            if not mount:
                raise DriveError(f"Google Drive is not mounted at {MOUNT_POINT}; call "
                                 "drive_dir(..., mount=True) or run "
                                 "`from google.colab import drive; drive.mount('/content/drive')`")
            _mount()
            if not base.is_dir():
                raise DriveError(f"mounting Google Drive did not create {base}; check the "
                                 "authorisation prompt in the cell output and run again")
    else:
        base = Path(root or os.environ.get("NBTOOLS_DRIVE_DIR") or "~/nbtools-drive").expanduser()
    path = base / subdir
    path.mkdir(parents=True, exist_ok=True)
    return path


def flush_drive(unmount: bool = True) -> None:
    """Force Drive to upload what was written (Colab: ``drive.flush_and_unmount()``, which also
    unmounts; elsewhere: ``os.sync()``)."""
    if in_colab() and MOUNT_POINT.joinpath(MY_DRIVE).is_dir():
        from google.colab import drive

        if unmount:
            drive.flush_and_unmount()
            return
    if hasattr(os, "sync"):
        os.sync()


def install_spec(extra: str = "notebook", run=None) -> str:
    """What the notebooks' install cell hands to ``%pip install``: the release on PyPI where
    one exists (``pip index versions`` finds it), else the GitHub repository.

    >>> from types import SimpleNamespace as R
    >>> install_spec(run=lambda *a, **k: R(returncode=1, stdout=""))
    'nbtools-offload[notebook] @ git+https://github.com/nbtools-dev/nbtools'
    """
    import subprocess
    run = run or subprocess.run
    found = run([sys.executable, "-m", "pip", "index", "versions", DISTRIBUTION],
                capture_output=True, text=True)
    spec = f"{DISTRIBUTION}[{extra}]"
    return spec if found.returncode == 0 else f"{spec} @ git+{REPO_URL}"


def badge_url(notebook: str) -> str:
    """The Colab link that opens ``notebooks/<notebook>`` of :data:`REPO_URL`."""
    repo = REPO_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/{notebook}"
