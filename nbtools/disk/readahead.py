"""Reading a disk table's coming rows while the current steps compute.

The training loop knows its next batches: ``table.prefetch(ids)`` hands a coming step's ids to
its disk rows (:meth:`nbtools.disk.DiskRows.read_ahead`), one call per step, up to
:data:`DEPTH` steps ahead. For each, in the order given, one background thread deduplicates
the ids as the lookup will (:func:`prepare`, kept for it), finds their misses, takes RAM slots
for them (CLOCK: idle rows are evicted, dirty ones to be written back) and assigns the rows to
their slots at once, marked *loading*; the reads (and the evicted rows' writes) then run on a
loader thread, outside the table's lock. So the next read-ahead's misses
are found and issued while this one's reads are in flight: the disk's queue stays full across
steps instead of draining at the end of each step's reads.

A read-ahead changes no value, only where rows are, so training is bit-identical with and
without it, at any depth. What keeps it so:

* A loading slot is locked (never evicted); a lookup that needs its row waits for its load.
* A row that a read-ahead (or a lookup) evicted is written back beside the reads, on the table's
  one write-back thread, from a copy. Until that write is done no read of the row from the file
  starts: a lookup or read-ahead that misses it takes it from that copy instead (the newest, if
  it was evicted twice). So a lookup waits only for the reads of its own rows, never for a
  write-back (a write-back may clean a segment of a log file, :mod:`nbtools.disk.log`: tens of
  ms now and then).
* Whatever reads or writes the file or the slab from outside a step (``.weight``, checkpoints,
  a slab that grows) waits for every read-ahead first.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import devices

# Coming steps whose rows may be in flight at once (table.prefetch calls not yet looked up).
DEPTH = 8
# Steps a loop reads ahead by default (fit_stream): on a cloud disk a step comes nearer its
# disk floor the more steps ahead it reads, up to 8 (benchmarks/RESULTS.md, "eight steps
# ahead"): the disk's queue stays fuller the more steps feed it.
AHEAD = 8
# Write-backs of evicted rows queued behind the write-back thread at most: a read-ahead waits
# for the oldest beyond this (their rows are copies in RAM until written).
WRITES = 2 * DEPTH


@dataclasses.dataclass
class Prepared:
    """A lookup's ids deduplicated on the CPU: ``uniq`` the sorted unique ids in range (and
    not padding), ``inverse`` [n] the slot of each id (the sentinel's slot ``len(uniq)`` where
    ``sentinel``), ``bad`` whether some id was out of range."""

    ids: torch.Tensor
    uniq: np.ndarray
    inverse: torch.Tensor
    bad: bool
    sentinel: bool


def prepare(ids: torch.Tensor, num_rows: int, padding_idx=None) -> Prepared:
    """Deduplicate ``ids`` (any shape, any device: GPU ids are a sync) on the CPU."""
    flat = ids.reshape(-1).to("cpu").long().numpy()  # note: a sync point for GPU ids
    # The checks in numpy, on this thread alone: torch would split them over its thread pool,
    # which the step's thread shares (on a 2-core machine they wait for each other).
    valid = (flat >= 0) & (flat < num_rows)
    bad = not valid.all()
    if padding_idx is not None:
        valid &= flat != padding_idx
    uniq, inverse = torch.unique(torch.from_numpy(np.where(valid, flat, num_rows)),
                                 sorted=True, return_inverse=True)
    sentinel = bool(uniq.numel()) and int(uniq[-1]) == num_rows
    uniq = uniq.numpy()
    return Prepared(ids, uniq[: len(uniq) - int(sentinel)], inverse, bad, sentinel)


def _lookup(sorted_: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of ``values`` is in ``sorted_`` (non-empty, sorted, unique), and whether it is
    there at all."""
    pos = np.searchsorted(sorted_, values).clip(max=len(sorted_) - 1)
    return pos, sorted_[pos] == values


class Ahead:
    """One read-ahead: the ids it was given, its background task, the lookup's deduplication,
    and its load (rows -> slots, the loader's future; the evicted rows and their write-back's
    future)."""

    __slots__ = ("ids", "key", "task", "prepared", "rows", "slots", "sorted_slots", "stash",
                 "evicted", "io", "write")

    def __init__(self, ids, key=None):
        self.ids = ids
        self.key = key          # what its lookup names it by (else the ids tensor itself)
        self.task = self.prepared = self.io = self.write = None
        self.rows = self.slots = self.sorted_slots = self.evicted = np.zeros(0, dtype=np.int64)
        self.stash = []


