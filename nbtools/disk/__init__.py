"""Rows on local disk, under a RAM cache of hot rows (``placement="disk"``).

A disk table keeps every row ``[weight | state...]`` in one preallocated file
(:class:`nbtools.rowfile.RowFile`) and a bounded number of them in RAM, in *slots* of a pinned
host buffer (the slab). A lookup deduplicates its ids on the CPU, finds each row's slot, reads
the rows that are not in RAM from the file (sorted by offset, in parallel) into free slots, and
hands the step a :class:`~nbtools.store.rows.RowBatch` whose ids are *slot numbers*. From there on the
step is the host placement's, unchanged: the GPU gathers the slots zero-copy, the optimizer's
fused update writes them back into the slab, with the same checks and the same lazy rules. So
a disk table trains bit-identically to the same table in host RAM.

Why slots and not a memory map: a map of a file grows the page cache to the table's size (the
failure that made SpeedTorch's author give up on disk); the slab is the only RAM the rows take,
and the file is read with ``O_DIRECT`` where the filesystem allows it.

Rules that keep it exact:

* A slot is *locked* from a training lookup until the optimizer step that writes it has been
  queued, and *busy* until the GPU work queued after that (recorded as a CUDA event at the next
  host access) has run. Only slots neither locked nor busy are evicted; dirty ones are written
  to the file before their slot is reused, so a row not in RAM is always current on disk.
* A read-ahead (:meth:`DiskRows.read_ahead`, from ``table.prefetch(next_ids)``) loads coming
  steps' missing rows in the background by the same rules (:mod:`nbtools.disk.readahead`); it only
  moves rows between file and RAM, never changes a value, so results are bit-identical with and
  without it.
* Anything that reads the file from outside a step (``table.weight``, ``state_dict``,
  checkpoints) first writes every dirty row back (:meth:`DiskRows.flush`).

Eviction is CLOCK (second chance), vectorised over windows of slots: cost per step follows the
number of misses, not the cache size. When one step touches more distinct rows than the RAM
cache holds, the slab grows to hold that step (with a warning: the RAM budget is too small for
the batch).
"""
from __future__ import annotations

import os
import re
import secrets
import stat
import tempfile
import threading
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import NbtoolsError
from . import log as disklog
from .slots import RamSlots
from ..devices import hold_host, host_memory_bytes, release_host
from .access import WholeTable, write_all
from ..rowfile.fileio import default_engine, uninterrupted
from ..rowfile.format import make_folder, remove_unheld
from ..hostmem import HostTensor, keep_freed_memory_small
from .readahead import Prepared, ReadAhead
from ..units import human_bytes

# Slab bytes a disk table keeps in RAM when neither host_cache_bytes is given nor a budget
# chosen: enough for the hot rows of most id streams, small next to Colab's 12.7 GB.
DEFAULT_HOST_CACHE_BYTES = 1 << 30
# Reads in flight: a step misses ~1,000-10,000 rows, and a cloud disk answers each in ~0.3 ms,
# so a step's reads are latency-bound unless many wait at once (NBTOOLS_DISK_THREADS overrides):
# 32 Python threads, or with an AIO engine (glibc's C threads, or the kernel's; a native AIO
# file falling back to glibc's keeps this) 128 requests in flight in all, shared
# by the table's read-aheads and write-backs (nbtools.rowfile.fileio.RequestPool). On a cloud
# disk, eight steps ahead, 128 shared came nearer the disk floor than 64 (benchmarks/RESULTS.md,
# "shared AIO descriptors").
DISK_THREADS = 32
DISK_AIO_DEPTH = 128


# Every disk table's traffic, for the meters and the dashboard (plain counters: the GIL keeps
# each += whole; the read-ahead thread adds to them too).
_counters = {"read_bytes": 0, "write_bytes": 0, "read_s": 0.0, "write_s": 0.0,
             "lookup_rows": 0, "hit_rows": 0, "wait_s": 0.0, "ahead_rows": 0,
             "moved_read_bytes": 0}


def disk_counters() -> dict:
    """Cumulative disk-table traffic: bytes read and written, seconds spent in reads and
    writes, unique rows looked up in training and evaluation and how many of them were in RAM
    (``hit_rows``), and ``wait_s``: seconds the training loop's thread spent waiting for the
    disk (its own reads and write-backs, and waiting for a read-ahead to finish);
    ``ahead_rows``: rows read-aheads brought in (nonzero once ``table.prefetch`` is in use);
    ``moved_read_bytes``: of ``read_bytes``, what a log file's cleaner read (whole segments).

    >>> sorted(disk_counters())[:3]
    ['ahead_rows', 'hit_rows', 'lookup_rows']
    """
    return dict(_counters)


