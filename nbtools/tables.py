"""Embedding tables whose rows live in (pinned) host memory.

Each lookup deduplicates the ids on the compute device, gathers only those rows from host memory
(on CUDA: GPU kernels read the pinned rows over PCIe, zero-copy) and returns differentiable rows.
The gathered rows are the leaves autograd sees; :class:`nbtools.OffloadOptimizer` later takes
their gradients, sums them per id and writes updated rows (and optimizer state) back. Step cost
grows with the batch, never with the table. The lookups (a bag's too) and the step input they
hand the optimizer are in :mod:`nbtools.engine.lookups`, its options (:class:`TableConfig`) and
where its rows go in :mod:`nbtools.placement`, and its rows behind one tier (:mod:`nbtools.store`);
this module holds the table itself: its rows' doors, its cache of hot rows, state dict and repr.

The full table is ``table.weight``: an ordinary CPU tensor (not an ``nn.Parameter``), so
``model.to("cuda")`` leaves it where it is.

Layout: once an optimizer attaches its per-row state, each row holds ``[weight | state_1 |
... | state_k]``: a step reads and writes one long row per id instead of k + 1 short ones, and
``table.weight`` is a strided view of the first columns.
"""
from __future__ import annotations

import torch
from torch import nn

from .devices import on_tables, resolve_device, synchronize
from .store.precision import LOW_PRECISION
from .units import human_bytes
from .store.cache import TableCache
# (the options and placement of a table; each name importable from here as before)
from .placement import (HostMemoryError, NoRoomError, TableConfig, auto_placement,  # noqa: F401
                        check_fits, check_table_args, choose_placement, copy_unless_same,
                        first_placement, make_store, padding_row, regrow_for_state, weight_in)
from .pretrained import building_rows_written_next, rows_written_next  # noqa: F401
from .store.capture import LookupGraphs
from .store import RowTier
from .store.layout import RowLayout
from .store.rows import grad_scale_rows, new_memory
from .store.tiers import with_cache
# lookups and the step input they make; StepRows and the rest importable from here as before
from .engine.lookups import PENDING_WARN, StepRows, TableLookups, ids_error_position  # noqa: F401


def _of_tier(name: str, doc: str) -> property:
    """A property of the table that its tier answers (the tier's attribute ``name``)."""
    return property(lambda table: getattr(table._rows, name), doc=doc)


