"""A GPU cache of a host table's hot rows: each row's weight *and* its optimizer state.

Real id streams (words, items, users) are Zipf-like: a few thousand rows take most lookups.
Without a cache each of those rows crosses PCIe twice per step (gathered, then written back).
With one, a hot row stays in GPU memory, ``[weight | state...]`` together, so a cached row's
optimizer state is never separated from its weight (a cache of weights alone would mix rows'
moments, or lose them on eviction).

How it works (all on the device, no host synchronisation, so a lookup with the cache still
replays as a CUDA graph):

* **Set-associative, LFU.** The cache has ``sets x ways`` slots; a row may live only in the
  ``ways`` slots of the set its id hashes to. Each row has a count of the steps that touched
  it (``freq``, optionally seeded from known frequencies with :meth:`RowCache.warm`).
* **Admission at lookup.** A training lookup's unique ids are looked up in ``slot_of`` (row ->
  slot). In each set, the most frequent missing row takes the set's least-frequent way when
  its own count is higher (one admission per set and lookup); rows of the current lookup are
  never evicted. The evicted row is written back to host
  memory first (write-back on eviction); then the new row is copied in. Rows that are not
  admitted (cold, or not their set's turn, or a cache smaller than one batch)
  are read and written in host memory, as without a cache.
* **Updates go where the row is.** The optimizer's step finds each row's slot again
  (:meth:`RowCache.locate`) and writes cached rows to the cache, the others to host memory.
* **Flush.** :meth:`RowCache.flush` writes every cached row back; the table calls it before
  its host rows are read or written from outside a step (``.weight``, ``state_dict``,
  checkpoints) and drops the cache's rows, so the host copy is the one truth again.

The arithmetic of a step is the same with and without a cache (the same kernels on the same
values), so the tables and states after N steps are identical.
"""
from __future__ import annotations

import warnings

import torch

from .. import kernels
from ..devices import gpu_free_bytes
from ..hostmem import count_cache
from ..units import human_bytes
from ..kernels import CACHE_HASH as _HASH  # the admission kernel hashes ids the same way


