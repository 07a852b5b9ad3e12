"""A disk table's RAM slots (:class:`RamSlots`, the cache of rows under its file), and which slot a
row takes, there and in its GPU cache (:class:`nbtools.disk.gpu.GpuLevel`): a free list, and CLOCK
(second chance)."""
from __future__ import annotations

import collections
import contextlib
import weakref

import numpy as np
import torch

from .. import devices
from ..devices import hold_host, release_host
from ..hostmem import HostTensor


def take_free(free: collections.deque, k: int) -> np.ndarray:
    """Up to ``k`` slots from a free list (a deque of slot arrays), oldest first."""
    got, need = [], k
    while need and free:
        part = free.popleft()
        if len(part) > need:
            free.appendleft(part[need:])
            part = part[:need]
        got.append(part)
        need -= len(part)
    return np.concatenate(got) if got else np.zeros(0, dtype=np.int64)


def clock_sweep(owner, need: int, size: int, usable) -> np.ndarray:
    """CLOCK (second chance) over ``size`` slots of ``owner`` (its ``hand``, ``ref`` and
    ``locked`` arrays), vectorised over windows: up to ``need`` slots that ``usable(lo, hi)``
    (a bool array of slots ``lo:hi``) allows and whose reference bit is clear, clearing the
    bits of the usable slots it passes (two turns at most)."""
    out, taken, passed = [], 0, 0
    window = max(4 * need, 4096)
    while taken < need and passed < 2 * size:
        lo = owner.hand
        hi = min(lo + window, size)
        ok = usable(lo, hi)
        pick = np.flatnonzero(ok & ~owner.ref[lo:hi])[: need - taken] + lo
        end = pick[-1] + 1 if len(pick) and taken + len(pick) == need else hi
        owner.ref[lo:end] &= ~ok[: end - lo]      # second chance spent
        owner.locked[pick] = True                 # not picked twice on the next turn
        out.append(pick)
        taken += len(pick)
        passed += end - lo
        owner.hand = end % size
    out = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    owner.locked[out] = False
    return out


