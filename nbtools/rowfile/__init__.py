"""A file of fixed-size rows on local disk, read and written in parallel, around the page cache.

The disk tier's storage (:mod:`nbtools.disk`): one preallocated file per table, a 4 KiB header
(magic ``NBTROWS\\0``, format version, JSON: rows, row bytes, stride, data offset, what the rows
are, and ``clean``: whether its writer closed it, with who that is), then row ``i`` at
``data_offset + i * stride``. A file whose writer died with it open is refused by
:meth:`RowFile.open` (its rows may be torn) and listed by :func:`leftovers`.

Why it reads the way it does:

* **O_DIRECT where the filesystem allows it.** Buffered reads fill the page cache with the
  table, and the page cache is charged to the process's memory (a container's limit, Colab's
  12.7 GB): the failure that ended memory-mapped tables. With ``O_DIRECT`` nothing is cached.
  ``O_DIRECT`` needs offsets, lengths and buffers aligned to the device's logical block, which
  is probed on the file itself (512 bytes, else 4,096).
* **Rows whole blocks, or packed.** By default the stride is the row rounded up to that block,
  so a write never reads its neighbours first (no read-modify-write): a 260-byte row takes 512
  bytes of file, a 1,536-byte row 1,536. A ``packed`` file (what a log file is,
  :mod:`nbtools.disk.log`) puts rows ``PACK`` (32) bytes apart: a 260-byte row takes 288. A
  read takes the one or two blocks a row touches (a cloud disk's cost is per request at these
  sizes); a write reads the blocks it shares with other rows first, except a ``fresh`` one (a
  log's appends at its head: nothing lives after them), which reads only a first block it
  starts in the middle of. A packed file's size is whole 4 KiB blocks.
* **Near rows in one request.** Reads merge rows at most ``GAP`` (4 KiB) apart into one
  request, the rows between them read and dropped: a disk whose random reads are bound by
  their count serves a 4 KiB request about as fast as a 512-byte one.
* **Many requests in flight, without the GIL.** A cloud disk answers one random read in ~50 µs
  but serves tens of thousands per second only with many in flight. Rows are sorted by offset,
  neighbours merged into one request (up to 1 MiB), and the requests of a call handed to
  glibc's POSIX AIO in one ``lio_listio`` call (C threads; the GIL is released for the whole
  call, so the training loop's Python and the reads do not take turns), spread over
  duplicates of the file's descriptor (glibc serialises one descriptor's requests). Where
  that is unavailable (not glibc, a forked child) the requests go to a pool of Python
  threads in ``os.preadv``, which need the GIL between two requests
  (:class:`nbtools.rowfile.fileio.RequestPool`; ``NBTOOLS_DISK_ENGINE=threads`` forces them).
  The engines' rates on a cloud disk: benchmarks/RESULTS.md, "the disk's I/O engines".
* **Bounded memory.** Each call goes through an aligned bounce buffer of at most 64 MiB, kept
  between calls (at most 64 MiB kept per file: :attr:`RowFile.ram_bytes`), so a step does not
  pay for fresh pages. The padding of a row inside the bounce buffer is only ever filled from
  the file's own padding, with zeros, or (a packed file with room for it, :attr:`RowFile.tagged`)
  with the row's tag, a uint32 its caller keeps there (a log file's id of the row).
* **Buffered fallback** (filesystems that refuse ``O_DIRECT``, or ``direct=False``): the file is
  opened with ``POSIX_FADV_RANDOM`` (no read-ahead of neighbours) and, after every call,
  ``POSIX_FADV_DONTNEED`` hands back its clean pages and starts write-back of dirty ones;
  ``fdatasync`` runs once 64 MiB were written since the last one (and in :meth:`drop_cache`),
  so dirty pages stay bounded without paying a device flush per step. ``auto_drop = False``
  leaves the cache alone until :meth:`drop_cache`. On tmpfs the file *is* memory either way.
  Measured on a virtual disk (random writes of 4 KiB rows): O_DIRECT 29K rows/s; buffered as
  above 37K, with ``fdatasync`` after
  every call 22K, never dropping 31K (and the cache grows). Rows smaller than a page written
  buffered make the kernel read the rest of the page first: 512-byte rows, 21K / 15K / 16K
  buffered against 30K with O_DIRECT. Its reads: O_DIRECT 58K rows/s at 16 threads for 512 B
  to 4 KiB, 32K for 16 KiB; buffered 40-47K with no page cache left, 51-56K without dropping.
* **Preallocated, not written.** ``posix_fallocate`` reserves the space (and fails early when it
  is missing), but the blocks stay "unwritten": they read as zeros without touching the disk,
  and the first write to each one costs a metadata update. Fill a new file sequentially
  (:meth:`write_range`) before timing random I/O.

The header, opening and housekeeping (:func:`leftovers`) are in :mod:`nbtools.rowfile.format`, a
packed file's reads and writes in :mod:`nbtools.rowfile.packed`; their names import from here too.

>>> import tempfile, os
>>> f = RowFile.create(os.path.join(tempfile.mkdtemp(), "t.rows"), 100, 12, {"dtype": "uint8"})
>>> f.write(np.array([7, 3]), np.arange(24, dtype=np.uint8).reshape(2, 12))
>>> out = np.zeros((1, 12), dtype=np.uint8)
>>> f.read(np.array([3]), out)
>>> out[0, :4].tolist()
[12, 13, 14, 15]
>>> f.meta["dtype"], f.counters["read_calls"]
('uint8', 1)
>>> f.close()
"""
from __future__ import annotations