class ReadAhead:
    """The read-aheads of one :class:`~nbtools.disk.DiskRows` (its ``reader``): a queue of
    coming steps' (oldest first, until looked up) and the loads in flight (until settled under
    the table's lock), and the write-backs of the rows they evicted (until written). Everything
    that touches the table's RAM slots (``disk.ram``) runs under ``disk.slots_lock``; the
    loads' file I/O does not."""

    def __init__(self, disk):
        self.disk = disk
        # the parts it works through, for the table's life: the file, the RAM slots, the lock
        # every change of them takes and the table's counts
        self.file, self.ram, self.lock = disk.file, disk.ram, disk.slots_lock
        self.stats = disk.stats
        self.num_rows = disk.num_rows
        self.queue: collections.deque[Ahead] = collections.deque()
        self.loads: list[Ahead] = []
        self.writes: collections.deque[Ahead] = collections.deque()   # oldest first
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="nbtools-readahead",
                                          initializer=devices.few_cores_thread)
        self._io = ThreadPoolExecutor(DEPTH, thread_name_prefix="nbtools-load")

    def submit(self, ids: torch.Tensor, padding_idx, key=None) -> None:
        """Start reading ahead for ``ids`` (waiting first for the oldest queued read-ahead's
        misses to be found when :data:`DEPTH` are queued); ``key``: what its lookup will name
        it by (:meth:`take`), where that is not the same ids tensor."""
        while len(self.queue) >= DEPTH:
            self.queue.popleft().task.result()
        item = Ahead(ids, key)
        item.task = self._thread.submit(self._find, item, padding_idx)
        self.queue.append(item)

    def _find(self, item: Ahead, padding_idx) -> None:
        # The lookup's deduplication, then its misses from it: one sort of the ids (a sort
        # just for the misses first cost a 2-core machine's read-ahead thread ~5 ms a step of
        # 65,536 ids, and the reads are needed steps later anyway)
        d = self.disk
        item.prepared = prepare(item.ids, self.num_rows, padding_idx)
        want = item.prepared.uniq.astype(np.int64, copy=False)
        while len(self.writes) > WRITES:    # the write-back thread is behind: no more evicted
            try:                            # copies queue up (waiting outside the lock)
                oldest = self.writes[0]
            except IndexError:              # (forgotten meanwhile by a lookup)
                break
            oldest.write.exception()
            with self.lock:
                self._written()
        with self.lock:
            self.settle_done()
            if d.above is not None:         # rows in the GPU cache: never read from here
                want = want[~d.above.holds(want)]
            where = self.ram.slot_of[want]
            self.ram.mark_referenced(where[where >= 0])  # rows in RAM this step needs: CLOCK
            self.start(item, want[where < 0])       # spares them once more before its lookup

    def load_beside(self, ids: np.ndarray) -> None:
        """A lookup of ``ids`` (sorted, unique) loads the rows no read-ahead brought in as one
        would, and waits for its loads outside the lock, so that a coming step's read-ahead
        starts its reads meanwhile. (Whatever changes before the lookup takes the lock again
        is settled under it, as without read-ahead.)"""
        with self.lock:
            self.settle_done()
            slots = self.ram.slot_of[ids]
            with self.ram.sparing(slots[slots >= 0]):
                self.start(Ahead(None), ids[slots < 0])
            pending = self.pending_for(ids)
        for f in pending:
            f.exception()                       # (raised where the load is settled)

    def start(self, item: Ahead, miss: np.ndarray) -> None:
        """Under the lock: start loading rows ``miss`` (sorted, not in RAM): slots taken
        (as many as free or evictable without waiting), rows still queued for write-back
        copied from there, the rest read on a loader thread; the rows it evicts written back."""
        d, ram = self.disk, self.ram
        if not len(miss):
            return
        ram.advance_clock()
        free = ram.take_slots(len(miss), wait=False)
        if len(free):
            rows = miss[: len(free)]
            ram.placed(rows, free)
            kept = self.fill(rows, free)            # still queued for write-back: no read
            ram.mark_dirty(free[kept])
            ram.mark_ahead(free[kept])
            item.rows, item.slots = rows[~kept], free[~kept]
            item.sorted_slots = np.sort(item.slots)
            ram.start_loading(item.slots)
            d.count_ahead(len(free))
        if ram.evicted_rows:                              # the rows it evicted, written back
            item.stash = ram.take_evicted()
            item.evicted = np.sort(np.concatenate([i for i, _ in item.stash]))
            self.writes.append(item)
            item.write = d.writer_pool().submit(d.drain, item.stash)
        if len(item.rows):
            self.loads.append(item)
            item.io = self._io.submit(self._load, item)

    def fill(self, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Under the lock: copy into ``slots`` the rows of ``ids`` that a write-back still
        holds (queued or in progress: the newest copy of each), and return which ids were
        copied. Such a row is in RAM already: a lookup or read-ahead takes it from there
        instead of waiting for its write and reading it back. (Its slot is to be marked dirty:
        the file may not have it yet.)"""
        got = np.zeros(len(ids), dtype=bool)
        for item in reversed(self.writes):
            for sid, rows in item.stash:
                if not len(sid) or not len(ids):
                    continue
                pos, hit = _lookup(sid, ids)
                hit &= ~got
                if hit.any():
                    self.ram.put_rows(slots[hit], rows[pos[hit]])
                    got |= hit
        self.stats["from_write_back"] += int(got.sum())
        return got

    def track_write(self, stash: list, future) -> None:
        """Under the lock: a lookup's own write-back of the rows it evicted (``stash``, on
        the write-back thread as ``future``), kept like a read-ahead's until written."""
        item = Ahead(None)
        item.stash = stash
        item.evicted = np.sort(np.concatenate([i for i, _ in stash]))
        item.write = future
        self.writes.append(item)

    def _load(self, item: Ahead) -> None:
        """The load's reads (no lock; its evicted rows are written meanwhile, on the write-back
        thread)."""
        d = self.disk
        t0 = time.perf_counter()
        self.file.read(item.rows, self.ram.slab_bytes, at=item.slots)
        d.count_read(item.rows, time.perf_counter() - t0)

    def _settle(self, item: Ahead) -> None:
        """Under the lock: wait for ``item``'s load and make its rows ordinary RAM rows (on a
        failed load, the slots are freed again and the error raised)."""
        ram = self.ram
        self.loads.remove(item)
        try:
            item.io.result()
        except BaseException:
            ram.load_failed(item.rows, item.slots)
            raise
        ram.loaded(item.slots)

    def _written(self, upto: Ahead | None = None) -> None:
        """Under the lock: forget the finished write-backs (raising the first that failed);
        with ``upto``, wait for the write-backs up to that one first (the thread writes them
        in order)."""
        if upto is not None:
            upto.write.exception()
        while self.writes and self.writes[0].write.done():
            self.writes.popleft().write.result()

    def settle_done(self) -> None:
        """Under the lock: settle the loads that have finished, forget the finished writes."""
        for item in [a for a in self.loads if a.io.done()]:
            self._settle(item)
        self._written()

    def settle_for(self, ids: np.ndarray) -> None:
        """Under the lock, before a lookup of ``ids`` (sorted, unique): wait for the loads
        that bring in one of them. (Those of them still queued for write-back are copied from
        the write's rows, :meth:`fill`: a lookup never waits for a write-back.)"""
        self.settle_done()
        for item in self.loads_of(ids):
            self._settle(item)

    def pending_for(self, ids: np.ndarray) -> list:
        """Under the lock: the loads' futures a lookup of ``ids`` (sorted, unique) would wait
        for, for the lookup to wait for *outside* the lock: a coming step's read-ahead then
        starts its reads meanwhile, instead of queueing for the lock behind this wait."""
        return [a.io for a in self.loads_of(ids) if not a.io.done()]

    def loads_of(self, ids: np.ndarray) -> list:
        """Under the lock: the loads in flight that bring in one of ``ids``. (Quick: the
        lock is held meanwhile, and a step's lookup asks with ~20K ids against up to
        DEPTH loads of ~2K rows each: only the ids' loading slots are looked for, each in
        a load's sorted slots.)"""
        ram = self.ram
        if not self.loads:
            return []
        slots = ram.slot_of[ids]
        slots = slots[slots >= 0]
        slots = slots[ram.loading[slots]]
        if not len(slots):
            return []
        out = []
        for a in self.loads:
            if _lookup(a.sorted_slots, slots)[1].any():
                out.append(a)
        return out

    def wait_io(self) -> None:
        """Wait for every load's and write-back's I/O (the slab may then be copied or freed)."""
        for item in list(self.loads) + list(self.writes):
            for f in (item.io, item.write):
                if f is not None:
                    f.exception()          # (raised where the load is settled, the write forgotten)

    def take(self, ids: torch.Tensor, key=None) -> Prepared | None:
        """The deduplication of these very ids (the same tensor object; or the read-ahead
        submitted with ``key``) from their read-ahead, once; read-aheads queued before it are
        dropped (their loads go on)."""
        for k, item in enumerate(self.queue):
            if (item.ids is ids and item.key is None) or (key is not None and item.key == key):
                for _ in range(k + 1):
                    self.queue.popleft()
                item.task.result()          # (an error once: the next lookup goes on)
                return item.prepared
        return None

    def wait(self) -> None:
        """Wait for every read-ahead, settle every load and write-back (the queue's
        deduplications stay for their lookups). The first error is raised once, after all
        of them are done: the next call goes on (a checkpoint after a disk error)."""
        errors = []
        for item in list(self.queue):
            try:
                item.task.result()
            except BaseException as e:          # its deduplication is left to the lookup
                self.queue.remove(item)
                errors.append(e)
        with self.lock:
            for item in list(self.loads):
                try:
                    self._settle(item)
                except BaseException as e:
                    errors.append(e)
            while self.writes:
                try:
                    self._written(self.writes[-1])
                except BaseException as e:
                    errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.queue.clear()
            self._thread.shutdown()
            self._io.shutdown()
