"""The optimizer step's engine: everything a step keeps from one step to the next.

:class:`StepEngine` owns the cross-step device state of an :class:`nbtools.OffloadOptimizer`:
the host buffers in turns (:class:`~nbtools.engine.steps.StepRing`, one per device), the CUDA
graphs of the checks and fused updates (:class:`~nbtools.engine.steps.StepGraphs`), the step
whose checks are still on their way to the host (:class:`PendingStep`), and the count of
skipped steps. A step, as :meth:`StepEngine.run` makes it:

1. queue every table's checks (ids in range, gradients finite) and, where everything lives on
   one device, every fused update, which reads the guard on the device and writes nothing
   when the step must not go ahead (:meth:`StepEngine.queue`);
2. read the checks of the step before it, if they were left to be read late, and raise if it
   was bad (its writes never happened; :meth:`StepEngine.settle`);
3. leave this step's checks to be read at the next step where that is safe
   (``OffloadConfig.checks``), else read them now (the step's one synchronisation), raise or
   skip on a bad step, and otherwise step the ordinary parameters and apply every table's
   update.

The engine reaches the optimizer's tables through their slots (``nbtools.optim.slot``):
``plan_fused``, ``queue_fused``, ``went_ahead``, ``commit_fused``, ``apply`` ... and the
tables through their public names.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from .. import NbtoolsError
from .. import devices
from . import steps
from .lookups import caller_stacklevel


class NonFiniteGradientError(NbtoolsError, FloatingPointError):
    """A gradient had inf or nan; nothing was updated."""


class Verdict:
    """A step's checks, queued on the device; :meth:`read` brings them to the host (the
    step's one synchronisation)."""

    def __init__(self, collected, guard, host, event, found_at):
        self.collected, self.guard, self.host, self.event = collected, guard, host, event
        self.found_at = found_at

    def read(self):
        """``([bad, count, sentinel] per table, any non-finite gradient)``; each cached
        table's statistics go to the table (:meth:`OffloadedEmbedding.record_cache_stats`)."""
        if self.found_at is not None:             # several devices: one read each
            tables = [got.batch.meta.tolist() for got in self.collected]
            for got in self.collected:
                if got.cache_stats is not None:
                    got.table.record_cache_stats(got.cache_stats.tolist())
            return tables, any(bool(f.item()) for f in self.found_at.values())
        if self.host is None:
            return [], False
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()
        k = len(self.collected)
        tables = [values[3 * i:3 * i + 3] for i in range(k)]
        at = 3 * k
        for got in self.collected:
            if got.cache_stats is not None:
                got.table.record_cache_stats(values[at:at + 4])
                at += 4
        return tables, bool(values[-1])


@dataclasses.dataclass
class PendingStep:
    """A step whose checks are still on their way to the host (OffloadConfig.checks): what
    reading them needs, and each table's scalar state from before the step, to restore when
    they say the step must not have happened."""

    verdict: Verdict
    collected: list                 # (slot, StepRows) of the step
    before: dict                    # id(slot) -> its scalar state before the step (saved())


def _raise_bad_ids(slot, got, late: str = "") -> None:
    """Raise the IndexError that names the first out-of-range id of a table's lookups."""
    for flat, shape in got.lookups:
        if bool(((flat < 0) | (flat >= slot.table.num_embeddings)).any()):
            try:
                slot.table.lookups.raise_bad_ids(flat, shape)
            except IndexError as e:
                raise IndexError(f"{e}{late}") from None
    if late:
        raise IndexError(f"table {slot.name!r}: an out-of-range id in the step before this "
                         f"one (its ids changed since){late}")


def _nonfinite_error(culprits: list, late: str = "") -> NonFiniteGradientError:
    return NonFiniteGradientError(
        f"inf/nan gradients in {', '.join(culprits) or 'the step before this one'}; nothing was "
        f"updated: every parameter, table and optimizer state was left unchanged{late}. Lower "
        "the learning rate, check the loss, or pass config=OffloadConfig(nonfinite='skip').")


