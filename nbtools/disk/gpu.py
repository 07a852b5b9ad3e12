"""A GPU cache of a disk table's hot rows: the level above its RAM slots.

A disk table (:mod:`nbtools.disk`) keeps its rows in a file under a RAM cache of slots. With a
GPU cache on top (``cache_bytes=``, ``cache_rows=`` or ``cache_fraction=``; ``placement="auto"``
gives a disk table ``gpu_fraction`` of the free GPU memory), the rows a training step touches
move into GPU memory, ``[weight | state...]`` together, and stay there until the GPU's CLOCK
hands their slot to a newer row; the row then moves down into a RAM slot (and later, as RAM's
own CLOCK decides, to the file).

The levels hold different rows: a row's value is in the GPU when the GPU holds it, else in
RAM, else in the file. So a 10 GiB GPU cache over a 7 GiB RAM cache keeps 17 GiB of distinct
hot rows off the disk, where a cache of the GPU that kept each row's RAM slot as well would
keep 10 GiB.

How a training lookup runs (every decision on the host, where a disk table's lookup is
anyway):

* its unique ids are split into GPU hits and the rest; the rest are brought into RAM slots
  as without a GPU cache (:meth:`nbtools.disk.DiskRows.resolve`);
* each of the rest takes a GPU slot: a free one, else one the GPU's CLOCK finds (never one of
  this step's rows), whose row is first copied down into a RAM slot; then its row is copied
  up from its RAM slot. The RAM slot it leaves keeps a clean, stale copy that CLOCK reclaims
  first; lookups never read it (the GPU is asked first), and a row moving down overwrites it;
* the step's :class:`~nbtools.store.rows.RowBatch` addresses both levels: a RAM slot ``s`` as
  ``s``, a GPU slot ``g`` as ``num_rows + g`` (the sentinel is ``num_rows + capacity``). The
  row store gathers and the fused update writes each row where it is (the GPU slot via the
  row store's cache of hot rows, which this object is), with the same kernels and the same
  arithmetic as without it, so a table trains bit-identically with and without the level.

Reads of the whole table (``table.weight``, ``state_dict``, checkpoints) first copy the rows
the GPU changed down (:meth:`GpuLevel.flush`); writes of the whole table drop the level first.
"""
from __future__ import annotations

import collections
import weakref

import numpy as np
import torch

from .. import devices, kernels
from ..devices import hold_host, release_host, synchronize
from ..hostmem import HostTensor, count_cache, count_transfer
from . import ram_summary
from .slots import clock_sweep, take_free


BATCH_DOWN = 16384


class IndexLists:
    """The index lists of the level's row copies, handed to the copy kernel where it reads
    them in place: pinned host memory in a few turns, each reused once the copy that read it
    has run (an event). A list copied to the device per call cost the host ~1 ms a lookup
    (a pinned allocation, a copy and its launch) on a step that is host-bound."""

    TURNS = 4

    def __init__(self, device: torch.device):
        self.device = device
        self.bufs = [None] * self.TURNS
        self.events = [None] * self.TURNS
        self.turn = 0

    def copy(self, src: torch.Tensor, sidx: np.ndarray, dst: torch.Tensor,
             didx: np.ndarray) -> None:
        """``dst[didx] = src[sidx]`` (whole rows; host index arrays), queued on the current
        stream where the kernels run (``src``/``dst``: GPU tensors or zero-copy views of host
        memory)."""
        n = len(sidx)
        if not n:
            return
        if self.device.type != "cuda" or not kernels.usable_on(self.device) or \
                src.stride(1) != 1 or dst.stride(1) != 1:
            s = torch.from_numpy(np.asarray(sidx, dtype=np.int64)).to(src.device)
            d = torch.from_numpy(np.asarray(didx, dtype=np.int64)).to(dst.device)
            dst.index_copy_(0, d, src.index_select(0, s).to(dst.device))
            return
        i = self.turn
        self.turn = (i + 1) % self.TURNS
        if self.events[i] is not None:
            self.events[i].synchronize()      # (long done: TURNS copies ago)
        buf = self.bufs[i]
        if buf is None or buf.tensor.shape[1] < n:
            if buf is not None:
                buf.close()
            # (an even row length: the second list starts on a 16-byte boundary, as Triton
            # compiled the copy for)
            buf = self.bufs[i] = HostTensor((2, max(n + (n & 1), 1 << 14)), torch.int64,
                                            name="GPU cache index lists", device=self.device)
            self.events[i] = torch.cuda.Event()
        host = buf.tensor.numpy()
        host[0, :n] = sidx
        host[1, :n] = didx
        both = buf.view()
        kernels.copy_rows(src, both[0, :n], dst, both[1, :n])
        devices.record(self.events[i], self.device)


