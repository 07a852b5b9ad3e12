"""Colab and Google Drive: installing nbtools, a folder that outlives the runtime, and forcing
Drive to upload.

The notebooks' first cell installs :data:`INSTALL_SPEC`: the project's repository at the release
tag of this version, so what runs is what the project released and never whatever a package
index holds under a name. :func:`installed` says which nbtools is in use: version and commit.

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
import json
import os
import subprocess
import sys
from pathlib import Path

from . import NbtoolsError, __version__

MOUNT_POINT = Path("/content/drive")          # where Colab mounts Google Drive
# The repository the notebooks' Colab badges open, and the only place installs come from.
REPO_URL = "https://github.com/nbtools-dev/nbtools"
DISTRIBUTION = "nbtools-offload"      # the distribution's name (nbtools is another project's)
# Each release is tagged v<version> in REPO_URL. The install pins that tag: the project publishes
# nothing on a package index, so a lookup by name there would get whatever someone registered.
RELEASE = f"v{__version__}"
INSTALL_SPEC = f"{DISTRIBUTION}[notebook] @ git+{REPO_URL}@{RELEASE}"
# The one install line: README.md and docs/notebooks.md quote it, the notebooks' first cell runs
# INSTALL_SPEC (tests/test_colab.py keeps the four in step).
INSTALL_LINE = f'%pip install -q "{INSTALL_SPEC}"'
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


def installed(package=None) -> str:
    """Which nbtools is in use and where it came from, for the record: version and commit.

    An install from the repository reports the ref and commit pip recorded for it (PEP 610's
    ``direct_url.json``); a git checkout reports its HEAD commit; an install from anywhere else
    says that no commit was recorded.

    Args:
        package: the ``nbtools`` package directory to report on; default the one imported.

    Returns:
        One line, e.g. ``nbtools 0.2.0 from git+https://github.com/nbtools-dev/nbtools@v0.2.0
        (commit 0123abc...)``.

    >>> installed().startswith(f"nbtools {__version__} from ")
    True
    """
    package = Path(package or Path(__file__).parent).resolve()
    root = package.parent
    recorded = _recorded_install(root)
    if recorded is not None:
        version, origin = recorded
        if origin is not None:
            return f"nbtools {version} from {origin}"
    if (root / ".git").exists():
        return f"nbtools {__version__} from the git checkout at {root} ({_git_commit(root)})"
    if recorded is not None:
        return (f"nbtools {version} at {root}, installed without a recorded source (e.g. by "
                f"name from a package index): no commit to report; {INSTALL_LINE} installs "
                "the pinned release")
    return f"nbtools {__version__} from {root} (not an installed distribution, not a git checkout)"


def _recorded_install(site: Path):
    """(version, where from) of the distribution installed in ``site``, or None when there is
    none; where from is None when pip recorded no source (an install from a package index)."""
    from importlib import metadata

    dist = next(iter(metadata.distributions(name=DISTRIBUTION, path=[str(site)])), None)
    if dist is None:
        return None
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        direct = None
    if not isinstance(direct, dict) or "url" not in direct:
        return dist.version, None
    vcs = direct.get("vcs_info")
    if vcs:
        ref = f"@{vcs['requested_revision']}" if vcs.get("requested_revision") else ""
        return dist.version, (f"{vcs.get('vcs', 'git')}+{direct['url']}{ref} "
                              f"(commit {vcs.get('commit_id', 'not recorded')})")
    return dist.version, f"{direct['url']} (not a repository: no commit recorded)"


def _git_commit(root: Path) -> str:
    """``commit <HEAD>``, with a note when tracked files differ from it; where the variable
    ``NBTOOLS_COMMIT`` names a commit (a copy of a checkout whose own git state is not that
    commit's, as on a machine that is sent the working tree), that commit."""
    named = os.environ.get("NBTOOLS_COMMIT", "").strip()
    if named:
        return f"commit {named} (NBTOOLS_COMMIT)"
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=10)
    try:
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError) as e:
        return f"commit unknown: git did not run ({e})"
    if head.returncode != 0:
        said = head.stderr.strip().splitlines()
        return f"commit unknown: {said[0] if said else 'git rev-parse HEAD failed'}"
    dirty = status.returncode == 0 and status.stdout.strip()
    changed = ", with uncommitted changes" if dirty else ""
    return f"commit {head.stdout.strip()}{changed}"


def badge_url(notebook: str) -> str:
    """The Colab link that opens ``notebooks/<notebook>`` of :data:`REPO_URL`."""
    repo = REPO_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{repo}/blob/main/notebooks/{notebook}"
