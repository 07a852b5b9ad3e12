"""A disk table's rows as a whole: what reads or writes them from outside a training step.

:class:`nbtools.disk.DiskRows` keeps rows in a file under a RAM cache of slots and moves them
row by row as steps need them. Everything else sees the table whole: ``table.weight`` and
``state_dict`` (a mapping of the file, after every dirty row is written back), the initial
rows and pretrained sources (written 64 MiB at a time), and checkpoints (which save the rows
changed since the last one, by reference to the file, and restore in place). Those paths live
here, in :class:`WholeTable` (a table's ``whole``, which also keeps the marks of the rows changed
since the last checkpoint and the file's mappings), with the two loads of many rows at once: the
initial rows' first write and the warming of the RAM cache with the hottest rows. Each first
waits for the read-ahead, so no read of the file overlaps a write of it.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..units import progress_bar
from .bits import BitSet


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty((), dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else np.uint16


WARM_CHUNK = 1 << 20       # ids warm() looks at at a time


def chunk_rows(disk) -> int:
    return max(1, (64 << 20) // disk.row_bytes)          # 64 MiB of rows at a time


def write_all(disk, make, write, what: str, overlap: bool = True) -> None:
    """Every row of ``disk`` written once, :func:`chunk_rows` at a time: ``write(start,
    make(start, stop))``, with a progress bar (shown past a second: a table of tens of GB takes
    minutes). ``overlap``: the next chunk
    is made (drawn, built) while one thread writes the last (packs it and hands it to the
    disk), so ``write`` must not need a lock the caller may hold; an error of either side is
    raised once the writer has stopped. Without, one after the other in this thread."""
    step = chunk_rows(disk)
    chunks = [(a, min(disk.num_rows, a + step)) for a in range(0, disk.num_rows, step)]
    bar = progress_bar(disk.num_rows * disk.row_bytes, f"table {disk.name!r}: {what}", None)

    def written(a: int, b: int) -> None:
        if bar is not None:
            bar.update((b - a) * disk.row_bytes)
    try:
        if not overlap:
            for a, b in chunks:
                write(a, make(a, b))
                written(a, b)
            return
        with ThreadPoolExecutor(1, thread_name_prefix="nbtools-first-write") as writer:
            pending = None                  # (the write in flight, its chunk)
            for a, b in chunks:
                rows = make(a, b)
                if pending is not None:
                    pending[0].result()
                    written(*pending[1])
                pending = writer.submit(write, a, rows), (a, b)
            if pending is not None:
                pending[0].result()
                written(*pending[1])
    finally:
        if bar is not None:
            bar.close()


class WholeTable:
    """Whole-table access to a :class:`~nbtools.disk.DiskRows` (its ``whole``: the table's
    methods of the same names call these), through the table's file, RAM slots and lock.

    It keeps ``changed`` (a :class:`~nbtools.disk.bits.BitSet`: the rows written to the file
    since the last checkpoint took them, for incremental saves; every row at first), the
    checkpoint those are counted from, and the file's mappings (:meth:`mapped`)."""

    def __init__(self, disk):
        # (the table owns this object: a weak reference back, so that a table nobody holds is
        # still freed at once, its file removed)
        self.disk = weakref.proxy(disk)
        # what the whole-table face (nbtools.store.RowTier.whole) says of the rows; ``stride``:
        # bytes from one row to the next in the file (and in its mapping)
        self.name, self.num_rows, self.dtype = disk.name, disk.num_rows, disk.dtype
        self.width, self.row_bytes, self.stride = disk.width, disk.row_bytes, disk.file.stride
        # the parts it works through, for the table's life: the file, the RAM slots and the
        # lock every change of them takes (the rest, the levels above and the loads in flight,
        # it asks the table for)
        self.file, self.ram, self.lock = disk.file, disk.ram, disk.slots_lock
        self.changed = BitSet(disk.num_rows, full=True)
        self.checkpoint = None          # the checkpoint ``changed`` counts from (a token)
        self.map = None                 # the writable mapping handed out last (sync_mapped)
        self.held = None                # the mapping a checkpoint holds (hold_mapping)

    def ensure_init(self) -> None:
        """Write the initial rows (``disk.initial``) to the file the first time any row is
        needed."""
        d = self.disk
        initial, d.initial = d.initial, None
        if initial is None:
            return
        # (in this thread: its writes take the table's lock, which a caller may hold)
        write_all(d, initial, self.write_range, "its initial rows, written once", overlap=False)

    def warm(self, ids, level=None, ram_too: bool = False) -> int:
        """Load rows ``ids`` (hottest first) into free RAM slots until they are full; evicts
        nothing. Returns the rows loaded. Where the wanted rows are dense in a stretch of the
        file (one in 16 or more) the stretch is read whole, sequentially, which beats random
        reads of them. Beside the rows, RAM holds a byte a row and ~1M ids at a time.
        ``level``: load them into the free slots of the table's GPU cache instead
        (:class:`nbtools.disk.gpu.GpuLevel`); rows the GPU holds are skipped either way.
        ``ram_too`` (with ``level``): then fill RAM with the next rows, in the same pass over
        the file (as a second call without ``level`` would, reading the file once)."""
        d, ram = self.disk, self.ram
        d.wait_read_ahead()
        self.ensure_init()
        d.ensure_slab()
        if level is not None:
            self.flush()                    # the file as current as RAM: rows read from it
        flat = np.asarray(ids).reshape(-1)
        up = level if level is not None else d.above
        with self.lock:
            # the rows to load: 1 into the GPU level, 2 into RAM
            want = np.zeros(self.num_rows, dtype=np.uint8)

            def candidates():       # the ids, hottest first, not held above, each once a chunk
                for a in range(0, len(flat), WARM_CHUNK):
                    chunk = flat[a:a + WARM_CHUNK].astype(np.int64)
                    if len(chunk) and (chunk.min() < 0 or chunk.max() >= self.num_rows):
                        raise ValueError(f"warm: row ids must be in [0, {self.num_rows}), got "
                                         f"{int(chunk.min())}..{int(chunk.max())}")
                    if up is not None:
                        chunk = chunk[~up.holds(chunk)]
                    first = np.unique(chunk, return_index=True)[1]  # (a chunk's repeats once)
                    yield chunk[np.sort(first)]
            chunks, rest = candidates(), ()
            room = level.free_rows if level is not None else 0
            for chunk in chunks if room else ():                # the GPU's, until full
                chunk = chunk[want[chunk] == 0]
                take, left = chunk[:room], chunk[room:]
                want[take] = 1
                room -= len(take)
                if not room:
                    rest = (left,)
                    break
            room = 0
            if level is None or ram_too:    # then RAM's, with the slots of rows going up
                room = sum(len(f) for f in ram.free_slots)
                if level is not None:       # (given back first, as the GPU's loads would)
                    room += ram.give_back(np.flatnonzero(want == 1))
            for chunk in itertools.chain(rest, chunks) if room else ():
                chunk = chunk[(want[chunk] == 0) & (ram.slot_of[chunk] < 0)][:room]
                want[chunk] = 2
                room -= len(chunk)
                if not room:
                    break
            span = max(1, (64 << 20) // self.file.stride)          # rows per sequential stretch
            starts = np.arange(0, self.num_rows, span)
            per = np.add.reduceat((want > 0).astype(np.int64), starts) if len(starts) else starts
            ends = np.minimum(starts + span, self.num_rows)
            # a stretch with a sixteenth of its rows wanted is read whole, in one sequential read
            dense_of = per * 16 >= span
            reads = np.where(dense_of, ends - starts, per)            # rows read per stretch
            bar = progress_bar(int(reads.sum()) * self.row_bytes,
                               f"table {self.name!r}: warming its caches", None)
            loaded = 0
            try:
                for at, end, dense, n in zip(starts.tolist(), ends.tolist(), dense_of.tolist(),
                                             reads.tolist()):
                    if not n:
                        continue
                    if bar is not None:
                        bar.update(n * self.row_bytes)
                    stretch = want[at:end]
                    part = np.flatnonzero(stretch) + at
                    if dense:
                        buf = np.empty((end - at, self.row_bytes), dtype=np.uint8)
                        self.file.read_range(at, buf)
                    gpu = part[stretch[part - at] == 1]
                    if len(gpu):
                        if dense:
                            level.place(gpu, buf[gpu - at])
                        else:
                            rows = np.empty((len(gpu), self.row_bytes), dtype=np.uint8)
                            self.file.read(gpu, rows)
                            level.place(gpu, rows)
                        loaded += len(gpu)
                    part = part[stretch[part - at] == 2]
                    slots = ram.take_free(len(part))
                    part = part[: len(slots)]
                    if dense and len(part):
                        ram.put_rows(slots, buf[part - at])
                        ram.placed(part, slots)
                    elif len(part):
                        d.load_rows(part, slots)
                    loaded += len(part)
            finally:
                if bar is not None:
                    bar.close()
        return loaded

    # --- whole-table access ---------------------------------------------------------------
    def flush(self, drop: bool = False) -> None:
        """Write every dirty row to the file (after the GPU work that writes them); with
        ``drop``, also empty RAM of every row no pending lookup holds."""
        d, ram = self.disk, self.ram
        d.wait_read_ahead()
        self.ensure_init()
        with self.lock:
            d.write_stash()
            ram.close_step()
            ram.advance_clock(wait_for=ram.last_use)
            if d.above is not None:         # rows the GPU changed: into RAM or the file first
                d.above.flush(drop)
            dirty = np.flatnonzero(ram.dirty & (ram.id_of >= 0))
            if len(dirty):
                self._write_slots(dirty)
            if drop:
                out = np.flatnonzero((ram.id_of >= 0) & ~ram.locked)
                ram.forget(out, unref=True)

    def _write_slots(self, slots: np.ndarray) -> None:
        ram = self.ram
        ids = ram.id_of[slots]
        order = np.argsort(ids, kind="stable")
        self.disk.file_write(ids[order], ram.slab_bytes, slots[order])
        ram.mark_clean(slots)

    def write_rows(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Write whole rows ``ids`` (sorted) to the file; rows cached in RAM are updated too."""
        d, ram = self.disk, self.ram
        d.wait_read_ahead()
        self.ensure_init()
        rows = rows.detach().to("cpu", self.dtype).contiguous()
        raw = rows.view(torch.uint8).numpy().reshape(len(ids), self.row_bytes)
        with self.lock:
            d.write_stash()
            if d.above is not None:
                d.above.forget_rows(ids)
            self.file.write(np.asarray(ids, dtype=np.int64), raw)
            self.changed.add(ids)
            slots = ram.slot_of[ids]
            hot = slots >= 0
            if hot.any():
                ram.put_rows(slots[hot], raw[hot])

    def write_range(self, start: int, rows: torch.Tensor) -> None:
        """Write rows ``start:start + len(rows)`` to the file (whole-table writes: the
        rows must not be cached in RAM, as at creation)."""
        rows = rows.detach().to("cpu", self.dtype).contiguous()
        self.write_bytes(start, rows.view(torch.uint8).numpy().reshape(rows.shape[0], -1))

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as they are now (RAM copies where cached): a fresh CPU tensor."""
        out = torch.empty((stop - start, self.width), dtype=self.dtype)
        self.read_bytes(start, out.view(torch.uint8).numpy().reshape(stop - start, self.row_bytes))
        return out

    # --- the whole-table face of the tier (nbtools.store.RowTier.whole): rows as stored ----
    @property
    def moved(self) -> bool:
        """Whether rows left their home slots (a log-structured file): read them in file
        order (:meth:`records`), where id order would read each moved row at random."""
        return getattr(self.file, "away", 0) > 0

    def read_bytes(self, start: int, out: np.ndarray) -> None:
        """Rows ``start:start + len(out)`` as they are now (RAM copies where cached) into
        ``out`` (uint8 ``[m, row_bytes]``)."""
        d, ram = self.disk, self.ram
        d.wait_read_ahead()
        self.ensure_init()
        with self.lock:
            d.write_stash()
            if d.above is not None:
                d.above.flush()
            self.file.read_range(start, out)
            slots = ram.slot_of[start:start + len(out)]
            hot = np.flatnonzero(slots >= 0)
            if len(hot):
                out[hot] = ram.slab_bytes[slots[hot]]

    def write_bytes(self, start: int, src: np.ndarray) -> None:
        """Rows ``start:start + len(src)`` from ``src`` (uint8 ``[m, row_bytes]``) into the file
        (whole-table writes: the rows must not be cached in RAM, as at creation or after
        :meth:`discard_cache`)."""
        d = self.disk
        d.wait_read_ahead()
        with self.lock:
            d.write_stash()
            if d.above is not None:
                d.above.forget_rows(np.arange(start, start + len(src)))
            self.file.write_range(start, src)
            self.changed.add_range(start, start + len(src))

    def write_records(self, ids: np.ndarray, src: np.ndarray) -> None:
        """Rows ``ids`` (any order, each once; not cached, as after :meth:`discard_cache`)
        from ``src`` (uint8 ``[len(ids), row_bytes]``) into the file: appended, in a log file."""
        with self.lock:
            self.file.write(ids, src)
            self.changed.add(ids)

    def records(self, per: int, out: np.ndarray):
        """Every row as ``(ids, rows)``, ``per`` file slots at a time, in file order (one large
        sequential read each; dead slots are read and skipped), read into ``out`` (uint8
        ``[per, row_bytes]``): a log file's rows, whose order is not the ids'."""
        log = self.file
        for a in range(0, log.slots, per):
            ids, live = log.live_rows(a, out[:min(per, log.slots - a)])
            yield ids, out[live]

    def mapped(self, writable: bool = True, ordered: bool = True) -> torch.Tensor:
        """Every row as a CPU tensor mapped onto the file (call :meth:`flush` first). Reads
        and writes go through the page cache: for whole-table access, not steps. Without
        ``writable``, writes stay in this process's copy (copy-on-write), never the file.
        While a checkpoint holds a mapping (:meth:`hold_mapping`), that one is returned.
        A log-structured file (:mod:`nbtools.disk.log`) first moves every row back home (id
        order); without ``ordered`` it does not, and the mapping's bytes are not the rows':
        for a caller that only needs its storage, never its values."""
        d = self.disk
        if self.held is not None:
            return self.held
        if ordered and getattr(self.file, "away", 0):     # a log file: rows home first
            d.wait_read_ahead()
            with self.lock:
                d.write_stash()
                self._move_home()
        self.file.flush()
        # the table's own descriptor mapped, never its path: a file put at that name since
        # is not what the rows are read from or written to
        arr = self.file.map_rows(self.num_rows, writable).view(_numpy_dtype(self.dtype))
        if writable:
            self.map = arr
            self.changed.fill(True)       # whatever is written through it is not tracked
        t = torch.from_numpy(arr)
        if self.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t[:, : self.width]

    def _move_home(self) -> None:
        """A log file's rows back in id order (:meth:`nbtools.disk.log.LogFile.identity`), with
        a progress bar when many moved (random reads and writes of each: minutes for tens of
        millions of rows)."""
        file = self.file
        away = file.away
        bar = progress_bar(away * file.stride, f"table {self.name!r}: rows to id order",
                           None if away >= (1 << 20) else False)
        try:
            file.identity(None if bar is None else (lambda n: bar.update(n * file.stride)))
        finally:
            if bar is not None:
                bar.close()

    def sync_mapped(self) -> None:
        """Writes made through :meth:`mapped` reach the file before rows are read again."""
        d, ram = self.disk, self.ram
        m = self.map
        if m is not None:
            d.wait_read_ahead()         # rows read before the writes reach the file go below
            m.flush()
            self.map = None
            with self.lock:        # rows cached in RAM may be older than what was written
                ram.forget(np.flatnonzero((ram.id_of >= 0) & ~ram.locked & ~ram.dirty))

    def take_changed(self) -> np.ndarray:
        """Sorted ids of the rows written to the file since the last call (every row the first
        time), after writing every dirty row back: what an incremental checkpoint saves."""
        self.flush()
        with self.lock:
            ids = self.changed.members()
            self.changed.fill(False)
            self.checkpoint = None        # a checkpoint's next save cannot be a delta now
            return ids

    # --- checkpoints (nbtools.checkpoint.rows: saved by reference, restored in place) ------
    def changed_since(self, token) -> int | None:
        """Rows written since the checkpoint ``token`` took every row (:meth:`mark_checkpointed`),
        after writing every dirty row back; None when changes were not counted from that
        checkpoint (another one came since, or none): the next save must copy every row."""
        self.flush()
        self.sync_mapped()
        with self.lock:
            if token is None or self.checkpoint != token:
                return None
            return self.changed.count()

    def changed_ids(self, start: int, stop: int) -> np.ndarray:
        """Sorted ids in ``start:stop`` of the rows written since the last checkpoint."""
        with self.lock:
            return self.changed.members(start, stop)

    def mark_checkpointed(self, token) -> None:
        """The checkpoint ``token`` now holds every row as it is: count changes from here.
        (Called after the checkpoint is committed, so a failed save loses no change.)"""
        with self.lock:
            self.changed.fill(False)
            self.checkpoint = token

    def copy_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` (sorted, unique) as stored into ``out`` (uint8 ``[len(ids), row_bytes]``):
        the RAM copy where cached, else the file's (they agree after :meth:`flush`)."""
        d, ram = self.disk, self.ram
        d.wait_read_ahead()
        with self.lock:
            if d.above is not None:
                d.above.flush()
            slots = ram.slot_of[ids]
            hot = slots >= 0
            if hot.any():
                out[hot] = ram.slab_bytes[slots[hot]]
            if not hot.all():
                cold = np.flatnonzero(~hot)
                self.file.read(ids[cold], out, at=cold)

    @contextlib.contextmanager
    def hold_mapping(self, writable: bool = False):
        """Within the block, :meth:`mapped` returns one and the same mapping of the file, so a
        checkpoint recognises the views a state dict hands out (it saves them by reference,
        never reading them) and can hand the same views back to ``load_state_dict`` (which then
        copies nothing)."""
        if self.held is not None:
            raise RuntimeError(f"table {self.name!r}: its mapping is held already")
        # No row moves home for it: a save reads rows through the file (every view of the
        # held mapping is saved by reference or refused, never read), and a restore's views
        # are only copied onto themselves; a log file whose rows moved is mapped
        # copy-on-write, so that nothing could reach the file through its unordered bytes.
        away = getattr(self.file, "away", 0) > 0
        self.held = self.mapped(writable and not away, ordered=False)
        try:
            yield self.held
        finally:
            self.held = None
            if writable:
                self.sync_mapped()

    def discard_cache(self) -> None:
        """Forget every row in RAM without writing it back, and rows not written yet (initial
        rows, evicted rows waiting to be written): a restore rewrites the whole file next.
        Waits for the read-ahead and for GPU work on the slots first."""
        d = self.disk
        d.wait_read_ahead()
        self.sync_mapped()
        with self.lock:
            self.ram.discard()
            if d.above is not None:
                d.above.discard()
            if d.reader is not None:
                d.reader.queue.clear()
            d.initial = None
            self.changed.fill(True)
            self.checkpoint = None

    def close(self) -> None:
        """Let go of the mapping handed out last and of the change marks (the table closes)."""
        self.map = None
        self.changed = None