class GpuLevel:
    """The GPU cache of one :class:`~nbtools.disk.DiskRows` (its ``above``), and the row store's
    cache of hot rows (``table.cache``) for that table.

    Args:
        disk: the table's file and RAM slots.
        capacity: rows the GPU holds (at most the table's rows).
        device: where (the table's compute device; on the CPU the same logic runs over a CPU
            tensor, for tests).

    Host arrays: ``slot_of`` (row -> GPU slot, -1), ``id_of`` (slot -> row, -1), and per slot
    ``ref`` (CLOCK's bit), ``locked`` (a training lookup's until its step is queued) and
    ``dirty`` (changed since last copied down).
    """

    def __init__(self, disk, capacity: int, device):
        self.disk = disk
        # the RAM level below, its lock and the table's counts, for the table's life
        self.ram, self.lock, self.disk_stats = disk.ram, disk.slots_lock, disk.stats
        self.row_bytes = disk.row_bytes
        self.num_ids = disk.num_rows               # GPU slot g is addressed as num_ids + g
        self.capacity = max(1, min(int(capacity), disk.num_rows))
        self.device = torch.device(device)
        self.rows = torch.zeros(self.capacity, disk.width, dtype=disk.dtype, device=self.device)
        self.slot_of = np.full(disk.num_rows, -1, dtype=np.int32)
        self.id_of = np.full(self.capacity, -1, dtype=disk.ram.index_dtype)
        hold_host(self.host_bytes, f"table {disk.name!r}'s GPU cache maps")
        self._release = weakref.finalize(self, release_host, self.host_bytes)
        for name in ("ref", "locked", "dirty"):
            setattr(self, name, np.zeros(self.capacity, dtype=bool))
        self._free = collections.deque([np.arange(self.capacity, dtype=np.int64)])
        # rows moved down at a time when the GPU is full (fewer, larger moves: each costs
        # the host ~1 ms whatever its size; a 1/256 of the capacity at most stays free)
        self.batch_down = max(1, min(BATCH_DOWN, self.capacity // 256))
        self.hand = 0                              # CLOCK's hand (clock_sweep)
        self._held = []                            # GPU slots locked since the last step
        self._located = None                       # (ids, their slots): locate's last answer
        # unique rows looked up in training, found in the GPU, copied up, copied down
        self.counts = {"lookups": 0, "hits": 0, "admitted": 0, "evicted": 0}
        self.stats = None      # (a RowCache's device counters: this level counts on the host)
        self.index_lists = IndexLists(self.device)

    # --- what the row store asks of a cache of hot rows ----------------------------------
    @property
    def sentinel(self) -> int:
        """The RowBatch sentinel of this table's lookups: past every address."""
        return self.num_ids + self.capacity

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def host_bytes(self) -> int:
        """Host RAM of the maps: row -> slot, and per slot its row and flags."""
        return 4 * self.disk.num_rows + (self.ram.index_dtype(0).itemsize + 3) * self.capacity

    def locate(self, ids: torch.Tensor) -> torch.Tensor:
        """GPU slot of each address of a batch (int32; -1: a RAM slot, or the sentinel);
        for the same ids tensor again (the step's update after its gather), the same answer."""
        last = self._located
        if last is not None and last[0] is ids:
            return last[1]
        hot = (ids >= self.num_ids) & (ids < self.sentinel)
        slots = torch.where(hot, ids - self.num_ids, -1).int()
        self._located = (ids, slots)
        return slots

    def admit(self, ids, count, host) -> torch.Tensor:
        """(Admission happens at the lookup, on the host: :meth:`lookup`.)"""
        return self.locate(ids)

    def cached_rows(self) -> int:
        return int((self.id_of >= 0).sum())

    def holds(self, ids: np.ndarray) -> np.ndarray:
        """Which of rows ``ids`` the GPU holds (their RAM and file copies are stale)."""
        return self.slot_of[ids] >= 0

    # --- a lookup -----------------------------------------------------------------------
    def lookup(self, uniq: np.ndarray, training: bool) -> tuple[np.ndarray, np.ndarray]:
        """Addresses of rows ``uniq`` (sorted, unique, in range) for a lookup's RowBatch, and
        the RAM slots it reads (marked used after its gather). Training: rows not in the GPU
        move up (as room allows), and every row of the lookup stays in its GPU slot until
        the step is queued."""
        d = self.disk
        g = self.slot_of[uniq].astype(np.int64)
        hit = g >= 0
        rest = np.flatnonzero(~hit)
        ram = d.resolve(uniq[rest], training)
        out = np.empty(len(uniq), dtype=np.int64)
        out[hit] = self.num_ids + g[hit]
        out[rest] = ram
        if not training:
            return out, ram
        self.counts["lookups"] += len(uniq)
        self.counts["hits"] += int(hit.sum())
        self._lock(g[hit])
        with self.lock:
            new = self._take(len(rest))
            k = len(new)
            if k:
                up, from_slots = uniq[rest[:k]], ram[:k]
                self.slot_of[up] = new
                self.id_of[new] = up
                self._lock(new)
                self.index_lists.copy(self.ram.slab.view(), from_slots, self.rows, new)
                # stale from now on: reclaimed first (once the copy has run), never read.
                # They stay locked until the step is queued: the step's list of slots holds
                # them and unlocks them then (unlocked now, CLOCK could hand one to a
                # read-ahead's row, whose slot the step would unlock while it loads)
                self.ram.moved_up(from_slots)
                self.ram.mark_used(from_slots)
                self.counts["admitted"] += k
                out[rest[:k]] = self.num_ids + new
        # over PCIe: the rows from RAM read once (up, or gathered), those left in RAM written
        # back; saved: a hit's read and write, an admitted row's write
        hits = int(hit.sum())
        count_transfer(h2d=len(rest) * self.row_bytes, d2h=(len(rest) - k) * self.row_bytes)
        count_cache(len(uniq), hits, (2 * hits + k) * self.row_bytes)
        return out, ram

    def _lock(self, slots: np.ndarray) -> None:
        self.locked[slots] = True
        self.ref[slots] = True
        self.dirty[slots] = True
        self._held.append(slots)

    def step_queued(self) -> None:
        """The optimizer queued the update of the rows this step's lookups hold (or dropped
        them): their slots may be handed on (anything that reads them later is queued after
        the update on the same stream)."""
        if self._held:
            self.locked[np.concatenate(self._held)] = False
            self._held = []

    def _take(self, k: int) -> np.ndarray:
        """Up to ``k`` GPU slots: free ones, else CLOCK's victims (rows of this step are never
        taken), whose rows are first copied down to RAM. Under the disk's lock."""
        got = take_free(self._free, k)
        if len(got) < k:        # a batch of victims at a time: the rest wait in the free list
            need = k - len(got)
            victims = clock_sweep(self, max(need, self.batch_down), self.capacity,
                                  lambda lo, hi: (self.id_of[lo:hi] >= 0) & ~self.locked[lo:hi])
            if len(victims):
                self._move_down(victims)
                got = np.concatenate((got, victims[:need]))
                if len(victims) > need:
                    self._free.append(victims[need:])
        return got

    def _move_down(self, slots: np.ndarray) -> None:
        """Rows in GPU ``slots`` move down into RAM (their stale RAM slot where it is still
        theirs, else a slot RAM's CLOCK frees): copied on the current stream, the RAM slots
        dirty and busy until the copy has run. Under the disk's lock."""
        d = self.disk
        ids = self.id_of[slots]
        ram = self.ram.slot_of[ids].astype(np.int64)
        new = np.flatnonzero(ram < 0)
        if len(new):
            with self.ram.sparing(ram[ram >= 0]):       # the others' slots are not taken for these
                ram[new] = self.ram.take_slots(len(new), wait=True, grow=d.grow)
        self.ram.placed(ids, ram, dirty=True)
        self.index_lists.copy(self.rows, slots, self.ram.slab.view(), ram)
        self.ram.mark_used(ram)
        count_transfer(d2h=len(slots) * self.row_bytes)
        self.slot_of[ids] = -1
        self.id_of[slots] = -1
        self.dirty[slots] = False
        self.counts["evicted"] += len(slots)
        d.write_evicted()

    # --- outside a step -----------------------------------------------------------------
    @property
    def free_rows(self) -> int:
        return sum(len(f) for f in self._free)

    def place(self, ids: np.ndarray, raw: np.ndarray) -> None:
        """Rows ``ids`` (not held here), as stored (uint8 ``[len(ids), row_bytes]``, current:
        the file after a flush), into free slots; their RAM slots are given back (clean
        copies). Warming (:meth:`nbtools.disk.DiskRows.warm`), under the disk's lock."""
        d = self.disk
        slots = take_free(self._free, len(ids))
        rows = torch.from_numpy(np.ascontiguousarray(raw)).view(d.dtype).view(len(ids), d.width)
        self.rows[torch.from_numpy(slots).to(self.device)] = rows.to(self.device)
        self.slot_of[ids] = slots
        self.id_of[slots] = ids
        self.ref[slots] = True
        self.ram.give_back(ids)

    def flush(self, drop: bool = False) -> None:
        """Copy every row the GPU changed down (into its RAM slot where it has one, else into
        the file); ``drop``: then forget every row no pending lookup holds. Under the disk's
        lock, after its read-ahead (the caller's)."""
        d = self.disk
        synchronize(self.device)
        dirty = np.flatnonzero(self.dirty & (self.id_of >= 0))
        step = max(1, (64 << 20) // self.row_bytes)
        for a in range(0, len(dirty), step):
            slots = dirty[a:a + step]
            ids = self.id_of[slots]
            order = np.argsort(ids, kind="stable")
            slots, ids = slots[order], ids[order]
            raw = self.rows.index_select(0, torch.from_numpy(slots).to(self.device)).cpu()
            raw = raw.contiguous().view(torch.uint8).numpy().reshape(len(slots), self.row_bytes)
            ram = self.ram.slot_of[ids]
            mapped = ram >= 0
            self.ram.put_rows(ram[mapped], raw[mapped])
            self.ram.mark_dirty(ram[mapped])
            if not mapped.all():
                d.write_file(ids[~mapped], np.ascontiguousarray(raw[~mapped]))
        self.dirty[dirty] = False
        if drop:
            self.forget(np.flatnonzero((self.id_of >= 0) & ~self.locked))

    def forget(self, slots: np.ndarray) -> None:
        """Forget the rows of GPU ``slots`` without copying them anywhere."""
        slots = np.asarray(slots, dtype=np.int64)
        if not len(slots):
            return
        self.slot_of[self.id_of[slots]] = -1
        self.id_of[slots] = -1
        self.ref[slots] = self.dirty[slots] = False
        self._free.append(slots)

    def forget_rows(self, ids: np.ndarray) -> None:
        """Rows ``ids`` are about to be overwritten in the file: the GPU forgets them."""
        g = self.slot_of[np.asarray(ids, dtype=np.int64)]
        self.forget(g[g >= 0])

    def discard(self) -> None:
        """Forget every row (a restore rewrites the whole file next)."""
        synchronize(self.device)
        self.forget(np.flatnonzero(self.id_of >= 0))
        self.locked[:] = False
        self._held = []

    def summary(self, row_bytes: int) -> dict:
        """``table.cache_stats()`` of a disk table with a GPU cache: this level's counts, and
        RAM's below it."""
        c = self.counts
        return {"lookups": c["lookups"], "hits": c["hits"],
                "hit_rate": c["hits"] / c["lookups"] if c["lookups"] else float("nan"),
                "admitted": c["admitted"], "evicted": c["evicted"],
                "bytes_saved": (2 * c["hits"] - c["admitted"] - c["evicted"]) * row_bytes,
                "capacity_rows": self.capacity, "cache_bytes": self.nbytes,
                **ram_summary(self.disk)}

    def describe(self) -> str:
        c = self.counts
        rate = f"{c['hits'] / c['lookups']:.0%}" if c["lookups"] else "n/a"
        from ..units import human_bytes
        return (f"GPU cache {self.capacity:,} rows ({human_bytes(self.nbytes)}, hit rate "
                f"{rate})")


def attach(d, capacity: int, device) -> GpuLevel:
    """Give disk rows ``d`` (a :class:`~nbtools.disk.DiskRows`) a cache of ``capacity`` rows
    on ``device`` now (what a table's ``cache_bytes``/``cache_rows``/``cache_fraction`` do when
    its optimizer attaches); its next lookup uses it."""
    d.flush()
    d.above = GpuLevel(d, capacity, device)
    return d.above
