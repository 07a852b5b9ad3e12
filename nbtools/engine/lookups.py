"""A table's lookups, and what an optimizer step takes from them: the table's side of the
row protocol (docs/step.md).

A lookup (``table(ids)``) deduplicates its ids on the compute device
(:func:`nbtools.store.rows.unique_ids`) and gathers only the unique rows from wherever the table
keeps them (its :class:`~nbtools.store.rows.RowStore`; a disk table brings them into RAM slots
first, :mod:`nbtools.disk`). A training lookup gathers whole rows ``[weight | state...]`` and
stays *pending* until the optimizer's step calls :meth:`TableLookups.collect`, which turns the
pending lookups into one :class:`StepRows`: the unique ids, their gradients summed per id, and
the rows as gathered. With the optimizer's side (:mod:`nbtools.optim.slot`: each table's update
of those rows) this is what happens to a row in a step; where the rows live is below both, in
:mod:`nbtools.store.rows`.

:class:`TableLookups` is the object a table owns for this (``table.lookups``) and imports
nothing of :mod:`nbtools.tables`: it reaches its table through the table's public surface
(``rows``, ``layout``, ``disk``, ``state_names``, ``grad_scale``, ``sync_slab``,
``compute_dtype``, ``deterministic`` and the table's shape and config). Each pending lookup is a
named :class:`Pending` record.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels
from . import ahead
from .prefetch import Prefetcher
from ..store.capture import LookupGraphs
from ..store.rows import RowBatch, merge, sum_by_slot, sums_in_fixed_order, unique_ids

# A table warns once when this many lookups wait for an optimizer step: a loop that runs the
# table with autograd on but never steps (evaluation without torch.no_grad) would grow forever.
PENDING_WARN = 256


class UnconsumedGradientWarning(UserWarning):
    """A table's gradients reached it but no :class:`nbtools.OffloadOptimizer` takes them:
    the table does not train (a plain ``torch.optim`` optimizer updates only the other
    parameters)."""


def caller_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised here that names the first frame outside nbtools
    and torch: the user's line that ran the model (however many modules and decorators lie
    between)."""
    inner = tuple(os.path.dirname(f) + os.sep for f in (os.path.dirname(__file__), torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inner):
        frame, level = frame.f_back, level + 1
    return level


def ids_error_position(flat_bad: torch.Tensor, shape) -> str:
    pos = int(flat_bad.nonzero()[0, 0])
    if len(shape) <= 1:
        return f"position {pos}"
    return f"position {tuple(int(i) for i in np.unravel_index(pos, tuple(shape)))}"


@dataclasses.dataclass
class StepRows:
    """What an optimizer step needs from one table: the rows touched since the last step.

    Everything is on the compute device and nothing here needed a host synchronisation.
    Attributes:
        batch: the unique ids (:class:`nbtools.store.rows.RowBatch`).
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

    def queue_sum(self, found: torch.Tensor | None = None) -> bool:
        """Queue the per-id sum into ``grad`` (on the current stream; inside a CUDA graph
        capture it becomes part of the graph). Does nothing where ``grad`` is written.
        Returns whether the sum also checked ``grad`` for inf/nan into ``found`` (a float [1]
        set to 1.0 if so; :func:`nbtools.store.rows.sum_by_slot`), so that no other pass need."""
        if self.summing is None:
            return False
        grad, batch = self.summing
        checks = found is not None and sums_in_fixed_order(grad, self.table.deterministic)
        sum_by_slot(grad, batch, self.table.deterministic, out=self.grad,
                    found=found if checks else None)
        return checks

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


@dataclasses.dataclass
class Pending:
    """A training lookup waiting for the optimizer's step (:meth:`TableLookups.collect`).

    ``batch``: its unique ids (:class:`~nbtools.store.rows.RowBatch`); ``leaf``: its unique
    rows as the gradient's leaf, or ``by_id``: its rows in the order of its ids as the leaf (one
    of the two is None); ``full``: the whole gathered rows ``[weight | state...]`` or None;
    ``flat``/``shape``: its ids, to name a bad one; ``capture``: the CUDA graph capture whose
    outputs these are, or None."""

    batch: RowBatch
    leaf: torch.Tensor | None
    full: torch.Tensor | None
    flat: torch.Tensor
    shape: tuple
    capture: object = None
    by_id: torch.Tensor | None = None

    @property
    def grad_leaf(self) -> torch.Tensor:
        """The tensor its gradient lands on."""
        return self.leaf if self.by_id is None else self.by_id


class TableLookups:
    """A table's lookups and the step input they make: what ``table(ids)`` does, the
    lookups pending until the optimizer's step (:class:`Pending` records), the CUDA graphs
    of training lookups (``graphs``) and a lookup started ahead (``prefetcher``). One per
    table (``table.lookups``); it reaches the table through its public surface (``rows``,
    ``layout``, ``disk``, ``state_names``, ``grad_scale``, ``sync_slab``, ...).
    """

    # A table's forward asks for its rows in id order (:meth:`result`); False: unique rows
    # upcast, then reordered (the earlier order; the probe prefetch_overlap.py --toggle id_order
    # in git history).
    ID_ORDER = True
    # ... reordered and upcast in one kernel (nbtools.kernels.take_rows) where the weights are
    # stored narrower than they compute and the step's kernels run; False: index_select, then
    # an upcast (the earlier path; the probe prefetch_overlap.py --toggle take_rows in git history).
    FUSED_TAKE = True

    def __init__(self, table):
        self.table = table
        self.pending: list[Pending] = []    # training lookups the next step takes
        self.graphs = LookupGraphs()
        self.prefetcher = Prefetcher(self)   # a training lookup started ahead (prefetch)
        self.owned = False                  # an OffloadOptimizer steps the table
        self.warned_pending = False
        self.warned_unconsumed = False      # UnconsumedGradientWarning given

    # --- lookups ----------------------------------------------------------------------------
    def prepare_ids(self, ids) -> torch.Tensor:
        t = self.table
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(f"table {t.name!r}: ids must be an integer tensor, "
                                f"got {type(ids).__name__}") from e
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"table {t.name!r}: ids must be integers, got dtype {ids.dtype}; "
                            "convert with ids.long() if they are whole numbers")
        if t.rows.keeps_host_ids:       # deduplicated on the CPU: host ids stay there
            return ids
        return ids.to(t.device, non_blocking=True)

    def raise_bad_ids(self, flat: torch.Tensor, shape) -> None:
        """Raise the IndexError that names the first out-of-range id of ``flat`` (a lookup of
        ``shape``) and its position. A host sync: called once a check has found one."""
        t = self.table
        bad = (flat < 0) | (flat >= t.num_embeddings)
        value = int(flat[bad.nonzero()[0, 0]])
        raise IndexError(
            f"table {t.name!r} has {t.num_embeddings:,} rows but ids contain {value:,} "
            f"(first at {ids_error_position(bad, shape)}); valid ids are 0 to "
            f"{t.num_embeddings - 1:,}")

    def lookup(self, ids: torch.Tensor, id_order: bool = False):
        """Deduplicate ``ids`` (any shape) and gather the unique rows, without a host sync.

        Returns (rows [capacity, dim], inverse [ids.numel()]), or with ``id_order`` where
        :meth:`result` can, (rows in the order of the ids [ids.numel(), dim], None).
        Ids are checked here when the
        lookup is not training a table that an OffloadOptimizer steps (a host sync); when it
        is, the check runs on the device and the optimizer's step reads its verdict, with
        every other flag of the step, in one synchronisation, before anything is written.
        """
        t = self.table
        flat = ids.reshape(-1).long()      # int64: index_copy_ (the write-back) takes no other
        recording = torch.is_grad_enabled() and t.trainable
        if recording and not self.owned and self.pending:
            self._warn_unconsumed()
        store = t.rows
        width = store.width if (recording and t.state_names) else t.layout.weight_cols
        if store.keeps_host_ids:        # a disk table: rows brought in from the file first
            return self._disk_lookup(ids, recording, width, id_order)
        self.prefetcher.wait()          # its cache admission comes before this lookup's
        if recording and self.owned and self.prefetcher.matches(ids, width):
            return self.prefetcher.take(flat, ids.shape, id_order)
        captured = None
        if recording and self.owned and t.config.cuda_graphs and store.direct \
                and t.device.type == "cuda" and kernels.usable_on(t.device, "rows"):
            captured = self.graphs.run(store, flat, t.padding_idx, width)
        if captured is not None:
            batch, full, capture = captured
        else:
            capture = None
            batch = unique_ids(flat, t.num_embeddings, t.padding_idx)
            if not (recording and self.owned) and bool(batch.bad):   # note: a sync point
                self.raise_bad_ids(flat, ids.shape)
            with torch.no_grad():
                # Training: whole rows now, so the optimizer step needs no second gather.
                full = store.gather_batch(batch, 0, width, admit=recording and self.owned)
        return self.result(batch, full, flat, ids.shape, capture, recording, id_order)

    def result(self, batch, full, flat, shape, capture, recording: bool,
               id_order: bool = False):
        """What a lookup returns from its gathered rows ``full``, ``(rows, inverse)``, and its
        pending record where it trains.

        ``id_order`` (the caller wants the rows in the order of its ids): where the lookup
        trains a table with optimizer state, or does not train, ``(rows in id order, None)``,
        taken from ``full`` in its storage dtype and then upcast: for bf16 rows one small
        copy instead of upcasting the unique rows and then reordering the upcast copy (twice
        the bytes). Training, they are the leaf the gradient lands on (as
        :meth:`rows_of_ids` makes it)."""
        t = self.table
        state = recording and bool(t.state_names)
        compute = t.compute_dtype
        if id_order and (state or not recording):
            weights = t.layout.weight(full)
            if weights.dtype != compute and self.FUSED_TAKE \
                    and kernels.usable_on(weights.device, "rows"):
                rows = kernels.take_rows(weights, batch.inverse, compute)
            else:
                rows = weights.index_select(0, batch.inverse)
                if rows.dtype != compute:
                    rows = rows.to(compute)
            if state:
                self._record(Pending(batch, None, full, flat, shape, capture,
                                     rows.requires_grad_(True)))
            return rows, None
        rows = self._leaf(full)
        if not state:
            full = None
        if recording:
            self._record(Pending(batch, rows.requires_grad_(True), full, flat, shape, capture))
        return rows, batch.inverse

    def _warn_unconsumed(self) -> None:
        """A training lookup of a table no OffloadOptimizer steps (none was made over it, or
        one was made over another model): the earlier lookups whose gradients arrived will
        never be applied. Warns once per table, and drops those lookups, which would otherwise
        pile up with their rows and gradients at every step of a loop that never trains the
        table."""
        stale = [rec for rec in self.pending if rec.grad_leaf.grad is not None]
        if not stale:                # no backward yet (this forward's earlier lookups)
            return
        self.pending = [rec for rec in self.pending if rec.grad_leaf.grad is None]
        LookupGraphs.release(rec.capture for rec in stale)
        if self.warned_unconsumed:
            return
        self.warned_unconsumed = True
        warnings.warn(
            f"table {self.table.name!r} received gradients, but no nbtools.OffloadOptimizer "
            "steps it, so its rows never change (a plain torch.optim optimizer updates only the "
            "model's other parameters, and an OffloadOptimizer steps only the tables of the "
            "model it was made with). Make the optimizer over this model: "
            "opt = nbtools.OffloadOptimizer(torch.optim.Adam, model, lr=...), one optimizer "
            "for the tables and the other parameters.", UnconsumedGradientWarning,
            stacklevel=caller_stacklevel())

    def _record(self, rec: Pending) -> None:
        """Keep a training lookup's record for the optimizer's step (:meth:`collect`)."""
        self.pending.append(rec)
        if len(self.pending) > PENDING_WARN and not self.warned_pending:
            self.warned_pending = True
            warnings.warn(
                f"table {self.table.name!r} holds {len(self.pending)} lookups waiting for an "
                "optimizer step: run evaluation under torch.no_grad(), or call "
                "optimizer.zero_grad()", RuntimeWarning, stacklevel=caller_stacklevel())

    def _disk_lookup(self, ids: torch.Tensor, recording: bool, width: int,
                     id_order: bool = False):
        """:meth:`lookup` for a disk table: its rows are brought into RAM slots first (or are
        in its GPU cache), then gathered from there like a host table's (nbtools.disk)."""
        t = self.table
        training = recording and self.owned
        # ids a loader handed out: its coming batches are read ahead (nbtools.engine.ahead)
        key = ahead.key_of(self, ids) if training else None
        batch, slots = t.rows.batch_of(ids, training, key, t.padding_idx)
        if training:
            ahead.follow(self, ids, t.disk, t.padding_idx)
        t.sync_slab()                # (the RAM cache may have grown: a new store)
        if not training and bool(batch.bad):                # note: a sync point
            self.raise_bad_ids(ids.reshape(-1), ids.shape)
        store = t.rows
        with torch.no_grad():
            full = store.gather_batch(batch, 0, width)
        if not training:             # its slots may be reused once the gather has run
            store.used(slots)
        return self.result(batch, full, ids.reshape(-1), ids.shape, None, recording, id_order)

    # --- prefetch ---------------------------------------------------------------------------
    def prefetch(self, ids) -> None:
        """``table.prefetch(ids)``: :meth:`nbtools.OffloadedEmbedding.prefetch`."""
        t = self.table
        if not (self.owned and t.trainable):
            raise ValueError(f"table {t.name!r}: prefetch starts a training lookup; create "
                             "the OffloadOptimizer that steps this table first")
        store = t.rows     # a disk table: the rows the next step misses, read from the file now
        if store.keeps_host_ids and store.read_ahead(self.prepare_ids(ids), t.padding_idx):
            ahead.explicit(self)
            t.sync_slab()
            return
        self.prefetcher.start(ids)

    def _leaf(self, full: torch.Tensor) -> torch.Tensor:
        """The weights of gathered rows as the leaf autograd sees: a fresh tensor (never a
        capture's or a prefetch's buffer), in the compute dtype (upcast from bf16 storage)."""
        t = self.table
        rows = t.layout.weight(full)
        return rows.to(t.compute_dtype) if rows.dtype != t.compute_dtype else rows[:, :]

    def collect(self) -> StepRows | None:
        """The row protocol's step input: the rows looked up since the last call, their unique
        ids and summed gradients (:class:`StepRows`), or None when no row has a gradient.
        Clears the pending lookups. No host synchronisation. Called by the optimizer."""
        t = self.table
        store = t.rows
        if store.cache is not None or self.prefetcher.UPDATE_WAITS:
            self.prefetcher.wait()    # the update must not race the prefetch's admission
        records = [rec for rec in self.pending if rec.grad_leaf.grad is not None]
        LookupGraphs.release(rec.capture for rec in self.pending if rec.grad_leaf.grad is None)
        self.pending.clear()
        store.step_queued()          # (a disk table: the update of their slots comes next)
        if not records:
            return None
        lookups = [(r.flat, r.shape) for r in records]
        has_state = all(r.full is not None for r in records)
        summing = None
        scale = t.grad_scale
        if len(records) == 1:
            rec = records[0]
            batch = rec.batch
            if t.padding_idx is None and scale is None:
                grad, summing = self._deferred_grad(rec)
            else:
                grad = self._grad_of(rec)
            rows = rec.full if has_state else rec.leaf.detach()
        else:                        # several lookups this step: one more dedup across them
            batch, grad, pick = merge([r.batch for r in records],
                                      [self._grad_of(r) for r in records])
            parts = [r.full if has_state else r.leaf.detach() for r in records]
            rows = torch.cat(parts).index_select(0, pick)
        if t.padding_idx is not None:
            # padding ids became the sentinel slot: its gradient is never applied, nor checked
            grad = grad.masked_fill((batch.ids == batch.num_rows).unsqueeze(1), 0)
        if scale is not None:
            grad = grad * scale.gather_batch(batch).to(grad.dtype)
        captures = [r.capture for r in records]
        store.written(batch.ids)     # (whole-table readers count these rows as changed)
        # a prefetch reads these rows again (batch.ids: a capture's output where one lookup)
        self.prefetcher.written(batch.ids, captures if len(records) == 1 else ())
        cache = store.cache
        return StepRows(batch, grad, rows, has_state, lookups, captures, t,
                        None if cache is None else cache.stats, summing)

    def _grad_of(self, rec: Pending) -> torch.Tensor | None:
        """A pending lookup's gradient per unique row [capacity, d], or None: the gradient of
        its rows in id order summed per id (:func:`nbtools.store.rows.sum_by_slot`: in a fixed
        order on CUDA unless OffloadConfig(deterministic=False))."""
        grad = rec.grad_leaf.grad
        if grad is None or rec.by_id is None:
            return grad
        return sum_by_slot(grad, rec.batch, self.table.deterministic)

    def _deferred_grad(self, rec: Pending) -> tuple:
        """``(grad, summing)`` of a step's only lookup: where its gradient is in id order,
        an unwritten [capacity, d] buffer and what :meth:`StepRows.queue_sum` writes into it
        (the optimizer queues that with the step's checks); else its gradient, None."""
        grad = rec.grad_leaf.grad
        if rec.by_id is None or grad is None or grad.requires_grad:
            return self._grad_of(rec), None
        return grad.new_empty(rec.batch.capacity, grad.shape[-1]), (grad, rec.batch)

    def take_gradients(self, rebuilt: bool = True) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gradients that reached the pending lookups, by row id: ``(ids [n], grad [n,
        dim])`` (an id may repeat; padding ids left out), or None where none has a gradient.
        Drops those lookups. What outlives the table's rows being rebuilt (``attach_state``):
        the records name rows as the old store held them (a disk table's RAM slots), ids do
        not. Lookups that backward() has not reached stay pending unless the rows are
        ``rebuilt`` (then they are dropped, with a warning)."""
        ids, grads = [], []
        waiting = [rec for rec in self.pending if rec.grad_leaf.grad is None]
        reached = [rec for rec in self.pending if rec.grad_leaf.grad is not None]
        if waiting and rebuilt:
            warnings.warn(
                f"table {self.table.name!r}: {len(waiting)} lookup(s) ran before its "
                "OffloadOptimizer was made, and backward() has not reached them yet: their "
                "gradient cannot be applied, because the table's rows are rebuilt to hold the "
                "optimizer's state. Make the optimizer before the forward pass.",
                UnconsumedGradientWarning, stacklevel=4)
        for rec in reached:
            grad = rec.grad_leaf.grad
            flat = rec.flat.to(grad.device)
            if rec.by_id is not None:           # one gradient row per id of the lookup
                ids.append(flat)
            else:                               # one per unique row: the id its slot holds
                inverse = rec.batch.inverse.to(grad.device)
                ids.append(torch.full((rec.batch.capacity,), -1, dtype=torch.long,
                                      device=grad.device).scatter_(0, inverse, flat))
            grads.append(grad.detach())
        if rebuilt or not waiting:
            self.clear()
        else:                   # the rows stay: what backward() is still to reach stays too
            LookupGraphs.release(rec.capture for rec in reached)
            self.pending = waiting
        if not ids:
            return None
        ids = torch.cat(ids)
        keep = ids >= 0                         # unused slots
        if self.table.padding_idx is not None:
            keep &= ids != self.table.padding_idx
        return ids[keep], torch.cat(grads)[keep]

    def restore_gradients(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """A training lookup of ``ids`` whose gradient is ``grad`` ([n, dim], one row per id),
        as if it had run and ``backward()`` had reached it: the next step applies it (what
        :meth:`take_gradients` gave, once the table's rows are rebuilt)."""
        if self.table.rows.keeps_host_ids:      # a disk table finds its rows by host ids
            ids = ids.cpu()
        with torch.enable_grad():
            rows, inverse = self.lookup(self.prepare_ids(ids), id_order=True)
            if inverse is not None:
                rows = self.rows_of_ids(rows, inverse)
        rows.grad = grad.to(device=rows.device, dtype=rows.dtype)

    def clear(self) -> None:
        """Drop the pending lookups (``zero_grad``, a skipped step)."""
        LookupGraphs.release(rec.capture for rec in self.pending)
        self.pending.clear()
        self.table.rows.step_queued()

    def device_ids(self, ids) -> torch.Tensor:
        """``ids`` on the compute device; for the very ids a prefetch was started with, the
        copy the prefetch made."""
        taken = self.prefetcher.device_ids(ids)
        return self.prepare_ids(ids) if taken is None else taken

    def rows_of_ids(self, rows: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        """``rows[inv]``: a lookup's unique rows in the order of its ids. For a training
        lookup these are the leaf its gradient lands on ([n, d], one row per id), summed per
        unique row by the optimizer's step (:attr:`StepRows.summing`, queued with its checks,
        inside its CUDA graph) with no second sort: in a fixed order on CUDA, where
        index_select's own backward (index_add_) adds with atomics, whose order changes from
        run to run. Not in autograd's backward: a Python backward runs on autograd's device
        thread and cost ~0.2 ms of host time a lookup (docs/reproducibility.md)."""
        rec = self.pending[-1] if self.pending else None
        if rec is None or rec.leaf is not rows:      # not a training lookup: no gradient
            return rows.index_select(0, inv)
        out = rows.detach().index_select(0, inv).requires_grad_(True)
        rec.by_id = out
        return out

    def bags(self, ids, offsets, per_sample_weights, mode: str) -> torch.Tensor:
        """What an :class:`~nbtools.OffloadedEmbeddingBag` returns: the rows of ``ids`` (2-D
        ``[bags, length]`` or 1-D with ``offsets``) summed, averaged or maxed (``mode``) per
        bag, padding entries left out of each bag."""
        t = self.table
        ids = self.prepare_ids(ids)
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"table {t.name!r}: without offsets, ids must be 2-D "
                                 f"[bags, length]; got shape {tuple(ids.shape)}")
            bags, length = ids.shape
            offsets = torch.arange(0, bags * length, length, device=t.device) if length else \
                torch.zeros(bags, dtype=torch.long, device=t.device)
        else:
            if ids.dim() != 1:
                raise ValueError(f"table {t.name!r}: with offsets, ids must be 1-D; got shape "
                                 f"{tuple(ids.shape)}")
            offsets = self.prepare_ids(offsets).long()
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(t.device).reshape(-1)
        flat = ids.reshape(-1)
        rows, inv = self.lookup(flat)
        if mode == "max" and rows.is_cuda and rows.requires_grad and t.deterministic:
            # max's backward adds each bag's gradient into its winning rows with atomics (bags
            # may share a row): one row per id instead, summed per unique row in a fixed order
            rows, inv = self.rows_of_ids(rows, inv), torch.arange(flat.numel(), device=flat.device)
        padding = None
        if t.padding_idx is not None:
            # Padding maps to one extra all-zero row that embedding_bag leaves out of each bag.
            padding = rows.shape[0]
            rows = torch.cat((rows, rows.new_zeros(1, t.embedding_dim)))
            inv = torch.where(flat == t.padding_idx, padding, inv)
        return F.embedding_bag(inv, rows, offsets, mode=mode,
                               per_sample_weights=per_sample_weights, padding_idx=padding)
