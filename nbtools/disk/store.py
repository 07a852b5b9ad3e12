"""A disk table's row store (:class:`DiskStore`): the tier the table and the step's engine
reach a disk table's rows through, over its RAM slots (:class:`nbtools.disk.DiskRows`), and its
lookup, which brings the rows of a batch in from the file first."""
from __future__ import annotations

import numpy as np
import torch

from ..devices import synchronize
from ..store.rows import RowBatch, RowStore
from . import DiskRows, describe, init_normal, ram_summary
from .gpu import attach
from .readahead import prepare


class DiskStore(RowStore):
    """A disk table's row store: the row store over its RAM slots (the slab, read zero-copy as
    a host table's rows; a GPU level above them is a :class:`nbtools.store.tiers.Cached`
    around this), whose lookups bring rows in from the file first (:func:`lookup`), which
    reads coming steps ahead, and whose rows as a whole are the file's. The table and its
    lookups use it as any row store."""

    keeps_host_ids = True
    in_memory = False           # rows in a file under RAM slots
    own_cache = True            # the RAM slots, and the GPU level attach_cache adds

    def __init__(self, disk: DiskRows, device, layout=None):
        super().__init__(disk.slab, device, layout=layout)
        self.disk = disk

    def cache_cost(self, num_rows: int) -> tuple[int, int]:
        """GPU bytes of the GPU level over the RAM slots: its rows alone (its maps are in host
        RAM)."""
        return 0, self.row_bytes

    def warm_rows(self, counts: torch.Tensor) -> bool:
        """Load the rows of the highest ``counts`` (positive ones, hottest first) now: into the
        GPU level where there is one, then RAM (:meth:`nbtools.disk.access.WholeTable.warm`)."""
        hot = torch.argsort(counts, descending=True, stable=True)
        hot = hot[counts[hot] > 0].numpy()
        self.disk.warm(hot, level=self.disk.above, ram_too=True)
        return True

    def own_cache_stats(self) -> dict:
        """``table.cache_stats()``: the GPU level's figures and RAM's below them
        (:meth:`nbtools.disk.gpu.GpuLevel.summary`), or RAM's alone
        (:func:`nbtools.disk.ram_summary`)."""
        above = self.disk.above
        return above.summary(self.row_bytes) if above is not None else ram_summary(self.disk)

    @property
    def kind(self) -> str:
        return "disk"

    def current_for(self, disk: DiskRows, cache=None) -> bool:
        """Whether this store (under ``cache``) still is ``disk``'s (its slab and GPU level as
        they are now). It is never written behind: its batches are slots, not the sorted ids
        patches need."""
        return self.host is disk.slab and cache is disk.above

    def step_queued(self) -> None:
        self.disk.step_queued()

    def init_normal(self, padding_idx) -> None:
        """N(0, 1) rows, drawn when the rows are first needed (:func:`nbtools.disk.init_normal`)."""
        init_normal(self.disk, padding_idx, self.device)

    def describe(self) -> str:
        """The file and the RAM cache, for ``repr(table)``."""
        return describe(self.disk)

    def written(self, ids) -> None:
        """(A disk table counts the rows written to its file itself: ``ids`` are slots.)"""

    def whole(self, writes: bool = False):
        """The table as a whole: its file under the RAM slots
        (:class:`nbtools.disk.access.WholeTable`, which writes back what RAM and the GPU
        level hold before it reads, and forgets their copies of what it writes)."""
        return self.disk.whole

    def batch_of(self, ids, training: bool, key=None, padding_idx=None):
        """A lookup's :class:`RowBatch` of slots, its rows brought into RAM (:func:`lookup`),
        and the RAM slots it reads."""
        return lookup(self.disk, self.device, ids, training, key, padding_idx)

    def used(self, slots) -> None:
        """GPU work queued so far reads ``slots`` (an evaluation lookup's gather)."""
        self.disk.mark_used(slots)

    def read_ahead(self, ids, padding_idx=None) -> bool:
        self.disk.read_ahead(ids, padding_idx)
        return True

    def attach_cache(self, capacity: int) -> bool:
        """The GPU level above the RAM slots, ``capacity`` rows (:func:`nbtools.disk.gpu.attach`)."""
        attach(self.disk, capacity, self.device)
        return True

    def rows_now(self, keep_cache: bool) -> torch.Tensor:
        self.disk.flush(drop=not keep_cache)            # the file, mapped, once every dirty
        return self.disk.mapped(writable=not keep_cache)    # row is in it

    @property
    def nbytes(self) -> int:
        return self.disk.nbytes

    @property
    def ram_bytes(self) -> int:
        return self.disk.ram_bytes

    def close(self) -> None:
        synchronize(self.device)
        self.disk.close()               # the file goes with it: save a checkpoint first
        self.host.close()


def lookup(disk: DiskRows, dev: torch.device, ids: torch.Tensor, training: bool, key=None,
           padding_idx=None) -> tuple[RowBatch, np.ndarray]:
    """Bring the rows of ``ids`` into RAM (deduplicated on the CPU, or taken from the
    read-ahead of these very ids) and return the lookup's :class:`RowBatch` of *slots* on the
    compute device (the sentinel stays ``num_rows``, past every slot; the bad-id flag and
    count as :func:`nbtools.store.rows.unique_ids` gives them), and the RAM slots it reads as a
    host array. With a GPU cache (:mod:`nbtools.disk.gpu`) the batch addresses GPU slots too,
    and its sentinel is the cache's. ``dev``: the compute device; ``padding_idx``: the
    table's padding row, looked up as the sentinel."""
    n = disk.num_rows
    p = disk.take_prepared(ids, key) or prepare(ids, n, padding_idx)
    if disk.above is not None:        # a GPU cache over the RAM slots: rows in either level
        where, slots = disk.above.lookup(p.uniq, training)
        n = disk.above.sentinel
    else:
        where = slots = disk.resolve(p.uniq, training)
    m = len(where)
    k, inv = m + int(p.sentinel), p.inverse.reshape(-1)
    # [addresses | meta | inverse] in one buffer: one pinned copy to the GPU (a pageable copy
    # would wait for the GPU). Each part starts on a 16-byte boundary, whatever k: Triton
    # compiles a kernel once per alignment of its pointers, so parts that moved with k's
    # parity would compile the step's kernels twice over, seconds each, at random steps.
    meta = k + (k & 1)
    first = meta + 4
    buf = torch.empty(first + inv.numel(), dtype=torch.long,
                      pin_memory=dev.type == "cuda")
    # Filled through numpy, on this thread alone: a torch copy of 65,536 ids splits over
    # torch's thread pool, which on a 2-core machine waits behind the read-ahead's own work
    # (~0.6 ms a step on 2 cores: benchmarks/RESULTS.md, "what the GPU level's step does on two
    # cores").
    host = buf.numpy()
    host[:m] = where
    host[m:k] = n
    host[meta:meta + 3] = (int(p.bad), k, int(p.sentinel))
    host[first:] = inv.numpy()
    if dev.type == "cuda":
        buf = buf.to(dev, non_blocking=True)
    return (RowBatch(buf[:k], buf[first:].view(p.inverse.shape), buf[meta:meta + 3], n),
            slots)
