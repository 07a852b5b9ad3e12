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

import collections
import contextlib
import os
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import NbtoolsError
from . import log as disklog
from ..engine import streams
from .bits import BitSet
from .slots import clock_sweep, take_free
from ..devices import hold_host, host_memory_bytes, release_host
from .access import WholeTable, chunk_rows
from ..rowfile.fileio import default_engine, uninterrupted
from ..hostmem import HostTensor, keep_freed_memory_small
from .readahead import Prepared, ReadAhead, Ahead  # noqa: F401  (Prepared: re-exported)
from ..units import human_bytes

# Slab bytes a disk table keeps in RAM when neither host_cache_bytes is given nor a budget
# chosen: enough for the hot rows of most id streams, small next to Colab's 12.7 GB.
DEFAULT_HOST_CACHE_BYTES = 1 << 30
# Reads in flight: a step misses ~1,000-10,000 rows, and a cloud disk answers each in ~0.3 ms,
# so a step's reads are latency-bound unless many wait at once (NBTOOLS_DISK_THREADS overrides):
# 32 Python threads, or with an AIO engine (glibc's C threads, or the kernel's; a native AIO
# file falling back to glibc's keeps this) 128 requests in flight in all, shared
# by the table's read-aheads and write-backs (nbtools.rowfile.fileio.RequestPool). On the GPU machine's
# disk, 100M rows, eight steps ahead: 128 shared took 1.20x the disk floor (median of 5
# rounds) where 64 shared took 1.38x (benchmarks/RESULTS.md "Session 16").
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
    """Where disk tables go unless ``disk_dir`` says otherwise: local disk, not Drive."""
    return os.path.join(tempfile.gettempdir(), "nbtools-tables")


class DiskTableBrokenError(NbtoolsError, OSError):
    """A disk table whose file lacks rows it wrote back (a failed write): it refuses every
    later use; its last checkpoint is intact."""


class _ReadsAhead:
    """A disk table's read-ahead (:mod:`nbtools.disk.readahead`) and the traffic counts it shares
    with lookups (:func:`disk_counters`): the part of :class:`DiskRows` the loader's next
    steps use."""

    def read_ahead(self, ids: torch.Tensor, padding_idx=None, key=None) -> None:
        """Start loading the rows of ``ids`` (a coming step's ids, any shape and device) that
        are not in RAM, in the background, and deduplicating them for their lookup. Calls for
        several coming steps, in order, keep that many in flight (up to
        :data:`nbtools.disk.readahead.DEPTH`). Changes no value: only where rows are."""
        self._ensure_init()
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

    def _load_beside(self, ids: np.ndarray) -> None:
        """Where read-aheads run, a lookup of ``ids`` loads the rows no read-ahead brought in
        as one would, and waits for its loads outside the lock, so that a coming step's
        read-ahead starts its reads meanwhile. (Whatever changes before the lookup takes the
        lock again is settled under it, as without read-ahead.)"""
        with self.slots_lock:
            ra = self._readahead
            ra.settle_done()
            slots = self.slot_of[ids]
            with self.sparing(slots[slots >= 0]):
                ra.start(Ahead(None), ids[slots < 0])
            pending = ra.pending_for(ids)
        for f in pending:
            f.exception()                       # (raised where the load is settled)

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
        """Raise if a write-back failed (see :meth:`_drain`)."""
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