class RamSlots:
    """A disk table's RAM cache of rows (:class:`nbtools.disk.DiskRows`' ``ram``): the slab of
    slots, what each slot holds and may do, and the table's row -> slot map.

    A missing row takes a free slot, else one CLOCK finds idle: never one a lookup of this step
    holds, a read-ahead is loading, or GPU work queued so far still reads or writes (a CUDA event
    per use). An evicted dirty row is copied aside (:attr:`evicted_rows`) for the table to write
    back beside the step's reads. Every method but :meth:`step_queued` runs under the table's
    lock (``slots_lock``); when and how far the slab grows is the table's call (it first waits
    for reads into the old slab: :meth:`resize`).

    Args:
        num_rows, width, dtype: the table's rows ``[num_rows, width]`` of ``dtype``.
        want: slots the slab takes once pinned (:meth:`resize`); it starts with one.
        device: the compute device (CUDA: the slab is read zero-copy, its uses are events).
        pin: pin the slab (CUDA only).
        name: the table's name, for the host budget's messages.
        counts: the table's counters (``DiskRows.stats``), whose ``"evicted"`` counts here.

    Arrays (host, numpy): ``slot_of`` (row -> slot, -1: on disk), ``id_of`` (slot -> row, -1:
    free), ``busy`` (a slot's last GPU use), one bool per slot for each of :data:`SLOT_FLAGS`;
    ``slab_bytes`` the slab as ``[slots, row_bytes]`` uint8; ``free_slots`` a deque of slot
    arrays; ``hand`` CLOCK's hand. The table's other parts change them only through its
    methods.

    >>> ram = RamSlots(100, 2, torch.float32, want=4, device=torch.device("cpu"), pin=False,
    ...                name="t", counts={"evicted": 0})
    >>> ram.resize(ram.want)                    # (a table does this when rows are first needed)
    >>> got = ram.take_slots(3, wait=False)
    >>> ram.placed(np.array([7, 8, 9]), got)
    >>> ram.slot_of[[7, 8, 9]].tolist(), len(ram.take_free(5)), ram.capacity_rows
    ([0, 1, 2], 1, 4)
    >>> ram.close()
    """

    # Per-slot flags: dirty (written since read), ref (CLOCK's reference bit), locked (a
    # lookup's until its step is queued, or a read-ahead's while loading), ahead (brought in by
    # a read-ahead, not looked up since), loading (a read-ahead's read in flight).
    SLOT_FLAGS = ("dirty", "ref", "locked", "ahead", "loading")

    def __init__(self, num_rows: int, width: int, dtype: torch.dtype, *, want: int, device,
                 pin: bool, name: str, counts: dict):
        self.width, self.dtype, self.device, self.name = width, dtype, device, name
        self.row_bytes = width * dtype.itemsize
        self.counts = counts
        self._pin = pin
        self._release = None                    # the slot arrays' hold on the host budget
        # row and slot numbers: int32 where they fit (4 bytes a row and a slot less than int64)
        self.index_dtype = np.int32 if num_rows < 2**31 else np.int64
        self.slot_of = np.full(num_rows, -1, dtype=self.index_dtype)  # row -> slot, -1: on disk
        # the RAM cache is pinned when first needed: a table whose optimizer attaches at once
        # (and so moves to a file of wider rows) never pins the first one's
        self.want = want
        self.evicted_rows = []                  # evicted dirty rows (ids, bytes) to write
        self._alloc(1)
        self._events = collections.deque()      # (index, CUDA event) of GPU uses of slots
        self._event_index = 0
        self._done_upto = 0                     # every use up to this index has run
        self._step = []                         # slots a training lookup locked since a step
        self._written = []                      # slots a step has queued writes to (unmarked)

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
        if self._release is not None:
            self._release()
        self._release = weakref.finalize(self, release_host, held)
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

    def resize(self, slots: int) -> None:
        """A slab of ``slots`` slots, the rows kept. The caller has waited for every read into
        the old slab and every GPU use of it."""
        old = self.slab
        self._alloc(slots, old)
        old.close()

    @property
    def capacity_rows(self) -> int:
        """Rows the RAM cache holds (once pinned; more if a step needed it)."""
        return max(self.slots, self.want)

    @property
    def slot_bytes(self) -> int:
        """RAM a slot takes beside its row: its row number, its last use, its flags and its
        place in the free list."""
        return 2 * np.dtype(self.index_dtype).itemsize + 8 + len(self.SLOT_FLAGS)

    @property
    def ram_bytes(self) -> int:
        """RAM the cache takes: the slab plus the row -> slot map and the slot arrays."""
        return self.slab.nbytes + self.slot_of.nbytes + self.slots * self.slot_bytes

    def close(self) -> None:
        """Unpin the slab; the slot arrays leave the host budget (the slab's pages when the
        table goes)."""
        self.slab.close()
        self._release()
        self.slot_of = None

    # --- GPU uses of slots ----------------------------------------------------------------
    def mark_used(self, slots: np.ndarray) -> None:
        """The GPU work queued so far reads or writes ``slots``: they are not reused before it
        has run (a CUDA event; nothing to wait for on the CPU)."""
        if self.device.type != "cuda" or len(slots) == 0:
            return
        event = torch.cuda.Event()
        devices.record(event, self.device)
        self._event_index += 1
        self._events.append((self._event_index, event))
        self.busy[slots] = self._event_index

    @property
    def last_use(self) -> int:
        """The newest GPU use marked so far (``advance_clock(wait_for=last_use)`` waits for
        every one)."""
        return self._event_index

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

    def lock_for_step(self, slots: np.ndarray) -> None:
        """A training lookup's ``slots``: locked (and dirty) until its step is queued."""
        self.locked[slots] = True
        self.dirty[slots] = True
        self._step.append(slots)

    def step_queued(self) -> None:
        """The optimizer has taken the table's lookups (its update is queued after this):
        their slots are marked used at the next host access (:meth:`close_step`). Lock-free:
        the step's Python never waits for a read-ahead."""
        if self._step:
            self._written.append(np.concatenate(self._step))
            self._step = []

    def close_step(self) -> None:
        """The slots of the steps queued since: marked used, and unlocked."""
        written, self._written = self._written, []
        if written:
            slots = np.concatenate(written)
            self.mark_used(slots)
            self.locked[slots] = False

    # --- which slot a row takes -----------------------------------------------------------
    @contextlib.contextmanager
    def sparing(self, hits: np.ndarray):
        """Under the lock: a lookup's ``hits`` (slots) are not evicted for its misses."""
        was = self.locked[hits].copy()
        self.locked[hits] = True
        try:
            yield
        finally:
            self.locked[hits] = was

    def take_slots(self, k: int, wait: bool, grow=None) -> np.ndarray:
        """``k`` free slots, evicting rows (dirty ones copied to :attr:`evicted_rows`) as CLOCK
        chooses. With ``wait``, waits for GPU uses and, if that frees too few, calls ``grow``
        (the table's: ``grow(n)`` makes room for ``n`` more slots); without (read-ahead), may
        return fewer."""
        got = [self.take_free(k)]
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
                grow(need)
                got.append(self.take_slots(need, wait, grow))
        except BaseException:      # (a KeyboardInterrupt in the wait): the slots hold no row
            self.free_slots.append(np.concatenate(got))
            raise
        return np.concatenate(got)

    def take_free(self, k: int) -> np.ndarray:
        """Up to ``k`` slots that hold no row."""
        return take_free(self.free_slots, k)

    def _sweep(self, need: int) -> np.ndarray:
        """CLOCK: up to ``need`` resident, unlocked, idle slots whose reference bit is clear."""
        return clock_sweep(self, need, self.slots, lambda lo, hi: (
            (self.id_of[lo:hi] >= 0) & ~self.locked[lo:hi] & (self.busy[lo:hi] <= self._done_upto)))

    def _evict(self, slots: np.ndarray) -> None:
        """Free ``slots``; their dirty rows are copied aside (:attr:`evicted_rows`) and written
        by the table's ``load_rows``, beside its reads, before the lock is released: no reader
        of the file can see a row between its eviction and its write."""
        dirty = slots[self.dirty[slots]]
        if len(dirty):
            ids = self.id_of[dirty]
            order = np.argsort(ids, kind="stable")
            self.evicted_rows.append((ids[order], self.slab_bytes[dirty[order]]))
            self.dirty[dirty] = False
        self.slot_of[self.id_of[slots]] = -1
        self.id_of[slots] = -1
        self.counts["evicted"] += len(slots)

    def take_evicted(self) -> list:
        """The evicted dirty rows not yet handed on (``(ids, rows)`` pairs), to be written."""
        stash, self.evicted_rows = self.evicted_rows, []
        return stash

    # --- rows in and out ------------------------------------------------------------------
    def placed(self, ids: np.ndarray, slots: np.ndarray, dirty: bool = False) -> None:
        """Rows ``ids`` now sit in ``slots``: clean, or with ``dirty`` newer than the file (rows
        moved down from the GPU level)."""
        self.slot_of[ids] = slots
        self.id_of[slots] = ids
        self.dirty[slots] = dirty
        self.ahead[slots] = False
        self.ref[slots] = True

    def put_rows(self, slots: np.ndarray, raw: np.ndarray) -> None:
        """Rows as stored (uint8 ``[len(slots), row_bytes]``) into ``slots``' bytes; what the
        slots hold and their flags stay as they are."""
        self.slab_bytes[slots] = raw

    def mark_referenced(self, slots: np.ndarray) -> None:
        """The rows of ``slots`` are wanted now: CLOCK passes them over once more."""
        self.ref[slots] = True

    def mark_dirty(self, slots: np.ndarray) -> None:
        """The rows of ``slots`` are newer than the file's: written back when evicted or
        flushed."""
        self.dirty[slots] = True

    def mark_clean(self, slots: np.ndarray) -> None:
        """The file now has the rows of ``slots``."""
        self.dirty[slots] = False

    def mark_ahead(self, slots: np.ndarray) -> None:
        """A read-ahead brought the rows of ``slots`` in (counted when a lookup first finds
        them: :meth:`take_ahead`)."""
        self.ahead[slots] = True

    def take_ahead(self, slots: np.ndarray) -> int:
        """How many of ``slots`` (a lookup's hits) hold rows a read-ahead brought in and no
        lookup found since; from now on they count as found."""
        early = int(self.ahead[slots].sum())
        self.ahead[slots] = False
        return early

    def moved_up(self, slots: np.ndarray) -> None:
        """The rows of ``slots`` are being copied up into the GPU level: the copies here go
        stale (neither written back nor spared by CLOCK), their slots reclaimed first once
        the copy has run."""
        self.dirty[slots] = False
        self.ref[slots] = False

    def start_loading(self, slots: np.ndarray) -> None:
        """A read-ahead's read into ``slots`` is in flight: locked (not evicted, nor given to
        another row) and loading (a lookup of their rows waits for it)."""
        self.loading[slots] = True
        self.locked[slots] = True

    def loaded(self, slots: np.ndarray) -> None:
        """A read-ahead's read into ``slots`` has landed: ordinary rows, brought in ahead."""
        self.loading[slots] = False
        self.locked[slots] = False
        self.ahead[slots] = True

    def load_failed(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """A read-ahead's read of rows ``ids`` into ``slots`` failed: the rows are on disk
        again, the slots unlocked and free."""
        self.slot_of[ids] = -1
        self.id_of[slots] = -1
        self.loading[slots] = False
        self.locked[slots] = False
        self.free(slots)

    def free(self, slots: np.ndarray) -> None:
        """``slots``, holding no row (taken for rows whose read failed), go back to the free
        list."""
        self.free_slots.append(slots)

    def give_back(self, ids: np.ndarray) -> int:
        """Rows ``ids`` moved up into the GPU level (clean copies here): their slots go back to
        the free list, in the order of ``ids``, but for those a pending lookup holds (stale
        copies until the step releases them). Returns the slots freed."""
        ram = self.slot_of[ids]
        ram = ram[ram >= 0]
        self.ref[ram] = False
        ram = ram[~self.locked[ram]]
        self.slot_of[self.id_of[ram]] = -1
        self.id_of[ram] = -1
        self.free_slots.append(ram.astype(np.int64))
        return len(ram)

    def forget(self, slots: np.ndarray, unref: bool = False) -> None:
        """The rows of ``slots`` leave RAM without being written (the file has them, or
        newer); the free list becomes every slot that holds no row. ``unref``: the slots'
        reference bits are cleared first."""
        if unref:
            self.ref[slots] = False
        self.slot_of[self.id_of[slots]] = -1
        self.id_of[slots] = -1
        free = np.flatnonzero(self.id_of < 0)
        self.free_slots = collections.deque([free]) if len(free) else collections.deque()

    def discard(self) -> None:
        """Forget every row without writing it back, the evicted rows waiting to be written and
        the step's slots, once the GPU work on the slots has run."""
        self.close_step()
        self._step = []
        self.advance_clock(wait_for=self._event_index)
        self.evicted_rows = []
        self.slot_of[:] = -1
        self.id_of[:] = -1
        for name in self.SLOT_FLAGS:
            getattr(self, name)[:] = False
        self.free_slots = collections.deque([np.arange(self.slots, dtype=np.int64)])
