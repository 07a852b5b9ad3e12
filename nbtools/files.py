"""Files someone else may have put there: a shared Drive folder, a lab server's shared
temporary folder, a copy handed over. What nbtools opens there is a regular file, opened
without blocking (a FIFO or a device is refused at once) and, where it writes, never through a
symbolic link; what it creates is its user's alone (files 0600, folders 0700), whatever the
umask.

>>> import tempfile, os
>>> folder = tempfile.mkdtemp()
>>> write_private(os.path.join(folder, "a.json"), b"{}")
>>> oct(os.stat(os.path.join(folder, "a.json")).st_mode & 0o777)
'0o600'
"""
from __future__ import annotations

import errno
import os
import stat
import time

from . import NbtoolsError


class UnsafeFileError(NbtoolsError, OSError):
    """A path that is not the regular file nbtools expected there (a symbolic link where it
    writes, a FIFO, a device, a socket or a folder); nothing was read from it or written
    through it."""


def open_regular(path, flags: int = os.O_RDONLY, *, follow: bool = False,
                 what: str = "file", error: type = None) -> int:
    """A descriptor of the regular file at ``path``, opened with ``flags``, for a file someone
    else may have put there: a FIFO, a device or a socket is refused without blocking on it
    (opened ``O_NONBLOCK``, checked with ``fstat``, then made blocking again), and, unless
    ``follow``, so is a symbolic link (``O_NOFOLLOW``: a write never lands in the file a link
    points to). ``what`` names the file in messages; ``error`` is the exception raised for
    a file that is not a regular one (default :class:`UnsafeFileError`).

    Raises:
        FileNotFoundError: nothing at ``path``.
        ``error``: a symbolic link (unless ``follow``), a FIFO, device, socket or folder.
        OSError: it cannot be opened otherwise (``PermissionError``...).
    """
    error = error or UnsafeFileError
    path = os.fspath(path)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC
                     | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"no {what} at {path!r}", path) from None
    except OSError as e:
        if e.errno == errno.ELOOP and not follow and os.path.islink(path):
            writes = flags & (os.O_WRONLY | os.O_RDWR)
            risk = ("what is written would land in the file it points to" if writes else
                    "what is read would come from wherever it points")
            raise error(f"{path!r} is a symbolic link (to {os.path.realpath(path)!r}), which a "
                        f"{what} is not opened through: {risk}. Pass the file's real path "
                        "(os.path.realpath(path)) if you meant that file") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):      # a socket; a folder opened to write
            raise error(f"{path!r} is {file_kind(path)}, not a regular file: not a "
                        f"{what}") from None
        raise

    def refuse(mode):
        raise error(f"{path!r} is {file_kind(mode)}, not a regular file: not a {what}")
    return regular_or_refuse(fd, refuse)


def regular_or_refuse(fd: int, refuse) -> int:
    """``fd`` (opened ``O_NONBLOCK``) made blocking, if it is a regular file; else it is
    closed and ``refuse(st_mode)`` raises."""
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            refuse(mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


_KINDS = {"p": "a FIFO (named pipe)", "c": "a character device", "b": "a block device",
          "s": "a socket", "d": "a folder", "l": "a symbolic link", "-": "a regular file"}


def file_kind(mode_or_path) -> str:
    """What a file is, in words ("a FIFO (named pipe)", "a character device"...), from its
    ``st_mode`` or (not following a link) its path."""
    if not isinstance(mode_or_path, int):
        try:
            mode_or_path = os.lstat(mode_or_path).st_mode
        except OSError:
            return "not a regular file"
    return _KINDS.get(stat.filemode(mode_or_path)[0], "not a regular file")


def make_folder(folder: str) -> None:
    """``folder`` and the folders above it that are missing, each made with mode 0700 (what
    nbtools makes is its user's alone; a folder that exists is left as it is)."""
    parent = os.path.dirname(folder)
    if parent != folder and not os.path.isdir(parent):
        make_folder(parent)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        if not os.path.isdir(folder):
            raise


def create_private(path) -> int:
    """A write descriptor of a new file at ``path``, mode 0600: never an existing file or a
    link planted at the name (``O_EXCL | O_NOFOLLOW``)."""
    return os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                   | os.O_CLOEXEC, 0o600)


def write_private(path, data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` as the file ``path``, whole or not at all: to a new name beside it
    (``O_EXCL | O_NOFOLLOW``, mode 0600: never an existing file or a link planted there), then
    renamed over ``path`` (a link at ``path`` is replaced, never written through). A folder at
    ``path`` raises :class:`UnsafeFileError`."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}-{time.time_ns():x}.tmp"
    fd = create_private(tmp)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if os.path.isdir(path) and not os.path.islink(path):
            raise UnsafeFileError(errno.EISDIR, f"{path!r} is a folder, where a file was to be "
                                  "written; nothing was written. Move or remove it", path)
        os.replace(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass


def open_append_private(path, what: str = "file") -> int:
    """A descriptor to append to the file ``path``, made (mode 0600) if missing: never
    through a symbolic link, never blocking on a FIFO or device (:class:`UnsafeFileError`)."""
    fd_flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        fd = os.open(os.fspath(path), fd_flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     0o600)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise UnsafeFileError(e.errno, f"{os.fspath(path)!r} is {file_kind(path)}, not a "
                                  f"regular file: not a {what} to append to", path) from None
        raise

    def refuse(mode):
        raise UnsafeFileError(errno.EINVAL, f"{os.fspath(path)!r} is {file_kind(mode)}, not a "
                              f"regular file: not a {what} to append to", path)
    return regular_or_refuse(fd, refuse)