def _count_clean(read_bytes: int, write_bytes: int) -> None:
    """A log file's cleaner moved rows (nbtools.disk.log): its disk traffic, in the counters."""
    _counters["read_bytes"] += read_bytes
    _counters["moved_read_bytes"] += read_bytes
    _counters["write_bytes"] += write_bytes


def default_dir() -> str:
    """Where disk tables go unless ``disk_dir`` says otherwise: ``nbtools-tables-<uid>`` in
    the system's temporary folder, this user's own (local disk, not Drive).

    Why the temporary folder and not the home's cache (``~/.cache``): a table takes tens of
    GB, and on shared servers the temporary folder is usually the large local disk where home
    is a network filesystem under a quota (on Colab both are the same local disk). Why a
    folder per user, checked before a file goes in (:func:`table_dir`): anyone may make a
    folder there, so one that exists is used only if it is a real folder (not a link) of this
    user's that nobody else may enter (no group or other permission bits), and is otherwise
    refused with an error that says so; one that is missing is made with mode 0700.
    Returns the path only (it makes and checks nothing).
    """
    return os.path.join(tempfile.gettempdir(), f"nbtools-tables-{os.geteuid()}")


def table_dir(folder=None) -> str:
    """The folder a disk table's file goes in, ready for it (an absolute path): ``folder``,
    made where missing (mode 0700, and the folders above it that are missing too), or by
    default :func:`default_dir`, made or checked to be this user's alone.

    Raises:
        PermissionError: the default folder exists but is a link, not a folder, another
            user's, or open to others (its mode has group or other bits); nothing is written
            there.
    """
    if folder is not None and os.path.abspath(os.fspath(folder)) != \
            os.path.abspath(default_dir()):
        folder = os.path.abspath(os.fspath(folder))
        make_folder(folder)
        return folder
    folder = os.path.abspath(default_dir())
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:         # (made before, perhaps by someone else: checked below)
        pass
    _check_private(folder, os.lstat(folder))
    return folder


