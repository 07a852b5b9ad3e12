"""A second copy of each finished checkpoint, e.g. on Google Drive: :func:`copy_checkpoint`
(atomic inside the target folder) and :class:`DriveSync` (copies in the background).

Drive in Colab is a FUSE mount that uploads late: ``os.replace`` from local disk into the mount
fails (EXDEV), and files written shortly before a disconnect can be missing or empty. So a copy
goes to a temporary directory *inside* the target, is fsync'ed (manifest last) and renamed there;
``CheckpointManager.restore`` verifies sizes and checksums and skips what did not arrive. A
checkpoint whose disk tables are a delta needs older directories (their base and earlier
deltas): those are copied first, unless the target has them already. Where
the folder lives (``nbtools.colab.drive_dir``) and how Drive is flushed are :mod:`nbtools.colab`'s.
"""
from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

from .. import colab
from ..colab import DriveError
from ..units import human_bytes
from .format import (MANIFEST, PRIVATE_DIR, CheckpointError, CheckpointSpaceError, check_files,
                     create_new, Damaged, fsync_dir, open_regular, read_manifest, STEP_DIR)
from .layout import remove_dir, tmp_name, needs


def copy_checkpoint(src, dst_root, *, fsync: bool = True) -> Path:
    """Copy a finished checkpoint directory into ``dst_root`` atomically: files go to a temp
    directory inside ``dst_root`` (a rename from local disk into a Drive mount fails, EXDEV),
    are fsync'ed, MANIFEST last, then the directory is renamed into place there.

    Only the files the manifest lists are copied, once the manifest is checked
    (:func:`~nbtools.checkpoint.format.check_manifest`: names of the format, no paths), each
    read as a regular file of ``src`` and created anew inside the temp directory: a crafted
    checkpoint cannot make it read or write anywhere else (:class:`CheckpointError`)."""
    src, dst_root = Path(src), Path(dst_root)
    if not STEP_DIR.match(src.name):
        raise ValueError(f"copy_checkpoint({str(src)!r}): expected a checkpoint directory "
                         "named step-NNNNNNNNN (as CheckpointManager names them)")
    dst_root.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    final = dst_root / src.name
    if final.exists():
        try:
            if read_manifest(final) == read_manifest(src):
                check_files(final, read_manifest(final))
                return final                     # already there and complete
        except Damaged:
            pass
        remove_dir(final)
    try:
        manifest = read_manifest(src)
        check_files(src, manifest)
    except Damaged as e:
        raise CheckpointError(f"cannot copy checkpoint {src}: {e}. Nothing was copied.") from None
    need = sum(manifest["files"].values())
    free = shutil.disk_usage(dst_root).free
    if free < need:
        raise CheckpointSpaceError(errno.ENOSPC, f"copying {src.name} needs {human_bytes(need)}; "
                                   f"{human_bytes(free)} free on {dst_root}")
    tmp = dst_root / tmp_name(src.name)
    tmp.mkdir(mode=PRIVATE_DIR)
    try:
        for name in [*manifest["files"], MANIFEST]:     # (names checked by read_manifest)
            with os.fdopen(open_regular(src, name), "rb") as fi, \
                    os.fdopen(create_new(tmp, name), "wb") as fo:
                shutil.copyfileobj(fi, fo, 16 << 20)
                fo.flush()
                if fsync:
                    os.fsync(fo.fileno())
        if fsync:
            fsync_dir(tmp)
        os.rename(tmp, final)
        if fsync:
            fsync_dir(dst_root)
    except Damaged as e:                       # (a file changed under the copy)
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot copy checkpoint {src}: {e}. Nothing was copied.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final



def _complete(path: Path, uid: str) -> bool:
    """Whether ``path`` is the complete checkpoint of id ``uid``."""
    try:
        m = read_manifest(path)
        check_files(path, m)
    except Damaged:
        return False
    return m.get("id") == uid


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
        self.target.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
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
        t0 = time.perf_counter()
        try:
            manifest = read_manifest(path)
        except Damaged as e:
            raise CheckpointError(f"cannot copy {path} to {self.target}: {e}") from None
        for name, uid in needs(manifest):      # the base and deltas first (step directories)
            if _complete(self.target / name, uid):
                continue
            if not _complete(path.parent / name, uid):
                raise CheckpointError(f"cannot copy {path.name} to {self.target}: it needs "
                                      f"{name}, complete in neither {path.parent} nor there")
            copy_checkpoint(path.parent / name, self.target)
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
        colab.flush_drive(unmount=colab.in_colab() if unmount is None else unmount)

    def __repr__(self) -> str:
        return (f"DriveSync({str(self.target)!r}, copied={len(self.copied)}, "
                f"pending={len(self.pending())}, errors={len(self.errors)})")
