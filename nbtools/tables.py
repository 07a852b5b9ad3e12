"""Embedding tables whose rows live in (pinned) host memory.

Each lookup deduplicates the ids on the compute device, gathers only those rows from host memory
(on CUDA: GPU kernels read the pinned rows over PCIe, zero-copy) and returns differentiable rows.
The gathered rows are the leaves autograd sees; :class:`nbtools.OffloadOptimizer` later takes
their gradients, sums them per id and writes updated rows (and optimizer state) back. Step cost
grows with the batch, never with the table.

The full table is ``table.weight``: an ordinary CPU tensor (not an ``nn.Parameter``), so
``model.to("cuda")`` leaves it where it is.

Layout: once an optimizer attaches its per-row state, each host row holds
``[weight | state_1 | ... | state_k]``. A training lookup gathers whole rows, so a step reads and
writes one long row per id instead of k + 1 short ones: on an H100, zero-copy gathers of
1,536-byte rows kept ~48 GB/s on a 23 GiB table where 512-byte rows fell to ~20 GB/s
(benchmarks/RESULTS.md). ``table.weight`` is then a strided view of the first columns.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .devices import resolve_device, synchronize
from .hostmem import HostTensor
from . import kernels
from .precision import LOW_PRECISION, check_rounding
from .units import human_bytes
from .cache import CacheCounts
from .prefetch import Prefetcher
from .placement import (HostMemoryError, NoRoomError, auto_placement, check_fits,  # noqa: F401
                        copy_unless_same, regrow_for_state)
from .rows import (DeviceRows, LookupGraphs, RowBatch, RowLayout, RowStore, merge, sum_by_slot,
                   unique_ids)

# A table warns once when this many lookups wait for an optimizer step: a loop that runs the
# table with autograd on but never steps (evaluation without torch.no_grad) would grow forever.
_PENDING_WARN = 256


def _ids_error_position(flat_bad: torch.Tensor, shape) -> str:
    pos = int(flat_bad.nonzero()[0, 0])
    if len(shape) <= 1:
        return f"position {pos}"
    return f"position {tuple(int(i) for i in np.unravel_index(pos, tuple(shape)))}"


@dataclasses.dataclass
class TableConfig:
    """Options of an offloaded table beyond its shape, name, device and placement."""

    # Storage of the weights. bfloat16/float16 halve the bytes; every update is still computed
    # in float32 (rows are upcast when gathered, rounded once when written).
    dtype: torch.dtype = torch.float32
    # Storage of the optimizer state: None = float32 for low-precision weights (an Adam moment
    # in bf16 loses small updates), else the weights' dtype. bfloat16 here halves it too.
    state_dtype: torch.dtype | None = None
    # How low-precision values are rounded when written: "nearest" (ties to even) or
    # "stochastic" (bfloat16 only: unbiased, so updates below bf16's resolution still count).
    rounding: str = "nearest"
    pin: bool = True               # register host rows with CUDA (zero-copy); False: pageable
    # placement="auto" puts a table on the GPU when its rows and optimizer state take at most
    # this share of the GPU memory free at that moment; the rest of it stays for activations.
    gpu_fraction: float = 0.5
    # Replay each training lookup's ~20 small kernels as one CUDA graph (per batch size seen
    # twice): most of a small step's CPU time. Off: every lookup launches them one by one.
    cuda_graphs: bool = True
    # A GPU cache of hot rows (weight and optimizer state together, nbtools.cache) for a table
    # in pinned host memory: its size in GPU bytes (the rows plus 8 bytes per table row for
    # the row -> slot map and the counts), or a share of the GPU memory free when the
    # optimizer attaches, or room for cache_rows rows. None, None, None: no cache, except under
    # placement="auto" when the table goes to host memory, where the cache takes the
    # gpu_fraction budget.
    cache_bytes: int | None = None
    cache_fraction: float | None = None
    cache_rows: int | None = None
    # Write a step's updated rows back to pinned host memory behind the next step, on a side
    # stream, so the link stays busy while the GPU computes (nbtools.rows, docs/step.md).
    # None: for tables in pinned host memory without a cache of hot rows, updated by a fused
    # kernel, in steps that write at least RowStore.WRITE_BEHIND_MIN_BYTES (8 MiB); False:
    # never (the update writes host memory itself); True: wherever the update is fused, any
    # size, a CPU table too (where the write runs at once: tests use it).
    write_behind: bool | None = None
    # placement="disk": the folder of the table's file (local disk, not a Drive mount; None:
    # nbtools.disk.default_dir(), under the system's temporary folder), and the RAM its cache
    # of hot rows may take (None: nbtools.disk.DEFAULT_HOST_CACHE_BYTES, 1 GiB). The file
    # holds every row with its optimizer state; RAM holds only the cached rows.
    disk_dir: str | None = None
    host_cache_bytes: int | None = None

    @property
    def storage_state_dtype(self) -> torch.dtype:
        """What the optimizer state is stored in (``state_dtype``, or its default)."""
        if self.state_dtype is not None:
            return self.state_dtype
        return torch.float32 if self.dtype in LOW_PRECISION else self.dtype

    def check(self, placement: str) -> None:
        """Raise TypeError / ValueError naming the first field (or ``placement``) that is wrong."""
        dtype = self.dtype
        for what, value in (("dtype", dtype), ("state_dtype", self.state_dtype or dtype)):
            if not (value.is_floating_point if isinstance(value, torch.dtype) else False):
                raise TypeError(f"{what} must be a floating torch.dtype, got {value!r}")
        if dtype not in (torch.float32, torch.float64) + LOW_PRECISION:
            raise TypeError(f"dtype must be float32, float64, bfloat16 or float16, got {dtype}")
        state_dtype = self.storage_state_dtype
        if state_dtype.itemsize < dtype.itemsize or state_dtype.itemsize == dtype.itemsize \
                and state_dtype != dtype:
            raise ValueError(f"state_dtype {state_dtype} with dtype {dtype}: the state may be "
                             f"as wide as the weights or wider (e.g. bf16 weights, fp32 state)")
        for value in (dtype, state_dtype):
            check_rounding(self.rounding, value if value in LOW_PRECISION else torch.bfloat16)
        if placement not in ("auto", "gpu", "host", "disk"):
            raise ValueError(f"placement must be 'auto', 'gpu', 'host' or 'disk', got "
                             f"{placement!r}")
        ram = self.host_cache_bytes
        if ram is not None and (isinstance(ram, bool) or not isinstance(ram, int) or ram <= 0):
            raise ValueError(f"host_cache_bytes must be a positive int (bytes of RAM for a disk "
                             f"table's cached rows), got {ram!r}")
        if placement == "disk" and any(getattr(self, k) is not None for k in
                                       ("cache_bytes", "cache_fraction", "cache_rows")):
            raise ValueError("placement='disk' keeps its hot rows in RAM (host_cache_bytes); "
                             "a GPU cache above a disk table is not supported: leave "
                             "cache_bytes, cache_fraction and cache_rows unset")
        if self.write_behind not in (None, True, False):
            raise ValueError(f"write_behind must be None (large steps of tables in pinned host "
                             f"memory), True or False, got {self.write_behind!r}")


@dataclasses.dataclass
class StepRows:
    """What an optimizer step needs from one table: the rows touched since the last step.

    Everything is on the compute device and nothing here needed a host synchronisation.
    Attributes:
        batch: the unique ids (:class:`nbtools.rows.RowBatch`).
        grad: [capacity, dim] gradients summed per unique id (per-row scale applied).
        rows: [capacity, width]: the rows as gathered, ``[weight | state...]`` when
            ``has_state`` (else only the weight).
        has_state: ``rows`` carries the optimizer state too.
        lookups: ``(ids, shape)`` of each lookup, to name a bad id in an error.
        captures: the CUDA graph captures whose outputs ``rows`` may be: :meth:`release` them
            once the step has used the rows.
        table, cache_stats: the table, and its cache's ``[lookups, hits, admitted, evicted]``
            (read with the step's flags), when it has a cache of hot rows.
        summing: where ``grad`` is not written yet, the per-id sum that writes it: ``(the
            lookup's gradient in id order [n, dim], the lookup's RowBatch)``. The optimizer
            queues it with the step's checks (:meth:`queue_sum`), so that a step replayed as
            a CUDA graph replays the sum too (no launches of its own); anything else reading
            ``grad`` calls :meth:`sum_now` first.
    """

    batch: RowBatch
    grad: torch.Tensor
    rows: torch.Tensor
    has_state: bool
    lookups: list
    captures: list = dataclasses.field(default_factory=list)
    table: object = None            # the table (for its cache statistics)
    cache_stats: torch.Tensor | None = None   # [4] on the device, when the table has a cache
    summing: tuple | None = None

    def queue_sum(self) -> None:
        """Queue the per-id sum into ``grad`` (on the current stream; inside a CUDA graph
        capture it becomes part of the graph). Does nothing where ``grad`` is written."""
        if self.summing is not None:
            grad, batch = self.summing
            sum_by_slot(grad, batch, self.table.deterministic, out=self.grad)

    def sum_now(self) -> None:
        """Write ``grad`` now (for readers outside the optimizer's step)."""
        self.queue_sum()
        self.summing = None

    def release(self) -> None:
        LookupGraphs.release(self.captures)
        self.captures = []

    def nonfinite(self) -> bool:
        """Whether the gradient holds inf/nan (a host sync: for error messages)."""
        return not bool(torch.isfinite(self.grad).all())


class OffloadedEmbedding(nn.Module):
    """``nn.Embedding`` whose table lives in (pinned) host memory.

    Args:
        num_embeddings: rows in the table.
        embedding_dim: values per row.
        padding_idx: this row reads as zeros (it starts at zero) and never gets a gradient.
        name: used in messages and in optimizer/checkpoint state.
        device: compute device, ``"auto"`` = CUDA when available, else CPU.
        placement: where the rows (and their optimizer state) live: ``"host"`` = pinned host
            RAM, read and written by the GPU over PCIe (zero-copy); ``"gpu"`` = GPU memory
            (the same API, lazy semantics, optimizer and checkpoint format, at GPU speed);
            ``"auto"`` = the GPU when rows + optimizer state take at most
            ``config.gpu_fraction`` of the free GPU memory, else the host (decided for good
            when the optimizer attaches; ``repr(table)`` says what it chose and why). With
            CPU compute every placement is host memory.
        config: :class:`TableConfig`; its fields can also be passed by name (``dtype=``,
            ``pin=``, ``gpu_fraction=``, ``cuda_graphs=``).

    ``table(ids)`` takes integer ids of any shape, on the compute device or the CPU, and
    returns ``ids.shape + (embedding_dim,)`` rows on the compute device.

    Ids are checked: out of range, a lookup that an :class:`~nbtools.OffloadOptimizer` trains
    raises ``IndexError`` at that optimizer's next ``step()`` (the check runs on the GPU, and
    the step reads its verdict with every other flag in its one host synchronisation, before
    anything is written); any other lookup raises at once.

    >>> table = OffloadedEmbedding(1000, 8, device="cpu", name="words")
    >>> table(torch.tensor([[1, 2], [2, 999]])).shape
    torch.Size([2, 2, 8])
    >>> table.weight.shape
    torch.Size([1000, 8])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx=None, name=None,
                 device="auto", placement: str = "host", config: TableConfig | None = None,
                 **options):
        super().__init__()
        for arg, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        unknown = set(options) - {f.name for f in dataclasses.fields(TableConfig)}
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; a table takes "
                            f"padding_idx, name, device, placement, config, and the TableConfig "
                            f"fields {[f.name for f in dataclasses.fields(TableConfig)]}")
        self.config = cfg = dataclasses.replace(config or TableConfig(), **options)
        cfg.check(placement)
        dtype = cfg.dtype
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} is out of range for "
                                 f"{self.num_embeddings:,} rows")
            padding_idx = int(padding_idx) % self.num_embeddings
        self.padding_idx = padding_idx
        self.name = name or type(self).__name__
        self.device = resolve_device(device)
        self.requested_placement = placement
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = self.num_embeddings * self.embedding_dim * itemsize
        try:
            self.placement, self.placement_reason = self._choose_placement(
                3 * nbytes, "Adam-sized state assumed until an optimizer attaches")
        except NoRoomError:          # the optimizer may keep less state: its attach decides
            self.placement, self.placement_reason = self._choose_placement(
                nbytes, "placed by its weights alone: with Adam-sized state it fits nowhere")
        if self.placement == "host":
            check_fits(nbytes, f"table {self.name!r} ({self.num_embeddings:,} x "
                               f"{self.embedding_dim} {str(dtype).replace('torch.', '')})",
                       "Use nbtools.plan(...) to size it; a smaller dim, fewer rows or "
                       "dtype=torch.bfloat16 halves it.")
        self._disk = None            # placement="disk": the file and its RAM slots (nbtools.disk)
        self._host = self._new_rows((self.num_embeddings, self.embedding_dim), dtype)
        self._layout = RowLayout(self.embedding_dim, dtype, dtype)
        self._rows = self._store()
        self._grad_scale = None      # RowStore over (num_embeddings, 1) per-row gradient weights
        self._state_names = []       # optimizer state interleaved after the weight, in order
        self._pending = []           # (RowBatch, rows leaf, full rows or None, flat ids, shape,
        #                              the CUDA graph capture whose outputs these are, or None,
        #                              the rows in id order where they are the gradient's leaf)
        self._graphs = LookupGraphs()
        self._warned_pending = False
        self._owned = False          # an OffloadOptimizer steps this table
        self._warm_counts = None     # warm_cache() before the cache exists
        self._prefetch = Prefetcher(self)   # a training lookup started ahead (prefetch)
        self._cache_counts = CacheCounts()   # its readings, as optimizer steps take them
        self._cache_why = ""
        self.trainable = True
        with torch.no_grad():        # nn.Embedding's default initialisation: N(0, 1)
            if self._disk is not None:
                from . import disk
                disk.init_normal(self._disk, padding_idx, self.device)
                return
            # pinned: drawn on the GPU (its generator, as nn.Embedding(device="cuda") would) and
            # written over PCIe, ~50x faster than the single CPU thread of Tensor.normal_
            rows = self._host.view()
            rows.normal_()
            if padding_idx is not None:
                rows[padding_idx].zero_()
            if rows.is_cuda and self.placement == "host":
                torch.cuda.synchronize(rows.device)   # the host copy is read from now on

    @property
    def layout(self) -> RowLayout:
        """How each row ``[weight | state...]`` is stored (:class:`nbtools.rows.RowLayout`)."""
        return self._layout

    @property
    def compute_dtype(self) -> torch.dtype:
        """What lookups return and updates compute in: float32 for low-precision storage."""
        return torch.float32 if self.config.dtype in LOW_PRECISION else self.config.dtype

    def _choose_placement(self, nbytes: int, assumption: str = "") -> tuple[str, str]:
        if self.requested_placement == "disk":
            return "disk", "asked for"
        if self.device.type != "cuda" and self.requested_placement != "auto":
            return "host", "CPU compute"
        if self.requested_placement != "auto":
            return self.requested_placement, "asked for"
        where, why = auto_placement(nbytes, self.device, self.config.gpu_fraction,
                                    self.config.disk_dir, self.num_embeddings)
        return where, f"auto: {why}" + (f" ({assumption})" if assumption else "")

    def _store(self) -> RowStore:
        """The row store over this table's memory (for a disk table: its RAM slots, which
        lookups address by slot; they never write behind, whose patches need sorted ids)."""
        store = RowStore(self._host, self.device)
        store.write_behind_ok = self._disk is None
        return store

    def _new_rows(self, shape, dtype):
        """Memory for ``shape`` rows where this table is placed (zero-filled)."""
        if self.placement == "disk":
            from . import disk
            self._disk = disk.new_rows(self, shape[1], dtype)
            return self._disk.slab
        if self.placement == "gpu":
            return DeviceRows(shape, dtype, self.device, self.name)
        return self._new_host(shape, dtype, self.config.pin and self.device.type == "cuda",
                              self.name)

    def _new_host(self, shape, dtype, pin: bool, name: str) -> HostTensor:
        """Host memory for this table, its zero-copy view on the table's CUDA device."""
        return HostTensor(shape, dtype, pin=pin, name=name,
                          device=self.device if self.device.type == "cuda" else None)

    # --- the rows, wherever they live -------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """All rows: a CPU tensor aliasing the (pinned) host memory, or, when the table is
        placed on the GPU, a CUDA tensor. Reading a host table waits for queued GPU writes
        first, so what you read is current. Write to it to initialise."""
        return self._current(keep_cache=False, state=None)

    def _current(self, keep_cache: bool, state) -> torch.Tensor:
        """The weights (``state`` None) or one state's columns of every row, current: cached
        rows are written back first, and the cache is emptied unless ``keep_cache`` (a read
        that nothing writes through, such as saving)."""
        self._prefetch.drop()           # a write through what is returned would make it stale
        if self._disk is not None:      # the file, mapped, once every dirty row is in it
            self._disk.flush(drop=not keep_cache)
            full = self._disk.mapped(writable=not keep_cache)
            if state is None:
                return self._layout.weight(full)
            return self._layout.state(full, state)
        if self.placement == "host":
            self._rows.settle()         # lookups stop patching from write-backs in flight
            self._rows.flush(drop=not keep_cache)
            synchronize(self.device)
        if state is None:
            return self._layout.weight(self._host.tensor)
        return self._layout.state(self._host.tensor, state)

    @property
    def rows(self) -> RowStore:
        """Where the rows ``[weight | state...]`` live, as the compute device reaches them
        (the row protocol's store: gather, scatter, and the view fused kernels write to)."""
        return self._rows

    @property
    def state_names(self) -> list:
        """Per-row optimizer state stored after each row's weight, in order."""
        return list(self._state_names)

    def state_columns(self, name: str, keep_cache: bool = False) -> torch.Tensor:
        """View of one per-row optimizer state (e.g. ``"exp_avg"``), aligned with rows.
        ``keep_cache``: for reads only (saving): the cache of hot rows is flushed, not
        emptied."""
        return self._current(keep_cache, self._state_names.index(name))

    def attach_state(self, names, initial: dict, owned: bool = True,
                     dims: dict | None = None) -> None:
        """Give every row room for per-row optimizer state, stored after its weight.

        Called once by :class:`nbtools.OffloadOptimizer`. The table is reallocated as
        ``[weight | state...]`` per row; state columns start at ``initial[name]``. ``dims``:
        columns of each state (default ``embedding_dim``; a row-wise optimizer's per-row
        state is narrower, e.g. ``{"exp_avg_sq": 1}``). With
        ``placement="auto"`` this is when the table's place is decided for good, from its
        size with this optimizer's state. Host memory peaks at the final footprint plus one
        64 MiB chunk: the old rows are handed back to the OS as they are copied. References to
        ``table.weight`` taken before this point see the old memory: create the optimizer
        first.
        """
        regrow_for_state(self, list(names), initial, owned, dims)

    # --- the cache of hot rows --------------------------------------------------------------
    @property
    def cache(self):
        """The GPU cache of hot rows (:class:`nbtools.cache.RowCache`), or None."""
        return self._rows.cache

    def warm_cache(self, counts) -> None:
        """Seed the cache's row counts with known frequencies (e.g. a word2vec vocabulary's
        word counts, ``counts[id]``) and load the most frequent rows now, so the first steps
        already hit. Before the optimizer attaches (no cache yet), the counts are kept and
        used when it does."""
        counts = torch.as_tensor(counts)
        if counts.shape != (self.num_embeddings,) or counts.is_floating_point() \
                and not torch.isfinite(counts).all():
            raise ValueError(f"table {self.name!r}: counts must be a finite tensor of shape "
                             f"({self.num_embeddings},), got {tuple(counts.shape)}")
        counts = counts.round().long() if counts.is_floating_point() else counts.long()
        if self._disk is not None:      # the RAM cache: the most frequent rows, read now
            hot = torch.argsort(counts, descending=True, stable=True)
            hot = hot[counts[hot] > 0][: self._disk.capacity_rows]
            self._disk.warm(hot.numpy())
            self._sync_slab()
            return
        if self._rows.cache is None:
            self._warm_counts = counts
            return
        self._prefetch.drop()
        self._rows.cache.warm(counts, self._rows.view())
        self._graphs.invalidate()

    def record_cache_stats(self, stats) -> None:
        """Take the cache's cumulative ``[lookups, hits, admitted, evicted]`` as read by the
        optimizer's step, and count the bytes that crossed PCIe since the last reading."""
        self._cache_counts.record(stats, self._rows)

    def cache_stats(self) -> dict:
        """The cache of hot rows as of the last optimizer step (no host sync): unique rows
        looked up in training, cache hits, hit rate, rows admitted and evicted, PCIe bytes
        saved (a hit reads and writes nothing over PCIe), capacity. Empty without a cache."""
        return self._cache_counts.summary(self._rows)

    @property
    def pinned(self) -> bool:
        return self._host.pinned

    @property
    def nbytes(self) -> int:
        """Bytes of rows (and optimizer state) where the table lives: host RAM, GPU or disk."""
        return self._disk.nbytes if self._disk is not None else self._host.nbytes

    @property
    def ram_bytes(self) -> int:
        """Host RAM the rows take: the table itself, or a disk table's cache of hot rows."""
        if self._disk is not None:
            return self._disk.ram_bytes
        return 0 if self.placement == "gpu" else self._host.nbytes

    @property
    def disk(self):
        """A disk table's file and RAM cache (:class:`nbtools.disk.DiskRows`), or None."""
        return self._disk

    @property
    def transfer_mode(self) -> str:
        """'zero-copy', 'gpu' (rows on the GPU), 'staged' (pageable memory, CUDA), 'host'
        (CPU compute) or 'disk' (rows in a file, a RAM cache read zero-copy)."""
        return "disk" if self._disk is not None else self._rows.mode

    def set_grad_scale(self, weights) -> None:
        """Multiply each row's summed gradient by ``weights[id]`` before the optimizer step.

        For rare words: e.g. inverse frequency. ``None`` turns it off. Like
        ``nn.Embedding(scale_grad_by_freq=True)``, but with your own per-id weights.
        """
        if weights is None:
            self._grad_scale = None
            return
        if self._disk is not None:
            raise NotImplementedError(f"table {self.name!r}: per-row gradient scaling is not "
                                      "supported with placement='disk' yet")
        weights = torch.as_tensor(weights)
        if weights.shape != (self.num_embeddings,) or not weights.is_floating_point():
            raise ValueError(f"grad scale for table {self.name!r} must be a float tensor of shape "
                             f"({self.num_embeddings},), got {tuple(weights.shape)} {weights.dtype}")
        if not torch.isfinite(weights).all():
            raise ValueError(f"grad scale for table {self.name!r} contains non-finite values")
        host = self._new_rows((self.num_embeddings, 1), self._host.tensor.dtype)
        host.tensor.copy_(weights.reshape(-1, 1))
        self._grad_scale = RowStore(host, self.device)

    def close(self) -> None:
        """Release the pinned registration now (the CPU tensor stays valid as plain memory)."""
        self._prefetch.drop()
        if self.placement == "host":
            self._rows.flush()
            synchronize(self.device)
        self.clear_pending()
        self._graphs.invalidate()
        if self._disk is not None:
            synchronize(self.device)
            self._disk.close()          # the file goes with it: save a checkpoint first
        self._host.close()
        self._rows = self._store()

    # --- lookups ----------------------------------------------------------------------------
    def _prepare_ids(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(f"table {self.name!r}: ids must be an integer tensor, "
                                f"got {type(ids).__name__}") from e
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"table {self.name!r}: ids must be integers, got dtype {ids.dtype}; "
                            "convert with ids.long() if they are whole numbers")
        if self._disk is not None:      # deduplicated on the CPU: host ids stay there
            return ids
        return ids.to(self.device, non_blocking=True)

    def raise_bad_ids(self, flat: torch.Tensor, shape) -> None:
        """Raise the IndexError that names the first out-of-range id of ``flat`` (a lookup of
        ``shape``) and its position. A host sync: called once a check has found one."""
        bad = (flat < 0) | (flat >= self.num_embeddings)
        value = int(flat[bad.nonzero()[0, 0]])
        raise IndexError(
            f"table {self.name!r} has {self.num_embeddings:,} rows but ids contain {value:,} "
            f"(first at {_ids_error_position(bad, shape)}); valid ids are 0 to "
            f"{self.num_embeddings - 1:,}")

    def _lookup(self, ids: torch.Tensor):
        """Deduplicate ``ids`` (any shape) and gather the unique rows, without a host sync.

        Returns (rows [capacity, dim], inverse [ids.numel()]). Ids are checked here when the
        lookup is not training a table that an OffloadOptimizer steps (a host sync); when it
        is, the check runs on the device and the optimizer's step reads its verdict, with
        every other flag of the step, in one synchronisation, before anything is written.
        """
        flat = ids.reshape(-1).long()      # int64: index_copy_ (the write-back) takes no other
        recording = torch.is_grad_enabled() and self.trainable
        width = self._rows.width if (recording and self._state_names) else \
            self._layout.weight_cols
        if self._disk is not None:
            return self._disk_lookup(ids, recording, width)
        self._prefetch.wait()           # its cache admission comes before this lookup's
        if recording and self._owned and self._prefetch.matches(ids, width):
            return self._prefetch.take(flat, ids.shape)
        captured = None
        if recording and self._owned and self.config.cuda_graphs and self._rows.direct \
                and self.device.type == "cuda" and kernels.usable_on(self.device):
            captured = self._graphs.run(self._rows, flat, self.padding_idx, width)
        if captured is not None:
            batch, full, capture = captured
        else:
            capture = None
            batch = unique_ids(flat, self.num_embeddings, self.padding_idx)
            if not (recording and self._owned) and bool(batch.bad):   # note: a sync point
                self.raise_bad_ids(flat, ids.shape)
            with torch.no_grad():
                # Training: whole rows now, so the optimizer step needs no second gather.
                full = self._rows.gather_batch(batch, 0, width,
                                               admit=recording and self._owned)
        rows = self._leaf(full)
        if not (recording and self._state_names):
            full = None
        if recording:
            rows.requires_grad_(True)
            self._pending.append((batch, rows, full, flat, ids.shape, capture, None))
            if len(self._pending) > _PENDING_WARN and not self._warned_pending:
                self._warned_pending = True
                warnings.warn(
                    f"table {self.name!r} holds {len(self._pending)} lookups waiting for an "
                    "optimizer step: run evaluation under torch.no_grad(), or call "
                    "optimizer.zero_grad()", RuntimeWarning, stacklevel=3)
        return rows, batch.inverse

    def _sync_slab(self) -> None:
        """A disk table's RAM cache was pinned or grew: its row store follows."""
        if self._host is not self._disk.slab:
            self._host = self._disk.slab
            self._rows = self._store()

    def _disk_lookup(self, ids: torch.Tensor, recording: bool, width: int):
        """:meth:`_lookup` for a disk table: its rows are brought into RAM slots first, then
        gathered from there like a host table's (nbtools.disk)."""
        from . import disk
        training = recording and self._owned
        batch, slots = disk.lookup(self, ids, training)
        self._sync_slab()
        if not training and bool(batch.bad):                # note: a sync point
            self.raise_bad_ids(ids.reshape(-1), ids.shape)
        with torch.no_grad():
            full = self._rows.gather_batch(batch, 0, width)
        if not training:             # its slots may be reused once the gather has run
            self._disk.mark_used(slots)
        rows = self._leaf(full)
        if not (recording and self._state_names):
            full = None
        if recording:
            rows.requires_grad_(True)
            self._pending.append((batch, rows, full, ids.reshape(-1), ids.shape, None, None))
        return rows, batch.inverse

    # --- prefetch ---------------------------------------------------------------------------

    def prefetch(self, ids) -> None:
        """Start the next training lookup of ``ids`` now, while the current step computes.

        Call it right after this step's lookups, with the ids tensor the next step will look up
        (the very same tensor object)::

            rows = table(ids)
            table.prefetch(next_ids)        # dedup, cache admission, row gather: side stream
            loss(rows).backward(); opt.step(); opt.zero_grad()
            rows = table(next_ids)          # takes the prefetched rows

        The next step's ids are deduplicated, admitted to the cache of hot rows (if any) and
        their rows gathered on a CUDA side stream, overlapping this step's forward and
        backward. The optimizer step waits for that work before it writes, and the rows it
        writes that the next lookup also needs are read again when the next lookup takes them,
        so the result is bit-identical to not prefetching. A lookup of other ids ignores the
        prefetch (it is kept for a later lookup of ``ids``); reading or writing ``.weight``
        drops it. On the CPU the same work runs at once (no overlap, same results).

        Ids on the GPU are ready only once the work queued before this call is done, which
        includes the last step's update. Ids given as a host tensor are copied and
        deduplicated on the side stream at once, beside that update; only the gather waits
        for it. So where the ids come from the host, pass them as they are.
        """
        if not (self._owned and self.trainable):
            raise ValueError(f"table {self.name!r}: prefetch starts a training lookup; create "
                             "the OffloadOptimizer that steps this table first")
        if self._disk is not None:   # the rows the next step misses, read from the file now
            self._disk.read_ahead(self._prepare_ids(ids), self.padding_idx)
            self._sync_slab()
            return
        self._prefetch.start(ids)

    def __getstate__(self) -> dict:
        # A pending prefetch and its side stream are left behind (Prefetcher.__getstate__).
        # The host rows are copied as they are once queued writes have landed. A disk table's
        # file is not copied: DiskRows refuses, naming the table.
        if self.placement == "host":
            self._rows.settle()
            synchronize(self.device)
        return dict(self.__dict__)

    def _leaf(self, full: torch.Tensor) -> torch.Tensor:
        """The weights of gathered rows as the leaf autograd sees: a fresh tensor (never a
        capture's or a prefetch's buffer), in the compute dtype (upcast from bf16 storage)."""
        rows = self._layout.weight(full)
        return rows.to(self.compute_dtype) if rows.dtype != self.compute_dtype else rows[:, :]

    def collect(self) -> StepRows | None:
        """The row protocol's step input: the rows looked up since the last call, their unique
        ids and summed gradients (:class:`StepRows`), or None when no row has a gradient.
        Clears the pending lookups. No host synchronisation. Called by the optimizer."""
        self._prefetch.wait()        # the update must not race the prefetch's admission
        records = [rec for rec in self._pending if self._leaf_of(rec).grad is not None]
        LookupGraphs.release(rec[5] for rec in self._pending if self._leaf_of(rec).grad is None)
        self._pending.clear()
        if self._disk is not None:   # the step's update of their slots is queued next
            self._disk.step_queued()
        if not records:
            return None
        lookups = [(r[3], r[4]) for r in records]
        has_state = all(r[2] is not None for r in records)
        summing = None
        if len(records) == 1:
            batch, leaf, full = records[0][:3]
            if self.padding_idx is None and self._grad_scale is None:
                grad, summing = self._deferred_grad(records[0])
            else:
                grad = self._grad_of(records[0])
            rows = full if has_state else leaf.detach()
        else:                        # several lookups this step: one more dedup across them
            batch, grad, pick = merge([r[0] for r in records],
                                      [self._grad_of(r) for r in records])
            parts = [r[2] if has_state else r[1].detach() for r in records]
            rows = torch.cat(parts).index_select(0, pick)
        if self.padding_idx is not None:
            # padding ids became the sentinel slot: its gradient is never applied, nor checked
            grad = grad.masked_fill((batch.ids == self.num_embeddings).unsqueeze(1), 0)
        if self._grad_scale is not None:
            grad = grad * self._grad_scale.gather_batch(batch).to(grad.dtype)
        self._prefetch.written(batch.ids)   # a prefetch reads these rows again
        cache = self._rows.cache
        return StepRows(batch, grad, rows, has_state, lookups, [r[5] for r in records], self,
                        None if cache is None else cache.stats, summing)

    @staticmethod
    def _leaf_of(rec) -> torch.Tensor:
        """The tensor a pending lookup's gradient lands on: its rows in id order where
        :meth:`_rows_of_ids` made them the leaf, else its unique rows."""
        return rec[1] if rec[6] is None else rec[6]

    def _grad_of(self, rec) -> torch.Tensor | None:
        """A pending lookup's gradient per unique row [capacity, d], or None: the gradient of
        its rows in id order summed per id (:func:`nbtools.rows.sum_by_slot`: in a fixed order
        on CUDA unless OffloadConfig(deterministic=False))."""
        grad = self._leaf_of(rec).grad
        if grad is None or rec[6] is None:
            return grad
        return sum_by_slot(grad, rec[0], self.deterministic)

    def _deferred_grad(self, rec) -> tuple:
        """``(grad, summing)`` of a step's only lookup: where its gradient is in id order,
        an unwritten [capacity, d] buffer and what :meth:`StepRows.queue_sum` writes into it
        (the optimizer queues that with the step's checks); else its gradient, None."""
        grad = self._leaf_of(rec).grad
        if rec[6] is None or grad is None or grad.requires_grad:
            return self._grad_of(rec), None
        return grad.new_empty(rec[0].capacity, grad.shape[-1]), (grad, rec[0])

    def clear_pending(self) -> None:
        LookupGraphs.release(rec[5] for rec in self._pending)
        self._pending.clear()
        if self._disk is not None:
            self._disk.step_queued()

    def _device_ids(self, ids) -> torch.Tensor:
        """``ids`` on the compute device; for the very ids a prefetch was started with, the
        copy the prefetch made."""
        taken = self._prefetch.device_ids(ids)
        return self._prepare_ids(ids) if taken is None else taken

    # The OffloadConfig.deterministic of the optimizer that steps this table (it sets this):
    # on CUDA the gradient of a training lookup is summed per id in a fixed order.
    deterministic = True

    def _rows_of_ids(self, rows: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """``rows[inv]``: a lookup's unique rows in the order of its ids. For a training
        lookup these are the leaf its gradient lands on ([n, d], one row per id), summed per
        unique row by the optimizer's step (:attr:`StepRows.summing`, queued with its checks,
        inside its CUDA graph) with no second sort: in a fixed order on CUDA, where
        index_select's own backward (index_add_) adds with atomics, whose order changes from
        run to run. Not in autograd's backward: a Python backward runs on autograd's device
        thread and cost ~0.2 ms of host time a lookup (docs/reproducibility.md)."""
        rec = self._pending[-1] if self._pending else None
        if rec is None or rec[1] is not rows:      # not a training lookup: no gradient
            return rows.index_select(0, inv)
        out = rows.detach().index_select(0, inv).requires_grad_(True)
        self._pending[-1] = rec[:6] + (out,)
        return out

    def forward(self, ids) -> torch.Tensor:
        ids = self._device_ids(ids)
        rows, inv = self._lookup(ids)
        return self._rows_of_ids(rows, inv).view(*ids.shape, self.embedding_dim)

    # --- state dict: 'weight' is the live table (no copy) -----------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # the live rows, current; a cache of hot rows is flushed and stays warm (load_state_dict
        # writes through .weight, which empties it first)
        destination[prefix + "weight"] = self._current(keep_cache=True, state=None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        src = state_dict[key]
        if tuple(src.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: checkpoint has {tuple(src.shape)}, table "
                              f"{self.name!r} is ({self.num_embeddings}, {self.embedding_dim})")
            return
        copy_unless_same(self.weight, src)     # .weight synchronises first

    def extra_repr(self) -> str:
        placement = self.placement
        if self.requested_placement == "auto" and self.device.type == "cuda":
            placement = f"auto -> {placement} ({self.placement_reason})"
        mode = self.transfer_mode      # how the GPU reaches host rows (zero-copy, staged)
        s = (f"{self.num_embeddings:,}, {self.embedding_dim}, name={self.name!r}, "
             f"dtype={self.config.dtype}, device={self.device}, placement={placement}"
             f"{'' if mode == self.placement else ', ' + mode}, rows="
             f"{human_bytes(self.nbytes)}")
        if self._state_names:
            s += f" with state {'+'.join(self._state_names)} in {self._layout.unit}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self._disk is not None:
            from . import disk
            s += ", " + disk.describe(self._disk)
        if self._rows.cache is not None:
            s += (f", cache={self._rows.cache.capacity:,} rows "
                  f"({human_bytes(self._rows.cache.nbytes)}, {self._cache_why})")
        return s

    @classmethod
    def from_pretrained(cls, source, **kwargs) -> "OffloadedEmbedding":
        """A table whose rows are ``source``: a tensor, a NumPy or CuPy array, or a ``.npy``
        file bigger than RAM, streamed in chunks (64 MiB beyond the table at most). Takes
        ``freeze=True`` and ``padding_idx`` as ``nn.Embedding.from_pretrained`` does, ``dtype``,
        ``placement``, ``name``, ``device``, ``config``, ``allow_nonfinite``, ``progress``:
        :func:`nbtools.pretrained.from_pretrained`.

        >>> OffloadedEmbedding.from_pretrained(torch.ones(3, 2), device="cpu").weight.sum()
        tensor(6.)
        """
        from .pretrained import from_pretrained
        return from_pretrained(cls, source, **kwargs)


class OffloadedEmbeddingBag(OffloadedEmbedding):
    """``nn.EmbeddingBag`` over a host-memory table: sums, means or maxima of rows per bag.

    Input is either padded 2-D ids ``[bags, length]`` or 1-D ids with ``offsets`` (start of
    each bag). With ``padding_idx`` set, padding entries are left out of the bag, so ``mean``
    divides by each bag's real length, not the padded one (as ``nn.EmbeddingBag`` does).

    Args:
        num_embeddings, embedding_dim, padding_idx, dtype, device, name, pin: as for
            :class:`OffloadedEmbedding`.
        mode: ``"sum"``, ``"mean"`` (default) or ``"max"``.

    >>> bag = OffloadedEmbeddingBag(100, 4, mode="mean", padding_idx=0, device="cpu")
    >>> bag(torch.tensor([[5, 6, 0], [7, 0, 0]])).shape
    torch.Size([2, 4])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", **kwargs):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.mode = mode

    def forward(self, ids, offsets=None, per_sample_weights=None) -> torch.Tensor:
        ids = self._prepare_ids(ids)
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"table {self.name!r}: without offsets, ids must be 2-D "
                                 f"[bags, length]; got shape {tuple(ids.shape)}")
            bags, length = ids.shape
            offsets = torch.arange(0, bags * length, length, device=self.device) if length else \
                torch.zeros(bags, dtype=torch.long, device=self.device)
        else:
            if ids.dim() != 1:
                raise ValueError(f"table {self.name!r}: with offsets, ids must be 1-D; got shape "
                                 f"{tuple(ids.shape)}")
            offsets = self._prepare_ids(offsets).long()
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(self.device).reshape(-1)
        flat = ids.reshape(-1)
        rows, inv = self._lookup(flat)
        if self.mode == "max" and rows.is_cuda and rows.requires_grad and self.deterministic:
            # max's backward adds each bag's gradient into its winning rows with atomics (bags
            # may share a row): one row per id instead, summed per unique row in a fixed order
            rows, inv = self._rows_of_ids(rows, inv), torch.arange(flat.numel(),
                                                                   device=flat.device)
        padding = None
        if self.padding_idx is not None:
            # Padding maps to one extra all-zero row that embedding_bag leaves out of each bag.
            padding = rows.shape[0]
            rows = torch.cat((rows, rows.new_zeros(1, self.embedding_dim)))
            inv = torch.where(flat == self.padding_idx, padding, inv)
        return F.embedding_bag(inv, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights, padding_idx=padding)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
