"""The row protocol between tables and the optimizer: unique ids, the rows they name, and where
those rows live.

A lookup hands the optimizer a :class:`RowBatch`: the batch's unique ids, sorted, in a buffer
of fixed capacity (the number of ids, at most the number of rows + 1), their count as a
one-element tensor on the compute device, and the inverse map from each id to its unique slot.
Nothing in it needs the host to know how many ids are unique, so a lookup never waits for the
GPU. Ids that must not be read or written (out of range, or the padding row) are replaced by the
*sentinel* ``num_rows``: it sorts last, reads as a zero row and is never written.

A :class:`RowStore` is where rows live (placement):

* ``zero-copy``: pinned host memory; GPU kernels read and write host RAM over PCIe.
* ``gpu``: a CUDA tensor (the table fits the GPU): same protocol, no PCIe.
* ``staged``: pageable host memory with CUDA compute (``pin=False``): the CPU gathers, then copies.
* ``host``: CPU compute.

A zero-copy store may carry a :class:`~nbtools.store.cache.RowCache` of hot rows in GPU memory:
lookups read cached rows from it, updates write them there, and :meth:`RowStore.flush` writes
them back before the host rows are read from outside a step.

A zero-copy store without a cache *writes behind* (:meth:`RowStore.write_behind`): a fused
update writes the step's rows into the gathered rows in GPU memory, and a side stream writes
them back to host memory while the next step deduplicates, gathers and computes, so the link
is never idle while the GPU computes. The next lookup takes the rows it shares with that
step from its GPU copy (:meth:`RowStore.patch`); anything else that reads or writes the host
rows first waits for the write-back (:meth:`RowStore.settle`, no host synchronisation).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import kernels
from ..engine import streams
from .cache import RowCache
from .layout import ALIGN_BYTES, RowLayout, row_padding  # noqa: F401  (nbtools.store.layout.RowLayout)
from ..devices import after_failed_capture, synchronize
from ..hostmem import count_transfer, gather_rows, scatter_rows


@dataclasses.dataclass
class RowBatch:
    """Unique ids of one lookup (or of every lookup of a step, merged).

    Attributes:
        ids: [cap] int64, sorted unique ids, then the sentinel ``num_rows`` (slots at and past
            ``count`` hold the sentinel too).
        inverse: [n] int64: slot of each id of the lookup, in the lookup's order.
        meta: [3] int64 on the compute device: ``[bad, count, sentinel]``: an id was out of
            range; how many slots are in use; whether the last used slot is the sentinel
            (some id was replaced by it). What the optimizer's one synchronisation reads.
        num_rows: the table's row count (= the sentinel value).
        order, slot: [n] int64: the lookup's positions sorted by id (stable), and the slot of
            each sorted position (nondecreasing): what sums a lookup's gradient per id in a
            fixed order (:func:`sum_by_slot`). None where the batch was made without them
            (the sum then sorts ``inverse`` itself). :func:`unique_ids` keeps them in the
            memory of ``inverse`` (one allocation: a stream that ``inverse`` is recorded on
            covers them too).
    """

    ids: torch.Tensor
    inverse: torch.Tensor
    meta: torch.Tensor
    num_rows: int
    order: torch.Tensor | None = None
    slot: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return self.ids.numel()

    @property
    def count(self) -> torch.Tensor:
        """[1] int64 on the device: slots in use (what the gather kernel reads)."""
        return self.meta[1:2]

    @property
    def bad(self) -> torch.Tensor:
        """[1] int64 on the device: nonzero when an id was out of range."""
        return self.meta[0:1]


def unique_ids(flat: torch.Tensor, num_rows: int, padding_idx=None) -> RowBatch:
    """Deduplicate 1-D int64 ``flat`` on its device, without a host synchronisation.

    Out-of-range ids (flagged in ``meta[0]``) and ``padding_idx`` become the sentinel
    ``num_rows``.

    >>> b = unique_ids(torch.tensor([5, 2, 5, 9, 2]), num_rows=8)
    >>> b.ids.tolist(), b.inverse.tolist(), b.meta.tolist()
    ([2, 5, 8, 8, 8], [1, 0, 1, 2, 0], [1, 3, 1])
    """
    n = flat.numel()
    device = flat.device
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return RowBatch(empty, empty, torch.zeros(3, dtype=torch.long, device=device), num_rows,
                        empty, empty)
    valid = (flat >= 0) & (flat < num_rows)
    bad = (~valid).any().reshape(1)
    if padding_idx is not None:
        valid &= flat != padding_idx
    safe = torch.where(valid, flat, num_rows)
    # inverse, order and slot in one allocation (RowBatch: a prefetch made on a side stream
    # records `inverse` on the main one, and with it the other two)
    maps = torch.empty(3, n, dtype=torch.long, device=device)
    inverse, order, slot = maps[0], maps[1], maps[2]
    # stable: equal ids keep their positions' order, so each id's gradient rows are summed in
    # the order of the lookup (sum_by_slot), the same on every run
    if num_rows < 2 ** 31 - 1:        # int32 keys: a radix sort of half the passes
        keys = torch.empty_like(safe, dtype=torch.int32)
        ordered = torch.sort(safe.int(), stable=True, out=(keys, order))[0].long()
    else:
        ordered = torch.sort(safe, stable=True, out=(torch.empty_like(safe), order))[0]
    new = torch.ones(n, dtype=torch.bool, device=device)
    torch.ne(ordered[1:], ordered[:-1], out=new[1:])
    torch.cumsum(new, 0, out=slot).sub_(1)          # slot of each sorted id
    inverse.scatter_(0, order, slot)
    ids = torch.full((min(n, num_rows + 1),), num_rows, dtype=torch.long, device=device)
    ids.scatter_(0, slot, ordered)                 # equal values to a slot: any writer wins
    # the sentinel is the largest value: present iff the last sorted id is it
    meta = torch.cat((bad.long(), slot[-1:] + 1, ordered[-1:].eq(num_rows).long()))
    return RowBatch(ids, inverse, meta, num_rows, order, slot)


def merge(batches: list, grads: list):
    """One RowBatch for several lookups of the same table, and their gradients summed per id.

    Returns ``(batch, grad, pick)``: ``pick[j]`` is a position in the concatenated slots of the
    lookups where unique id ``j`` came from (to take its gathered row and state).
    """
    num_rows = batches[0].num_rows
    all_ids = torch.cat([b.ids for b in batches])
    merged = unique_ids(all_ids, num_rows)          # sentinel slots merge into one sentinel
    bad = torch.stack([b.meta[0] for b in batches]).amax().reshape(1)
    merged.meta = torch.cat((bad, merged.meta[1:]))  # sentinels are not bad ids
    grad = sum_by_slot(torch.cat(grads), merged)
    # the first place each id was looked up (its rows are equal in every lookup of the step;
    # the first one is taken so that the choice, too, is the same on every run)
    pick = torch.zeros(merged.capacity, dtype=torch.long, device=all_ids.device)
    pick.scatter_reduce_(0, merged.inverse, torch.arange(all_ids.numel(), device=all_ids.device),
                         "amin", include_self=False)
    return merged, grad, pick


def sums_in_fixed_order(grad: torch.Tensor, deterministic: bool = True) -> bool:
    """Whether :func:`sum_by_slot` sums ``grad`` with :func:`nbtools.kernels.segment_sum`
    (which can check the sums for inf/nan as it writes them: its ``found``)."""
    return grad.device.type == "cuda" and deterministic and kernels.usable_on(grad.device) \
        and not (torch.is_grad_enabled() and grad.requires_grad)


def sum_by_slot(grad: torch.Tensor, batch: RowBatch, deterministic: bool = True,
                out: torch.Tensor | None = None,
                found: torch.Tensor | None = None) -> torch.Tensor:
    """``[capacity, d]``: the rows of ``grad`` [n, d] (one per position of the lookup) summed per
    unique id, ``out[batch.inverse[j]] += grad[j]``: the gradient of a lookup's unique rows.

    On the CPU this is ``index_add_``, which adds in position order. On CUDA ``index_add_``
    adds with atomics, in an order that changes from run to run (the last bits of a row
    whose id repeats differ between two identical runs); here each id's rows are summed in a
    fixed order instead, by :func:`nbtools.kernels.segment_sum` over the lookup's sorted
    positions (the sort its deduplication made already), or, without Triton, by torch's
    embedding backward (sort-based, deterministic). ``deterministic=False`` (CUDA): the
    atomics, kept as a fast path to compare with (``OffloadConfig(deterministic=False)``).
    Where the sum must stay differentiable (a backward with ``create_graph=True``) it is
    ``index_add``, atomics included. ``out``: a [capacity, d] tensor to write (any contents)
    instead of a new one; not with a differentiable sum. ``found``: where the sum is the
    fixed-order kernel's (:func:`sums_in_fixed_order`), set to 1.0 if a sum is inf or nan;
    untouched on the other paths.
    """
    cap = batch.capacity
    if not sums_in_fixed_order(grad, deterministic):
        differentiable = torch.is_grad_enabled() and grad.requires_grad
        if grad.device.type == "cuda" and deterministic and not differentiable:   # no Triton
            got = torch.ops.aten.embedding_dense_backward(grad, batch.inverse, cap, -1, False)
            return got if out is None else out.copy_(got)
        if differentiable:
            return grad.new_zeros(cap, grad.shape[1]).index_add(0, batch.inverse, grad)
        out = grad.new_zeros(cap, grad.shape[1]) if out is None else out.zero_()
        return out.index_add_(0, batch.inverse, grad)
    order, slot = batch.order, batch.slot
    if order is None:                   # a batch made elsewhere (a disk table's): sort here
        slot, order = torch.sort(batch.inverse, stable=True)
    if out is None:
        out = grad.new_empty(cap, grad.shape[1])     # every row written (no memset)
    return kernels.segment_sum(grad, order, slot, out, found)


@dataclasses.dataclass
class _WriteBack:
    """A step's rows on their way back to host memory (:meth:`RowStore.write_behind`): its
    unique ids and count, the updated rows in GPU memory, the event that ends the write, the
    stream the step ran on, and the lookup captures whose outputs these are."""

    ids: torch.Tensor
    count: torch.Tensor
    rows: torch.Tensor
    event: object
    stream: object
    captures: list


class DeviceRows:
    """A table's rows held on the GPU (``placement="gpu"``): what :class:`HostTensor` is for
    host rows, with the same attributes, so a RowStore treats both alike."""

    pinned = False

    def __init__(self, shape, dtype, device, name: str = "tensor"):
        self.name = name
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def view(self) -> torch.Tensor:
        return self.tensor

    def close(self) -> None:
        pass

    def __repr__(self):
        return (f"DeviceRows(name={self.name!r}, shape={tuple(self.tensor.shape)}, "
                f"dtype={self.tensor.dtype}, device={self.tensor.device})")


class RowStore:
    """The rows of a 2-D table as the compute device reaches them (see the module docs).

    ``idx`` arguments are on the compute device. Bytes that cross PCIe are counted.

    >>> from nbtools.hostmem import HostTensor
    >>> store = RowStore(HostTensor((5, 2), name="demo"), torch.device("cpu"))
    >>> store.scatter(torch.tensor([1, 3]), torch.ones(2, 2))
    >>> store.gather(torch.tensor([3])).tolist()
    [[1.0, 1.0]]
    """

    def __init__(self, host, device: torch.device):
        self.host = host
        self.device = torch.device(device)
        if isinstance(host, DeviceRows):
            self.mode = "gpu"
        elif self.device.type == "cuda":
            self.mode = "zero-copy" if host.pinned else "staged"
        else:
            self.mode = "host"
        shape = host.tensor.shape
        self.width = int(shape[1]) if len(shape) > 1 else 1
        self.row_bytes = (int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1) \
            * host.tensor.element_size()
        self.cache: RowCache | None = None
        self.write_behind_ok = True   # False: updates always write the rows themselves
        self._back: _WriteBack | None = None     # the last write-back queued
        self._older = None        # event: every write-back queued before it is done
        self._put_stream = None

    # --- what a table asks of its rows, whatever tier holds them (the disk tier's store,
    # nbtools.disk.store.DiskStore, answers otherwise) ---------------------------------------------
    keeps_host_ids = False   # lookups deduplicate ids on the CPU (ids stay where they are)

    @property
    def kind(self) -> str:
        """How the compute device reaches the rows: the table's ``transfer_mode``."""
        return self.mode

    def step_queued(self) -> None:
        """The optimizer took the table's lookups; their update is queued next."""

    def current_for(self, disk) -> bool:
        """Whether this store still serves the table's rows (a disk table's changes when its
        RAM cache grows or gets a GPU cache above it)."""
        return True

    def read_ahead(self, ids, padding_idx=None) -> bool:
        """Start reading the rows of a coming step where the tier reads ahead itself
        (False: it does not; the table's prefetch gathers them instead)."""
        return False

    def rows_now(self, keep_cache: bool) -> torch.Tensor:
        """Every row ``[N, width]``, current (written back from caches and write-backs in
        flight; the cache emptied unless ``keep_cache``)."""
        if self.mode != "gpu":
            self.settle()           # lookups stop patching from write-backs in flight
            self.flush(drop=not keep_cache)
            synchronize(self.device)
        return self.host.tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the rows where they live."""
        return self.host.nbytes

    @property
    def ram_bytes(self) -> int:
        """Host RAM the rows take."""
        return 0 if self.mode == "gpu" else self.host.nbytes

    def close(self) -> None:
        """Write everything back and release the memory's pinning."""
        if self.mode != "gpu":
            self.flush()
            synchronize(self.device)
        self.host.close()

    def __getstate__(self) -> dict:
        # Write-backs in flight belong to this process's CUDA work: a copy waits for them.
        if self._back is not None:
            self.settle()
            synchronize(self.device)
        state = dict(self.__dict__)
        state.update(_back=None, _older=None, _put_stream=None)
        return state

    def attach_cache(self, capacity: int, ways: int = 32) -> RowCache:
        """Keep up to ``capacity`` hot rows in a GPU cache (zero-copy stores; host stores on
        the CPU too, where it only exercises the same logic)."""
        if self.mode not in ("zero-copy", "host"):
            raise ValueError(f"a cache of hot rows needs rows in pinned host memory, not "
                             f"{self.mode!r}")
        self.settle()
        self.flush()
        self.cache = RowCache(self.host.view(), capacity, ways)
        return self.cache

    def flush(self, drop: bool = True) -> None:
        """Write the cached rows back to host memory (and, with ``drop``, empty the cache):
        before the host rows are read or written from outside a step."""
        if self.cache is not None:
            self.settle()
            self.cache.flush(self.host.view(), drop)

    # --- write-behind ---------------------------------------------------------------------
    # Smaller write-backs are written by the update itself: a step that small is bound by the
    # host's Python, which queueing a write-back costs more (~0.1 ms) than its link time
    # saves (4,096 ids of 1,536 B: 1.11x the step's time; 16,384 ids: 0.79x; 65,536: 0.85x;
    # write_behind.py (git show dc87be8:benchmarks/experiments/write_behind.py) --sizes).
    WRITE_BEHIND_MIN_BYTES = 8 << 20

    def can_write_behind(self, rows: torch.Tensor, forced: bool = False) -> bool:
        """Whether updated ``rows`` (a step's gathered ``[weight | state...]`` rows, updated
        in place) can be written back behind the next step: a zero-copy store without a
        cache, and at least :attr:`WRITE_BEHIND_MIN_BYTES` of rows (``forced``: any size, and
        a CPU store too, where the write-back runs at once: tests)."""
        return (self.mode == "zero-copy" or (forced and self.mode == "host")) \
            and self.write_behind_ok and self.cache is None and rows.dtype == self.host.tensor.dtype \
            and rows.dim() == 2 and rows.shape[1] == self.width and rows.stride(1) == 1 \
            and (forced or rows.shape[0] * self.row_bytes >= self.WRITE_BEHIND_MIN_BYTES) \
            and kernels.usable_on(self.device)

    def write_behind(self, batch: RowBatch, rows: torch.Tensor, captures=()) -> None:
        """Write ``rows`` ([capacity, width], GPU memory: the step's gathered rows, which its
        fused update has updated in place) to the table's rows ``batch.ids``, on a side stream
        once the work queued so far is done, without making the current stream wait. The
        grid is small (:data:`kernels.WRITE_BEHIND_PROGRAMS`): the write keeps the link busy
        and leaves the SMs to the next step's kernels. ``captures``: the lookup captures whose
        outputs ``batch`` and ``rows`` are; their next replay waits for this write, and the
        write itself replays as a CUDA graph of the capture's (a Triton launch costs the host
        more than the rest of the write-back together)."""
        captures = [c for c in captures if c is not None]
        view = self.host.view()

        def put():
            kernels.put_rows(view, batch.ids, batch.count, rows,
                             programs=kernels.WRITE_BEHIND_PROGRAMS)
        if self.device.type != "cuda":
            put()
            self._older, self._back = None, _WriteBack(batch.ids, batch.count, rows, None,
                                                        None, [])
            return
        main = streams.current(self.device)
        if self._put_stream is None:
            self._put_stream = torch.cuda.Stream(self.device)
        side = self._put_stream
        side.wait_stream(main)
        own = _own_outputs(captures, batch, rows)
        with streams.entered(side):
            if own is not None:
                own.graphed("put", put)
            else:
                put()
        event = torch.cuda.Event()
        event.record(side)
        if own is None:
            for t in (batch.ids, batch.meta, rows):
                t.record_stream(side)     # eager lookups' tensors: not reused before it ends
        for cap in captures:
            cap.free.append(event)
        if self._back is not None:
            self._older = self._back.event     # one stream: it ends every write before it
        self._back = _WriteBack(batch.ids, batch.count, rows, event, main, captures)

    def patches_from(self, cap, stream) -> bool:
        """Whether lookups on the stream that queued the last write-back may still patch from
        the outputs of lookup capture ``cap`` (the write-back's own rows and ids), where
        ``stream`` is another one: a replay of ``cap`` there must not overwrite them."""
        back = self._back
        return back is not None and back.event is not None and stream != back.stream and \
            any(c is cap for c in back.captures)

    @property
    def write_back_queued(self) -> bool:
        """Whether the last update wrote behind (its write-back queued on a stream) and no
        :meth:`settle` has ordered the current stream after it yet."""
        return self._back is not None

    def writing(self, ids: torch.Tensor) -> bool:
        """Whether the last write-back queued is of the rows ``ids`` (that very tensor)."""
        return self._back is not None and self._back.ids is ids

    def settle(self) -> None:
        """Order the current stream after every write-back queued (no host synchronisation):
        what it queues next reads and writes the host rows as they are. On the stream that
        queued them, lookups stop patching from them."""
        back = self._back
        if back is None:
            return
        if back.event is not None:
            current = streams.current(self.device)
            current.wait_event(back.event)
            if current != back.stream:     # (a prefetch's side stream): the main one has not
                return
        self._back = self._older = None

    def before_gather(self, overwrites=(), after=None) -> bool:
        """Before a lookup gathers host rows: whether it must then :meth:`patch` them from
        the last write-back. Orders the current stream after every other write-back, or after
        all of them where the lookup cannot patch (another stream, a cache, or a lookup
        capture in ``overwrites`` holds the last write-back's rows). ``after``: a stream the
        current one was ordered after just before (a prefetch's side stream after the main
        one): where the write-back was queued on it, the update whose rows it writes is
        done before the gather too, and the lookup patches beside the write-back."""
        back = self._back
        if back is None:
            return False
        if back.event is None:           # CPU: written already; patching changes nothing
            return self.cache is None
        current = streams.current(self.device)
        if self.cache is not None or (current != back.stream and after != back.stream) or \
                any(c is o for c in back.captures for o in overwrites):
            self.settle()
            return False
        if self._older is not None:
            current.wait_event(self._older)
            if current == back.stream:   # (the main stream still waits for it itself)
                self._older = None
        return True

    def patch(self, batch: RowBatch, out: torch.Tensor, start: int = 0,
              capture=None, aside: bool = False) -> None:
        """Rows of ``batch`` the last write-back holds, taken from its GPU copy into ``out``
        (columns ``start:`` of the rows): the host copy of them may still be on its way.
        ``capture``: the lookup capture whose outputs ``batch`` and ``out`` are; between two
        captures' outputs the patch replays as a CUDA graph. ``aside``: the captures the
        write-back's rows belong to may next be replayed on another stream without waiting
        for this one (:meth:`patched_aside`); so may a dedup's alone (a prefetch of host
        ids), whatever the caller says."""
        back = self._back
        if back is None:
            return
        src = back.rows[:, start:start + out.shape[1]]

        def run():
            kernels.patch_rows(out, batch.ids, batch.count, self.num_rows, src, back.ids,
                               back.count)
        own = _own_outputs([capture] if capture is not None else [], batch, out)
        source = _own_outputs(back.captures, back.ids, back.rows)
        if own is not None and source is not None and start == 0:
            own.graphed(("patch", id(source)), run)
        else:
            run()
        if aside or any(c.rows is None for c in back.captures):
            self.patched_aside()

    def patched_aside(self) -> None:
        """A :meth:`patch` from the last write-back's rows ran where the lookup captures those
        rows belong to may next be replayed on another stream (it ran on a stream other than
        the one that queued the write-back, or the rows' ids are a dedup's alone, from a
        prefetch of host ids, whose next dedup replays on the side stream without waiting
        for the main one): they wait for it before their next replay, as they wait for the
        write-back itself."""
        back = self._back
        if back is None or back.event is None:      # (the CPU: written already, in order)
            return
        current = streams.current(self.device)
        if back.captures:
            LookupGraphs.read_here(back.captures, current)
        elif current != back.stream:    # an eager lookup's tensors: kept until this stream
            for t in (back.ids, back.count, back.rows):     # is done (the one that queued
                t.record_stream(current)                    # the write-back orders itself)

    @property
    def num_rows(self) -> int:
        return self.host.tensor.shape[0]

    @property
    def direct(self) -> bool:
        """The compute device indexes the rows itself (zero-copy or GPU-placed)."""
        return self.mode in ("zero-copy", "gpu")

    def _cols(self, tensor: torch.Tensor, start: int, stop):
        if start == 0 and stop is None:
            return tensor
        return tensor[:, start:stop]

    def view(self) -> torch.Tensor:
        """The rows as the compute device indexes them (a zero-copy CUDA view of host memory,
        the GPU tensor, or the host tensor): what fused kernels read and write."""
        return self.host.view()

    def count_bytes(self, nbytes: int, h2d: bool) -> None:
        """Add bytes that crossed PCIe to nbtools' transfer counters (not for GPU rows)."""
        if self.mode != "gpu":
            count_transfer(h2d=nbytes) if h2d else count_transfer(d2h=nbytes)

    def gather(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor:
        """Rows ``idx`` (columns ``start:stop``) on the compute device; every id in range."""
        self.settle()
        if self.cache is not None:     # (ids past the host rows address the cache's: a disk
            rows = self._gather_host(idx.clamp(max=self.num_rows - 1), start, stop)  # table's)
            return self._from_cache(rows, self.cache.locate(idx), start, stop)
        return self._gather_host(idx, start, stop)

    def _from_cache(self, rows, slots, start, stop):
        hot = slots >= 0              # (the torch path: a host sync)
        rows[hot] = self._cols(self.cache.rows, start, stop)[slots[hot].long()].to(rows.dtype)
        return rows

    def _gather_host(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor:
        if self.mode == "host":
            return self._cols(self.host.tensor, start, stop).index_select(0, idx)
        width = (stop if stop is not None else self.width) - start
        self.count_bytes(idx.numel() * width * self.host.tensor.element_size(), h2d=True)
        if self.direct:
            return gather_rows(self._cols(self.host.view(), start, stop), idx)
        return self._cols(self.host.tensor, start, stop).index_select(0, idx.cpu()).to(self.device)

    def gather_batch(self, batch: RowBatch, start: int = 0, stop=None,
                     admit: bool = False, programs: int | None = None,
                     into: torch.Tensor | None = None, written: str = "patch") -> torch.Tensor:
        """Rows of a :class:`RowBatch`: [capacity, width]; rows of unused slots and of the
        sentinel are zeros. No host synchronisation where the kernels run (CUDA + Triton).
        ``admit``: a training lookup, whose rows the cache (if any) counts and may admit.
        ``programs``: caps the gather kernel's grid (:func:`kernels.gather_rows`); rows read
        from pinned host memory default to :func:`kernels.zero_copy_programs`. ``into``:
        write the rows into this [capacity, width] tensor and return it, leaving the rows of
        unused slots and of the sentinel as they were. ``written``: how rows still being
        written back (:meth:`write_behind`) are read: "patch" (from their GPU copy where
        this stream can, else after waiting), "wait", or "ignore" (inside a CUDA graph
        capture: the caller sees to it)."""
        stop = self.width if stop is None else stop
        patch = False
        if written == "patch":
            patch = self.before_gather()
        elif written == "wait":
            self.settle()
        rows = self._gather_batch(batch, start, stop, admit, programs, into)
        if patch:
            self.patch(batch, rows, start)
        return rows

    def _gather_batch(self, batch, start, stop, admit, programs, into):
        slots = None
        if self.cache is not None:
            slots = (self.cache.admit(batch.ids, batch.count, self.host.view()) if admit
                     else self.cache.locate(batch.ids))
        if (self.direct or slots is not None) and kernels.usable_on(self.device):
            out = into if into is not None else torch.empty(
                batch.capacity, stop - start, dtype=self.host.tensor.dtype, device=self.device)
            if slots is None:
                # bytes estimated from capacity: the exact count is on the GPU (a sync to
                # read); with a cache they are counted from its statistics at the step
                itemsize = self.host.tensor.element_size()
                self.count_bytes(batch.capacity * (stop - start) * itemsize, h2d=True)
            if programs is None and self.mode == "zero-copy":
                programs = kernels.zero_copy_programs(self.device, cached=slots is not None)
            return kernels.gather_rows(self.host.view(), batch.ids, batch.count, out, start,
                                       None if slots is None else self.cache.rows, slots,
                                       programs, keep=into is not None,
                                       num_rows=batch.num_rows)
        # torch path: the sentinel reads row 0 and is zeroed after (it is at most one slot per
        # unique value, and ids past count repeat it). It is batch.num_rows, which is past
        # every row here (a disk table's RAM slots are fewer than its rows).
        safe = batch.ids.clamp(max=self.num_rows - 1)
        rows = self._gather_host(safe, start, stop)
        if slots is not None:
            rows = self._from_cache(rows, slots, start, stop)
        unused = (batch.ids >= batch.num_rows).unsqueeze(1)
        if into is not None:
            return into.copy_(torch.where(unused, into, rows))
        return rows.masked_fill_(unused, 0)

    def target(self, ids: torch.Tensor, layout: RowLayout, rounding: str = "nearest",
               num_rows: int | None = None) -> kernels.Target:
        """Where a fused update of the rows ``ids`` writes: the table's view (and its weights as
        ``layout`` stores them) and, with a cache, the cache and each id's slot in it.
        ``num_rows``: the batch's sentinel (ids below it are rows)."""
        self.settle()
        view = self.host.view()
        t = kernels.Target(view, layout.weight(view), layout.weight_cols, rounding=rounding,
                           num_rows=num_rows)
        if self.cache is not None:
            t.cache, t.cache_w = self.cache.rows, layout.weight(self.cache.rows)
            t.slots = self.cache.locate(ids)
        return t

    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Write whole rows ``idx`` (every id in range); cached rows go to the cache."""
        self.settle()
        if self.cache is not None:
            slots = self.cache.locate(idx)
            hot = slots >= 0              # (the generic path has synchronised already)
            self.cache.rows[slots[hot].long()] = rows[hot].to(self.cache.rows.dtype)
            idx, rows = idx[~hot], rows[~hot]
        if self.mode == "host":
            self.host.tensor.index_copy_(0, idx, rows)
            return
        self.count_bytes(idx.numel() * self.row_bytes, h2d=False)
        if self.direct:
            scatter_rows(self.host.view(), idx, rows)
        else:
            self.host.tensor.index_copy_(0, idx.cpu(), rows.cpu())


def _own_outputs(captures, batch, rows):
    """The one capture whose outputs ``batch`` (a RowBatch, or its ids) and ``rows`` are, or
    None."""
    if len(captures) != 1:
        return None
    cap = captures[0]
    ids = batch.ids if isinstance(batch, RowBatch) else batch
    return cap if cap.rows is rows and cap.batch.ids is ids else None


class _Captured:
    """One captured lookup of ``n`` ids: static input, outputs, whether a pending lookup
    still holds its outputs, when it was released, and ``free``: events after the work that
    reads its outputs, which its next replay waits for. That work is a write-back behind the
    next step (:meth:`RowStore.write_behind`) and, for a dedup alone (``rows`` None, a
    prefetch of host ids, replayed on a side stream without waiting for the main one), the
    main stream's reads of its ids."""

    def __init__(self, graph, flat, batch, rows):
        self.graph, self.flat, self.batch, self.rows = graph, flat, batch, rows
        self.in_use = False
        self.released = 0
        self.free = []            # events: the work that reads its outputs is done
        self.graphs = {}          # work on its outputs, as CUDA graphs (graphed)

    def graphed(self, key, fn) -> None:
        """Run ``fn`` (kernels on this capture's outputs, and on other captures' outputs
        named in ``key``) on the current stream: eagerly the first time (so its kernels are
        compiled), captured as a CUDA graph the second, replayed after that. A capture that
        fails leaves that work eager from then on (slower, not wrong)."""
        got = self.graphs.get(key)
        if got is None or got == "eager":
            self.graphs[key] = got or "seen"
            fn()
            return
        if got == "seen":
            try:
                got = self.graphs[key] = _capture_work(fn)
            except RuntimeError:
                after_failed_capture()
                self.graphs[key] = "eager"
                fn()
                return
        got.replay()


def _capture_work(fn) -> "torch.cuda.CUDAGraph":
    """``fn``'s kernels as a CUDA graph, captured on a side stream (capture_begin/end, not
    torch.cuda.graph(), which empties the allocator's cache)."""
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream(main.device)
    side.wait_stream(main)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    main.wait_stream(side)
    return graph


class LookupGraphs:
    """CUDA graphs of a table's training lookup (deduplicate + gather), one per batch size.

    A lookup is ~20 small kernels; replaying them as one graph takes the CPU ~15 µs instead of
    ~0.3 ms, which is most of a small step. A batch size is captured once it has been seen
    ``after`` times (the last, partial batch of an epoch is never captured), at most
    ``max_shapes`` sizes per table, ``copies`` captures per size (a table looked up twice in
    a step uses two; a third lookup of the same size runs eagerly). The outputs of a capture
    are reused by its next replay, so a capture is handed out only when no pending lookup
    holds it; the optimizer's step releases them (:meth:`release`).
    """

    def __init__(self, after: int = 2, max_shapes: int = 4, copies: int = 2):
        self.after, self.max_shapes, self.copies = after, max_shapes, copies
        self._seen = {}
        self._graphs = {}
        self._key = None

    def __getstate__(self) -> dict:
        # Captures are a cache of this process's CUDA graphs: a copy (deepcopy, pickle)
        # starts without them and captures its own.
        return {"after": self.after, "max_shapes": self.max_shapes, "copies": self.copies}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def captured(self) -> int:
        """How many captures the table holds now, over every batch size."""
        return sum(len(caps) for caps in self._graphs.values())

    @property
    def shapes_seen(self) -> int:
        """How many lookup shapes (batch size, width) were counted since the last
        :meth:`invalidate`, captured or not yet seen ``after`` times."""
        return len(self._seen)

    def invalidate(self) -> None:
        """Forget every capture (the table's memory moved)."""
        self._graphs.clear()
        self._seen.clear()

    def run(self, store: "RowStore", flat: torch.Tensor, padding_idx, width: int | None,
            after=None):
        """``(batch, rows, capture)`` from a graph, or None where the lookup must run eagerly.
        ``width`` None: the dedup alone (``rows`` is None). ``after``: a prefetch's, the
        main stream its side stream was ordered after (:meth:`RowStore.before_gather`); it
        may keep one copy more, so that it need not wait for the capture whose rows the last
        write-back still reads."""
        key = (id(store.host), flat.numel(), width, flat.device)
        if self._key != key[0]:
            self.invalidate()
            self._key = key[0]
        caps = self._graphs.get(key)
        if caps is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen <= self.after or len(self._graphs) >= self.max_shapes:
                return None
            caps = self._graphs[key] = []
        current = streams.current(flat.device)
        # Not a capture whose outputs the last write-back holds where this replay runs on
        # another stream (a prefetch's): lookups on the write-back's stream may still patch
        # from them (before_gather), and nothing orders them before such a replay.
        free = [c for c in caps if not c.in_use and not store.patches_from(c, current)]
        # The capture released longest ago: its replay waits for the last work that reads
        # its outputs (cap.free), by then all but always done; while it is not, one more copy
        # is captured (a dedup alone keeps one copy more: see _Captured).
        copies = self.copies + (width is None) + (after is not None)
        cap = min(free, key=lambda c: c.released) if free else None
        if cap is None or (len(caps) < copies and not all(e.query() for e in cap.free)):
            if len(caps) >= copies:
                return None
            try:
                cap = self._capture(store, flat, padding_idx, width)
            except RuntimeError:        # this batch size runs eagerly (slower, not wrong)
                after_failed_capture()
                if not caps:
                    del self._graphs[key]
                    self._seen[key] = -(1 << 62)    # never counted as seen enough again
                return None
            caps.append(cap)
        patch = width is not None and store.before_gather(overwrites=(cap,), after=after)
        for event in cap.free:
            current.wait_event(event)
        cap.free = []
        cap.flat.copy_(flat)
        cap.graph.replay()
        if patch:    # read beside the main stream (a prefetch): the captures whose rows it
            # read are not replayed before it is done
            store.patch(cap.batch, cap.rows, capture=cap,
                        aside=after is not None and current != after)
        cap.in_use = True
        if store.cache is None and cap.rows is not None:   # else counted from cache statistics
            store.count_bytes(cap.rows.numel() * cap.rows.element_size(), h2d=True)
        return cap.batch, cap.rows, cap

    @staticmethod
    def _capture(store, flat, padding_idx, width) -> _Captured:
        static = flat.clone()
        n = store.num_rows

        def lookup():
            batch = unique_ids(static, n, padding_idx)
            if width is None:
                return batch, None
            return batch, store.gather_batch(batch, 0, width, admit=True, written="ignore")

        side = torch.cuda.Stream(flat.device)
        side.wait_stream(torch.cuda.current_stream(flat.device))
        cache = store.cache if width is not None else None     # a dedup admits nothing
        if cache is not None:
            kept = [(t, t.clone()) for t in (cache.stats, cache.tick, cache.stamp)]
        with torch.cuda.stream(side):           # warm-up: kernels compiled, workspaces sized
            lookup()
            lookup()
        torch.cuda.current_stream(flat.device).wait_stream(side)
        if cache is not None:
            # The warm-ups are not lookups of the model's: their statistics, their ticks and
            # their counts of the batch's rows are taken back (the rows they admitted stay,
            # as if admitted a little early; every row's value is where it was).
            for t, before in kept:
                t.copy_(before)
            batch = unique_ids(static, n, padding_idx)
            live = (torch.arange(batch.capacity, device=flat.device) < batch.count) & \
                (batch.ids < n)
            cache.freq.index_add_(0, batch.ids, -2 * live.int())
        graph = torch.cuda.CUDAGraph()
        # the capture on a stream of this table's device: torch.cuda.graph's default capture
        # stream is made once per process, on whichever device was current then
        with torch.cuda.graph(graph, stream=side):
            batch, rows = lookup()
        return _Captured(graph, static, batch, rows)

    _releases = 0

    @staticmethod
    def read_here(captures, stream) -> None:
        """``stream`` reads the outputs of lookup ``captures`` up to the work queued on it so
        far: their next replay, on whatever stream, waits for that (an event, ``cap.free``)."""
        event = torch.cuda.Event()
        event.record(stream)
        for cap in captures:
            cap.free.append(event)

    @classmethod
    def release(cls, captures) -> None:
        for cap in captures:
            if cap is not None:
                cap.in_use = False
                cls._releases += 1
                cap.released = cls._releases
                if cap.rows is None:          # a dedup alone: see _Captured
                    LookupGraphs.read_here([cap], streams.current(cap.flat.device))
