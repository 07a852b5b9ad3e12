"""Colab and Google Drive: a folder that outlives the runtime, and copies into it that are safe.

Drive in Colab is a FUSE mount that uploads late: after a disconnect, files written shortly
before can be missing or empty, and ``os.replace`` from local disk into the mount fails (EXDEV).
So nbtools writes checkpoints to local disk first, then copies each finished one into the Drive
folder under a temporary name, fsyncs it, and renames it *inside* the Drive folder; a reader
(``CheckpointManager.restore``) verifies sizes and checksums and skips what did not arrive.
``DriveSync.finalize()`` at the end calls ``drive.flush_and_unmount()`` to force the upload.

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
import threading
import time
import warnings
from pathlib import Path

from . import NbtoolsError

MOUNT_POINT = Path("/content/drive")          # where Colab mounts Google Drive
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


class DriveSync:
    """Copies finished checkpoint directories into ``target`` on a background thread.

    Each copy goes to a temporary directory inside ``target``, is fsync'ed (manifest last) and
    renamed there, so ``target`` only ever shows complete checkpoints. When saves come faster
    than copies, only the newest waiting one is copied (the older ones stay on local disk).

    Args:
        target: the mirror directory (e.g. ``drive_dir("runs/w2v")``).
        background: copy on a worker thread (True) or inside ``submit`` (False).

    ``after_copy`` (a callable, set by :class:`~nbtools.CheckpointManager` to prune the mirror)
    runs after each copy. Errors in the background are warned about at the next ``submit`` and
    raised by ``wait()`` / ``finalize()``.
    """

    def __init__(self, target, *, background: bool = True):
        self.target = Path(target).expanduser()
        self.target.mkdir(parents=True, exist_ok=True)
        self.background = background
        self.after_copy = None
        self.copied: list[dict] = []          # {"path", "bytes", "seconds"} per finished copy
        self.skipped: list[Path] = []         # superseded before they were copied
        self.errors: list[BaseException] = []
        self._queue: list[Path] = []
        self._current: Path | None = None
        self._cond = threading.Condition()
        self._running = False                 # a worker thread is (still) taking from the queue
        self._reported = 0

    def submit(self, path) -> None:
        """Queue a finished checkpoint directory for copying."""
        self._report_errors()
        path = Path(path)
        if not self.background:
            self._copy(path)
            return
        with self._cond:
            self._queue.append(path)
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name="nbtools-drive-sync", daemon=True).start()

    def pending(self) -> set[Path]:
        """Directories queued or being copied right now (not to be deleted yet)."""
        with self._cond:
            return set(self._queue) | ({self._current} if self._current else set())

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._current = None
                    self._running = False
                    self._cond.notify_all()
                    return
                *older, newest = self._queue
                self.skipped.extend(older)
                self._queue.clear()
                self._current = newest
            try:
                self._copy(newest)
            except BaseException as e:    # reported to the training loop, never lost
                with self._cond:
                    self.errors.append(e)

    def _copy(self, path: Path) -> None:
        from .checkpoint import copy_checkpoint

        t0 = time.perf_counter()
        final = copy_checkpoint(path, self.target)
        nbytes = sum(f.stat().st_size for f in final.iterdir())
        self.copied.append({"path": str(final), "bytes": nbytes,
                            "seconds": time.perf_counter() - t0})
        if self.after_copy is not None:
            self.after_copy()

    def _report_errors(self) -> None:
        with self._cond:
            new = self.errors[self._reported:]
            self._reported = len(self.errors)
        for e in new:
            warnings.warn(f"copying a checkpoint to {self.target} failed: {e!r} (the local copy "
                          "is intact; the next save is copied again)", RuntimeWarning, stacklevel=3)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued copy is done; raise the first background error not
        reported yet."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._current is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"copies to {self.target} still running after {timeout} s")
                self._cond.wait(left)
            new = self.errors[self._reported:]
            self._reported = len(self.errors)
        if new:
            raise DriveError(f"{len(new)} copy(ies) to {self.target} failed; first: "
                             f"{new[0]!r}. Local checkpoints are intact.") from new[0]

    def finalize(self, unmount: bool | None = None) -> None:
        """Wait for the copies, then flush Drive. In Colab this unmounts Drive by default
        (``drive.flush_and_unmount()`` is the only way to force the upload): call it once, at
        the end of training."""
        self.wait()
        flush_drive(unmount=in_colab() if unmount is None else unmount)

    def __repr__(self) -> str:
        return (f"DriveSync({str(self.target)!r}, copied={len(self.copied)}, "
                f"pending={len(self.pending())}, errors={len(self.errors)})")
