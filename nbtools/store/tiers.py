"""Tiers around a row store: a cache of hot rows above it, a write-back behind the next step.

A table reaches its rows through one tier (:class:`nbtools.store.RowTier`), built by
:func:`nbtools.placement.make_store` from the table's placement:

* the plain tier where the rows live: :class:`~nbtools.store.rows.RowStore` (GPU, pinned host,
  pageable host, CPU) or a disk table's :class:`~nbtools.disk.store.DiskStore` (its RAM slots);
* :class:`Cached` around any of them: hot rows in GPU memory, read and written there instead
  (a :class:`~nbtools.store.cache.RowCache` over host rows; over a disk table, its GPU level,
  :class:`~nbtools.disk.gpu.GpuLevel`);
* :class:`WriteBehind` around rows in host memory without a cache: a fused update writes the
  step's rows into the gathered rows in GPU memory, and a side stream writes them back to host
  memory while the next step deduplicates, gathers and computes, so the link is never idle
  while the GPU computes. The next lookup takes the rows it shares with that step from its GPU
  copy (:meth:`WriteBehind.patch`); anything else that reads or writes the host rows first
  waits for the write-back (:meth:`WriteBehind.settle`, no host synchronisation).

A wrapper answers whatever it does not change as the tier inside it does (``inner``), so the
table, its lookups and the optimizer never ask which tiers are stacked.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import devices, kernels
from ..devices import synchronize
from .capture import LookupGraphs, own_outputs
from .cache import RowCache
from .layout import RowLayout
from .rows import RowBatch, from_cache


class Tier:
    """A tier around another (``inner``): what it does not change, it answers as ``inner``
    does. What a step reads often is forwarded explicitly (a read that falls through to
    ``__getattr__`` costs ~0.9 µs, and a step makes dozens); the rest falls through."""

    # fixed for the inner tier's life: copied, read as plain attributes
    FIXED = ("host", "device", "mode", "width", "row_bytes", "keeps_host_ids", "layout")

    def __init__(self, inner):
        self.inner = inner
        for name in self.FIXED:
            setattr(self, name, getattr(inner, name))
        self.cache = inner.cache

    def __getattr__(self, name):
        if name == "inner" or name.startswith("__"):     # (unpickling: no inner yet)
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def base(self):
        """The plain tier at the bottom, where the rows live."""
        return self.inner.base

    def __repr__(self):
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def kind(self) -> str:
        return self.inner.kind

    @property
    def direct(self) -> bool:
        return self.inner.direct

    @property
    def num_rows(self) -> int:
        return self.inner.num_rows

    @property
    def write_back_queued(self) -> bool:
        return self.inner.write_back_queued

    def view(self) -> torch.Tensor:
        return self.inner.view()

    def count_bytes(self, nbytes: int, h2d: bool) -> None:
        self.inner.count_bytes(nbytes, h2d)

    def step_queued(self) -> None:
        self.inner.step_queued()

    def written(self, ids: torch.Tensor) -> None:
        self.inner.written(ids)

    def whole(self, writes: bool = False):
        return self.inner.whole(writes)

    def current_for(self, disk, cache=None) -> bool:
        return self.inner.current_for(disk, cache)

    def can_write_behind(self, rows: torch.Tensor, forced: bool = False) -> bool:
        return self.inner.can_write_behind(rows, forced)

    def settle(self) -> None:
        self.inner.settle()

    def before_gather(self, overwrites=(), after=None) -> bool:
        return self.inner.before_gather(overwrites, after)

    def writing(self, ids: torch.Tensor) -> bool:
        return self.inner.writing(ids)

    def patches_from(self, cap, stream) -> bool:
        return self.inner.patches_from(cap, stream)


class Cached(Tier):
    """``inner``'s rows with a cache of hot rows in GPU memory above them: lookups read cached
    rows from it, updates write them there. ``cache`` answers ``locate(ids)`` (each id's slot,
    -1: not cached), ``admit(ids, count, host)`` (a training lookup's) and ``rows``.
    ``writes_back``: this tier writes the cache's rows back to ``inner``'s before the rows are
    read or written from outside a step (a :class:`~nbtools.store.cache.RowCache`); False
    where ``inner`` moves rows between the levels itself (a disk table's GPU level)."""

    def __init__(self, inner, cache, writes_back: bool = True):
        super().__init__(inner)
        self.cache = cache        # (what the tiers above it see as the cache)
        self.writes_back = writes_back

    def current_for(self, disk, cache=None) -> bool:
        return self.inner.current_for(disk, self.cache)

    def flush(self, drop: bool = True) -> None:
        """Write the cached rows back to ``inner``'s (and, with ``drop``, empty the cache)."""
        if self.writes_back:
            self.cache.flush(self.inner.view(), drop)
        self.inner.flush(drop)

    def rows_now(self, keep_cache: bool) -> torch.Tensor:
        self.flush(drop=not keep_cache)
        return self.inner.rows_now(keep_cache)

    def whole(self, writes: bool = False):
        """``inner``'s whole-table face once the cached rows are written back to it (and,
        with ``writes``, the cache is emptied: the face writes below it)."""
        self.flush(drop=writes)
        return self.inner.whole(writes)

    def close(self) -> None:
        self.flush()
        self.inner.close()

    def gather(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor:
        # (ids past inner's rows address the cache's: a disk table's GPU level)
        rows = self.inner.gather(idx.clamp(max=self.inner.num_rows - 1), start, stop)
        return from_cache(rows, self.cache.rows, self.cache.locate(idx), start, stop)

    def gather_batch(self, batch: RowBatch, start: int = 0, stop=None, admit: bool = False,
                     programs: int | None = None, into: torch.Tensor | None = None,
                     written: str = "patch", cached=None) -> torch.Tensor:
        """:meth:`nbtools.store.rows.RowStore.gather_batch`, cached rows read from the cache;
        ``admit``: a training lookup, whose rows the cache counts and may admit."""
        slots = (self.cache.admit(batch.ids, batch.count, self.inner.view()) if admit
                 else self.cache.locate(batch.ids))
        return self.inner.gather_batch(batch, start, stop, admit, programs, into, written,
                                       cached=(self.cache.rows, slots))

    def target(self, ids: torch.Tensor, layout: RowLayout, rounding: str = "nearest",
               num_rows: int | None = None) -> kernels.Target:
        """Where a fused update writes: ``inner``'s rows, and the cache with each id's slot."""
        t = self.inner.target(ids, layout, rounding, num_rows)
        t.cache, t.cache_w = self.cache.rows, layout.weight(self.cache.rows)
        t.slots = self.cache.locate(ids)
        return t

    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Write whole rows ``idx``: cached ones to the cache, the rest to ``inner``."""
        slots = self.cache.locate(idx)
        hot = slots >= 0              # (the generic path has synchronised already)
        self.cache.rows[slots[hot].long()] = rows[hot].to(self.cache.rows.dtype)
        self.inner.scatter(idx[~hot], rows[~hot])


def with_cache(tier, capacity: int, ways: int = 32) -> Cached:
    """``tier`` (rows in pinned host memory, or CPU rows, where it only exercises the same
    logic) with a :class:`~nbtools.store.cache.RowCache` of up to ``capacity`` hot rows above
    it. A write-back behind the next step is not kept: cached rows are written in the cache."""
    base = tier.base
    if base.mode not in ("zero-copy", "host"):
        raise ValueError(f"a cache of hot rows needs rows in pinned host memory, not "
                         f"{base.mode!r}")
    tier.settle()
    tier.flush()
    return Cached(base, RowCache(base.view(), capacity, ways))


@dataclasses.dataclass
class _WriteBack:
    """A step's rows on their way back to host memory (:meth:`WriteBehind.write_behind`): its
    unique ids and count, the updated rows in GPU memory, the event that ends the write, the
    stream the step ran on, and the lookup captures whose outputs these are."""

    ids: torch.Tensor
    count: torch.Tensor
    rows: torch.Tensor
    event: object
    stream: object
    captures: list


class WriteBehind(Tier):
    """``inner``'s rows (host memory) written back behind the next step (see the module
    docs). ``enabled`` False: updates write the rows themselves."""

    # Smaller write-backs are written by the update itself: a step that small is bound by the
    # host's Python, which queueing a write-back costs more than its link time saves (the
    # sizes are measured in benchmarks/RESULTS.md, "Write-behind").
    WRITE_BEHIND_MIN_BYTES = 8 << 20

    def __init__(self, inner):
        super().__init__(inner)
        self.enabled = True
        self._back: _WriteBack | None = None     # the last write-back queued
        self._older = None        # event: every write-back queued before it is done
        self._put_stream = None

    def __getstate__(self) -> dict:
        # Write-backs in flight belong to this process's CUDA work: a copy waits for them.
        if self._back is not None:
            self.settle()
            synchronize(self.device)
        state = dict(self.__dict__)
        state.update(_back=None, _older=None, _put_stream=None)
        return state

    def can_write_behind(self, rows: torch.Tensor, forced: bool = False) -> bool:
        """Whether updated ``rows`` (a step's gathered ``[weight | state...]`` rows, updated
        in place) can be written back behind the next step: a zero-copy store, and at least
        :attr:`WRITE_BEHIND_MIN_BYTES` of rows (``forced``: any size, and a CPU store too,
        where the write-back runs at once: tests)."""
        return (self.mode == "zero-copy" or (forced and self.mode == "host")) \
            and self.enabled and self.cache is None \
            and rows.dtype == self.host.tensor.dtype \
            and rows.dim() == 2 and rows.shape[1] == self.width and rows.stride(1) == 1 \
            and (forced or rows.shape[0] * self.row_bytes >= self.WRITE_BEHIND_MIN_BYTES) \
            and kernels.usable_on(self.device, "rows")

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
        view = self.view()

        def put():
            kernels.put_rows(view, batch.ids, batch.count, rows,
                             programs=kernels.WRITE_BEHIND_PROGRAMS)
        if self.device.type != "cuda":
            put()
            self._older, self._back = None, _WriteBack(batch.ids, batch.count, rows, None,
                                                        None, [])
            return
        main = devices.current(self.device)
        if self._put_stream is None:
            self._put_stream = torch.cuda.Stream(self.device)
        side = self._put_stream
        side.wait_stream(main)
        own = own_outputs(captures, batch, rows)
        with devices.entered(side):
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
            current = devices.current(self.device)
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
        current = devices.current(self.device)
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
        own = own_outputs([capture] if capture is not None else [], batch, out)
        source = own_outputs(back.captures, back.ids, back.rows)
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
        current = devices.current(self.device)
        if back.captures:
            LookupGraphs.read_here(back.captures, current)
        elif current != back.stream:    # an eager lookup's tensors: kept until this stream
            for t in (back.ids, back.count, back.rows):     # is done (the one that queued
                t.record_stream(current)                    # the write-back orders itself)

    # --- what reads or writes the host rows waits for the write-backs queued ----------------
    def rows_now(self, keep_cache: bool) -> torch.Tensor:
        self.settle()               # lookups stop patching from write-backs in flight
        return self.inner.rows_now(keep_cache)

    def whole(self, writes: bool = False):
        self.settle()
        return self.inner.whole(writes)

    def gather(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor:
        self.settle()
        return self.inner.gather(idx, start, stop)

    def gather_batch(self, batch: RowBatch, start: int = 0, stop=None, admit: bool = False,
                     programs: int | None = None, into: torch.Tensor | None = None,
                     written: str = "patch", cached=None) -> torch.Tensor:
        """:meth:`nbtools.store.rows.RowStore.gather_batch`; ``written``: how rows still being
        written back are read: "patch" (from their GPU copy where this stream can, else after
        waiting), "wait", or "ignore" (inside a CUDA graph capture: the caller sees to it)."""
        patch = False
        if written == "patch":
            patch = self.before_gather()
        elif written == "wait":
            self.settle()
        rows = self.inner.gather_batch(batch, start, stop, admit, programs, into, written,
                                       cached)
        if patch:
            self.patch(batch, rows, start)
        return rows

    def target(self, ids: torch.Tensor, layout: RowLayout, rounding: str = "nearest",
               num_rows: int | None = None) -> kernels.Target:
        self.settle()
        return self.inner.target(ids, layout, rounding, num_rows)

    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        self.settle()
        self.inner.scatter(idx, rows)
