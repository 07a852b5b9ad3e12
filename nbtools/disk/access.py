"""A disk table's rows as a whole: what reads or writes them from outside a training step.

:class:`nbtools.disk.DiskRows` keeps rows in a file under a RAM cache of slots and moves them
row by row as steps need them. Everything else sees the table whole: ``table.weight`` and
``state_dict`` (a mapping of the file, after every dirty row is written back), the initial
rows and pretrained sources (written 64 MiB at a time), and checkpoints (which save the rows
changed since the last one, by reference to the file, and restore in place). Those paths live
here, as a base class of :class:`~nbtools.disk.DiskRows`, with the two loads of many rows at
once: the initial rows' first write and the warming of the RAM cache with the hottest rows.
Each first waits for the read-ahead, so no read of the file overlaps a write of it.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch


def _numpy_dtype(dtype: torch.dtype):
    return torch.empty((), dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else np.uint16


WARM_CHUNK = 1 << 20       # ids warm() looks at at a time


def chunk_rows(disk) -> int:
    return max(1, (64 << 20) // disk.row_bytes)          # 64 MiB of rows at a time


class WholeTable:
    """Whole-table access to a :class:`~nbtools.disk.DiskRows` (its base class: the methods
    use its file, RAM slots (``ram``) and lock)."""

    def _ensure_init(self) -> None:
        """Write the initial rows to the file the first time any row is needed."""
        initial, self.initial = self.initial, None
        if initial is None:
            return
        step = chunk_rows(self)
        for start in range(0, self.num_rows, step):
            stop = min(self.num_rows, start + step)
            self.write_range(start, initial(start, stop))

    def warm(self, ids, level=None) -> int:
        """Load rows ``ids`` (hottest first) into free RAM slots until they are full; evicts
        nothing. Returns the rows loaded. Where the wanted rows are dense in a stretch of the
        file (one in 16 or more) the stretch is read whole, sequentially, which beats random
        reads of them. Beside the rows, RAM holds a byte a row and ~1M ids at a time.
        ``level``: load them into the free slots of the table's GPU cache instead
        (:class:`nbtools.disk.gpu.GpuLevel`); rows the GPU holds are skipped either way."""
        self.wait_read_ahead()
        self._ensure_init()
        self.ensure_slab()
        if level is not None:
            self.flush()                    # the file as current as RAM: rows read from it
        flat = np.asarray(ids).reshape(-1)
        above = self.above
        with self.slots_lock:
            room = level.free_rows if level is not None else \
                sum(len(f) for f in self.ram.free_slots)
            have = (lambda c: level.holds(c)) if level is not None else \
                (lambda c: (self.ram.slot_of[c] >= 0) | (above is not None and above.holds(c)))
            want = np.zeros(self.num_rows, dtype=bool)          # the rows to load
            for a in range(0, len(flat), WARM_CHUNK):           # hottest first, until full
                if not room:
                    break
                chunk = flat[a:a + WARM_CHUNK].astype(np.int64)
                if len(chunk) and (chunk.min() < 0 or chunk.max() >= self.num_rows):
                    raise ValueError(f"warm: row ids must be in [0, {self.num_rows}), got "
                                     f"{int(chunk.min())}..{int(chunk.max())}")
                chunk = chunk[~have(chunk) & ~want[chunk]]
                first = np.unique(chunk, return_index=True)[1]  # (a chunk's repeats once)
                chunk = chunk[np.sort(first)][:room]
                want[chunk] = True
                room -= len(chunk)
            span = max(1, (64 << 20) // self.file.stride)       # rows per sequential stretch
            loaded = 0
            for at in range(0, self.num_rows, span):
                part = np.flatnonzero(want[at:at + span]) + at
                if not len(part):
                    continue
                dense = len(part) * 16 >= span
                if dense:
                    start = int(part[0]) // span * span
                    stop = min(self.num_rows, start + span)
                    buf = np.empty((stop - start, self.row_bytes), dtype=np.uint8)
                    self.file.read_range(start, buf)
                if level is not None:
                    if not dense:
                        buf, start = np.empty((len(part), self.row_bytes), dtype=np.uint8), None
                        self.file.read(part, buf)
                    level.place(part, buf[part - start] if dense else buf)
                    loaded += len(part)
                    continue
                free = self.ram.take_free(len(part))
                part = part[: len(free)]
                if not len(part):
                    break
                if dense:
                    self.ram.slab_bytes[free] = buf[part - start]
                    self.ram.placed(part, free)
                else:
                    self.load_rows(part, free)
                loaded += len(part)
        return loaded

    # --- whole-table access ---------------------------------------------------------------
    def flush(self, drop: bool = False) -> None:
        """Write every dirty row to the file (after the GPU work that writes them); with
        ``drop``, also empty RAM of every row no pending lookup holds."""
        self.wait_read_ahead()
        self._ensure_init()
        ram = self.ram
        with self.slots_lock:
            self._write_stash()
            ram.close_step()
            ram.advance_clock(wait_for=ram.last_use)
            if self.above is not None:      # rows the GPU changed: into RAM or the file first
                self.above.flush(drop)
            dirty = np.flatnonzero(ram.dirty & (ram.id_of >= 0))
            if len(dirty):
                self._write_slots(dirty)
            if drop:
                out = np.flatnonzero((ram.id_of >= 0) & ~ram.locked)
                ram.ref[out] = False
                ram.forget(out)

    def _write_slots(self, slots: np.ndarray) -> None:
        ram = self.ram
        ids = ram.id_of[slots]
        order = np.argsort(ids, kind="stable")
        self.file_write(ids[order], ram.slab_bytes, slots[order])
        ram.dirty[slots] = False

    def _write_stash(self) -> None:
        """Write evicted rows a lookup did not get to write (it was interrupted): before
        anything reads the file, or writes rows the stash would then overwrite. Under the
        lock."""
        if self.ram.evicted_rows:
            self.drain(self.ram.take_evicted())

    def write_rows(self, ids: np.ndarray, rows: torch.Tensor) -> None:
        """Write whole rows ``ids`` (sorted) to the file; rows cached in RAM are updated too."""
        self.wait_read_ahead()
        self._ensure_init()
        rows = rows.detach().to("cpu", self.dtype).contiguous()
        raw = rows.view(torch.uint8).numpy().reshape(len(ids), self.row_bytes)
        with self.slots_lock:
            self._write_stash()
            if self.above is not None:
                self.above.forget_rows(ids)
            self.file.write(np.asarray(ids, dtype=np.int64), raw)
            self.changed.add(ids)
            slots = self.ram.slot_of[ids]
            hot = slots >= 0
            if hot.any():
                self.ram.slab_bytes[slots[hot]] = raw[hot]

    def write_range(self, start: int, rows: torch.Tensor) -> None:
        """Write rows ``start:start + len(rows)`` to the file (whole-table writes: the
        rows must not be cached in RAM, as at creation)."""
        rows = rows.detach().to("cpu", self.dtype).contiguous()
        self.wait_read_ahead()
        with self.slots_lock:
            self._write_stash()
            if self.above is not None:
                self.above.forget_rows(np.arange(start, start + rows.shape[0]))
            self.file.write_range(start, rows.view(torch.uint8).numpy().reshape(
                rows.shape[0], self.row_bytes))
            self.changed.add_range(start, start + rows.shape[0])

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` as they are now (RAM copies where cached): a fresh CPU tensor."""
        self.wait_read_ahead()
        self._ensure_init()
        with self.slots_lock:
            self._write_stash()
            if self.above is not None:
                self.above.flush()
            out = torch.empty((stop - start, self.width), dtype=self.dtype)
            raw = out.view(torch.uint8).numpy().reshape(stop - start, self.row_bytes)
            self.file.read_range(start, raw)
            slots = self.ram.slot_of[start:stop]
            hot = np.flatnonzero(slots >= 0)
            if len(hot):
                raw[hot] = self.ram.slab_bytes[slots[hot]]
            return out

    def mapped(self, writable: bool = True, ordered: bool = True) -> torch.Tensor:
        """Every row as a CPU tensor mapped onto the file (call :meth:`flush` first). Reads
        and writes go through the page cache: for whole-table access, not steps. Without
        ``writable``, writes stay in this process's copy (copy-on-write), never the file.
        While a checkpoint holds a mapping (:meth:`hold_mapping`), that one is returned.
        A log-structured file (:mod:`nbtools.disk.log`) first moves every row back home (id
        order); without ``ordered`` it does not, and the mapping's bytes are not the rows':
        for a caller that only needs its storage, never its values."""
        held = getattr(self, "_held", None)
        if held is not None:
            return held
        if ordered and getattr(self.file, "away", 0):     # a log file: rows home first
            self.wait_read_ahead()
            with self.slots_lock:
                self._write_stash()
                self._move_home()
        self.file.flush()
        unit = self.file.stride // self.dtype.itemsize
        arr = np.memmap(self.file.path, dtype=_numpy_dtype(self.dtype),
                        mode="r+" if writable else "c",
                        offset=self.file.data_offset, shape=(self.num_rows, unit))
        if writable:
            self._map = arr
            self.changed.fill(True)       # whatever is written through it is not tracked
        t = torch.from_numpy(arr)
        if self.dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t[:, : self.width]

    def _move_home(self) -> None:
        """A log file's rows back in id order (:meth:`nbtools.disk.log.LogFile.identity`), with
        a progress bar when many moved (random reads and writes of each: minutes for tens of
        millions of rows)."""
        from ..checkpoint.save import progress_bar
        away = self.file.away
        bar = progress_bar(away * self.file.stride, f"table {self.name!r}: rows to id order",
                           None if away >= (1 << 20) else False)
        try:
            self.file.identity(None if bar is None else
                               (lambda n: bar.update(n * self.file.stride)))
        finally:
            if bar is not None:
                bar.close()

    def sync_mapped(self) -> None:
        """Writes made through :meth:`mapped` reach the file before rows are read again."""
        m = getattr(self, "_map", None)
        if m is not None:
            self.wait_read_ahead()      # rows read before the writes reach the file go below
            m.flush()
            self._map = None
            ram = self.ram
            with self.slots_lock:     # rows cached in RAM may be older than what was written
                ram.forget(np.flatnonzero((ram.id_of >= 0) & ~ram.locked & ~ram.dirty))

    def take_changed(self) -> np.ndarray:
        """Sorted ids of the rows written to the file since the last call (every row the first
        time), after writing every dirty row back: what an incremental checkpoint saves."""
        self.flush()
        with self.slots_lock:
            ids = self.changed.members()
            self.changed.fill(False)
            self._checkpoint = None       # a checkpoint's next save cannot be a delta now
            return ids

    # --- checkpoints (nbtools.checkpoint.rows: saved by reference, restored in place) ------
    def changed_since(self, token) -> int | None:
        """Rows written since the checkpoint ``token`` took every row (:meth:`mark_checkpointed`),
        after writing every dirty row back; None when changes were not counted from that
        checkpoint (another one came since, or none): the next save must copy every row."""
        self.flush()
        self.sync_mapped()
        with self.slots_lock:
            if token is None or getattr(self, "_checkpoint", None) != token:
                return None
            return self.changed.count()

    def changed_ids(self, start: int, stop: int) -> np.ndarray:
        """Sorted ids in ``start:stop`` of the rows written since the last checkpoint."""
        with self.slots_lock:
            return self.changed.members(start, stop)

    def mark_checkpointed(self, token) -> None:
        """The checkpoint ``token`` now holds every row as it is: count changes from here.
        (Called after the checkpoint is committed, so a failed save loses no change.)"""
        with self.slots_lock:
            self.changed.fill(False)
            self._checkpoint = token

    def copy_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` (sorted, unique) as stored into ``out`` (uint8 ``[len(ids), row_bytes]``):
        the RAM copy where cached, else the file's (they agree after :meth:`flush`)."""
        self.wait_read_ahead()
        with self.slots_lock:
            if self.above is not None:
                self.above.flush()
            slots = self.ram.slot_of[ids]
            hot = slots >= 0
            if hot.any():
                out[hot] = self.ram.slab_bytes[slots[hot]]
            if not hot.all():
                cold = np.flatnonzero(~hot)
                self.file.read(ids[cold], out, at=cold)

    @contextlib.contextmanager
    def hold_mapping(self, writable: bool = False):
        """Within the block, :meth:`mapped` returns one and the same mapping of the file, so a
        checkpoint recognises the views a state dict hands out (it saves them by reference,
        never reading them) and can hand the same views back to ``load_state_dict`` (which then
        copies nothing)."""
        if getattr(self, "_held", None) is not None:
            raise RuntimeError(f"table {self.name!r}: its mapping is held already")
        # No row moves home for it: a save reads rows through the file (every view of the
        # held mapping is saved by reference or refused, never read), and a restore's views
        # are only copied onto themselves; a log file whose rows moved is mapped
        # copy-on-write, so that nothing could reach the file through its unordered bytes.
        away = getattr(self.file, "away", 0) > 0
        self._held = self.mapped(writable and not away, ordered=False)
        try:
            yield self._held
        finally:
            self._held = None
            if writable:
                self.sync_mapped()

    def discard_cache(self) -> None:
        """Forget every row in RAM without writing it back, and rows not written yet (initial
        rows, evicted rows waiting to be written): a restore rewrites the whole file next.
        Waits for the read-ahead and for GPU work on the slots first."""
        self.wait_read_ahead()
        self.sync_mapped()
        with self.slots_lock:
            self.ram.discard()
            if self.above is not None:
                self.above.discard()
            if self._readahead is not None:
                self._readahead.queue.clear()
            self.initial = None
            self.changed.fill(True)
            self._checkpoint = None
