"""A row file's format and housekeeping, beside :mod:`nbtools.rowfile` (the file itself).

What a file of rows is on disk and around it: the 4 KiB header (magic, format version, JSON)
written, read and checked; who writes a file (``writer``) and whether that process still lives;
the files killed runs left open (:func:`leftovers`, :func:`remove_leftovers`, and
:func:`remove_unheld`: a file no live process holds); and making one (for this process alone:
:func:`create_exclusive`) or opening one, with ``O_DIRECT`` where the filesystem allows it (its
block probed on the file itself), and reserving a new one's space. The errors and the names
here are importable from :mod:`nbtools.rowfile` too.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat

import numpy as np

from .. import NbtoolsError
from .. import files as _files
from ..files import file_kind, make_folder, regular_or_refuse  # noqa: F401 (importable here)
from .fileio import _aligned, pwrite_all
from ..units import human_bytes

MAGIC = b"NBTROWS\x00"
VERSION = 1
HEADER = 4096                  # header bytes; data starts here (aligned for any block size)
BLOCKS = (512, 4096)           # O_DIRECT alignments tried, smallest first


class RowFileError(NbtoolsError, ValueError):
    """A row file that is not one, is truncated, or does not match what was expected."""

    __module__ = "nbtools.rowfile"    # where users import it from, with RowFile


class DiskFullError(NbtoolsError, OSError):
    """Not enough free disk space; nothing was written (or the partial file was removed)."""

    __module__ = "nbtools.rowfile"    # where users import it from, with RowFile


def new_file_folder(path: str, overwrite: bool) -> str:
    """The folder of a new row file at ``path``, created if missing and checked writable, and
    no file at ``path`` unless ``overwrite``: raises what :meth:`RowFile.create
    <nbtools.rowfile.RowFile.create>` says."""
    folder = os.path.dirname(path)
    try:
        make_folder(folder)
    except PermissionError as e:
        raise PermissionError(f"cannot create the folder {folder!r} for a disk table "
                              f"({e.strerror}): pick another disk_dir") from None
    if not os.access(folder, os.W_OK):
        raise PermissionError(f"the folder {folder!r} is read-only: pick another disk_dir "
                              "(a writable folder on local disk)")
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{path!r} exists already (overwrite=True replaces it)")
    return folder


def create_exclusive(path: str) -> int:
    """A new file at ``path`` for this process alone, open read-write: created, never opened
    where something is already (a file, or a symbolic link to one: ``O_EXCL | O_NOFOLLOW``),
    with mode 0600, and locked (``flock``) for as long as a descriptor of it stays open, so
    that a cleaner can tell it from a file its writer left when it died
    (:func:`remove_unheld`; a filesystem without such locks leaves it unlocked, and such
    cleaners then keep it).

    Raises:
        FileExistsError: something is at ``path`` already, or a cleaner took the new file
            before it was locked (it removes it): try another name.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        remove_if_same(path, fd)
        os.close(fd)
        raise FileExistsError(errno.EEXIST, f"{path!r} was taken by a cleaner of dead "
                              "processes' files as it was made; try another name", path) from None
    except OSError:
        pass
    return fd


