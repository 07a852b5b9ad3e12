"""A file of fixed-size rows on local disk, read and written in parallel, around the page cache.

The disk tier's storage (:mod:`nbtools.disk`): one preallocated file per table, a 4 KiB header
(magic, format version, JSON: rows, row bytes, stride, what the rows are), then row ``i`` at
``data_offset + i * stride``.

Why it reads the way it does:

* **O_DIRECT where the filesystem allows it.** Buffered reads fill the page cache with the
  table, and the page cache is charged to the process's memory (a container's limit, Colab's
  12.7 GB): the failure that ended memory-mapped tables. With ``O_DIRECT`` nothing is cached.
  ``O_DIRECT`` needs offsets, lengths and buffers aligned to the device's logical block
  (512 bytes on the disks measured), so the **stride is the row rounded up to 512 bytes**: every
  row is whole sectors, a write never has to read its neighbours first (a 260-byte row takes
  512, a 1,536-byte row 1,536). Filesystems that refuse ``O_DIRECT`` (tmpfs) get buffered I/O
  with ``POSIX_FADV_RANDOM`` (no read-ahead of neighbours) and ``POSIX_FADV_DONTNEED`` after each
  batch, so the cache stays small there too; their stride is the row itself.
* **Many requests in flight.** A cloud disk answers one random read in ~50 µs but serves tens of
  thousands per second only with many in flight. Rows are sorted by offset, neighbours merged
  into one request, and the requests split across a thread pool (``os.preadv`` releases the GIL).
* **Bounded memory.** Each call goes through an aligned bounce buffer of at most 64 MiB.

>>> import tempfile, os
>>> f = RowFile.create(os.path.join(tempfile.mkdtemp(), "t.rows"), 100, 12)
>>> f.write(np.array([7, 3]), np.arange(24, dtype=np.uint8).reshape(2, 12))
>>> out = np.zeros((1, 12), dtype=np.uint8)
>>> f.read(np.array([3]), out)
>>> out[0, :4].tolist()
[12, 13, 14, 15]
>>> f.close()
"""
from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import NbtoolsError
from .units import human_bytes

MAGIC = b"NBTROWS\x00"
VERSION = 1
HEADER = 4096
ALIGN = 512                    # O_DIRECT's unit on the disks measured (logical block size)
BOUNCE = 64 << 20              # bytes of aligned buffer per call, at most


class RowFileError(NbtoolsError, ValueError):
    """A row file that is not one, is truncated, or does not match what was expected."""


class DiskFullError(NbtoolsError, OSError):
    """Not enough free disk space; nothing was written (or the partial file was removed)."""


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of at least ``nbytes`` (anonymous memory, never cached)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)


def _runs(first: np.ndarray, count: int):
    """Split sorted row numbers into runs of consecutive rows: (start index, end index)."""
    if len(first) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    brk = np.flatnonzero(np.diff(first) != 1) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(first)]))
    # long runs are cut so one request stays under `count` rows
    if (ends - starts).max() > count:
        s, e = [], []
        for a, b in zip(starts, ends):
            for x in range(a, b, count):
                s.append(x)
                e.append(min(b, x + count))
        starts, ends = np.array(s), np.array(e)
    return starts, ends