import math
import os
import shutil
import threading
import time

import numpy as np

from .fileio import RequestPool, check_engine, fadvise
from .packed import TAG, row_requests, packed_io, packed_range
from .format import (BLOCKS, HEADER, DiskFullError, check_direct, checked_meta,
                     create_exclusive, direct_block, new_file_folder, open_regular,
                     remove_if_same, reserve, round_up, write_header, _writer)
from ..units import human_bytes
# the package's public names that live in its modules
from .packed import REQUEST  # noqa: F401
from .format import MAGIC, VERSION, RowFileError, leftovers, remove_leftovers  # noqa: F401

BOUNCE = 64 << 20              # bytes of aligned buffer per call, at most
KEEP = 64 << 20                # bytes of bounce buffers kept between calls, per file
PACK = 32                      # a packed file's stride: the row rounded up to this many bytes
GAP = 4096                     # reads: rows at most this many bytes apart share a request
DIRTY_LIMIT = 64 << 20         # buffered mode: fdatasync once this much was written


def checked_request(f, ids, rows: np.ndarray, at) -> tuple[np.ndarray, np.ndarray | None]:
    """A read's or write's arguments as :class:`RowFile` uses them (int64 ids, int64 places in
    ``rows`` or None), or the error that names what is wrong: ids that are not integers or
    outside file ``f``'s rows, ``rows`` not uint8 ``[k, row_bytes]``, ``at`` out of ``rows``."""
    ids = np.asarray(ids).reshape(-1)
    if ids.dtype.kind not in "iu" and len(ids):
        raise TypeError(f"ids must be integers, got {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2 \
            or rows.shape[1] != f.row_bytes or (at is None and len(rows) != len(ids)):
        got = (f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, np.ndarray)
               else type(rows).__name__)
        want = len(ids) if at is None else "k"
        raise ValueError(f"rows must be a uint8 numpy array [{want}, {f.row_bytes}], "
                         f"got {got}")
    dst = None
    if at is not None:
        dst = np.asarray(at).reshape(-1).astype(np.int64, copy=False)
        if len(dst) != len(ids):
            raise ValueError(f"at has {len(dst)} entries for {len(ids)} ids")
        if len(dst) and (dst.min() < 0 or dst.max() >= len(rows)):
            raise IndexError(f"at ranges {dst.min()}..{dst.max()}; rows has {len(rows):,}")
    if len(ids) and (ids.min() < 0 or ids.max() >= f.num_rows):
        bad = int(np.flatnonzero((ids < 0) | (ids >= f.num_rows))[0])
        raise IndexError(f"{f.path!r} has {f.num_rows:,} rows but ids contain "
                         f"{int(ids[bad]):,} (first at position {bad})")
    return ids, dst