class StepEngine:
    """The cross-step state of an optimizer's steps, and the step itself (:meth:`run`).

    Args:
        slots: the optimizer's table slots (``nbtools.optim.slot.TableSlot``), in order.
        config: the optimizer's :class:`nbtools.OffloadConfig` (``checks``, ``nonfinite``).
        param_names: ``id(parameter) -> name`` for error messages about ordinary parameters.

    Attributes:
        pending: the last step, when its checks are still to be read (else ``None``).
        graphs: the :class:`~nbtools.engine.steps.StepGraphs` of the steps' device work.
        skips: steps skipped for non-finite gradients (``OffloadConfig(nonfinite="skip")``).
    """

    # The step's inf/nan check of a table's gradient is made by the fixed-order sum that
    # writes it (nbtools.kernels.segment_sum's ``found``), where that kernel sums it: no pass
    # of its own over the summed gradient, which is a measurable share of a bf16
    # RowWiseAdagrad step's GPU time. False: one multi-tensor check over every gradient
    # (kept so the two can be timed against each other).
    SUMS_CHECK = True

    def __init__(self, slots: list, config, param_names: dict | None = None):
        self.slots, self.config = slots, config
        self.param_names = param_names or {}
        self.rings = {}             # device -> steps.StepRing: a step's host buffers, in turns
        self.graphs = steps.StepGraphs()
        self.pending: PendingStep | None = None
        self.skips = 0
        self.warned_skip = False

    def __getstate__(self) -> dict:      # pinned buffers and graphs stay behind
        state = dict(self.__dict__)
        state.update(rings={}, graphs=steps.StepGraphs(), pending=None)
        return state

    # --- the step -----------------------------------------------------------------------------
    def run(self, collected: list, dense: list, dense_step=None) -> None:
        """One step over ``collected`` (``(slot, StepRows)`` of each table with lookups) and
        ``dense`` (``(parameter, gradient)`` of the ordinary parameters; ``dense_step()``
        updates them). Raises ``IndexError`` / :class:`NonFiniteGradientError` with nothing
        written, or skips the whole step (``nonfinite="skip"``)."""
        pending, self.pending = self.pending, None
        verdict, fused = self.queue(collected, dense, pending)
        if pending is not None:
            self.settle(pending)               # the last step's checks: raises if it was bad
        if self.may_read_late(collected, dense, fused, verdict):
            self.pending = PendingStep(verdict, collected,
                                       {id(slot): slot.saved() for slot, _ in collected})
            for slot, got in collected:        # as if it went ahead; settle() undoes it if not
                slot.went_ahead(fused[id(slot)])
                got.rows = None                # queued kernels hold them; nothing else needs them
            return
        tables, nonfinite = verdict.read()     # note: the step's CPU-GPU sync point
        for (slot, got), (bad, _, _) in zip(collected, tables):
            if bad:
                _raise_bad_ids(slot, got)
        if nonfinite:
            culprits = [f"table {slot.name!r}" for slot, got in collected if got.nonfinite()]
            culprits += [f"parameter {self.param_names.get(id(p), tuple(p.shape))!r}"
                         for p, g in dense
                         if not bool(torch.isfinite(g).all())]
            if self.config.nonfinite != "skip":
                raise _nonfinite_error(culprits)
            self.skip(culprits)
            return
        if dense_step is not None:
            dense_step()
        for (slot, got), (_, count, sentinel) in zip(collected, tables):
            if id(slot) in fused:
                slot.commit_fused(fused[id(slot)], count, bool(sentinel))
            else:
                slot.apply(got, count, bool(sentinel))

    def skip(self, culprits: list) -> None:
        """Count a skipped step (every table's too); warn the first time."""
        self.skips += 1
        for slot in self.slots:
            slot.skipped_steps += 1
        if not self.warned_skip:
            self.warned_skip = True
            warnings.warn(f"skipped an optimizer step: inf/nan gradients in {', '.join(culprits)}"
                          "; later skips are counted in optimizer.skipped_steps() without a "
                          "warning", RuntimeWarning, stacklevel=caller_stacklevel())

    def queue(self, collected: list, dense: list, pending: PendingStep | None):
        """Queue the step's checks (every table's ``[bad, count, sentinel]``, its cache's
        statistics, an inf/nan check of every gradient: its fixed-order sum checks a table's)
        and, where everything lives on one device, every fused update; as two CUDA graphs
        when the step repeats one seen before (:mod:`nbtools.engine.steps`). Returns the
        :class:`Verdict` and, per table that took a fused kernel, the scalar state to keep
        if the step goes ahead.

        The updates read the guard (nonzero when the step must not go ahead) on the device;
        it includes the guard of ``pending``, a step whose checks the host has not read yet
        (a bad step stops the one after it too)."""
        gots = [got for _, got in collected]
        grads = [got.grad for got in gots] + [g for _, g in dense]
        grad_devices = {g.device for g in grads}
        if not grad_devices:
            return Verdict([], None, None, None, None), {}
        if len(grad_devices) > 1:        # rare: one read per device, no guard (updates wait)
            for got in gots:
                got.sum_now()
            return self._verdict_per_device(gots, grads, grad_devices), {}
        (device,) = grad_devices
        ring = self.rings.get(device)
        if ring is None:
            ring = self.rings[device] = steps.StepRing(device, len(self.slots))
        turn = ring.next()
        before = ring.previous().guard
        linked = pending is not None and pending.verdict.guard is before
        plans = [slot.plan_fused(got) for slot, got in collected]
        behind = [slot.writes_behind(got, fp) for (slot, got), fp in zip(collected, plans)]
        for (slot, _), fp, back in zip(collected, plans, behind):
            if fp is not None:
                turn.scalars[slot.index] = fp.values
                if not back:     # it writes host rows: after their write-backs (no graph may
                    slot.table.rows.settle()     # wait for an event from outside it)
        flags = [got.batch.meta for got in gots] + \
            [got.cache_stats for got in gots if got.cache_stats is not None]

        def checks():     # first the tables' per-id gradient sums (StepRows.summing)
            turn.found.zero_()
            found = turn.found if self.SUMS_CHECK else None
            checked = {id(got.grad) for got in gots if got.queue_sum(found)}
            return steps.queue_checks(turn, [g for g in grads if id(g) not in checked], flags,
                                      len(gots), before if linked else None)

        def updates():
            for (slot, got), fp, back in zip(collected, plans, behind):
                if fp is not None:
                    slot.queue_fused(got, fp, turn.guard, turn.hyper[slot.index], back)

        n = None
        if device.type == "cuda" and all(p is not None for p in plans) and \
                all(got.table.config.cuda_graphs for got in gots):
            parts = [slot.graph_key(got, fp, back)
                     for (slot, got), fp, back in zip(collected, plans, behind)]
            key = (turn.index, linked, self.SUMS_CHECK, tuple(k for k, _ in parts),
                   tuple(steps.signature(g) for _, g in dense))
            n = self.graphs.run(key, checks, updates, turn, [keep for _, keep in parts])
        if n is None:
            n = checks()
            if turn.checked is not None:
                devices.record(turn.checked, device)
            updates()
        for got in gots:           # queued (or replayed) with the checks
            got.summing = None
        for (slot, got), back in zip(collected, behind):
            if back:     # (a lookup capture's outputs, unless several lookups were merged)
                caps = got.captures if len(got.captures) == 1 else []
                slot.table.rows.write_behind(got.batch, got.rows, caps)
        if turn.done is not None:
            devices.record(turn.done, device)
        fused = {id(slot): plan for (slot, _), plan in zip(collected, plans)
                 if plan is not None}
        return Verdict(gots, turn.guard, turn.flags[:n], turn.checked, None), fused

    @staticmethod
    def _verdict_per_device(gots: list, grads: list, devices) -> Verdict:
        found_at = {}
        for device in devices:
            found = torch.zeros(1, device=device)
            steps.find_nonfinite([g for g in grads if g.device == device], found,
                                 torch.ones(1, device=device))
            found_at[device] = found.long()
        return Verdict(gots, None, None, None, found_at)

    def may_read_late(self, collected, dense, fused, verdict) -> bool:
        """Whether this step's checks may be read at the next step (OffloadConfig.checks)."""
        return (self.config.checks == "auto" and self.config.nonfinite == "raise"
                and not dense and bool(collected) and len(fused) == len(collected)
                and verdict.guard is not None)

    def settle(self, pending: PendingStep) -> None:
        """Read the checks of a step queued earlier; if it was bad, put back every table's
        scalar state from before it and raise (its rows and state were never written)."""
        tables, nonfinite = pending.verdict.read()
        if any(bad for bad, _, _ in tables) or nonfinite:
            for slot, _ in pending.collected:
                slot.restore(pending.before[id(slot)])
            late = ("; found one step late (OffloadConfig.checks='auto'): neither that step "
                    "nor the one after it wrote anything")
            for (slot, got), (bad, _, _) in zip(pending.collected, tables):
                if bad:
                    _raise_bad_ids(slot, got, late)
            raise _nonfinite_error([f"table {slot.name!r}" for slot, got in pending.collected
                                    if got.nonfinite()], late)
        for (slot, _), (_, count, sentinel) in zip(pending.collected, tables):
            slot.count_written(count, bool(sentinel))

    def synchronize(self) -> None:
        """Read the checks of the last step if they are still on their way."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.settle(pending)

    def forget(self) -> None:
        """Drop the step not read back yet (a loaded state replaces it)."""
        self.pending = None