def row_map_bytes(num_rows: int) -> int:
    """RAM a disk table of ``num_rows`` rows keeps whatever its cache (beside a log file's
    maps): its row -> slot map (int32 where the rows fit, else int64) and its change marks
    (a bit a row)."""
    return num_rows * (4 if num_rows < 2 ** 31 else 8) + -(-num_rows // 8)


class _Slots:
    """Which RAM slot a missing row of a :class:`DiskRows` takes (its base class; the methods
    use its slot arrays under its lock): a free slot, else one CLOCK finds idle, never one
    a lookup of this step holds, a read-ahead is loading, or GPU work queued so far still
    reads or writes (a CUDA event per use). An evicted dirty row is copied aside to be written
    back beside the step's reads."""

    def mark_used(self, slots: np.ndarray) -> None:
        """The GPU work queued so far reads or writes ``slots``: they are not reused before it
        has run (a CUDA event; nothing to wait for on the CPU)."""
        if self.device.type != "cuda" or len(slots) == 0:
            return
        event = torch.cuda.Event()
        streams.record(event, self.device)
        self._event_index += 1
        self._events.append((self._event_index, event))
        self.busy[slots] = self._event_index

    def advance_clock(self, wait_for: int = 0) -> None:
        """Move ``_done_upto`` past every finished use (waiting for uses up to ``wait_for``)."""
        while self._events:
            index, event = self._events[0]
            if index <= wait_for:
                event.synchronize()
            elif not event.query():
                break
            self._done_upto = index
            self._events.popleft()

    @contextlib.contextmanager
    def sparing(self, hits: np.ndarray):
        """Under the lock: a lookup's ``hits`` (slots) are not evicted for its misses."""
        was = self.locked[hits].copy()
        self.locked[hits] = True
        try:
            yield
        finally:
            self.locked[hits] = was

    def take_slots(self, k: int, wait: bool) -> np.ndarray:
        """``k`` free slots, evicting rows (dirty ones written back) as CLOCK chooses. With
        ``wait``, waits for GPU uses and grows the slab if it must; without (read-ahead), may
        return fewer."""
        got = [self._take_free(k)]
        need = k - len(got[0])
        try:
            for waiting in (False, True):
                if not need or waiting and not wait:
                    break
                self.advance_clock(wait_for=self._event_index if waiting else 0)  # (a sync)
                victims = self._sweep(need)
                self._evict(victims)
                got.append(victims)
                need -= len(victims)
            if need and wait:
                self._grow(need)
                got.append(self.take_slots(need, wait))
        except BaseException:      # (a KeyboardInterrupt in the wait): the slots hold no row
            self.free_slots.append(np.concatenate(got))
            raise
        return np.concatenate(got)

    def _take_free(self, k: int) -> np.ndarray:
        """Up to ``k`` slots that hold no row."""
        return take_free(self.free_slots, k)

    def _sweep(self, need: int) -> np.ndarray:
        """CLOCK: up to ``need`` resident, unlocked, idle slots whose reference bit is clear."""
        return clock_sweep(self, need, self.slots, lambda lo, hi: (
            (self.id_of[lo:hi] >= 0) & ~self.locked[lo:hi] & (self.busy[lo:hi] <= self._done_upto)))

    def _evict(self, slots: np.ndarray) -> None:
        """Free ``slots``; their dirty rows are copied aside (:attr:`_stash`) and written by
        :meth:`load_rows`, beside its reads, before the lock is released: no reader of the file
        can see a row between its eviction and its write."""
        dirty = slots[self.dirty[slots]]
        if len(dirty):
            ids = self.id_of[dirty]
            order = np.argsort(ids, kind="stable")
            self.evicted_rows.append((ids[order], self.slab_bytes[dirty[order]]))
            self.dirty[dirty] = False
        self.slot_of[self.id_of[slots]] = -1
        self.id_of[slots] = -1
        self.stats["evicted"] += len(slots)


class DiskRows(WholeTable, _ReadsAhead, _Slots):
    """The rows of one table in a file, and the RAM slots that cache them.

    Args:
        directory: folder for the table file (created if missing); the file is removed when
            the table is closed or collected.
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

    # Per-slot flags: dirty (written since read), ref (CLOCK's reference bit), locked (a
    # lookup's until its step is queued, or a read-ahead's while loading), ahead (brought in by
    # a read-ahead, not looked up since), loading (a read-ahead's read in flight).
    SLOT_FLAGS = ("dirty", "ref", "locked", "ahead", "loading")

    def __init__(self, directory, num_rows: int, width: int, dtype: torch.dtype, *,
                 cache_rows: int, device="cpu", pin: bool = True, name: str = "table",
                 threads: int | None = None):
        self.name = name
        self.num_rows, self.width, self.dtype = int(num_rows), int(width), dtype
        self.device = torch.device(device)
        self.row_bytes = self.width * dtype.itemsize
        self.directory = os.path.abspath(os.fspath(directory))
        path = os.path.join(self.directory, f"{_safe(name)}-{uuid.uuid4().hex[:8]}.nbrows")
        meta = {"dtype": str(dtype).replace("torch.", ""), "width": self.width, "name": name}
        threads = threads or int(os.environ.get(
            "NBTOOLS_DISK_THREADS",
            DISK_AIO_DEPTH if default_engine() in ("aio", "kaio") else DISK_THREADS))
        self.file, raw = disklog.create(path, self.num_rows, self.row_bytes, meta,
                                        threads=threads, free=free_bytes(self.directory))
        if isinstance(self.file, disklog.LogFile):
            self.file.on_clean = _count_clean
        self._remove = weakref.finalize(self, _remove_file, raw, path)
        self._pin = pin and self.device.type == "cuda"
        self.slots_lock = threading.RLock()
        self.above = None                       # a GPU cache of hot rows (nbtools.disk.gpu)
        self._readahead = None                  # ReadAhead, from the first read_ahead
        self.evicted_rows = []                        # evicted dirty rows (ids, bytes) to write
        self._writer = None
        self._lost = None                       # (rows, error) of a write-back that failed
        self._release_slots = None              # the slot arrays' hold on the host budget
        # row and slot numbers: int32 where they fit (4 bytes a row and a slot less than int64)
        self.index_dtype = np.int32 if self.num_rows < 2**31 else np.int64
        # the two maps below (and a log file's): counted in the host budget
        maps = row_map_bytes(self.num_rows) + getattr(self.file, "map_bytes", 0)
        hold_host(maps, f"table {name!r}'s row maps")
        self._release_maps = weakref.finalize(self, release_host, maps)
        keep_freed_memory_small()
        self.slot_of = np.full(self.num_rows, -1, dtype=self.index_dtype)  # row -> slot, -1: on disk
        # rows written to the file since the last checkpoint took them (incremental saves)
        self.changed = BitSet(self.num_rows, full=True)
        # the RAM cache is pinned when first needed: a table whose optimizer attaches at once
        # (and so moves to a file of wider rows) never pins the first one's
        self._want = max(1, min(int(cache_rows), self.num_rows))
        self._alloc(1)
        self._events = collections.deque()      # (index, CUDA event) of GPU uses of slots
        self._event_index = 0
        self._done_upto = 0                     # every use up to this index has run
        self._step = []                         # slots a training lookup locked since a step
        self._written = []                      # slots a step has queued writes to (unmarked)
        self._grew_warned = False
        # rows(start, stop) -> the initial rows, until they are first needed (_ensure_init)
        self.initial = None
        # hits: rows found in RAM that no read-ahead brought in (those count as ahead_hits:
        # read from disk all the same, only earlier)
        self.stats = {"lookups": 0, "hits": 0, "misses": 0, "evicted": 0, "written_back": 0,
                      "read_ahead": 0, "ahead_hits": 0, "from_write_back": 0}

    # --- the slab -------------------------------------------------------------------------
    def _alloc(self, slots: int, old=None) -> None:
        """(Re)allocate ``slots`` RAM slots, keeping the first ``len(old)`` slots' rows."""
        held = slots * self.slot_bytes              # the slot arrays, counted in the host budget
        hold_host(held, f"table {self.name!r}'s RAM slots")
        try:
            slab = HostTensor((slots, self.width), self.dtype, pin=self._pin,
                              name=f"{self.name} (RAM cache)",
                              device=self.device if self.device.type == "cuda" else None)
        except BaseException:
            release_host(held)
            raise
        if self._release_slots is not None:
            self._release_slots()
        self._release_slots = weakref.finalize(self, release_host, held)
        keep = 0
        if old is not None:
            keep = old.tensor.shape[0]
            slab.tensor[:keep].copy_(old.tensor)
        self.slab = slab
        self.slots = slots
        self.slab_bytes = slab.tensor.view(torch.uint8).numpy().reshape(slots, self.row_bytes)
        if old is None:
            self.id_of = np.full(slots, -1, dtype=self.index_dtype)
            self.busy = np.zeros(slots, dtype=np.int64)
            for name in self.SLOT_FLAGS:
                setattr(self, name, np.zeros(slots, dtype=bool))
            self.hand = 0                       # CLOCK's hand (clock_sweep)
        else:
            grow = slots - keep
            self.id_of = np.concatenate((self.id_of, np.full(grow, -1, dtype=self.index_dtype)))
            self.busy = np.concatenate((self.busy, np.zeros(grow, dtype=np.int64)))
            for name in self.SLOT_FLAGS:
                setattr(self, name, np.concatenate((getattr(self, name),
                                                    np.zeros(grow, dtype=bool))))
        if old is None:
            self.free_slots = collections.deque([np.arange(slots, dtype=self.index_dtype)])
        else:   # the old slots keep their free list (a _take that grows holds the rest)
            self.free_slots.append(np.arange(keep, slots, dtype=self.index_dtype))
        self.generation = getattr(self, "generation", 0) + 1   # the slab's memory changed

    @property
    def capacity_rows(self) -> int:
        """Rows the RAM cache holds (once pinned; more if a step needed it)."""
        return max(self.slots, self._want)

    @property
    def pinned(self) -> bool:
        return self.slab.pinned

    @property
    def ram_bytes(self) -> int:
        """RAM this table's rows take: the slab plus the row -> slot map and slot arrays."""
        if self.slot_of is None:                # closed
            return 0
        return (self.slab.nbytes + self.slot_of.nbytes + self.changed.nbytes
                + self.slots * self.slot_bytes + getattr(self.file, "map_bytes", 0))

    @property
    def slot_bytes(self) -> int:
        """RAM a slot takes beside its row: its row number, its last use, its flags and its
        place in the free list."""
        return 2 * np.dtype(self.index_dtype).itemsize + 8 + len(self.SLOT_FLAGS)

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
        if self._step:
            self._written.append(np.concatenate(self._step))
            self._step = []
        if self.above is not None:
            self.above.step_queued()

    def _close_step(self) -> None:
        written, self._written = self._written, []
        if written:
            slots = np.concatenate(written)
            self.mark_used(slots)
            self.locked[slots] = False

    # --- rows in and out of RAM -----------------------------------------------------------
    def resolve(self, ids: np.ndarray, training: bool) -> np.ndarray:
        """Slots holding rows ``ids`` (sorted, unique, in range), reading the missing rows
        from the file. ``training``: the slots stay locked until the optimizer's step (their
        rows are written by it)."""
        t0 = time.perf_counter()
        self._intact()
        self.sync_mapped()
        self._ensure_init()
        self.ensure_slab()
        if self._readahead is not None:
            self._load_beside(ids)
        with self.slots_lock:
            if self._readahead is not None:     # (now quick; and whatever began meanwhile)
                self._readahead.settle_for(ids)
            self._close_step()
            slots = self.slot_of[ids]
            miss = slots < 0
            nmiss = int(miss.sum())
            found = slots[~miss]
            early = int(self.ahead[found].sum())     # rows a read-ahead brought in
            self.ahead[found] = False
            self.stats["lookups"] += len(ids)
            self.stats["misses"] += nmiss
            self.stats["hits"] += len(ids) - nmiss - early
            self.stats["ahead_hits"] += early
            _counters["lookup_rows"] += len(ids)
            _counters["hit_rows"] += len(ids) - nmiss - early
            if nmiss:
                with self.sparing(slots[~miss]):
                    free = self.take_slots(nmiss, wait=True)
                self.load_rows(ids[miss], free)
                slots[miss] = free
            self.ref[slots] = True
            if training:
                self.locked[slots] = True
                self.dirty[slots] = True
                self._step.append(slots)
        _counters["wait_s"] += time.perf_counter() - t0
        return slots

    def _write_slots(self, slots: np.ndarray) -> None:
        ids = self.id_of[slots]
        order = np.argsort(ids, kind="stable")
        self.file_write(ids[order], self.slab_bytes, slots[order])
        self.dirty[slots] = False

    def file_write(self, ids: np.ndarray, src: np.ndarray, at=None) -> None:
        """Rows ``ids`` (sorted), as stored (``src``, or its rows ``at``), into the file,
        counted; every write of the table's file goes through here."""
        t0 = time.perf_counter()
        self.file.write(ids, src, at=at)
        self.changed.add(ids)
        _counters["write_s"] += time.perf_counter() - t0
        _counters["write_bytes"] += len(ids) * self.row_bytes
        self.stats["written_back"] += len(ids)

    def load_rows(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Read rows ``ids`` (sorted) into ``slots``, writing the stash of evicted rows on
        another thread meanwhile (the disk serves both at once; they touch different rows).
        Where read-aheads run, the write is theirs to track (:meth:`ReadAhead.track_write`):
        this lookup, which holds the table's lock, does not wait behind their write-backs.
        (A read-ahead's loads are :mod:`nbtools.disk.readahead`'s, outside the lock.)"""
        writing = None
        if self.evicted_rows:
            stash, self.evicted_rows = self.evicted_rows, []
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
                self.file.read(rest, self.slab_bytes, at=at)
        except BaseException:      # an I/O error or a KeyboardInterrupt: nothing was placed
            self.free_slots.append(np.asarray(slots, dtype=self.index_dtype))
            raise
        finally:
            if writing is not None:     # evicted rows on disk before any reader looks
                uninterrupted(writing.result)
        self.count_read(rest, time.perf_counter() - t0)
        self.placed(ids, slots)
        if kept is not None:
            self.dirty[slots[kept]] = True      # (the file may not have them yet)

    def write_evicted(self) -> None:
        """Write the rows evicted so far (on the write-back thread; where read-aheads run,
        theirs to track, else waited for here). Under the lock."""
        if not self.evicted_rows:
            return
        stash, self.evicted_rows = self.evicted_rows, []
        writing = self.writer_pool().submit(self.drain, stash)
        if self._readahead is not None:
            self._readahead.track_write(stash, writing)
        else:
            uninterrupted(writing.result)

    def write_file(self, ids: np.ndarray, raw: np.ndarray) -> None:
        """Write rows ``ids`` (sorted; not in RAM) as stored (uint8 ``[len(ids), row_bytes]``)
        to the file, after the evicted rows still waiting. Under the lock, with no read-ahead
        in flight."""
        self._write_stash()
        self.file_write(np.asarray(ids, dtype=np.int64), raw)

    def placed(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Rows ``ids`` now sit, clean, in ``slots``."""
        self.slot_of[ids] = slots
        self.id_of[slots] = ids
        self.dirty[slots] = False
        self.ahead[slots] = False
        self.ref[slots] = True

    def ensure_slab(self) -> None:
        """Pin the RAM cache at its full size, the first time rows are needed (on the
        training loop's thread: the table then takes the new slab, ``slab``)."""
        with self.slots_lock:
            if self.slots < self._want:
                self._resize(self._want)

    def _resize(self, slots: int) -> None:
        if self._readahead is not None:         # reads in flight write into the old slab
            self._readahead.wait_io()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)     # queued kernels read the old slab
        old = self.slab
        self._alloc(slots, old)
        old.close()

    def _grow(self, need: int) -> None:
        """One step touches more rows than the slab holds: make room (a host sync)."""
        slots = self.slots + max(need, self.slots // 4)
        if not self._grew_warned:
            self._grew_warned = True
            warnings.warn(
                f"table {self.name!r}: one step touches more distinct rows than its RAM cache "
                f"holds ({self.slots:,} rows, {human_bytes(self.slab.nbytes)}); growing it to "
                f"{slots:,} rows ({human_bytes(slots * self.row_bytes)}). Give host_cache_bytes "
                "at least one step's distinct rows x row bytes.", RuntimeWarning, stacklevel=5)
        self._resize(slots)

    # --- read-ahead -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the read-ahead, unpin the slab and remove the file."""
        try:
            if self._readahead is not None:
                self._readahead.close()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
            self._readahead = self._writer = None
        self.slab.close()
        self._map = None
        self.above = None
        self._remove()
        # the row maps leave the host budget now (the slab's pages when the table goes)
        self._release_maps()
        self._release_slots()
        self.slot_of = self.changed = None

    def __reduce__(self):
        raise TypeError(f"table {self.name!r} lives on disk and cannot be copied or pickled; "
                        "save it with nbtools.CheckpointManager instead")

    def __repr__(self):
        return (f"DiskRows(name={self.name!r}, file={self.file.path!r}, rows={self.num_rows:,}, "
                f"row_bytes={self.row_bytes}, ram={self.slots:,} rows "
                f"({human_bytes(self.slab.nbytes)}))")

def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "table"


def _remove_file(file, path: str) -> None:
    try:
        file.close()
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


# --- the table's side: what OffloadedEmbedding calls for placement="disk" ----------------------

def cache_rows_for(config, row_bytes: int) -> int:
    """RAM slots for rows of ``row_bytes`` under ``config.host_cache_bytes``."""
    budget = config.host_cache_bytes
    if budget is None:      # 1 GiB, or half of what the host budget leaves when that is less
        available = host_memory_bytes()["available"]
        budget = DEFAULT_HOST_CACHE_BYTES if available is None else \
            min(DEFAULT_HOST_CACHE_BYTES, available // 2)
    return max(1, int(budget) // row_bytes)


def new_rows(table, width: int, dtype: torch.dtype) -> DiskRows:
    """A disk table's file (``width`` columns of ``dtype`` per row) and its RAM slots."""
    cfg = table.config
    return DiskRows(cfg.disk_dir or default_dir(), table.num_embeddings, width, dtype,
                    cache_rows=cache_rows_for(cfg, width * dtype.itemsize),
                    device=table.device, pin=cfg.pin, name=table.name)


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


def regrow(table, old, layout, init, copy_rows) -> DiskRows:
    """``old`` rows (weights only: a :class:`DiskRows`, or host/GPU rows under placement
    "auto") copied into a new file of ``layout`` rows, state columns at their initial values,
    64 MiB at a time; the old rows are released (a file removed)."""
    if isinstance(old, DiskRows) and old.initial is not None:   # never written: draw them now
        read = old.initial
        old.close()          # its file goes before the new one is made: only one needs room
        old = None
    elif isinstance(old, DiskRows):
        old.flush()
        read = old.read_rows
    else:
        read = lambda a, b: old.tensor[a:b].cpu()      # noqa: E731
    new = new_rows(table, layout.width, layout.unit)
    step = chunk_rows(new)
    for start in range(0, table.num_embeddings, step):
        stop = min(table.num_embeddings, start + step)
        src = read(start, stop)          # (drawn on the compute device, rows are built there)
        dst = torch.empty((stop - start, layout.width), dtype=layout.unit, device=src.device)
        copy_rows(dst, src, init, layout)
        new.write_range(start, dst)
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


def describe(disk: DiskRows) -> str:
    """What ``repr(table)`` says of a disk table's file and RAM cache."""
    s = disk.stats
    rate = f"{s['hits'] / s['lookups']:.0%}" if s["lookups"] else "n/a"
    log = getattr(disk.file, "stats", None)
    layout = "" if log is None else (
        f", log-structured ({disk.file.slots - disk.num_rows:,} spare slots; "
        f"{log['appended']:,} rows appended, {log['cleaned']:,} moved by the cleaner)")
    return (f"file={disk.file.path!r} ({human_bytes(disk.file_bytes)}{layout}), RAM cache "
            f"{disk.capacity_rows:,} rows ({human_bytes(disk.capacity_rows * disk.row_bytes)}, "
            f"hit rate {rate})")