class RowFile:
    """One preallocated file of ``num_rows`` rows of ``row_bytes`` bytes (see module docs).

    Use :meth:`create` or :meth:`open`; close with :meth:`close` or a ``with`` block.

    Attributes:
        path, num_rows, row_bytes: what the header says.
        stride: bytes between rows on disk (``row_bytes`` rounded up to ``block`` with O_DIRECT).
        data_offset: file offset of row 0 (4,096).
        meta: the header's JSON (``num_rows``, ``row_bytes``, ``stride``, ``data_offset`` and the
            caller's own keys).
        direct: whether ``O_DIRECT`` is in use; block: its alignment in bytes (0 when buffered).
        threads: requests in flight at most.
        auto_drop: buffered mode only: drop this file's cached pages after every call.
        counters: ``read_bytes``, ``write_bytes`` (disk bytes, whole strides), ``read_calls``,
            ``write_calls``, ``read_s``, ``write_s`` (wall seconds inside the calls).
    """

    def __init__(self, path, fd: int, meta: dict, block: int, threads: int, writable: bool):
        self.path = os.fspath(path)
        self._fd = fd
        self.meta = meta
        self.num_rows = int(meta["num_rows"])
        self.row_bytes = int(meta["row_bytes"])
        self.stride = int(meta["stride"])
        self.data_offset = int(meta["data_offset"])
        self.block = block
        self.direct = block > 0
        self.packed = bool(meta.get("packed"))
        # a packed file's I/O unit (the O_DIRECT block; 512 bytes when buffered), and the rows
        # a run must start at a multiple of for its first byte to begin a unit
        self.unit = block or 512
        self.align_rows = self.unit // math.gcd(self.stride, self.unit) if self.packed else 1
        self.writable = writable
        self.threads = max(1, int(threads))
        self.auto_drop = True
        self._lock = threading.Lock()
        self._pool = RequestPool(self.threads, KEEP, "nbtools-rowfile", direct=self.direct)
        self._unsynced = 0                       # buffered bytes written since the last fdatasync
        self.counters = {"read_bytes": 0, "write_bytes": 0, "read_calls": 0, "write_calls": 0,
                         "read_s": 0.0, "write_s": 0.0}
        if not self.direct:
            fadvise(fd, "POSIX_FADV_RANDOM")

    # --- creating and opening -------------------------------------------------------------
    @classmethod
    def create(cls, path, num_rows: int, row_bytes: int, meta: dict | None = None, *,
               threads: int = 16, direct: str | bool = "auto",
               overwrite: bool = False, packed: bool = False) -> "RowFile":
        """A new file of ``num_rows`` zero rows, its space reserved now.

        The file is this process's alone: made new (never through a link or over a file
        someone put at ``path``), mode 0600, locked (``flock``) while it is open so that a
        cleaner of dead processes' files keeps it (:func:`nbtools.rowfile.format.remove_unheld`),
        and used through its descriptor from then on, whatever is at its name later.

        Args:
            path: the file; its folder is created if missing (mode 0700).
            num_rows, row_bytes: the shape of the table in bytes.
            meta: JSON-able keys stored in the header (``dtype``, what the columns are...).
            threads: requests in flight at most.
            direct: ``True`` (O_DIRECT or an error), ``False`` (buffered) or ``"auto"``.
            overwrite: remove what is at ``path`` (a file, or a link: not what it points to)
                instead of raising ``FileExistsError``.
            packed: rows ``PACK`` bytes apart instead of whole blocks (see the module): a
                write of rows that share a block with others reads that block first, unless
                the caller says the rest of it holds nothing (``write(..., fresh=True)``).

        Raises:
            DiskFullError: the disk lacks the room (checked before anything is written), or
                filled while the space was reserved (the partial file is removed).
            PermissionError: the folder cannot be created or written.
            FileExistsError: something is at ``path`` and ``overwrite`` is false.
        """
        num_rows, row_bytes = int(num_rows), int(row_bytes)
        if num_rows < 0 or row_bytes < 1:
            raise ValueError(f"a row file needs num_rows >= 0 and row_bytes >= 1, got "
                             f"num_rows={num_rows}, row_bytes={row_bytes}")
        path = os.path.abspath(os.fspath(path))
        check_direct(direct, path)
        folder = new_file_folder(path, overwrite)
        if overwrite:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        fd = create_exclusive(path)
        try:
            os.ftruncate(fd, HEADER)         # something to probe (a hole: reads still check)
            block = direct_block(fd, path, direct)
            stride = (round_up(row_bytes, PACK) if packed
                      else round_up(row_bytes, block) if block else row_bytes)
            size = HEADER + (round_up(num_rows * stride, BLOCKS[-1]) if packed
                             else num_rows * stride)      # (packed: whole blocks at its end)
            free = shutil.disk_usage(folder).free
            if size > free:
                raise DiskFullError(
                    f"a row file of {human_bytes(size)} ({size:,} bytes: {num_rows:,} rows of "
                    f"{stride} bytes) does not fit: {human_bytes(free)} ({free:,} bytes) free in "
                    f"{folder!r}. Free space, pick another disk_dir, or make rows smaller "
                    "(dtype=torch.bfloat16, an optimizer with less state)")
            reserve(fd, size, path)
            info = {"num_rows": num_rows, "row_bytes": row_bytes, "stride": stride,
                    **({"packed": True} if packed else {}),
                    "data_offset": HEADER, **(meta or {}), "clean": False, "writer": _writer()}
            write_header(fd, info)
        except BaseException:
            remove_if_same(path, fd)         # ours: a partial (or empty) file
            os.close(fd)
            raise
        return cls(path, fd, info, block, threads, True)

    @classmethod
    def open(cls, path, *, expect: dict | None = None, threads: int = 16,
             direct: str | bool = "auto", writable: bool = True,
             unclean_ok: bool = False) -> "RowFile":
        """An existing row file, its header checked (and compared with ``expect``).

        The header says whether the file was closed by its writer (``clean``) and who writes it
        (``writer``: pid, host, start time). A file whose writer died with it open (killed,
        crashed, out of memory) may hold stale or torn rows: opening it raises, unless
        ``unclean_ok`` (to rewrite every row, as a checkpoint restore does). Opened
        ``writable``, the file is this process's until :meth:`close` marks it clean again.

        A file handed over by someone else is data, never trusted: ``path`` is opened once,
        without blocking (a FIFO or a device is refused, not waited on), and everything after
        goes through that descriptor; every header field the file's reads and writes rely on
        (``num_rows``, ``row_bytes``, ``stride``, ``data_offset``, ``packed``, ``clean``,
        ``writer``) is checked, and its size against them. Opened ``writable``, a symbolic
        link at ``path`` is refused: writing its header and rows would change the file it
        points to (someone's shared folder holding a link to your own table); pass the real
        path (``os.path.realpath(path)``) to write that file. Read-only, a link is followed
        (nothing is written through it).

        Raises:
            FileNotFoundError: no file at ``path``.
            RowFileError: not a row file (a FIFO, a device, a folder, another format), a
                symbolic link opened ``writable``, another format version, a damaged header
                ("its header is damaged: ..." names the field), shorter than its header says
                (truncated), a field differs from ``expect``, or it was not closed cleanly
                (and ``unclean_ok`` is false).
        """
        path = os.fspath(path)
        check_direct(direct, path)
        fd = open_regular(path, os.O_RDWR if writable else os.O_RDONLY, follow=not writable,
                          what="row file")
        try:
            meta = checked_meta(fd, path, expect, unclean_ok)
            block = direct_block(fd, path, direct,
                                 stride=0 if meta.get("packed") else meta["stride"])
            if writable:             # this process writes it now: unclean until closed
                meta = {**meta, "clean": False, "writer": _writer()}
                write_header(fd, meta)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, meta, block, threads, writable)

    # --- rows -----------------------------------------------------------------------------
    def read(self, ids: np.ndarray, out: np.ndarray, at: np.ndarray | None = None,
             tags: np.ndarray | None = None) -> None:
        """``out[i] = row ids[i]``.

        Args:
            ids: row numbers, int64 (any integer type), unique, any order, may be empty.
            out: C-contiguous uint8 ``[len(ids), row_bytes]``; with ``at``, any number of rows.
            at: optional: ``out[at[i]] = row ids[i]`` (a RAM cache's slots, filled without an
                intermediate copy).
            tags: optional (a :attr:`tagged` file): a uint32 array ``[len(ids)]`` that gets
                row ``ids[i]``'s tag.
        """
        n = int(np.asarray(ids).size)
        self._tags_out(tags, n)
        self._io(ids, out, write=False, at=at, tags=tags)

    def write(self, ids: np.ndarray, src: np.ndarray, at: np.ndarray | None = None,
              fresh: bool = False, tags: np.ndarray | None = None) -> None:
        """Row ``ids[i] = src[i]`` (ids unique, any order); with ``at``, ``src[at[i]]``.
        ``fresh`` (packed files): nothing worth keeping follows these rows in the blocks they
        touch (a log's appends, at its head): those blocks are written without reading them
        first, zeros after the rows; only a block where a run of consecutive rows starts
        mid-block is read first (rows appended before it end there). ``tags`` (a
        :attr:`tagged` file): row ``ids[i]``'s tag is ``tags[i]``; without, a fresh write's
        rows get tag 0 and the others keep theirs."""
        n = int(np.asarray(ids).size)
        if fresh and tags is None and self.tagged:    # (a first block read keeps old ones)
            tags = np.zeros(n, dtype=np.uint32)
        self._io(ids, src, write=True, at=at, fresh=fresh, tags=self._tags(tags, n))

    def read_range(self, start: int, out: np.ndarray, tags: np.ndarray | None = None) -> None:
        """Rows ``start : start + len(out)`` into ``out``, in large sequential requests;
        ``tags`` (a :attr:`tagged` file): a uint32 array that gets each row's tag."""
        self._tags_out(tags, len(out))
        self._range(start, out, write=False, tags=tags)

    def write_range(self, start: int, src: np.ndarray, tags: np.ndarray | None = None) -> None:
        """Rows ``start : start + len(src)`` from ``src``, in large sequential requests; their
        tags are ``tags`` (a :attr:`tagged` file), else 0."""
        self._range(start, src, write=True, tags=self._tags(tags, len(src)))

    @property
    def tagged(self) -> bool:
        """Whether each row carries a tag, a uint32 kept in its padding: a packed file with at
        least TAG bytes of it a row (a log file keeps its ids of the rows there,
        :mod:`nbtools.disk.log`)."""
        return self.packed and self.stride - self.row_bytes >= TAG

    def _tags_out(self, tags, n: int) -> None:
        if tags is not None and (not self.tagged or not isinstance(tags, np.ndarray)
                                 or tags.dtype != np.uint32 or tags.shape != (n,)):
            raise ValueError(f"tags must be a uint32 array [{n}] of a tagged file "
                             f"(tagged: {self.tagged})")

    def _tags(self, tags, n: int):
        if tags is None:
            return None
        if not self.tagged:
            raise ValueError(f"{self.path!r}: its rows carry no tags (packed: {self.packed}, "
                             f"{self.stride - self.row_bytes} bytes of padding a row)")
        tags = np.asarray(tags).reshape(-1)
        if len(tags) != n or tags.dtype.kind not in "iu" or (
                len(tags) and (tags.min() < 0 or tags.max() >= 2 ** 32)):
            raise ValueError(f"tags must be {n} integers in 0 .. 2**32 - 1")
        return tags.astype("<u4")

    def flush(self) -> None:
        """Make written rows durable (``fsync``)."""
        os.fsync(self._live())
        self._unsynced = 0

    def drop_cache(self) -> None:
        """Hand this file's cached pages back (buffered mode; O_DIRECT caches none). Dirty
        pages are written first, since only clean ones can be dropped."""
        fd = self._live()
        if not self.direct:
            if self._unsynced:
                os.fdatasync(fd)
                self._unsynced = 0
            fadvise(fd, "POSIX_FADV_DONTNEED")

    @property
    def unsynced_bytes(self) -> int:
        """Bytes written through the page cache (buffered mode) since the last ``fdatasync``
        (:meth:`flush`, :meth:`drop_cache`, or every ``DIRTY_LIMIT`` bytes)."""
        return self._unsynced

    @property
    def ram_bytes(self) -> int:
        """Bytes of bounce buffers held between calls."""
        return self._pool.kept_bytes

    def map_rows(self, rows: int | None = None, writable: bool = True) -> np.memmap:
        """Rows ``0:rows`` (every row by default) as uint8 ``[rows, stride]`` mapped into
        memory from the file's own descriptor, so the mapping is of this file whatever is at
        its name now: shared with the file, or (not ``writable``) copy-on-write, writes
        staying in this process. Through the page cache: for whole-file access, not steps."""
        fd = self._live()
        if writable and not self.writable:
            raise PermissionError(f"{self.path!r} was opened read-only (writable=False)")
        n = self.num_rows if rows is None else int(rows)
        if not 0 < n <= self.num_rows:
            raise ValueError(f"map_rows: rows must be in 1..{self.num_rows:,}, got {n:,}")
        # (numpy maps a duplicate of the descriptor, aligned to the system's granularity)
        with open(os.dup(fd), "r+b" if self.writable else "rb", buffering=0) as f:
            return np.memmap(f, dtype=np.uint8, mode="r+" if writable else "c",
                             offset=self.data_offset, shape=(n, self.stride))

    def delete(self) -> bool:
        """Close the file and remove it: its name, where that still names this file (a file
        moved over the name, or a link put there, is left alone). Returns whether the name
        was removed."""
        fd = self._fd
        removed = fd is not None and remove_if_same(self.path, fd)
        self.close()
        return removed

    def close(self) -> None:
        """Stop the threads and close the file (idempotent), its header marked clean (closed
        by its writer). Buffered mode drops its clean cached pages; nothing is fsynced (call
        :meth:`flush` for durability)."""
        with self._lock:
            fd, self._fd = self._fd, None
        self._pool.close()
        if fd is not None:
            if self.writable and self.meta.get("clean") is False:
                self.meta = {**self.meta, "clean": True}
                try:
                    write_header(fd, self.meta)
                except OSError:      # it stays marked unclean: the safe side
                    pass
            if not self.direct:
                fadvise(fd, "POSIX_FADV_DONTNEED")
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                self._pool.close()
                os.close(fd)
            except Exception:
                pass

    @property
    def engine(self) -> str:
        """How requests are issued: ``"aio"`` (glibc's AIO, no GIL), ``"threads"`` (Python
        threads) or ``"kaio"`` (Linux's native AIO); see :class:`nbtools.rowfile.fileio.RequestPool`.
        Settable."""
        return self._pool.engine

    @engine.setter
    def engine(self, value: str) -> None:
        self._pool.engine = check_engine(value)

    def __repr__(self):
        mode = f"O_DIRECT, {self.block}-byte blocks" if self.direct else "buffered"
        mode += f", {self.engine}"
        return (f"RowFile({self.path!r}, rows={self.num_rows:,}, row_bytes={self.row_bytes}, "
                f"stride={self.stride}, {mode})")

    # --- internals ------------------------------------------------------------------------
    def _live(self) -> int:
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.path!r} is closed")
        return fd

    def _check(self, ids, rows: np.ndarray, write: bool, at) -> tuple[np.ndarray, np.ndarray]:
        self._live()
        if write and not self.writable:
            raise PermissionError(f"{self.path!r} was opened read-only (writable=False)")
        return checked_request(self, ids, rows, at)

    def _io(self, ids, rows: np.ndarray, write: bool, at=None, fresh: bool = False,
            tags=None) -> None:
        ids, at = self._check(ids, rows, write, at)
        t0 = time.perf_counter()
        k = len(ids)
        nbytes = k * self.stride
        if k:
            order = np.argsort(ids, kind="stable")
            ids = ids[order]
            dst = order if at is None else at[order]
        given = tags
        if k and tags is not None:        # (sorted as the ids are; a read's, put back after)
            tags = tags[order] if write else np.empty(k, dtype=np.uint32)
        if k and self.packed:
            nbytes = packed_io(self, ids, dst, rows, write, fresh, bounce=BOUNCE, gap=GAP,
                               tags=tags)
            if not write and given is not None:
                given[order] = tags
        elif k:
            stride, rb = self.stride, self.row_bytes
            # reads also take the rows between two near ones (at most GAP bytes apart): one
            # request instead of two, on a disk whose random reads are bound by their count
            gap = 0 if write else GAP // stride
            per = max(1, BOUNCE // (stride * (gap + 1)))    # rows per bounce buffer
            buf = None
            try:
                for a in range(0, k, per):
                    part, where = ids[a:a + per], dst[a:a + per]
                    n = len(part)
                    boff, blen, foff, pos = row_requests(part, stride, self.data_offset, gap=gap)
                    need = (int(pos[-1]) + 1) * stride
                    buf = self.at_least(buf, need)
                    if write:
                        view = buf[: n * stride].reshape(n, stride)
                        if stride == rb:
                            np.take(rows, where, axis=0, out=view)
                        else:
                            view[:, :rb] = rows[where]
                    self._pool.run(self._live(), buf, boff, blen, foff, write)
                    if not write:
                        rows[where] = buf[:need].reshape(-1, stride)[pos, :rb]
                        nbytes += need - n * stride
            finally:
                if buf is not None:
                    self._pool.give(buf)
        self._account(write, nbytes, t0)

    def _range(self, start: int, rows: np.ndarray, write: bool, tags=None) -> None:
        self._live()
        if write and not self.writable:
            raise PermissionError(f"{self.path!r} was opened read-only (writable=False)")
        n = len(rows)
        if not isinstance(rows, np.ndarray) or rows.dtype != np.uint8 or rows.ndim != 2 \
                or rows.shape[1] != self.row_bytes:
            raise ValueError(f"rows must be a uint8 numpy array [n, {self.row_bytes}], got "
                             f"{getattr(rows, 'dtype', type(rows).__name__)} "
                             f"{list(getattr(rows, 'shape', []))}")
        if start < 0 or start + n > self.num_rows:
            raise IndexError(f"rows {start:,}..{start + n:,} of {self.path!r}: it has "
                             f"{self.num_rows:,}")
        t0 = time.perf_counter()
        if self.packed:
            moved = packed_range(self, start, rows, write, bounce=BOUNCE, tags=tags) if n else 0
            self._account(write, moved, t0)
            return
        stride, rb = self.stride, self.row_bytes
        # straight into the caller's rows when they are laid out as on disk (no bounce copy)
        own = stride == rb and rows.flags.c_contiguous and (
            not self.direct or rows.ctypes.data % self.block == 0)
        per = max(1, BOUNCE // stride)
        buf = None if own or n == 0 else self._pool.take(min(n, per) * stride)
        try:
            for a in range(0, n, per):
                m = min(per, n - a)
                if own:
                    flat = rows[a:a + m].reshape(-1)
                else:
                    flat = buf[: m * stride]
                    if write:
                        flat.reshape(m, stride)[:, :rb] = rows[a:a + m]
                # requests of 4 MiB: large enough for the disk's sequential rate, many in flight
                step = max(stride, (4 << 20) // stride * stride)
                boff = list(range(0, m * stride, step))
                blen = [min(step, m * stride - b) for b in boff]
                base = self.data_offset + (start + a) * stride
                self._pool.run(self._live(), flat, boff, blen, [base + b for b in boff],
                                   write, chunk=1)
                if not own and not write:
                    rows[a:a + m] = flat.reshape(m, stride)[:, :rb]
        finally:
            if buf is not None:
                self._pool.give(buf)
        self._account(write, n * stride, t0)

    # --- bounce-buffer I/O (what the packed rows' reads and writes, nbtools.rowfile.packed,
    # ask of the file: they never reach its descriptor or request pool themselves) --------
    def submit(self, buf: np.ndarray, boff, blen, foff, write: bool, chunk: int = 0) -> None:
        """Requests ``j``: ``blen[j]`` bytes at ``buf[boff[j]:]`` <-> file offset ``foff[j]``,
        through the file's request pool (:meth:`nbtools.rowfile.fileio.RequestPool.run`)."""
        self._pool.run(self._live(), buf, boff, blen, foff, write, chunk)

    def take_buffer(self, nbytes: int) -> np.ndarray:
        """A bounce buffer of at least ``nbytes`` (aligned for O_DIRECT); hand it back with
        :meth:`give_buffer`."""
        return self._pool.take(nbytes)

    def give_buffer(self, buf: np.ndarray) -> None:
        self._pool.give(buf)

    def at_least(self, buf, nbytes: int) -> np.ndarray:
        """``buf`` (or None) when it holds ``nbytes``, else a larger bounce buffer in its
        place."""
        if buf is not None and buf.nbytes >= nbytes:
            return buf
        if buf is not None:
            self._pool.give(buf)
        return self._pool.take(nbytes)

    def count_reads(self, nbytes: int) -> None:
        """Blocks a packed file's write read first (to keep the rows sharing them)."""
        with self._lock:
            self.counters["read_bytes"] += nbytes

    def _account(self, write: bool, nbytes: int, t0: float) -> None:
        if not self.direct and nbytes:
            fd = self._live()
            if write:
                self._unsynced += nbytes
                if self._unsynced >= DIRTY_LIMIT:
                    os.fdatasync(fd)
                    self._unsynced = 0
            if self.auto_drop:
                # drops clean pages and starts write-back of dirty ones (dropped next time)
                fadvise(fd, "POSIX_FADV_DONTNEED")
        key = "write" if write else "read"
        with self._lock:
            c = self.counters
            c[f"{key}_bytes"] += nbytes
            c[f"{key}_calls"] += 1
            c[f"{key}_s"] += time.perf_counter() - t0
