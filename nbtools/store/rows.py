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

Caches and write-backs are tiers around a store (:mod:`nbtools.store.tiers`): a
:class:`~nbtools.store.tiers.Cached` store keeps hot rows in GPU memory above any tier, and a
:class:`~nbtools.store.tiers.WriteBehind` store writes a step's rows back behind the next step.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .. import kernels
from .cache import RowCache
from .layout import RowLayout
from .whole import WholeRows
from ..devices import synchronize
from ..hostmem import HostTensor, count_transfer, gather_rows, scatter_rows


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
    # records `inverse` on the main one, and with it the other two), each on a 16-byte
    # boundary whatever n: Triton compiles a kernel once per alignment of its pointers
    maps = torch.empty(3, n + (n & 1), dtype=torch.long, device=device)
    inverse, order, slot = maps[0, :n], maps[1, :n], maps[2, :n]
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
    return grad.device.type == "cuda" and deterministic \
        and kernels.usable_on(grad.device, "segsum") \
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


def new_memory(shape, dtype: torch.dtype, device: torch.device, on_gpu: bool, pin: bool,
               name: str):
    """Zero-filled memory for ``shape`` rows: on the GPU (:class:`DeviceRows`, ``on_gpu``), or
    host memory, pinned where ``pin`` and ``device`` is a CUDA device (which then reads it
    zero-copy)."""
    if on_gpu:
        return DeviceRows(shape, dtype, device, name)
    cuda = device.type == "cuda"
    return HostTensor(shape, dtype, pin=pin and cuda, name=name, device=device if cuda else None)