class RowFile:
    """One preallocated file of ``num_rows`` rows of ``row_bytes`` bytes (see module docs).

    Use :meth:`create` or :meth:`open`. ``threads``: requests in flight; ``direct``: ``True``,
    ``False`` or ``"auto"`` (O_DIRECT where the filesystem accepts it).
    """

    def __init__(self, path, fd, meta: dict, direct: bool, threads: int, writable: bool):
        self.path = os.fspath(path)
        self._fd = fd
        self.meta = meta
        self.num_rows = int(meta["num_rows"])
        self.row_bytes = int(meta["row_bytes"])
        self.stride = int(meta["stride"])
        self.data_offset = int(meta["data_offset"])
        self.direct = direct
        self.writable = writable
        self.threads = max(1, int(threads))
        self._pool = None
        self._lock = threading.Lock()
        self.counters = {"read_bytes": 0, "write_bytes": 0, "read_calls": 0, "write_calls": 0,
                         "read_s": 0.0, "write_s": 0.0}
        if not direct:
            fadvise(fd, "POSIX_FADV_RANDOM")

    # --- creating and opening -------------------------------------------------------------
    @classmethod
    def create(cls, path, num_rows: int, row_bytes: int, meta: dict | None = None, *,
               threads: int = 16, direct="auto", overwrite: bool = False) -> "RowFile":
        """A new file of ``num_rows`` zero rows, its space reserved now. Refuses before writing
        anything when the disk lacks the room (:class:`DiskFullError`) or the folder cannot be
        written (``PermissionError``)."""
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        try:
            os.makedirs(folder, exist_ok=True)
        except PermissionError as e:
            raise PermissionError(f"cannot create the folder {folder!r} for a disk table: {e}; "
                                  "pick another disk_dir") from None
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"the folder {folder!r} is read-only: a disk table needs a "
                                  "writable disk_dir")
        if os.path.exists(path) and not overwrite:
            raise FileExistsError(f"{path!r} exists already (overwrite=True replaces it)")
        fd, is_direct = _open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, direct)
        stride = -(-row_bytes // ALIGN) * ALIGN if is_direct else row_bytes
        size = HEADER + num_rows * stride
        free = shutil.disk_usage(folder).free
        if size > free:
            os.close(fd)
            os.remove(path)
            raise DiskFullError(f"a table file of {human_bytes(size)} ({num_rows:,} rows of "
                                f"{stride} bytes) does not fit: {human_bytes(free)} free in "
                                f"{folder!r}. Free space, pick another disk_dir, or make rows "
                                "smaller (dtype=torch.bfloat16, an optimizer with less state)")
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (28,):            # ENOSPC
                    raise
                os.ftruncate(fd, size)          # filesystems without fallocate: sparse
            info = {"num_rows": int(num_rows), "row_bytes": int(row_bytes), "stride": stride,
                    "data_offset": HEADER, **(meta or {})}
            head = _header(info)
            buf = _aligned(HEADER)
            buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
            _pwrite_all(fd, memoryview(buf)[:HEADER], 0)
        except OSError as e:
            os.close(fd)
            os.remove(path)
            if e.errno == 28:
                raise DiskFullError(f"the disk filled while reserving {human_bytes(size)} for "
                                    f"{path!r}; the partial file was removed") from None
            raise
        return cls(path, fd, info, is_direct, threads, True)

    @classmethod
    def open(cls, path, *, expect: dict | None = None, threads: int = 16, direct="auto",
             writable: bool = True) -> "RowFile":
        """An existing row file, its header checked (and compared with ``expect``)."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no row file at {path!r}")
        with open(path, "rb") as f:
            head = f.read(HEADER)
        if len(head) < 16 or head[:8] != MAGIC:
            raise RowFileError(f"{path!r} is not an nbtools row file (no {MAGIC!r} header)")
        version = int.from_bytes(head[8:12], "little")
        if version != VERSION:
            raise RowFileError(f"{path!r} is row-file format {version}; this nbtools reads "
                               f"{VERSION}")
        n = int.from_bytes(head[12:16], "little")
        try:
            meta = json.loads(head[16:16 + n])
        except ValueError:
            raise RowFileError(f"{path!r}: its header is damaged") from None
        need = meta["data_offset"] + meta["num_rows"] * meta["stride"]
        have = os.path.getsize(path)
        if have < need:
            raise RowFileError(f"{path!r} is truncated: {have:,} bytes, its header says "
                               f"{need:,} ({meta['num_rows']:,} rows of {meta['stride']})")
        wrong = {k: (v, meta.get(k)) for k, v in (expect or {}).items() if meta.get(k) != v}
        if wrong:
            raise RowFileError(f"{path!r} does not match: " + ", ".join(
                f"{k} is {got!r}, expected {want!r}" for k, (want, got) in wrong.items()))
        flags = os.O_RDWR if writable else os.O_RDONLY
        fd, is_direct = _open(path, flags, direct if meta["stride"] % ALIGN == 0 else False)
        return cls(path, fd, meta, is_direct, threads, writable)

    # --- rows -----------------------------------------------------------------------------
    def read(self, ids: np.ndarray, out: np.ndarray, at: np.ndarray | None = None) -> None:
        """``out[i] = row ids[i]`` (ids unique, any order; ``out`` uint8 [k, row_bytes]); with
        ``at``, ``out[at[i]] = row ids[i]`` (``out`` any number of rows: a RAM cache's slots,
        filled without an intermediate copy of the rows)."""
        self._io(ids, out, write=False, at=at)

    def write(self, ids: np.ndarray, src: np.ndarray, at: np.ndarray | None = None) -> None:
        """Row ``ids[i] = src[i]`` (ids unique, any order; ``src`` uint8 [k, row_bytes]);
        with ``at``, row ``ids[i] = src[at[i]]``."""
        self._io(ids, src, write=True, at=at)

    def read_range(self, start: int, out: np.ndarray) -> None:
        """Rows ``start : start + len(out)`` into ``out``, in large sequential requests."""
        self._range(start, out, write=False)

    def write_range(self, start: int, src: np.ndarray) -> None:
        self._range(start, src, write=True)

    def flush(self) -> None:
        """Make written rows durable (fsync)."""
        os.fsync(self._fd)

    def drop_cache(self) -> None:
        """Hand this file's cached pages back (buffered mode; O_DIRECT caches none)."""
        if not self.direct:
            fadvise(self._fd, "POSIX_FADV_DONTNEED")

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return (f"RowFile({self.path!r}, rows={self.num_rows:,}, row_bytes={self.row_bytes}, "
                f"stride={self.stride}, direct={self.direct})")

    # --- internals ------------------------------------------------------------------------
    def _check(self, ids: np.ndarray, rows: np.ndarray, write: bool, at) -> np.ndarray:
        if self._fd is None:
            raise ValueError(f"{self.path!r} is closed")
        if write and not self.writable:
            raise PermissionError(f"{self.path!r} was opened read-only")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        k = len(ids) if at is None else rows.shape[0]
        if at is not None and len(at) != len(ids):
            raise ValueError(f"at has {len(at)} entries for {len(ids)} ids")
        if rows.dtype != np.uint8 or rows.shape != (k, self.row_bytes):
            raise ValueError(f"rows must be uint8 [{len(ids)}, {self.row_bytes}], got "
                             f"{rows.dtype} {list(rows.shape)}")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_rows):
            raise IndexError(f"{self.path!r} has {self.num_rows:,} rows; ids range "
                             f"{ids.min()}..{ids.max()}")
        return ids

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="nbtools-rowfile")
        return self._pool

    def _io(self, ids, rows, write: bool, at=None) -> None:
        import time
        ids = self._check(ids, rows, write, at)
        if not len(ids):
            return
        t0 = time.perf_counter()
        order = np.argsort(ids, kind="stable")
        if at is not None:
            order_rows = np.asarray(at, dtype=np.int64)[order]
        else:
            order_rows = order
        ids = ids[order]
        stride = self.stride
        per = max(1, BOUNCE // stride)                  # rows per bounce buffer
        buf = _aligned(min(len(ids), per) * stride).reshape(-1, stride)
        for a in range(0, len(ids), per):
            part, rows_at = ids[a:a + per], order_rows[a:a + per]
            k = len(part)
            if write:
                buf[:k, : self.row_bytes] = rows[rows_at]
            starts, ends = _runs(part, max(1, (1 << 20) // stride))
            offs = self.data_offset + part[starts] * stride
            self._parallel(buf, starts, ends, offs, write)
            if not write:
                rows[rows_at] = buf[:k, : self.row_bytes]
        if not self.direct:
            if write:
                os.fdatasync(self._fd)
            self.drop_cache()
        key = "write" if write else "read"
        self.counters[f"{key}_bytes"] += len(ids) * stride
        self.counters[f"{key}_calls"] += 1
        self.counters[f"{key}_s"] += time.perf_counter() - t0

    def _parallel(self, buf, starts, ends, offs, write: bool) -> None:
        """Requests (rows ``starts[j]:ends[j]`` of ``buf`` at file offset ``offs[j]``) across
        the pool, each thread a contiguous share."""
        flat = memoryview(buf.reshape(-1))
        stride, fd = self.stride, self._fd
        op = _pwrite_all if write else _pread_all
        jobs = len(starts)

        def run(lo, hi):
            for j in range(lo, hi):
                a, b = int(starts[j]) * stride, int(ends[j]) * stride
                op(fd, flat[a:b], int(offs[j]))
        workers = min(self.threads, jobs)
        if workers <= 1:
            run(0, jobs)
            return
        bounds = np.linspace(0, jobs, workers + 1).astype(np.int64)
        futures = [self._executor().submit(run, int(bounds[i]), int(bounds[i + 1]))
                   for i in range(workers)]
        for f in futures:
            f.result()

    def _range(self, start: int, rows: np.ndarray, write: bool) -> None:
        n = len(rows)
        if start < 0 or start + n > self.num_rows:
            raise IndexError(f"rows {start}..{start + n} of {self.path!r}: it has "
                             f"{self.num_rows:,}")
        self._io(np.arange(start, start + n, dtype=np.int64), rows, write)


def _header(info: dict) -> bytes:
    body = json.dumps(info).encode()
    head = MAGIC + VERSION.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body
    if len(head) > HEADER:
        raise ValueError(f"row-file header of {len(head)} bytes exceeds {HEADER}")
    return head


def _open(path: str, flags: int, direct) -> tuple[int, bool]:
    """Open with O_DIRECT when asked for or ("auto") when the filesystem takes it."""
    use = direct is True or (direct == "auto" and hasattr(os, "O_DIRECT"))
    if use:
        try:
            fd = os.open(path, flags | os.O_DIRECT)
            if _probe_direct(fd):
                return fd, True
            os.close(fd)
        except OSError:
            if direct is True:
                raise
    return os.open(path, flags & ~os.O_TRUNC if use else flags), False


def _probe_direct(fd: int) -> bool:
    """Whether an aligned O_DIRECT read works on this file (tmpfs opens but refuses)."""
    buf = _aligned(ALIGN)
    try:
        os.preadv(fd, [memoryview(buf)], 0)
        return True
    except OSError:
        return False


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n <= 0:
            raise OSError(f"short read at offset {offset} (file truncated?)")
        mv, offset = mv[n:], offset + n


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwritev(fd, [mv], offset)
        mv, offset = mv[n:], offset + n


def fadvise(fd: int, advice: str) -> None:
    """``posix_fadvise`` over the whole file, where the platform has it (best effort)."""
    value = getattr(os, advice, None)
    if value is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, value)
        except OSError:
            pass