class RowCache:
    """The hot rows of one table, in GPU memory.

    Args:
        host: the table's rows as the compute device reaches them ([N, W]: the zero-copy
            view, or the CPU tensor).
        capacity: rows the cache may hold (rounded down to whole sets; at least one set).
        ways: slots per set (fewer for a cache of under 64 x ``ways`` rows, so that it has
            64 sets: each set admits one row per lookup).

    ``stats`` is a device tensor ``[lookups, hits, admitted, evicted]`` (cumulative counts of
    unique rows): read it with the optimizer's one synchronisation, not on its own.
    """

    def __init__(self, host: torch.Tensor, capacity: int, ways: int = 32):
        n, width = host.shape
        device = host.device
        # at least 64 sets where the capacity allows: one admission per set and lookup
        self.ways = max(1, min(ways, capacity // 64))
        self.sets = max(1, capacity // self.ways)
        self.capacity = self.sets * self.ways
        self.num_rows = n
        self.device = device
        self.rows = torch.zeros(self.capacity, width, dtype=host.dtype, device=device)
        # the last entry of each map is a dummy that masked writes go to
        self.tags = torch.full((self.capacity + 1,), -1, dtype=torch.long, device=device)
        self.slot_of = torch.full((n + 1,), -1, dtype=torch.int32, device=device)
        self.freq = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.stamp = torch.zeros(self.capacity + 1, dtype=torch.long, device=device)
        self.tick = torch.zeros(1, dtype=torch.long, device=device)
        self.stats = torch.zeros(4, dtype=torch.long, device=device)
        self._way = torch.arange(self.ways, device=device)
        self._best = torch.full((self.sets,), -1, dtype=torch.long, device=device)
        self._set_ids = torch.arange(self.sets, device=device)
        # admission in two Triton kernels where they run (else the torch code below)
        self.use_kernels = True

    @staticmethod
    def overhead_bytes(num_rows: int) -> int:
        """GPU bytes the cache needs beyond its rows: the row -> slot map and the counts."""
        return 8 * (num_rows + 1)

    @staticmethod
    def slot_bytes(row_bytes: int) -> int:
        """GPU bytes per cached row: the row, its tag and its stamp."""
        return row_bytes + 16

    @property
    def nbytes(self) -> int:
        return (self.rows.numel() * self.rows.element_size()
                + self.tags.numel() * 8 + self.stamp.numel() * 8
                + self.slot_of.numel() * 4 + self.freq.numel() * 4)

    def set_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The set each id hashes to: a row is cached only in one of its set's ``ways``."""
        return torch.remainder(ids * _HASH, self.sets)

    # --- the step --------------------------------------------------------------------------
    def locate(self, ids: torch.Tensor) -> torch.Tensor:
        """Slot of each id (int32; -1: in host memory). Ids in ``[0, num_rows]`` (the
        sentinel ``num_rows`` is never cached)."""
        return self.slot_of.index_select(0, ids)

    def admit(self, ids: torch.Tensor, count: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Count a training lookup's unique ``ids`` (sorted, sentinel-padded, ``count`` [1] in
        use) and admit, in each set, the most frequent missing row when it is more frequent
        than the set's least frequent row (rows of this lookup are never evicted): the evicted
        row is written back to ``host``, the admitted one copied in. Returns each id's slot
        (int32, -1 for rows left in host memory), as :meth:`locate` would now.

        One admission per set and lookup keeps this to a few passes over the ids (no sort) and
        one over the sets' ways: a hot row that loses its set's turn comes back at a later
        step."""
        self.tick += 1
        if self.use_kernels and kernels.usable_on(self.device, "admission"):
            # two kernels, the same decisions
            kernels.admit(ids, count, host, rows=self.rows, tags=self.tags, slot_of=self.slot_of,
                          freq=self.freq, stamp=self.stamp, tick=self.tick, best=self._best,
                          stats=self.stats, ways=self.ways)
            return self.locate(ids)
        cap = ids.numel()
        n, ways = self.num_rows, self.ways
        pos = torch.arange(cap, device=ids.device)
        live = (pos < count) & (ids < n)
        self.freq.index_add_(0, ids, live.int())
        slot = self.slot_of.index_select(0, ids).long()
        hit = live & (slot >= 0)
        # rows of this lookup are not evicted by it
        self.stamp.scatter_(0, torch.where(hit, slot, self.capacity), self.tick.expand(cap))
        miss = live & (slot < 0)
        f = self.freq.index_select(0, ids).long()
        sets = self.set_of(ids)
        # each set's candidate: its most frequent miss (ties: the larger id)
        key = torch.where(miss, (f << 32) | ids, -1)
        best = self._best.scatter_reduce_(0, sets, key, "amax")   # all -1 between lookups
        cand = torch.where(best >= 0, best & 0xFFFFFFFF, -1)          # per set: a row or -1
        # its victim: the set's least frequent way (empty: -1; this lookup's rows: never)
        tags = self.tags[: self.capacity].view(self.sets, ways)
        score = torch.where(tags >= 0, self.freq.index_select(0, tags.clamp(min=0).view(-1))
                            .view(self.sets, ways).long(), -1)
        score = torch.where(self.stamp[: self.capacity].view(self.sets, ways) == self.tick,
                            torch.iinfo(torch.long).max, score)
        victim_score, way = score.min(dim=1)
        admitted = (best >= 0) & ((best >> 32) > victim_score)       # per set
        slot_new = torch.where(admitted, self._set_ids * ways + way, -1)
        victim = torch.where(admitted, tags.gather(1, way.unsqueeze(1)).squeeze(1), -1)
        # write the evicted rows back, then copy the admitted ones in
        self._copy(self.rows, torch.where(victim >= 0, slot_new, -1), host, victim)
        self._copy(host, torch.where(admitted, cand, -1), self.rows, slot_new)
        self.slot_of.scatter_(0, torch.where(victim >= 0, victim, n),
                              torch.full_like(victim, -1, dtype=torch.int32))
        self.slot_of.scatter_(0, torch.where(admitted, cand, n), slot_new.int())
        self.slot_of[n:].fill_(-1)          # (a slice: writable inside a CUDA graph)
        self.tags.scatter_(0, torch.where(admitted, slot_new, self.capacity), cand)
        self.tags[self.capacity:].fill_(-1)
        self.stamp.scatter_(0, torch.where(admitted, slot_new, self.capacity),
                            self.tick.expand(self.sets))
        self.stats += torch.stack((live.sum(), hit.sum(), admitted.sum(),
                                   (victim >= 0).sum()))
        # each id's slot: its own if it hit; its set's new slot if it was the set's winner
        won = miss & (key == best.index_select(0, sets))
        slots = torch.where(hit, slot, torch.where(won, slot_new.index_select(0, sets), -1))
        self._best.fill_(-1)
        return slots.int()

    def _copy(self, src, sidx, dst, didx) -> None:
        """``dst[didx] = src[sidx]`` where both are >= 0."""
        if kernels.usable_on(self.device, "rows"):
            kernels.copy_rows(src, sidx, dst, didx)
            return
        keep = (sidx >= 0) & (didx >= 0)          # the CPU path: a sync costs nothing here
        dst.index_copy_(0, didx[keep], src.index_select(0, sidx[keep]))

    # --- outside the step ------------------------------------------------------------------
    def flush(self, host: torch.Tensor, drop: bool = True) -> None:
        """Write every cached row back to ``host``; ``drop``: then empty the cache (the row
        counts are kept, so the hot rows come back at the next steps)."""
        tags = self.tags[: self.capacity]
        self._copy(self.rows, torch.arange(self.capacity, device=self.device), host, tags)
        if drop:
            self.slot_of.scatter_(0, torch.where(tags >= 0, tags, self.num_rows),
                                  torch.full_like(tags, -1, dtype=torch.int32))
            self.slot_of[self.num_rows:].fill_(-1)
            self.tags.fill_(-1)

    def warm(self, counts: torch.Tensor, host: torch.Tensor) -> None:
        """Seed the row counts with known frequencies (e.g. word counts) and load, in each set,
        its most frequent rows. Rows already cached are flushed first."""
        self.flush(host)
        counts = torch.as_tensor(counts).to(self.device)
        self.freq[: self.num_rows] = counts.clamp(0, torch.iinfo(torch.int32).max).int()
        ids = torch.arange(self.num_rows, device=self.device)
        f = self.freq[: self.num_rows].long()
        sets = self.set_of(ids)
        key, order = torch.sort(sets * (1 << 31) + ((1 << 31) - 1 - f))
        s_sets = sets[order]
        pos = torch.arange(self.num_rows, device=self.device)
        first = torch.ones_like(s_sets, dtype=torch.bool)
        first[1:] = s_sets[1:] != s_sets[:-1]
        rank = pos - torch.cummax(torch.where(first, pos, 0), 0).values
        take = (rank < self.ways) & (f[order] > 0)
        slot = torch.where(take, s_sets * self.ways + rank, -1)
        self.tags[: self.capacity] = -1
        self.tags.scatter_(0, torch.where(take, slot, self.capacity), order)
        self.tags[self.capacity:].fill_(-1)
        self.slot_of.scatter_(0, torch.where(take, order, self.num_rows), slot.int())
        self.slot_of[self.num_rows:].fill_(-1)
        self._copy(host, torch.where(take, order, -1), self.rows, slot)

    def cached_rows(self) -> int:
        """Rows in the cache now (a host sync)."""
        return int((self.tags[: self.capacity] >= 0).sum())


# The config options that ask a table for a GPU cache of hot rows (one at most).
CACHE_OPTIONS = ("cache_bytes", "cache_fraction", "cache_rows")


def cache_budget(rows, cfg, *, name: str, placement: str, asked: str,
                 num_rows: int) -> tuple[int | None, str]:
    """GPU bytes for the cache of hot rows of a table over tier ``rows`` (``num_rows`` rows,
    its ``placement``, the placement ``asked`` for), and why (its config ``cfg``'s cache_bytes,
    cache_fraction or cache_rows; under placement="auto", gpu_fraction): (None, "") for none."""
    given = [k for k in CACHE_OPTIONS if getattr(cfg, k) is not None]
    if len(given) > 1:
        raise ValueError(f"table {name!r}: give one of cache_bytes, cache_fraction and "
                         f"cache_rows, not {' and '.join(given)}")
    if placement not in ("host", "disk") or rows.device.type != "cuda" and not (
            cfg.cache_bytes or cfg.cache_rows):
        return None, ""
    if cfg.cache_bytes is not None:
        return int(cfg.cache_bytes), "cache_bytes"
    if cfg.cache_rows is not None:
        return (RowCache.overhead_bytes(num_rows) + int(cfg.cache_rows)
                * RowCache.slot_bytes(rows.row_bytes)), "cache_rows"
    fraction = cfg.cache_fraction
    why = "cache_fraction"
    if fraction is None and asked == "auto":
        fraction, why = cfg.gpu_fraction, "auto: gpu_fraction"
    if fraction is None:
        return None, ""
    if not 0 < fraction <= 1:
        raise ValueError(f"table {name!r}: cache_fraction must be in (0, 1], got "
                         f"{fraction!r}")
    free = gpu_free_bytes(rows.device)
    return int(fraction * free), f"{why} {fraction:.0%} of {human_bytes(free)} free"


class CacheCounts:
    """A table's cache readings as optimizer steps take them: the cumulative ``[lookups, hits,
    admitted, evicted]`` of its last reading, and the PCIe bytes each reading accounts for."""

    def __init__(self):
        self.seen = [0, 0, 0, 0]

    @staticmethod
    def saved_bytes(row_bytes: int, hits: int, admitted: int, evicted: int) -> int:
        """PCIe bytes the cache saved: a hit reads and writes nothing over PCIe, an admission
        reads its row once and an eviction writes it once."""
        return (2 * hits - admitted - evicted) * row_bytes

    def record(self, stats, rows) -> None:
        """Take a reading ``stats`` of the cache over row store ``rows``: count the rows that
        crossed PCIe since the last one (the store's byte counters and the meters')."""
        lookups, hits, admitted, evicted = (int(v) - s for v, s in zip(stats, self.seen))
        self.seen = [int(v) for v in stats]
        row = rows.row_bytes
        rows.count_bytes((lookups - hits) * row, h2d=True)
        rows.count_bytes((lookups - hits - admitted + evicted) * row, h2d=False)
        count_cache(lookups, hits, self.saved_bytes(row, hits, admitted, evicted))

    def summary(self, rows) -> dict:
        """What ``table.cache_stats()`` returns (empty when ``rows`` has no cache)."""
        cache = rows.cache
        if cache is None:
            return {}
        lookups, hits, admitted, evicted = self.seen
        return {"lookups": lookups, "hits": hits,
                "hit_rate": hits / lookups if lookups else float("nan"),
                "admitted": admitted, "evicted": evicted,
                "bytes_saved": self.saved_bytes(rows.row_bytes, hits, admitted, evicted),
                "capacity_rows": cache.capacity, "cache_bytes": cache.nbytes}


def cache_capacity(rows, cfg, *, name: str, placement: str, asked: str,
                   num_rows: int) -> tuple:
    """``(rows, why)``: how many rows the GPU cache of hot rows a table's config asks for
    holds (None: no cache), and why (for its repr); the arguments as :func:`cache_budget`'s.
    Called when its optimizer attaches: the rows' width, with their state, is known only then.
    The table attaches the cache itself."""
    budget, why = cache_budget(rows, cfg, name=name, placement=placement, asked=asked,
                               num_rows=num_rows)
    if budget is None:
        return None, why
    if rows.mode not in ("zero-copy", "host"):
        warnings.warn(f"table {name!r}: no cache of hot rows for {rows.mode!r} "
                      "rows (it needs pinned host memory and CUDA)", RuntimeWarning,
                      stacklevel=5)
        return None, why
    n = num_rows
    fixed, per_row = rows.cache_cost(n)     # (a disk table's own GPU level: maps in host RAM)
    capacity = cfg.cache_rows or (budget - fixed) // per_row
    if capacity < 1 and not fixed:
        raise ValueError(f"table {name!r}: a cache of {human_bytes(budget)} cannot "
                         f"hold one row of {human_bytes(rows.row_bytes)}")
    if capacity < 1:
        raise ValueError(
            f"table {name!r}: a cache of {human_bytes(budget)} cannot hold one row: its "
            f"row -> slot map alone takes {human_bytes(fixed)} and a "
            f"row {human_bytes(per_row)}; give "
            "cache_bytes more room or leave the cache off")
    return min(capacity, n), why


def warm_counts(counts, num_rows: int, name: str) -> torch.Tensor:
    """Known row frequencies as the int32 counts a cache is seeded with: ``counts`` (ints) as
    they are, or shares (floats of any scale, e.g. normalised frequencies summing to 1) scaled
    so that the smallest positive share becomes 1 (shares of real counts give those counts
    back; the largest is kept within int32), each positive value at least 1. What matters is
    the order of the hottest rows and the counters' seed: a share rounded to 0 would warm
    nothing. TypeError / ValueError say what is wrong with ``counts``.

    >>> warm_counts(torch.tensor([0.5, 0.25, 0.25, 0.0]), 4, "t").tolist()
    [2, 1, 1, 0]
    >>> warm_counts([3, 0, 7], 3, "t").tolist()
    [3, 0, 7]
    """
    if isinstance(counts, torch.Tensor):
        values = counts.detach().cpu()
    elif isinstance(counts, (list, tuple)) or type(counts).__module__ == "numpy":
        try:
            values = torch.as_tensor(counts)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"table {name!r}: counts must be numbers, one a row; {e}") from None
    else:
        raise TypeError(f"table {name!r}: counts must be a tensor, numpy array or list of "
                        f"{num_rows:,} row counts or shares, got {type(counts).__name__}")
    if values.dtype == torch.bool or values.is_complex():
        raise TypeError(f"table {name!r}: counts must be integer counts or float shares, got "
                        f"dtype {values.dtype}")
    if values.shape != (num_rows,):
        raise ValueError(f"table {name!r}: counts must be a finite tensor of shape "
                         f"({num_rows},), one count or share a row, got {tuple(values.shape)}")
    if values.is_floating_point():
        values = values.double()
        if not torch.isfinite(values).all():
            raise ValueError(f"table {name!r}: counts must be finite; row "
                             f"{int((~torch.isfinite(values)).nonzero()[0])} is "
                             f"{float(values[~torch.isfinite(values)][0])}")
    if (values < 0).any():
        bad = int((values < 0).nonzero()[0])
        raise ValueError(f"table {name!r}: counts must be >= 0 (how often each row is used); "
                         f"row {bad} is {values[bad].item()}")
    top = torch.iinfo(torch.int32).max
    if values.is_floating_point():
        positive = values[values > 0]
        if len(positive):
            scale = min(max(1.0, 1.0 / float(positive.min())), top / float(positive.max()))
            values = torch.where(values > 0, (values * scale).round().clamp(1, top), 0.0)
    return values.clamp(max=top).int()


class TableCache:
    """A table's GPU cache of hot rows as the table sees it (``table.hot``): the size its
    config asks for and why, counts given to :meth:`warm` before the cache exists, and the
    readings optimizer steps take. The cache itself is the row store's (``table.rows.cache``:
    a :class:`RowCache`, or for a disk table the GPU level above its RAM slots,
    :class:`nbtools.disk.gpu.GpuLevel`)."""

    def __init__(self):
        self.why = ""                  # what sized it (for the table's repr)
        self.counts = CacheCounts()    # its readings, as optimizer steps take them
        self.warm_counts = None        # warm() before the cache exists
        self.attached = False          # attach() ran: the rows have their final place

    def attach(self, table) -> None:
        """The cache ``table``'s config asks for (:func:`cache_capacity`: once its optimizer
        attached, the rows' width with their state is known), warmed with the counts given
        before."""
        self.attached = True
        capacity, self.why = cache_capacity(
            table.rows, table.config, name=table.name, placement=table.placement,
            asked=table.requested_placement, num_rows=table.num_embeddings)
        if capacity is not None and table.rows.attach_cache(capacity):
            table.sync_slab()           # a cache of the tier's own: a disk table's GPU level
        elif capacity is not None:
            table.stack_cache(capacity)
            self.counts = CacheCounts()
        counts, self.warm_counts = self.warm_counts, None
        if counts is not None:
            self.warm(table, counts)
        if capacity is not None:
            table.lookup_graphs.invalidate()

    @staticmethod
    def may_cache(rows, config, asked: str) -> bool:
        """Whether a table over tier ``rows``, with ``config`` and placement ``asked`` for,
        has, or may get when its optimizer attaches, a cache to warm: a disk table's RAM (and
        GPU level), a host table's GPU cache."""
        return rows.own_cache or rows.cache is not None or asked in ("auto", "disk") or any(
            getattr(config, k) is not None for k in CACHE_OPTIONS)

    def warm(self, table, counts) -> None:
        """:meth:`nbtools.OffloadedEmbedding.warm_cache`."""
        counts = warm_counts(counts, table.num_embeddings, table.name)
        if not self.attached:           # the rows move (with their state) when it attaches:
            keep = self.may_cache(table.rows, table.config, table.requested_placement)
            self.warm_counts = counts if keep else None     # warmed again then
        # A tier with a cache of its own (a disk table's RAM and GPU level) is warmed now too:
        # one used without an optimizer (inference) never attaches.
        if table.rows.warm_rows(counts):
            table.sync_slab()
            return
        if not self.attached:
            return
        cache = table.rows.cache
        if cache is None:
            return
        table.lookups.prefetcher.drop()
        cache.warm(counts, table.rows.view())
        table.lookup_graphs.invalidate()

    def summary(self, rows) -> dict:
        """:meth:`nbtools.OffloadedEmbedding.cache_stats` of a table over tier ``rows``."""
        if rows.own_cache:               # (a disk table's levels: GPU and RAM, or RAM alone)
            return rows.own_cache_stats()
        return self.counts.summary(rows)

    def describe(self, rows) -> str:
        """What ``repr(table)`` says of the cache of a table over tier ``rows`` ("" without
        one)."""
        cache = rows.cache
        if cache is None:
            return ""
        if rows.own_cache:                           # (a disk table's GPU level)
            return f", {cache.describe()} ({self.why})"
        return f", cache={cache.capacity:,} rows ({human_bytes(cache.nbytes)}, {self.why})"