def remove_if_same(path: str, fd: int) -> bool:
    """Remove ``path`` if it still names the file open as ``fd``: a file moved over that
    name, or a link put there, is left alone. Returns whether it was removed."""
    try:
        st, mine = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def remove_unheld(path: str) -> int | None:
    """Remove the file at ``path`` if it is a leftover: a regular file (not a link, a folder
    or a device) owned by this user, whose lock (:func:`create_exclusive`) no open descriptor
    holds, so no live process has it open as its writer, and written on this machine (its
    header's writer; a file on a filesystem several machines share may be locked where the
    lock does not show here) or never given a header (its writer died making it). The lock
    is held while the name is removed. Returns the disk bytes freed, or None where the file
    was kept."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None                # (replaced since the lstat)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        writer = (_parse_head(os.pread(fd, HEADER, 0)) or {}).get("writer")
        if isinstance(writer, dict) and writer.get("host") != socket.gethostname():
            return None
        return now.st_blocks * 512 if remove_if_same(path, fd) else None
    except OSError:                    # held (or no locks here), or unreadable: kept
        return None
    finally:
        os.close(fd)


def open_regular(path, flags: int = os.O_RDONLY, *, follow: bool = False,
                 what: str = "file", error: type = None) -> int:
    """:func:`nbtools.files.open_regular`, refusing with :class:`RowFileError` by default."""
    return _files.open_regular(path, flags, follow=follow, what=what, error=error or RowFileError)


def checked_meta(fd: int, path: str, expect: dict | None, unclean_ok: bool) -> dict:
    """The header's JSON of the row file open as ``fd`` (at ``path``, for messages),
    checked: raises what :meth:`RowFile.open <nbtools.rowfile.RowFile.open>` says."""
    head = os.pread(fd, HEADER, 0)
    if len(head) < 16 or head[:8] != MAGIC:
        raise RowFileError(f"{path!r} is not an nbtools row file (it does not start with "
                           f"{MAGIC!r})")
    version = int.from_bytes(head[8:12], "little")
    if version != VERSION:
        raise RowFileError(f"{path!r} is row-file format {version}; this nbtools reads "
                           f"format {VERSION}")
    meta = _checked_fields(head, path)
    have = os.fstat(fd).st_size
    used = meta["num_rows"] * meta["stride"]
    need = meta["data_offset"] + (round_up(used, BLOCKS[-1]) if meta.get("packed") else used)
    if have < need:
        raise RowFileError(f"{path!r} is truncated: {have:,} bytes, its header says "
                           f"{need:,} ({meta['num_rows']:,} rows of {meta['stride']} bytes "
                           f"after {meta['data_offset']}"
                           f"{', in whole 4,096-byte blocks' if meta.get('packed') else ''})")
    wrong = [(k, v, meta.get(k, "missing")) for k, v in (expect or {}).items()
             if meta.get(k, "missing") != v]
    if wrong:
        raise RowFileError(f"{path!r} does not match what was expected: " + ", ".join(
            f"{k} is {got!r}, expected {want!r}" for k, want, got in wrong))
    if meta.get("clean") is False and not unclean_ok and not _alive(meta.get("writer")):
        w = meta.get("writer") or {}
        raise RowFileError(
            f"{path!r} was not closed cleanly: its writer (process {w.get('pid')} on "
            f"{w.get('host')!r}) stopped while it was open (killed, crashed or out of "
            "memory), so rows written just before may be stale or torn. Rebuild it from a "
            "checkpoint (CheckpointManager.restore rewrites every row of a disk table), or "
            "open it as it is with RowFile.open(path, unclean_ok=True); "
            "nbtools.rowfile.leftovers(folder) lists such files, remove_leftovers deletes them")
    return meta


def _checked_fields(head: bytes, path: str) -> dict:
    """The JSON of a row file's header ``head`` with the fields this module and
    :class:`~nbtools.rowfile.RowFile` act on checked (the caller's own keys, ``dtype`` and the
    like, are only ever compared with an ``expect``): a RowFileError "its header is damaged:
    <what>" otherwise."""
    def damaged(why: str) -> RowFileError:
        return RowFileError(f"{path!r}: its header is damaged: {why}")

    n = int.from_bytes(head[12:16], "little")
    if n > HEADER - 16:
        raise damaged(f"its JSON is said to take {n:,} bytes, past the header's {HEADER:,}")
    try:
        meta = json.loads(head[16:16 + n])
    except ValueError as e:
        raise damaged(f"its JSON does not parse ({e})") from None
    if not isinstance(meta, dict):
        raise damaged(f"its JSON is a {type(meta).__name__}, not an object")
    limit = 1 << 62                    # (offsets stay int64 in numpy's arithmetic)
    for key, lo in (("num_rows", 0), ("row_bytes", 1), ("stride", 1),
                    ("data_offset", HEADER)):
        v = meta.get(key, "missing")
        if type(v) is not int:
            raise damaged(f"{key} is {v!r}, not an integer")
        if not lo <= v < limit:
            raise damaged(f"{key} is {v:,}; it must be at least {lo:,} (and below 2**62)")
    if meta["stride"] < meta["row_bytes"]:
        raise damaged(f"stride {meta['stride']:,} is less than row_bytes "
                      f"{meta['row_bytes']:,} (rows would overlap)")
    if meta["data_offset"] % BLOCKS[-1]:
        raise damaged(f"data_offset {meta['data_offset']:,} is not a multiple of "
                      f"{BLOCKS[-1]:,}")
    if meta["num_rows"] * meta["stride"] >= limit:
        raise damaged(f"{meta['num_rows']:,} rows of {meta['stride']:,} bytes pass 2**62 bytes")
    for key in ("packed", "clean"):
        if key in meta and type(meta[key]) is not bool:
            raise damaged(f"{key} is {meta[key]!r}, not true or false")
    writer = meta.get("writer")
    if writer is not None and not isinstance(writer, dict):
        raise damaged(f"writer is {writer!r}, not an object")
    return meta


def _writer() -> dict:
    """Who writes a row file: this process (pid, host, its start time)."""
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "started": _started(pid)}