def _check_private(folder: str, st: os.stat_result) -> None:
    """Refuse the default folder of disk tables unless ``st`` (its lstat) is of a folder of
    this user's with no group or other permission bits."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        what = f"a symbolic link (to {os.readlink(folder)!r}), not a folder"
    elif not stat.S_ISDIR(st.st_mode):
        what = "not a folder"
    elif st.st_uid != uid:
        what = f"owned by another user (uid {st.st_uid}; this process runs as uid {uid})"
    elif st.st_mode & 0o077:
        what = f"open to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    fix = (f"or, if it is yours, `chmod 700 {folder}`" if stat.S_ISDIR(st.st_mode)
           and st.st_uid == uid else f"or remove {folder!r} if you may, and nbtools makes "
           "it again")
    raise PermissionError(
        f"the default folder of disk tables {folder!r} is {what}: nbtools puts table files "
        "only in a folder of this user's that nobody else may enter (mode 0700), since "
        "others could read, remove or replace them there. Pass disk_dir= a folder of yours "
        f"(or set TMPDIR to one), {fix}.")


# A table file's name (file_name): what remove_stale_tables takes to be a table's file.
TABLE_FILE = re.compile(r".{1,64}-[0-9]{1,10}-[0-9a-f]{16}\.nbrows")


def file_name(name: str) -> str:
    """The name of a new file of table ``name``: ``<name>-<pid>-<16 random hex
    digits>.nbrows`` (the name kept to letters, digits and ``-_.``, 64 at most); what
    :func:`remove_stale_tables` looks for.

    >>> bool(TABLE_FILE.fullmatch(file_name("items/v2")))
    True
    """
    return f"{_safe(name)}-{os.getpid()}-{secrets.token_hex(8)}.nbrows"


def remove_stale_tables(directory=None) -> list[dict]:
    """Remove the files of disk tables whose process died without closing them (killed,
    crashed, out of memory) from ``directory`` (default :func:`default_dir`, where a new
    table in that folder does this itself): ``{"path", "bytes"}`` of each file removed, the
    bytes it freed on disk.

    A file is removed only if its name is a table file's (:func:`file_name`), it is a
    regular file (not a link) owned by this user, and no open descriptor holds its lock: a
    table holds it on its file from creation until it is closed, so a live process's table,
    this one's or another's, is never removed, whatever its pid says. Nothing else in the
    folder is touched. A folder that several machines share over the network: files another
    machine wrote are kept (its locks may not show here).

    Raises:
        PermissionError: the default folder is not this user's alone (:func:`table_dir`).

    >>> import tempfile
    >>> remove_stale_tables(tempfile.mkdtemp())
    []
    """
    folder = os.path.abspath(os.fspath(default_dir() if directory is None else directory))
    try:
        if folder == os.path.abspath(default_dir()):
            _check_private(folder, os.lstat(folder))
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if TABLE_FILE.fullmatch(name):
            path = os.path.join(folder, name)
            freed = remove_unheld(path)
            if freed is not None:
                out.append({"path": path, "bytes": freed})
    return out


class DiskTableBrokenError(NbtoolsError, OSError):
    """A disk table whose file lacks rows it wrote back (a failed write): it refuses every
    later use; its last checkpoint is intact."""


def row_map_bytes(num_rows: int) -> int:
    """RAM a disk table of ``num_rows`` rows keeps whatever its cache (beside a log file's
    maps): its row -> slot map (int32 where the rows fit, else int64) and its change marks
    (a bit a row)."""
    return num_rows * (4 if num_rows < 2 ** 31 else 8) + -(-num_rows // 8)


class DiskRows:
    """The rows of one table in a file, and the RAM slots that cache them.

    It owns the file (``file``), the RAM cache (``ram``, :class:`~nbtools.disk.slots.RamSlots`:
    the slab, the row -> slot map and every slot's state), the read-ahead (``reader``,
    :class:`~nbtools.disk.readahead.ReadAhead`, from the first :meth:`read_ahead`), the
    write-back thread of evicted rows, and the table's lock (``slots_lock``), and runs a
    lookup's path from the file into RAM (:meth:`resolve`). Whole-table access (``.weight``,
    checkpoints, warming) is ``whole`` (:class:`~nbtools.disk.access.WholeTable`), whose
    methods the table's of the same names call. A GPU cache above the slots is ``above``.

    Args:
        directory: folder for the table file (:func:`table_dir`: created if missing; the
            default folder, :func:`default_dir`, checked to be this user's alone, and its
            files of dead processes removed first). The file (mode 0600, this process's
            alone: :meth:`nbtools.rowfile.RowFile.create`) is removed when the table is closed
            or collected.
        num_rows, width, dtype: the rows ``[num_rows, width]`` of ``dtype``.
        cache_rows: slots in RAM (grown if one step needs more).
        device: the compute device (CUDA: the slab is pinned and read zero-copy).
        name: the table's name, for the file name and messages.

    >>> import tempfile
    >>> d = DiskRows(tempfile.mkdtemp(), 10, 2, torch.float32, cache_rows=4, device="cpu")
    >>> d.write_rows(np.arange(10), torch.arange(20.).view(10, 2))
    >>> slots = d.resolve(np.array([3, 7]), training=False)
    >>> d.slab.tensor[torch.as_tensor(slots)].tolist()
    [[6.0, 7.0], [14.0, 15.0]]
    >>> d.close()
    """

    def __init__(self, directory, num_rows: int, width: int, dtype: torch.dtype, *,
                 cache_rows: int, device="cpu", pin: bool = True, name: str = "table",
                 threads: int | None = None):
        self.name = name
        self.num_rows, self.width, self.dtype = int(num_rows), int(width), dtype
        self.device = torch.device(device)
        self.row_bytes = self.width * dtype.itemsize
        self.directory = table_dir(directory)
        if self.directory == os.path.abspath(default_dir()):
            _say_removed(remove_stale_tables(self.directory), self.directory)
        meta = {"dtype": str(dtype).replace("torch.", ""), "width": self.width, "name": name}
        threads = threads or int(os.environ.get(
            "NBTOOLS_DISK_THREADS",
            DISK_AIO_DEPTH if default_engine() in ("aio", "kaio") else DISK_THREADS))
        self.file, raw = _new_file(self.directory, name, self.num_rows, self.row_bytes, meta,
                                   threads)
        if isinstance(self.file, disklog.LogFile):
            self.file.on_clean = _count_clean
        # the file's own descriptor is what every later use reads and writes (never its name);
        # at the end the name is removed only where it still names this file
        self._remove = weakref.finalize(self, raw.delete)
        self.slots_lock = threading.RLock()
        self.above = None                       # a GPU cache of hot rows (nbtools.disk.gpu)
        self._readahead = None                  # ReadAhead, from the first read_ahead
        self._writer = None
        self._lost = None                       # (rows, error) of a write-back that failed
        # the row -> slot map and the change marks (and a log file's maps): in the host budget
        maps = row_map_bytes(self.num_rows) + getattr(self.file, "map_bytes", 0)
        hold_host(maps, f"table {name!r}'s row maps")
        self._release_maps = weakref.finalize(self, release_host, maps)
        keep_freed_memory_small()
        # hits: rows found in RAM that no read-ahead brought in (those count as ahead_hits:
        # read from disk all the same, only earlier)
        self.stats = {"lookups": 0, "hits": 0, "misses": 0, "evicted": 0, "written_back": 0,
                      "read_ahead": 0, "ahead_hits": 0, "from_write_back": 0}
        self.ram = RamSlots(self.num_rows, self.width, dtype,
                            want=max(1, min(int(cache_rows), self.num_rows)),
                            device=self.device, pin=pin and self.device.type == "cuda",
                            name=name, counts=self.stats)
        self.whole = WholeTable(self)
        self._grew_warned = False
        # rows(start, stop) -> the initial rows, until they are first needed (ensure_init)
        self.initial = None

    @property
    def slab(self) -> HostTensor:
        """The RAM cache's rows ``[slots, width]`` (``ram.slab``; a new one when it grows)."""
        return self.ram.slab

    @property
    def ram_bytes(self) -> int:
        """RAM this table's rows take: the slab plus the row -> slot map and slot arrays."""
        if self.ram.slot_of is None:            # closed
            return 0
        return (self.ram.ram_bytes + self.whole.changed.nbytes
                + getattr(self.file, "map_bytes", 0))

    @property
    def nbytes(self) -> int:
        """Bytes of the rows themselves (as in RAM); :attr:`file_bytes` is what they take on disk."""
        return self.num_rows * self.row_bytes

    @property
    def file_bytes(self) -> int:
        """Bytes the file's rows take on disk, spare slots included: packed in a log file (a
        260-byte row takes 288), else each row rounded up to the file's O_DIRECT block (512)."""
        return getattr(self.file, "slots", self.num_rows) * self.file.stride

    # --- GPU uses of slots ----------------------------------------------------------------
    def step_queued(self) -> None:
        """The optimizer has taken this table's lookups (its update is queued after this):
        their slots are marked used at the next host access. Lock-free: the step's Python
        never waits for a read-ahead."""
        self.ram.step_queued()
        if self.above is not None:
            self.above.step_queued()

    def mark_used(self, slots: np.ndarray) -> None:
        """The GPU work queued so far reads or writes RAM ``slots`` (:meth:`RamSlots.mark_used`)."""
        self.ram.mark_used(slots)

    # --- rows in and out of RAM -----------------------------------------------------------
    def resolve(self, ids: np.ndarray, training: bool) -> np.ndarray:
        """Slots holding rows ``ids`` (sorted, unique, in range), reading the missing rows
        from the file. ``training``: the slots stay locked until the optimizer's step (their
        rows are written by it)."""
        t0 = time.perf_counter()
        self._intact()
        self.whole.sync_mapped()
        self.whole.ensure_init()
        self.ensure_slab()
        if self._readahead is not None:
            self._readahead.load_beside(ids)
        ram = self.ram
        with self.slots_lock:
            if self._readahead is not None:     # (now quick; and whatever began meanwhile)
                self._readahead.settle_for(ids)
            ram.close_step()
            slots = ram.slot_of[ids]
            miss = slots < 0
            nmiss = int(miss.sum())
            found = slots[~miss]
            early = ram.take_ahead(found)           # rows a read-ahead brought in
            self.stats["lookups"] += len(ids)
            self.stats["misses"] += nmiss
            self.stats["hits"] += len(ids) - nmiss - early
            self.stats["ahead_hits"] += early
            _counters["lookup_rows"] += len(ids)
            _counters["hit_rows"] += len(ids) - nmiss - early
            if nmiss:
                with ram.sparing(slots[~miss]):
                    free = ram.take_slots(nmiss, wait=True, grow=self.grow)
                self.load_rows(ids[miss], free)
                slots[miss] = free
            ram.mark_referenced(slots)
            if training:
                ram.lock_for_step(slots)
        _counters["wait_s"] += time.perf_counter() - t0
        return slots

    def file_write(self, ids: np.ndarray, src: np.ndarray, at=None) -> None:
        """Rows ``ids`` (sorted), as stored (``src``, or its rows ``at``), into the file,
        counted; every write of the table's file goes through here."""
        t0 = time.perf_counter()
        self.file.write(ids, src, at=at)
        self.whole.changed.add(ids)
        _counters["write_s"] += time.perf_counter() - t0
        _counters["write_bytes"] += len(ids) * self.row_bytes
        self.stats["written_back"] += len(ids)

    def load_rows(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Read rows ``ids`` (sorted) into ``slots``, writing the stash of evicted rows on
        another thread meanwhile (the disk serves both at once; they touch different rows).
        Where read-aheads run, the write is theirs to track (:meth:`ReadAhead.track_write`):
        this lookup, which holds the table's lock, does not wait behind their write-backs.
        (A read-ahead's loads are :mod:`nbtools.disk.readahead`'s, outside the lock.)"""
        ram = self.ram
        writing = None
        if ram.evicted_rows:
            stash = ram.take_evicted()
            writing = self.writer_pool().submit(self.drain, stash)
            if self._readahead is not None:
                self._readahead.track_write(stash, writing)
                writing = None
        # rows still queued for write-back: copied from there (ReadAhead.fill), not read
        kept = self._readahead.fill(ids, slots) if self._readahead is not None else None
        rest, at = (ids, slots) if kept is None else (ids[~kept], slots[~kept])
        t0 = time.perf_counter()
        try:
            if len(rest):
                self.file.read(rest, ram.slab_bytes, at=at)
        except BaseException:      # an I/O error or a KeyboardInterrupt: nothing was placed
            ram.free(np.asarray(slots, dtype=ram.index_dtype))
            raise
        finally:
            if writing is not None:     # evicted rows on disk before any reader looks
                uninterrupted(writing.result)
        self.count_read(rest, time.perf_counter() - t0)
        ram.placed(ids, slots)
        if kept is not None:
            ram.mark_dirty(slots[kept])        # (the file may not have them yet)

    def write_evicted(self) -> None:
        """Write the rows evicted so far (on the write-back thread; where read-aheads run,
        theirs to track, else waited for here). Under the lock."""
        if not self.ram.evicted_rows:
            return
        stash = self.ram.take_evicted()
        writing = self.writer_pool().submit(self.drain, stash)
        if self._readahead is not None:
            self._readahead.track_write(stash, writing)
        else:
            uninterrupted(writing.result)

    def write_stash(self) -> None:
        """Write evicted rows a lookup did not get to write (it was interrupted): before
        anything reads the file, or writes rows the stash would then overwrite. Under the
        lock."""
        if self.ram.evicted_rows:
            self.drain(self.ram.take_evicted())

    def write_file(self, ids: np.ndarray, raw: np.ndarray) -> None:
        """Write rows ``ids`` (sorted; not in RAM) as stored (uint8 ``[len(ids), row_bytes]``)
        to the file, after the evicted rows still waiting. Under the lock, with no read-ahead
        in flight."""
        self.write_stash()
        self.file_write(np.asarray(ids, dtype=np.int64), raw)

    # --- the slab's size ------------------------------------------------------------------
    def ensure_slab(self) -> None:
        """Pin the RAM cache at its full size, the first time rows are needed (on the
        training loop's thread: the table then takes the new slab, ``slab``). Once it is, a
        step does not wait for the lock (a read-ahead may hold it for milliseconds): the slab
        only ever grows, under the lock."""
        if self.ram.slots >= self.ram.want:
            return
        with self.slots_lock:
            if self.ram.slots < self.ram.want:
                self._resize(self.ram.want)

    def _resize(self, slots: int) -> None:
        if self._readahead is not None:         # reads in flight write into the old slab
            self._readahead.wait_io()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)     # queued kernels read the old slab
        self.ram.resize(slots)

    def grow(self, need: int) -> None:
        """One step touches more rows than the slab holds: make room for ``need`` more (a
        host sync; what :meth:`RamSlots.take_slots` calls when waiting frees too few)."""
        ram = self.ram
        slots = ram.slots + max(need, ram.slots // 4)
        if not self._grew_warned:
            self._grew_warned = True
            warnings.warn(
                f"table {self.name!r}: one step touches more distinct rows than its RAM cache "
                f"holds ({ram.slots:,} rows, {human_bytes(ram.slab.nbytes)}); growing it to "
                f"{slots:,} rows ({human_bytes(slots * self.row_bytes)}). Give host_cache_bytes "
                "at least one step's distinct rows x row bytes.", RuntimeWarning, stacklevel=5)
        self._resize(slots)

    # --- read-ahead and write-back --------------------------------------------------------
    def read_ahead(self, ids: torch.Tensor, padding_idx=None, key=None) -> None:
        """Start loading the rows of ``ids`` (a coming step's ids, any shape and device) that
        are not in RAM, in the background, and deduplicating them for their lookup. Calls for
        several coming steps, in order, keep that many in flight (up to
        :data:`nbtools.disk.readahead.DEPTH`). Changes no value: only where rows are."""
        self.whole.ensure_init()
        self.ensure_slab()
        if self._readahead is None:
            self._readahead = ReadAhead(self)
        self._readahead.submit(ids, padding_idx, key)

    @property
    def reader(self) -> "ReadAhead | None":
        """The table's read-ahead (:class:`~nbtools.disk.readahead.ReadAhead`: its queue of
        coming steps and the write-backs it tracks); None until a read-ahead starts."""
        return self._readahead

    def take_prepared(self, ids: torch.Tensor, key=None) -> "Prepared | None":
        """The read-ahead's deduplication of these very ids (the same tensor object, or the
        read-ahead submitted with ``key``: :mod:`nbtools.engine.ahead`), once."""
        if self._readahead is None:
            return None
        t0 = time.perf_counter()
        p = self._readahead.take(ids, key)
        _counters["wait_s"] += time.perf_counter() - t0
        return p

    def wait_read_ahead(self) -> None:
        """Wait for every read-ahead in flight (before the file or the slab is used from
        outside a step); raise if a write-back ever failed (:meth:`_intact`)."""
        if self._readahead is not None:
            try:
                self._readahead.wait()
            except Exception:
                self._intact()              # a failed write-back is what to report
                raise
        self._intact()

    def drain(self, stash) -> None:
        """Write evicted rows: a stash's ``(ids, rows)`` pairs (on the write-back thread).
        If that fails, the file lacks their newest values: the table refuses every later
        use (:meth:`_intact`) rather than read or save stale rows."""
        try:
            for ids, rows in stash:
                self.file_write(ids, rows)
        except BaseException as e:
            if self._lost is None:
                self._lost = (sum(len(i) for i, _ in stash), e)
            raise

    def _intact(self) -> None:
        """Raise if a write-back failed (see :meth:`drain`)."""
        if self._lost is not None:
            rows, e = self._lost
            raise DiskTableBrokenError(
                f"table {self.name!r}: writing {rows:,} evicted rows back to "
                f"{self.file.path!r} failed ({e}); the file lacks their newest values, so "
                "nothing more is read from or saved out of this table. Restore the last "
                "checkpoint into a new table (CheckpointManager.restore).") from e

    def writer_pool(self) -> ThreadPoolExecutor:
        """The table's one write-back thread: write-backs run in the order given."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="nbtools-writeback")
        return self._writer

    def count_ahead(self, rows: int) -> None:
        self.stats["read_ahead"] += rows
        _counters["ahead_rows"] += rows

    def count_read(self, ids: np.ndarray, seconds: float) -> None:
        _counters["read_s"] += seconds
        _counters["read_bytes"] += len(ids) * self.row_bytes

    # --- the table as a whole (nbtools.disk.access.WholeTable: see its methods) -----------
    def warm(self, ids, level=None, ram_too: bool = False) -> int:
        """Load rows ``ids`` (hottest first) into free RAM slots, or ``level``'s (and then
        RAM's, ``ram_too``): :meth:`nbtools.disk.access.WholeTable.warm`."""
        return self.whole.warm(ids, level, ram_too)

    def flush(self, drop: bool = False) -> None:
        """Write every dirty row to the file; with ``drop``, also empty RAM."""
        self.whole.flush(drop)

    def write_rows(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Write whole rows ``ids`` (sorted) to the file (and their RAM copies)."""
        self.whole.write_rows(ids, rows)

    def write_range(self, start: int, rows: torch.Tensor) -> None:
        """Write rows ``start:start + len(rows)`` (not cached in RAM) to the file."""
        self.whole.write_range(start, rows)

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as they are now: a fresh CPU tensor."""
        return self.whole.read_rows(start, stop)

    def mapped(self, writable: bool = True, ordered: bool = True) -> torch.Tensor:
        """Every row as a CPU tensor mapped onto the file (call :meth:`flush` first)."""
        return self.whole.mapped(writable, ordered)

    def take_changed(self) -> np.ndarray:
        """Sorted ids of the rows written to the file since the last call, after a flush."""
        return self.whole.take_changed()

    def changed_since(self, token) -> int | None:
        """Rows written since the checkpoint ``token``, or None where not counted from it."""
        return self.whole.changed_since(token)

    def changed_ids(self, start: int, stop: int) -> np.ndarray:
        """Sorted ids in ``start:stop`` of the rows written since the last checkpoint."""
        return self.whole.changed_ids(start, stop)

    def mark_checkpointed(self, token) -> None:
        """The checkpoint ``token`` now holds every row as it is: count changes from here."""
        self.whole.mark_checkpointed(token)

    def copy_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` (sorted, unique) as stored into ``out``: RAM's copy, else the file's."""
        self.whole.copy_rows(ids, out)

    def hold_mapping(self, writable: bool = False):
        """A context within which :meth:`mapped` returns one and the same mapping."""
        return self.whole.hold_mapping(writable)

    def discard_cache(self) -> None:
        """Forget every row in RAM and every row not yet written (a restore comes next)."""
        self.whole.discard_cache()

    def close(self) -> None:
        """Stop the read-ahead, unpin the slab and remove the file."""
        try:
            if self._readahead is not None:
                self._readahead.close()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
            self._readahead = self._writer = None
        self.ram.close()                # (its slot arrays leave the host budget now)
        self.whole.close()
        self.above = None
        self._remove()
        self._release_maps()            # the row maps leave the host budget now

    def __reduce__(self):
        raise TypeError(f"table {self.name!r} lives on disk and cannot be copied or pickled; "
                        "save it with nbtools.CheckpointManager instead")

    def __repr__(self):
        return (f"DiskRows(name={self.name!r}, file={self.file.path!r}, rows={self.num_rows:,}, "
                f"row_bytes={self.row_bytes}, ram={self.ram.slots:,} rows "
                f"({human_bytes(self.slab.nbytes)}))")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "table"


def _new_file(folder: str, name: str, num_rows: int, row_bytes: int, meta: dict,
              threads: int):
    """A new table file in ``folder`` (:func:`nbtools.disk.log.create`) under a fresh name
    (:func:`file_name`); another name where something is at one already (a file or link put
    there), three names at most."""
    for attempt in range(3):
        path = os.path.join(folder, file_name(name))
        try:
            return disklog.create(path, num_rows, row_bytes, meta, threads=threads,
                                  free=free_bytes(folder))
        except FileExistsError as e:
            taken = e
    raise FileExistsError(f"table {name!r}: three fresh file names in {folder!r} were all "
                          f"taken already (last: {taken}); something keeps planting files "
                          "there: pass disk_dir= a folder only you can write") from taken


def _say_removed(removed: list, folder: str) -> None:
    """One line on the files of dead processes :func:`remove_stale_tables` removed."""
    if removed:
        freed = sum(r["bytes"] for r in removed)
        warnings.warn(f"removed {len(removed)} disk-table file(s) that killed or crashed "
                      f"processes left in {folder} ({human_bytes(freed)} freed)",
                      RuntimeWarning, stacklevel=4)


# --- the table's side: what OffloadedEmbedding calls for placement="disk" ----------------------

def cache_rows_for(config, row_bytes: int) -> int:
    """RAM slots for rows of ``row_bytes`` under ``config.host_cache_bytes``."""
    budget = config.host_cache_bytes
    if budget is None:      # 1 GiB, or half of what the host budget leaves when that is less
        available = host_memory_bytes()["available"]
        budget = DEFAULT_HOST_CACHE_BYTES if available is None else \
            min(DEFAULT_HOST_CACHE_BYTES, available // 2)
    return max(1, int(budget) // row_bytes)


def new_rows(config, num_rows: int, width: int, dtype: torch.dtype, device,
             name: str) -> DiskRows:
    """A disk table's file (``num_rows`` rows of ``width`` columns of ``dtype``) and its RAM
    slots, as the table's ``config`` (its ``disk_dir``, RAM cache and pinning) asks."""
    return DiskRows(config.disk_dir or default_dir(), num_rows, width, dtype,
                    cache_rows=cache_rows_for(config, width * dtype.itemsize),
                    device=device, pin=config.pin, name=name)


def init_normal(disk: DiskRows, padding_idx, device: torch.device) -> None:
    """``N(0, 1)`` weights (``nn.Embedding``'s initialisation), drawn on the compute device
    64 MiB at a time when the rows are first needed: a table whose optimizer attaches first is
    written once, in its final layout, and RAM never holds it."""
    width, dtype = disk.width, disk.dtype

    def rows(start: int, stop: int) -> torch.Tensor:
        out = torch.randn(stop - start, width, device=device).to(dtype)
        if padding_idx is not None and start <= padding_idx < stop:
            out[padding_idx - start].zero_()
        return out
    disk.initial = rows


def regrow(old, layout, init, copy_rows, make) -> DiskRows:
    """``old`` rows (weights only: a :class:`DiskRows`, or host/GPU rows under placement
    "auto") copied into a new file of ``layout`` rows (``make(width, dtype)``: its
    :func:`new_rows`), state columns at their initial values, 64 MiB at a time; the old rows
    are released (a file removed)."""
    if isinstance(old, DiskRows) and old.initial is not None:   # never written: draw them now
        read = old.initial
        old.close()          # its file goes before the new one is made: only one needs room
        old = None
    elif isinstance(old, DiskRows):
        old.flush()
        read = old.read_rows
    else:
        read = lambda a, b: old.tensor[a:b].cpu()      # noqa: E731
    new = make(layout.width, layout.unit)

    def build(start: int, stop: int) -> torch.Tensor:
        src = read(start, stop)          # (drawn on the compute device, rows are built there)
        dst = torch.empty((stop - start, layout.width), dtype=layout.unit, device=src.device)
        copy_rows(dst, src, init, layout)
        return dst
    # (overlapped: ``new`` is this function's own, its lock held by nobody)
    write_all(new, build, new.write_range, "its rows with the optimizer's state, written once")
    if old is not None:
        old.close()
    return new


def check_dir(folder) -> None:
    """Refuse a ``disk_dir`` that cannot hold a disk table's file, before anything is made:
    TypeError where it is not a path, NotADirectoryError where it (or a folder above it) is a
    file. A folder that does not exist yet is fine: the table creates it."""
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"disk_dir must be a folder path (str or os.PathLike), got {folder!r} "
                        f"({type(folder).__name__})")
    asked = path = os.path.abspath(os.fspath(folder))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        where = "is a file" if path == asked else f"lies under {path!r}, which is a file"
        raise NotADirectoryError(f"disk_dir={os.fspath(folder)!r} {where}, not a folder: give "
                                 "the folder a disk table's file should go in (a missing one "
                                 "is created)")


def free_bytes(folder) -> int:
    """Free bytes on the disk that holds ``folder`` (its nearest existing parent)."""
    import shutil
    path = os.path.abspath(os.fspath(folder))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def ram_summary(disk: DiskRows) -> dict:
    """The RAM cache's part of a disk table's ``cache_stats()``: rows looked up in RAM, those
    found there (``ram_hits``; rows a read-ahead brought in count apart, as
    ``ram_ahead_hits``: they were read from disk all the same, only earlier), those read from
    the file at their lookup, the hit rate (NaN before a lookup; ``repr(table)`` shows the same
    figure) and the cache's size."""
    s = disk.stats
    return {"ram_lookups": s["lookups"], "ram_hits": s["hits"],
            "ram_ahead_hits": s["ahead_hits"], "ram_misses": s["misses"],
            "ram_hit_rate": s["hits"] / s["lookups"] if s["lookups"] else float("nan"),
            "ram_capacity_rows": disk.ram.capacity_rows}


def describe(disk: DiskRows) -> str:
    """What ``repr(table)`` says of a disk table's file and RAM cache."""
    ram = ram_summary(disk)
    rate = "n/a" if not ram["ram_lookups"] else f"{ram['ram_hit_rate']:.0%}"
    log = getattr(disk.file, "stats", None)
    layout = "" if log is None else (
        f", log-structured ({disk.file.slots - disk.num_rows:,} spare slots; "
        f"{log['appended']:,} rows appended, {log['cleaned']:,} moved by the cleaner)")
    return (f"file={disk.file.path!r} ({human_bytes(disk.file_bytes)}{layout}), RAM cache "
            f"{disk.ram.capacity_rows:,} rows "
            f"({human_bytes(disk.ram.capacity_rows * disk.row_bytes)}, "
            f"hit rate {rate})")
