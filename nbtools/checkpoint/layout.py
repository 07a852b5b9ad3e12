"""Checkpoint directories under a root: finding them (newest first, damaged ones included),
temporary names for saves in progress, removing old ones (never one that a kept checkpoint
needs: the base and deltas of its disk tables), and cleaning up after dead saves."""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import time
from pathlib import Path

from .format import STEP_DIR as _DIR_RE, Damaged, read_manifest

_TMP_PREFIX = ".tmp-"
_DEL_PREFIX = ".del-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclasses.dataclass
class Entry:
    path: Path
    step: int
    rev: int
    manifest: dict | None
    error: str | None

    @property
    def seq(self) -> int:
        return self.manifest["seq"] if self.manifest else -1


def scan(root: Path) -> list[Entry]:
    """Checkpoint directories under ``root`` (complete or damaged), newest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        m = _DIR_RE.match(name)
        if not m:
            continue
        try:
            manifest, error = read_manifest(root / name), None
        except Damaged as e:
            manifest, error = None, str(e)
        out.append(Entry(root / name, int(m.group(1)), int(m.group(2) or 0), manifest, error))
    out.sort(key=lambda e: (e.seq, e.step, e.rev), reverse=True)
    return out


def needs(manifest: dict) -> list[tuple[str, str]]:
    """The other checkpoint directories whose row data ``manifest``'s checkpoint needs (the
    base and deltas of its disk tables), oldest first, as ``(directory name, checkpoint id)``."""
    own = manifest.get("id")
    out = []
    for item in manifest.get("rows") or ():
        for link in item["chain"]:
            key = (link["dir"], link["id"])
            if link["id"] != own and key not in out:
                out.append(key)
    return out


def remove_dir(path: Path) -> None:
    """Rename out of the way first (atomic), then delete: a crash mid-delete never leaves a
    half-deleted directory that looks like a checkpoint."""
    trash = path.parent / f"{_DEL_PREFIX}{path.name}-{os.getpid()}-{time.time_ns():x}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    _delete(trash)


def _delete(path: Path) -> None:
    """Delete a directory tree, or what stands at its name instead (a file, a link: never
    followed)."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def clean_leftovers(root: Path, max_age_s: float = 86400.0) -> None:
    """Remove temp directories of dead saves and interrupted deletions."""
    host = _host()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        path = root / name
        if name.startswith(_DEL_PREFIX):
            _delete(path)
        elif name.startswith(_TMP_PREFIX):
            parts = name.rsplit("-", 3)          # .tmp-<name>-<host>-<pid>-<nonce>
            try:
                same_host, pid = parts[1] == host, int(parts[2])
            except (IndexError, ValueError):
                same_host, pid = False, -1
            if same_host:
                stale = pid != os.getpid() and not _pid_alive(pid)
            else:
                try:
                    stale = time.time() - path.stat().st_mtime > max_age_s
                except OSError:
                    stale = False
            if stale:
                _delete(path)


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def tmp_name(final_name: str) -> str:
    return f"{_TMP_PREFIX}{final_name}-{_host()}-{os.getpid()}-{time.time_ns():x}"


def prune(root, keep: int, protect=()) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (and damaged ones
    older than all of those), except those a kept one needs (:func:`needs`). Paths in
    ``protect`` are left alone, and what they need. Returns what was deleted."""
    clean_leftovers(Path(root))          # (a prune or save killed part-way here before)
    entries = scan(Path(root))
    good = [e for e in entries if e.manifest is not None]
    removed = []
    protect = {Path(p) for p in protect}
    kept = protect | {e.path for e in good[:keep]}
    for e in good:
        if e.path in kept:
            protect.update(Path(root) / name for name, _ in needs(e.manifest))
    for e in good[keep:]:
        if e.path not in protect:
            remove_dir(e.path)
            removed.append(e.path)
    if len(good) >= keep and keep > 0:
        oldest_kept = good[keep - 1].manifest.get("created_unix", 0)
        for e in entries:
            if e.manifest is None and e.path not in protect:
                try:
                    if e.path.stat().st_mtime < oldest_kept:
                        remove_dir(e.path)
                        removed.append(e.path)
                except OSError:
                    pass
    return removed