class OffloadedEmbedding(nn.Module):
    """``nn.Embedding`` whose table lives in (pinned) host memory.

    Args:
        num_embeddings: rows in the table.
        embedding_dim: values per row.
        padding_idx: this row reads as zeros (it starts at zero) and never gets a gradient.
        name: used in messages and in optimizer/checkpoint state.
        device: compute device, ``"auto"`` = CUDA when available, else CPU.
        placement: where the rows (and their optimizer state) live: ``"host"`` (default:
            pinned host RAM, which the GPU reads and writes over PCIe, zero-copy), ``"gpu"``
            (GPU memory: the same API at GPU speed; needs CUDA compute), ``"disk"`` (a file
            under ``disk_dir=``, default :func:`nbtools.disk.default_dir`, with a RAM cache
            of the hot rows, ``host_cache_bytes=``, default 1 GiB: for tables bigger than
            RAM) or ``"auto"`` (the first of them where rows + optimizer state fit,
            :func:`nbtools.placement.auto_placement`, decided for good when the optimizer
            attaches; ``repr(table)`` says what it chose and why; a table that fits nowhere
            raises :class:`~nbtools.placement.NoRoomError` before anything is allocated).
            With CPU compute, ``"host"`` and ``"auto"`` use ordinary host memory.
        config: :class:`TableConfig`; its fields can also be passed by name (``dtype=``,
            ``pin=``, ``gpu_fraction=``, ``cuda_graphs=``, ``cache_bytes=``, ``disk_dir=``,
            ``host_cache_bytes=``, ...).

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
        self.config = cfg = TableConfig.with_options(config, options)
        self.num_embeddings, self.embedding_dim = cfg.check(
            placement, {"num_embeddings": num_embeddings, "embedding_dim": embedding_dim})
        dtype = cfg.dtype
        self.padding_idx = padding_row(padding_idx, self.num_embeddings)
        self.name = name or type(self).__name__
        self.device = resolve_device(device)
        self.requested_placement = placement
        self.placement, self.placement_reason = first_placement(
            placement, self.device, cfg, self.name, self.num_embeddings, self.embedding_dim)
        layout = RowLayout(self.embedding_dim, dtype, dtype)
        if self.placement == "disk":     # a file and its RAM slots (nbtools.disk)
            from . import disk
            rows = disk.new_rows(cfg, self.num_embeddings, self.embedding_dim, dtype,
                                 self.device, self.name)
            self._rows = make_store(rows.slab, self.device, layout, rows)
        else:
            memory = new_memory((self.num_embeddings, self.embedding_dim), dtype, self.device,
                                self.placement == "gpu", cfg.pin, self.name)
            self._rows = make_store(memory, self.device, layout)
        self._grad_scale = None      # RowStore over (num_embeddings, 1) per-row gradient weights
        self.lookups = TableLookups(self)   # its lookups, pending ones, graphs and prefetch
        self.hot = TableCache()      # its GPU cache of hot rows: size, warm-up, readings
        self.trainable = True
        if building_rows_written_next():
            return                   # its builder writes every row next (from_pretrained)
        self._rows.init_normal(self.padding_idx)     # nn.Embedding's N(0, 1)

    @property
    def layout(self) -> RowLayout:
        """How each row ``[weight | state...]`` is stored (:class:`nbtools.store.layout.RowLayout`)."""
        return self._rows.layout

    @property
    def compute_dtype(self) -> torch.dtype:
        """What lookups return and updates compute in: float32 for low-precision storage."""
        return torch.float32 if self.config.dtype in LOW_PRECISION else self.config.dtype

    def _store(self) -> RowTier:
        """The tiers over this table's memory as it is now (:func:`make_store`)."""
        return make_store(self._rows.host, self.device, self._rows.layout, self._rows.disk)

    # --- the rows, wherever they live -------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """All rows: a CPU tensor aliasing the (pinned) host memory, or, when the table is
        placed on the GPU, a CUDA tensor. Reading a host table waits for queued GPU writes
        first, so what you read is current. Write to it to initialise. Since anything may be
        written through it, a cache of hot rows is emptied first and every row counts as
        changed for the next checkpoint (which then copies them all): to only read, use
        :meth:`read_weight`."""
        return self._current(keep_cache=False, state=None)

    def read_weight(self) -> torch.Tensor:
        """All rows, current, as :attr:`weight` gives them, for reading only: a cache of hot
        rows stays warm and the next checkpoint stays incremental (nearest neighbours, a check
        for inf/nan, an export). What is written through it is not tracked: write through
        :attr:`weight`."""
        return self._current(keep_cache=True, state=None)

    @on_tables
    def _current(self, keep_cache: bool, state) -> torch.Tensor:
        """The weights (``state`` None) or one state's columns of every row, current: cached
        rows are written back first, and the cache is emptied unless ``keep_cache`` (a read
        that nothing writes through, such as saving)."""
        self.lookups.prefetcher.drop()  # a write through what is returned would make it stale
        full = self._rows.rows_now(keep_cache)
        layout = self._rows.layout
        return layout.weight(full) if state is None else layout.state(full, state)

    storage = _of_tier("host", """The memory the rows live in: a
        :class:`~nbtools.hostmem.HostTensor`, the GPU's :class:`~nbtools.store.rows.DeviceRows`,
        or a disk table's RAM slots.""")

    @property
    def lookup_graphs(self) -> LookupGraphs:
        """CUDA graphs of this table's training lookups (one per batch size)."""
        return self.lookups.graphs

    @property
    def rows(self) -> RowTier:
        """Where the rows ``[weight | state...]`` live, as the compute device reaches them
        (the row protocol's tiers, :mod:`nbtools.store`: gather, scatter, and the view fused
        kernels write to)."""
        return self._rows

    @property
    def state_names(self) -> list:
        """Per-row optimizer state stored after each row's weight, in order."""
        return list(self._rows.layout.names)

    def state_columns(self, name: str, keep_cache: bool = False) -> torch.Tensor:
        """View of one per-row optimizer state (e.g. ``"exp_avg"``), aligned with rows.
        ``keep_cache``: for reads only (saving): the cache of hot rows is flushed, not
        emptied."""
        return self._current(keep_cache, self._rows.layout.names.index(name))

    @on_tables
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
        first. Gradients that reached the table before (``backward()``, then the optimizer)
        are kept for its first step.
        """
        if self.state_names:
            raise ValueError(f"table {self.name!r} already carries optimizer state "
                             f"{self.state_names}; use one OffloadOptimizer per table")
        # A backward() before the optimizer was made: its gradient is applied at the first
        # step, as torch's optimizers apply a .grad that exists when they are made. It is
        # looked up again as a training lookup of the rows as they are now (with their state).
        # Without state the rows stay where they are, and so do lookups that backward() has
        # not reached yet (it reaches them as usual).
        carried = self.lookups.take_gradients(rebuilt=bool(names))
        self.lookups.owned = owned
        if names:
            got = regrow_for_state(self, list(names), initial, dims)
            self.placement, self.placement_reason = got.placement, got.reason
            self._rows = make_store(got.rows, self.device, got.layout, got.disk)
            self.clear_pending()
            self.lookups.graphs.invalidate()
        self.hot.attach(self)
        if carried is not None:
            self.lookups.restore_gradients(*carried)

    def stack_cache(self, capacity: int) -> None:
        """Keep up to ``capacity`` hot rows in a GPU cache above this table's rows in host
        memory (:func:`nbtools.store.tiers.with_cache`; what ``cache_rows`` asks for)."""
        self._rows = with_cache(self._rows, capacity)

    # --- the cache of hot rows (self.hot: nbtools.store.cache.TableCache) -------------------
    cache = _of_tier("cache", """The GPU cache of hot rows (:class:`nbtools.store.cache.RowCache`;
        a disk table's: :class:`nbtools.disk.gpu.GpuLevel`), or None.""")

    @on_tables
    def warm_cache(self, counts) -> None:
        """Seed the cache's row counts with known frequencies and load the most frequent rows
        now, so the first steps already hit (a disk table: into its GPU cache, then RAM).

        Args:
            counts: one value a row (a tensor, numpy array or list): counts (ints, e.g. a
                word2vec vocabulary's word counts, ``counts[id]``) or shares (floats of any
                scale, e.g. frequencies summing to 1: scaled so the smallest positive share
                counts 1, :func:`nbtools.store.cache.warm_counts`). Rows at 0 are not loaded.

        Before the optimizer attaches (no cache yet, and a disk table's rows not yet in their
        final file), the counts are kept and used when it does; a table that can have no
        cache (in host RAM without ``cache_bytes``, or on the GPU) ignores them.
        :class:`~nbtools.models.SkipGram` and :func:`~nbtools.models.fit` call this
        themselves, and :meth:`nbtools.PinnedLoader.id_counts` gives a column's counts.

        >>> from nbtools import OffloadOptimizer
        >>> table = OffloadedEmbedding(1000, 4, device="cpu", cache_rows=64)
        >>> shares = torch.zeros(1000)
        >>> shares[:3] = torch.tensor([0.5, 0.3, 0.2])    # frequencies summing to 1
        >>> table.warm_cache(shares)                       # kept until the optimizer attaches
        >>> opt = OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
        >>> table.cache.cached_rows()
        3
        """
        self.hot.warm(self, counts)

    def record_cache_stats(self, stats) -> None:
        """Take the cache's cumulative ``[lookups, hits, admitted, evicted]`` as read by the
        optimizer's step, and count the bytes that crossed PCIe since the last reading."""
        self.hot.counts.record(stats, self._rows)

    def cache_stats(self) -> dict:
        """The cache of hot rows as of the last optimizer step (no host sync): unique rows
        looked up in training, cache hits, hit rate, rows admitted and evicted, PCIe bytes
        saved (a hit reads and writes nothing over PCIe), capacity. A disk table adds its RAM
        cache's figures (``ram_lookups``, ``ram_hits``, ``ram_hit_rate``, ...; rows looked up
        in RAM, per lookup), and gives those alone without a GPU cache. Empty for a table in
        memory without a cache."""
        return self.hot.summary(self._rows)

    @property
    def pinned(self) -> bool:
        return self._rows.host.pinned

    nbytes = _of_tier("nbytes", "Bytes of rows (and optimizer state) where the table lives: "
                                "host RAM, GPU or disk.")
    ram_bytes = _of_tier("ram_bytes", "Host RAM the rows take: the table itself, or a disk "
                                      "table's cache of hot rows.")
    disk = _of_tier("disk", "A disk table's file and RAM cache (:class:`nbtools.disk.DiskRows`), "
                            "or None.")
    transfer_mode = _of_tier("kind", """'zero-copy', 'gpu' (rows on the GPU), 'staged' (pageable
        memory, CUDA), 'host' (CPU compute) or 'disk' (rows in a file, a RAM cache read
        zero-copy).""")

    @on_tables
    def set_grad_scale(self, weights) -> None:
        """Multiply each row's summed gradient by ``weights[id]`` before the optimizer step.

        For rare words: e.g. inverse frequency. ``None`` turns it off. Like
        ``nn.Embedding(scale_grad_by_freq=True)``, but with your own per-id weights.
        """
        self._grad_scale = None if weights is None else grad_scale_rows(
            weights, self._rows, self.name, self.num_embeddings, self.config.pin)

    @on_tables
    def close(self) -> None:
        """Release the pinned registration now (the CPU tensor stays valid as plain memory)."""
        self.lookups.prefetcher.drop()
        self.clear_pending()
        self.lookups.graphs.invalidate()
        self._rows.close()
        self._rows = self._store()

    def sync_slab(self) -> None:
        """A disk table's RAM cache was pinned or grew, or it got a GPU cache: its row store
        follows."""
        if not self._rows.current_for(self._rows.disk):
            self._rows = self._store()

    def __getstate__(self) -> dict:
        # A pending prefetch and its side stream are left behind (Prefetcher.__getstate__).
        # The host rows are copied as they are once queued writes have landed. A disk table's
        # file is not copied: DiskRows refuses, naming the table.
        if self.placement == "host":
            self._rows.settle()
            synchronize(self.device)
        return dict(self.__dict__)

    # --- lookups: self.lookups, a nbtools.engine.lookups.TableLookups ----------------------------
    # The OffloadConfig.deterministic of the optimizer that steps this table (it sets this):
    # on CUDA the gradient of a training lookup is summed per id in a fixed order.
    deterministic = True

    @on_tables
    def forward(self, ids) -> torch.Tensor:
        look = self.lookups
        ids = look.device_ids(ids)
        rows, inv = look.lookup(ids, id_order=look.ID_ORDER)
        if inv is not None:
            rows = look.rows_of_ids(rows, inv)
        return rows.view(*ids.shape, self.embedding_dim)

    @on_tables
    def prefetch(self, ids) -> None:
        """Start the next training lookup of ``ids`` (the very tensor the next step will look
        up) now, while this step computes: its ids deduplicated, admitted to the cache of hot
        rows and gathered on a CUDA side stream (a disk table: its missing rows read from the
        file); the next lookup of ``ids`` takes them. Bit-identical to not prefetching; a
        lookup of other ids ignores it; ``.weight`` drops it; on the CPU it runs at once.
        Host ids are copied and deduplicated beside the last update: pass them as they are.
        docs/cache.md ("Prefetch") has the details; a disk table looked up with a
        :class:`~nbtools.PinnedLoader`'s batches reads ahead by itself (docs/disk.md)."""
        self.lookups.prefetch(ids)

    @on_tables
    def collect(self) -> StepRows | None:
        """The rows looked up since the last call as one step's input (:class:`StepRows`), or
        None; clears the pending lookups (:meth:`TableLookups.collect`). Called by the
        optimizer."""
        return self.lookups.collect()

    @on_tables
    def clear_pending(self) -> None:
        self.lookups.clear()

    @property
    def grad_scale(self):
        """The per-row gradient weights (a row store, :meth:`set_grad_scale`), or None."""
        return self._grad_scale

    # --- state dict: 'weight' is the live table (no copy) -----------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # the live rows, current; a cache of hot rows is flushed and stays warm (load_state_dict
        # writes through .weight, which empties it first)
        destination[prefix + "weight"] = self._current(keep_cache=True, state=None)

    @on_tables
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        src = weight_in(state_dict, prefix + "weight", (self.num_embeddings, self.embedding_dim),
                        self.name, missing_keys, error_msgs)
        if src is not None:
            copy_unless_same(self.weight, src)     # .weight synchronises first

    def extra_repr(self) -> str:
        return _describe(self)

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

    @on_tables
    def forward(self, ids, offsets=None, per_sample_weights=None) -> torch.Tensor:
        return self.lookups.bags(ids, offsets, per_sample_weights, self.mode)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"


def _describe(table) -> str:
    """What ``repr(table)`` says inside its parentheses."""
    placement = table.placement
    if table.requested_placement == "auto" and table.device.type == "cuda":
        placement = f"auto -> {placement} ({table.placement_reason})"
    mode = table.transfer_mode      # how the GPU reaches host rows (zero-copy, staged)
    s = (f"{table.num_embeddings:,}, {table.embedding_dim}, name={table.name!r}, "
         f"dtype={table.config.dtype}, device={table.device}, placement={placement}"
         f"{'' if mode == table.placement else ', ' + mode}, rows="
         f"{human_bytes(table.nbytes)}")
    if table.state_names:
        s += f" with state {'+'.join(table.state_names)} in {table.layout.unit}"
    if table.padding_idx is not None:
        s += f", padding_idx={table.padding_idx}"
    where = table.rows.describe()     # (a disk table's file and RAM cache)
    return s + (", " + where if where else "") + table.hot.describe(table.rows)