class RowStore:
    """The rows of a 2-D table as the compute device reaches them, where they live (see the
    module docs): the plain tier, which a cache of hot rows or a write-back behind the next
    step wraps (:mod:`nbtools.store.tiers`).

    ``idx`` arguments are on the compute device. Bytes that cross PCIe are counted.

    >>> from nbtools.hostmem import HostTensor
    >>> store = RowStore(HostTensor((5, 2), name="demo"), torch.device("cpu"))
    >>> store.scatter(torch.tensor([1, 3]), torch.ones(2, 2))
    >>> store.gather(torch.tensor([3])).tolist()
    [[1.0, 1.0]]
    """

    cache = None             # a cache of hot rows: nbtools.store.tiers.Cached's
    keeps_host_ids = False   # lookups deduplicate ids on the CPU (ids stay where they are)
    disk = None              # a disk table's file and RAM slots (nbtools.disk.store.DiskStore's)

    def __init__(self, host, device: torch.device, used: int | None = None,
                 layout: RowLayout | None = None):
        self.host = host
        self.device = torch.device(device)
        self.layout = layout      # how a row [weight | state...] is stored (a table's rows)
        if used is None and layout is not None:
            used = layout.used
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
        # the rows as a whole (``used``: the columns a row uses, without the padding of rows
        # in memory), and which of them changed since a checkpoint
        self._whole = WholeRows(host.tensor, self.width if used is None else used,
                                getattr(host, "name", "rows"), self.device) \
            if self.in_memory else None     # (a disk tier's rows as a whole are its file's)

    # --- what a table asks of its rows, whatever tier holds them ----------------------------
    @property
    def base(self) -> "RowStore":
        """The plain tier at the bottom of a stack of tiers: this one."""
        return self

    @property
    def kind(self) -> str:
        """How the compute device reaches the rows: the table's ``transfer_mode``."""
        return self.mode

    def step_queued(self) -> None:
        """The optimizer took the table's lookups; their update is queued next."""

    def current_for(self, disk, cache=None) -> bool:
        """Whether this store (with ``cache`` above it) still serves the table's rows (a disk
        table's changes when its RAM cache grows or gets a GPU cache above it)."""
        return True

    def read_ahead(self, ids, padding_idx=None) -> bool:
        """Start reading the rows of a coming step where the tier reads ahead itself
        (False: it does not; the table's prefetch gathers them instead)."""
        return False

    def attach_cache(self, capacity: int) -> bool:
        """Give the rows a GPU cache of ``capacity`` rows where the tier keeps one of
        its own (False: it does not; the table stacks a :class:`~nbtools.store.tiers.Cached`
        around it instead)."""
        return False

    # --- what the table and its cache ask instead of which tier this is -------------------
    # Whether every row is in memory addressed as one tensor (host RAM or the GPU), not in a
    # file under RAM slots (a disk table's, written as a whole through :meth:`whole`).
    in_memory = True
    # Whether the tier keeps a cache of hot rows of its own (a disk table: RAM slots, and the
    # GPU level :meth:`attach_cache` adds, its maps in host RAM), which :meth:`warm_rows` fills
    # before any optimizer attaches, rather than a stacked :class:`~nbtools.store.cache.RowCache`.
    own_cache = False

    def cache_cost(self, num_rows: int) -> tuple[int, int]:
        """GPU bytes a cache of hot rows over these ``num_rows`` rows takes: ``(fixed, per
        cached row)``: a :class:`~nbtools.store.cache.RowCache`'s row -> slot map and its
        slots (a tier with a cache of its own answers for it)."""
        return RowCache.overhead_bytes(num_rows), RowCache.slot_bytes(self.row_bytes)

    def warm_rows(self, counts: torch.Tensor) -> bool:
        """Load the rows of the highest ``counts`` now into the tier's own cache; False where
        it keeps none (a stacked cache is warmed through its counts)."""
        return False

    @torch.no_grad()
    def init_normal(self, padding_idx) -> None:
        """``nn.Embedding``'s initialisation of every row, N(0, 1), the padding row zero. Pinned
        rows are drawn on the GPU (its generator, as ``nn.Embedding(device="cuda")`` would) and
        written over PCIe, ~50x faster than the single CPU thread of ``Tensor.normal_``."""
        rows = self.host.view()
        rows.normal_()
        if padding_idx is not None:
            rows[padding_idx].zero_()
        if rows.is_cuda and self.mode != "gpu":
            synchronize(self.device)      # the host copy is read from now on

    def describe(self) -> str:
        """What ``repr(table)`` adds about where the rows live (nothing: its placement says)."""
        return ""

    def rows_now(self, keep_cache: bool) -> torch.Tensor:
        """Every row ``[N, width]``, current (written back from caches and write-backs in
        flight; the cache emptied unless ``keep_cache``). Without ``keep_cache`` they are
        handed out to be written: every row counts as changed since the last checkpoint."""
        if self.mode != "gpu":
            synchronize(self.device)
        if not keep_cache:
            self._whole.all_changed()
        return self.host.tensor

    # --- the table as a whole (nbtools.store.whole) -----------------------------------------
    def whole(self, writes: bool = False) -> WholeRows:
        """The rows as a whole (:class:`~nbtools.store.whole.WholeRows`), current: read or
        write ranges and rows as stored, and the rows changed since a checkpoint. The tiers
        around this one first write back what they hold (``writes``: and empty their cache,
        since the face's writes go below it)."""
        if self.mode != "gpu":
            synchronize(self.device)
        return self._whole

    def written(self, ids: torch.Tensor) -> None:
        """A step's update of rows ``ids`` (its unique ids, padded with the sentinel) is
        queued next: they count as changed."""
        self._whole.written(ids)

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
            synchronize(self.device)
        self.host.close()

    def flush(self, drop: bool = True) -> None:
        """Write rows held above the host rows back to them (and, with ``drop``, let go of
        them): before the host rows are read or written from outside a step. The plain tier
        holds none."""

    # --- writing behind (nbtools.store.tiers.WriteBehind); the plain tier writes in place ---
    def can_write_behind(self, rows: torch.Tensor, forced: bool = False) -> bool:
        """Whether a step's updated ``rows`` can be written back behind the next step."""
        return False

    def settle(self) -> None:
        """Order the current stream after every write-back queued: none here."""

    @property
    def write_back_queued(self) -> bool:
        """Whether a write-back is queued that no :meth:`settle` has ordered the stream after."""
        return False

    def writing(self, ids: torch.Tensor) -> bool:
        """Whether the last write-back queued is of the rows ``ids``."""
        return False

    def patches_from(self, cap, stream) -> bool:
        """Whether lookups may still patch from lookup capture ``cap``'s outputs."""
        return False

    def before_gather(self, overwrites=(), after=None) -> bool:
        """Before a lookup gathers: whether it must then :meth:`patch` its rows."""
        return False

    def patch(self, batch: RowBatch, out: torch.Tensor, start: int = 0,
              capture=None, aside: bool = False) -> None:
        """Take rows still being written back from their GPU copy: none here."""

    def patched_aside(self) -> None:
        """See :meth:`nbtools.store.tiers.WriteBehind.patched_aside`: nothing here."""

    # --- the rows ---------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.host.tensor.shape[0]

    @property
    def direct(self) -> bool:
        """The compute device indexes the rows itself (zero-copy or GPU-placed)."""
        return self.mode in ("zero-copy", "gpu")

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
        if self.mode == "host":
            return cols(self.host.tensor, start, stop).index_select(0, idx)
        width = (stop if stop is not None else self.width) - start
        self.count_bytes(idx.numel() * width * self.host.tensor.element_size(), h2d=True)
        if self.direct:
            return gather_rows(cols(self.host.view(), start, stop), idx)
        return cols(self.host.tensor, start, stop).index_select(0, idx.cpu()).to(self.device)

    def gather_batch(self, batch: RowBatch, start: int = 0, stop=None,
                     admit: bool = False, programs: int | None = None,
                     into: torch.Tensor | None = None, written: str = "patch",
                     cached=None) -> torch.Tensor:
        """Rows of a :class:`RowBatch`: [capacity, width]; rows of unused slots and of the
        sentinel are zeros. No host synchronisation where the kernels run (CUDA + Triton).
        ``admit``: a training lookup, whose rows a cache (if any) counts and may admit.
        ``programs``: caps the gather kernel's grid (:func:`kernels.gather_rows`); rows read
        from pinned host memory default to :func:`kernels.zero_copy_programs`. ``into``:
        write the rows into this [capacity, width] tensor and return it, leaving the rows of
        unused slots and of the sentinel as they were. ``written``: how rows still being
        written back are read (:meth:`nbtools.store.tiers.WriteBehind.gather_batch`).
        ``cached``: ``(rows, slots)`` of a cache of hot rows above this tier (each id's slot
        in it, -1: read here), which the gather reads from instead."""
        stop = self.width if stop is None else stop
        cache_rows, slots = cached if cached is not None else (None, None)
        if (self.direct or slots is not None) and kernels.usable_on(self.device, "rows"):
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
                                       cache_rows, slots, programs, keep=into is not None,
                                       num_rows=batch.num_rows)
        # torch path: the sentinel reads row 0 and is zeroed after (it is at most one slot per
        # unique value, and ids past count repeat it). It is batch.num_rows, which is past
        # every row here (a disk table's RAM slots are fewer than its rows).
        safe = batch.ids.clamp(max=self.num_rows - 1)
        rows = self.gather(safe, start, stop)
        if slots is not None:
            rows = from_cache(rows, cache_rows, slots, start, stop)
        unused = (batch.ids >= batch.num_rows).unsqueeze(1)
        if into is not None:
            return into.copy_(torch.where(unused, into, rows))
        return rows.masked_fill_(unused, 0)

    def target(self, ids: torch.Tensor, layout: RowLayout, rounding: str = "nearest",
               num_rows: int | None = None) -> kernels.Target:
        """Where a fused update of the rows ``ids`` writes: the table's view (and its weights as
        ``layout`` stores them). ``num_rows``: the batch's sentinel (ids below it are rows)."""
        view = self.host.view()
        return kernels.Target(view, layout.weight(view), layout.weight_cols, rounding=rounding,
                              num_rows=num_rows)

    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Write whole rows ``idx`` (every id in range)."""
        self.written(idx)
        if self.mode == "host":
            self.host.tensor.index_copy_(0, idx, rows)
            return
        self.count_bytes(idx.numel() * self.row_bytes, h2d=False)
        if self.direct:
            scatter_rows(self.host.view(), idx, rows)
        else:
            self.host.tensor.index_copy_(0, idx.cpu(), rows.cpu())


def cols(tensor: torch.Tensor, start: int, stop):
    """Columns ``start:stop`` of a 2-D tensor (itself where that is all of them)."""
    if start == 0 and stop is None:
        return tensor
    return tensor[:, start:stop]


def from_cache(rows, cache_rows, slots, start, stop):
    """``rows`` with those a cache holds (``slots`` >= 0) taken from ``cache_rows``."""
    hot = slots >= 0              # (the torch path: a host sync)
    rows[hot] = cols(cache_rows, start, stop)[slots[hot].long()].to(rows.dtype)
    return rows


def grad_scale_rows(weights, rows, name: str, num_rows: int, pin: bool) -> RowStore:
    """The per-row gradient weights of :meth:`nbtools.OffloadedEmbedding.set_grad_scale` for
    table ``name``, checked, as a row store of ``[num_rows, 1]`` in the kind of memory its
    tier ``rows`` keeps (``pin``: the table's option)."""
    if not rows.in_memory:
        raise NotImplementedError(f"table {name!r}: per-row gradient scaling is not "
                                  "supported with placement='disk' yet")
    weights = torch.as_tensor(weights)
    if weights.shape != (num_rows,) or not weights.is_floating_point():
        raise ValueError(f"grad scale for table {name!r} must be a float tensor of shape "
                         f"({num_rows},), got {tuple(weights.shape)} {weights.dtype}")
    if not torch.isfinite(weights).all():
        raise ValueError(f"grad scale for table {name!r} contains non-finite values")
    host = new_memory((num_rows, 1), rows.host.tensor.dtype, rows.device, rows.mode == "gpu",
                      pin, name)
    host.tensor.copy_(weights.reshape(-1, 1))
    return RowStore(host, rows.device)