def _started(pid: int):
    """A process's start time in clock ticks since boot (Linux; None elsewhere): tells a live
    writer from a later process that got its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(writer) -> bool:
    """Whether ``writer`` (a header's) is a live process on this host."""
    if not isinstance(writer, dict) or writer.get("host") != socket.gethostname():
        return False
    pid = writer.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    started = _started(pid)
    return started is None or writer.get("started") in (None, started)


def write_header(fd: int, info: dict) -> None:
    head = _header(info)
    buf = _aligned(HEADER)
    buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
    pwrite_all(fd, memoryview(buf), 0)


def _read_meta(path) -> dict | None:
    """The header's JSON of the row file at ``path``, or None when it is not one."""
    try:
        fd = open_regular(path)
    except (OSError, RowFileError):
        return None
    try:
        return _parse_head(os.pread(fd, HEADER, 0))
    except OSError:
        return None
    finally:
        os.close(fd)


def _parse_head(head: bytes) -> dict | None:
    """The JSON of a row file's first bytes ``head``, or None when they are not a header."""
    if len(head) < 16 or head[:8] != MAGIC:
        return None
    n = int.from_bytes(head[12:16], "little")
    try:
        meta = json.loads(head[16:16 + n])
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None


def leftovers(folder) -> list[dict]:
    """Row files in ``folder`` that their writer left open when it died (killed, crashed):
    ``{"path", "bytes", "writer"}`` each. A disk table's working file is removed when the
    table is closed, so these are files of killed runs, taking disk space for nothing (their
    rows may be torn: checkpoints are what a run resumes from). A file whose lock
    (:func:`create_exclusive`) a live process holds is never one, whatever its header says
    (a writer in another container may look dead from here).

    >>> import tempfile
    >>> leftovers(tempfile.mkdtemp())
    []
    """
    out = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return out
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        meta = _read_meta(path)
        if meta is not None and meta.get("clean") is False and \
                not _alive(meta.get("writer")) and not _held(path):
            out.append({"path": path, "bytes": os.path.getsize(path),
                        "writer": meta.get("writer")})
    return out


def _held(path: str) -> bool:
    """Whether a live process holds the lock of the file at ``path`` (False where that cannot
    be told: no such file, or no locks on its filesystem)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def remove_leftovers(folder) -> int:
    """Delete the files :func:`leftovers` lists; returns the bytes freed."""
    freed = 0
    for f in leftovers(folder):
        try:
            os.remove(f["path"])
            freed += f["bytes"]
        except OSError:
            pass
    return freed


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def _header(info: dict) -> bytes:
    body = json.dumps(info).encode()
    head = MAGIC + VERSION.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body
    if len(head) > HEADER:
        raise ValueError(f"row-file header of {len(head):,} bytes exceeds {HEADER:,}: meta is "
                         "too large")
    return head


def reserve(fd: int, size: int, path: str) -> None:
    """Reserve ``size`` bytes (``posix_fallocate``; a sparse ``ftruncate`` where unsupported)."""
    try:
        if not hasattr(os, "posix_fallocate"):
            raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DiskFullError(errno.ENOSPC, f"the disk filled while reserving "
                                f"{human_bytes(size)} ({size:,} bytes) for {path!r}; the "
                                "partial file was removed") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)


def check_direct(direct, path: str) -> None:
    """Refuse a ``direct`` that is not True, False or "auto", or True where this platform has
    no O_DIRECT (before any file is made)."""
    if direct not in (True, False, "auto"):
        raise ValueError(f"direct must be True, False or 'auto', got {direct!r}")
    if direct is True and not hasattr(os, "O_DIRECT"):
        raise OSError(errno.EINVAL, f"O_DIRECT is not available on this platform; pass "
                      f"direct='auto' or direct=False for {path!r}", path)


def direct_block(fd: int, path: str, direct, stride: int = 0) -> int:
    """O_DIRECT set on the open file ``fd`` where the filesystem takes it and a read at some
    block works (:func:`probe_block`, among the blocks that divide ``stride``): that block;
    else 0, the file buffered (or, with ``direct=True``, an OSError that says why). Set on
    the descriptor (``F_SETFL``), never by opening ``path`` again: the file stays the one
    opened, whatever is at its name by then."""
    if direct is False or not hasattr(os, "O_DIRECT"):
        return 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        settable = False
    else:
        settable = True
        block = probe_block(fd, stride)
        if block:
            return block
    stride_only = settable and stride and probe_block(fd) > 0
    if settable:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    if direct is True:
        why = (f"the row stride ({stride} bytes) is not a multiple of the disk's block"
               if stride_only else "the filesystem refuses O_DIRECT (tmpfs on older kernels, "
               "some network or FUSE filesystems)")
        raise OSError(errno.EINVAL, f"cannot use O_DIRECT on {path!r}: {why}; pass "
                      "direct='auto' or direct=False", path)
    return 0


def probe_block(fd: int, stride: int = 0) -> int:
    """The smallest alignment at which an O_DIRECT read works on this file (0: none), among
    those that divide ``stride`` (when given): ``block`` bytes at offset 0, into memory aligned
    to exactly ``block`` (a device of 4 KiB sectors refuses the 512-byte read)."""
    buf = _aligned(2 * BLOCKS[-1])
    for block in BLOCKS:
        if stride and stride % block:
            continue
        try:
            if os.preadv(fd, [memoryview(buf)[block:2 * block]], 0) == block:
                return block
        except OSError:
            pass
    return 0
