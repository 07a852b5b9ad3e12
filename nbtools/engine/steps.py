"""An optimizer step's work on the device: every table's checks and fused update, queued with no
host synchronisation, and replayed as two CUDA graphs once a step repeats itself.

A step queues, on one device (see :class:`nbtools.optim.OffloadOptimizer`):

1. the checks: an inf/nan test of every gradient (a table's summed by its fixed-order sum
   as it writes it, the rest by one multi-tensor pass), each table's
   ``[bad, count, sentinel]`` (and its cache's statistics), copied into pinned host memory
   for the host to read, and the *guard*, nonzero when the step must not go ahead;
2. each table's fused update, which reads the guard on the device and writes nothing when
   it is set, and reads its scalars (learning rate, bias corrections, rounding seed) from
   pinned host memory the host filled for this step.

Queued op by op that is ~10 small torch calls and one Triton launch per table: a fraction
of a millisecond of CPU per step, most of a small step. Nothing in it depends on the
step's values, only on where its tensors live, so once a step's tensors sit at the same
addresses as a step seen before (the CUDA caching allocator hands out the same blocks to a
training loop that repeats), both parts replay as CUDA graphs: two calls.

The host buffers come in turns (:class:`StepRing`): a step writes its scalars into a turn the
GPU is done with, and its flags stay readable until the host has read them, one step later
when checks are read late.
"""
from __future__ import annotations

import warnings

import torch

from .. import devices
from ..hostmem import HostTensor
from ..kernels import HYPER
from ..store.capture import capture


class Turn:
    """One step's buffers: scalars the kernels read ([tables, HYPER] float64, pinned host
    memory), flags the host reads (int64, pinned), the guard (int64 [1] on the device), and
    the events that mark its checks and its updates done on the GPU."""

    def __init__(self, device: torch.device, tables: int, index: int):
        self.index, self.device = index, device
        cuda = device.type == "cuda"
        self._hyper = HostTensor((tables, HYPER), torch.float64, pin=cuda,
                                 name="step scalars", device=device if cuda else None)
        self._flags = HostTensor((7 * tables + 1,), torch.int64, pin=cuda,
                                 name="step flags", device=device if cuda else None)
        self.scalars = self._hyper.tensor.numpy()      # what the host writes
        self.hyper = self._hyper.view()                # where the kernels read them
        self.flags = self._flags.tensor                # what the host reads
        self.flags_out = self._flags.view()            # where the device writes them
        self.guard = torch.zeros(1, dtype=torch.long, device=device)
        self.found = torch.zeros(1, device=device)
        self.one = torch.ones(1, device=device)
        self.checked = torch.cuda.Event() if cuda else None
        self.done = torch.cuda.Event() if cuda else None
        self.used = False


class StepRing:
    """Turns of step buffers, used in rotation. Two: a step's flags are read by the next
    step at the latest, and when a turn comes back its updates are all but always done (the
    host waits for the checks of the step before, queued right before those updates); if
    they are not, :meth:`next` waits for them. Two turns also match a training loop's own
    rhythm: a step whose checks are read late keeps its gradients until the next step, so
    gradients come back to the same addresses every other step, and so do the turns."""

    def __init__(self, device: torch.device, tables: int, turns: int = 2):
        self.turns = [Turn(device, tables, i) for i in range(turns)]
        self.at = turns - 1

    def next(self) -> Turn:
        """The next turn, once the GPU has finished the step that used it last."""
        self.at = (self.at + 1) % len(self.turns)
        turn = self.turns[self.at]
        if turn.used and turn.done is not None and not turn.done.query():
            turn.done.synchronize()
        turn.used = True
        return turn

    def previous(self) -> Turn:
        """The turn before the current one (the step before this one used it)."""
        return self.turns[(self.at - 1) % len(self.turns)]


def find_nonfinite(grads: list, found: torch.Tensor, one: torch.Tensor) -> None:
    """Set ``found`` (float [1], zero) nonzero where any of ``grads`` (one device) holds
    inf/nan: one multi-tensor kernel per dtype (``one``: a scale of 1.0, which changes none)."""
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, one)
        except (RuntimeError, AttributeError, NotImplementedError):   # dtypes it lacks
            found += torch.stack([~torch.isfinite(g).all() for g in same]).any()


def queue_checks(turn: Turn, grads: list, flags: list, tables: int, before=None) -> int:
    """Queue the step's checks: ``flags`` (each table's ``[bad, count, sentinel]``, then
    cache statistics) and whether any of ``grads`` holds inf/nan go to ``turn.flags``; the
    guard (bad ids of ``tables`` tables + inf/nan + ``before``, a step not read yet) to
    ``turn.guard``. ``turn.found`` is zeroed before (queue ``found.zero_()`` first), and may
    already say inf/nan (gradient sums that checked themselves: StepRows.queue_sum). Returns
    how many flags the host will read."""
    found = turn.found
    find_nonfinite(grads, found, turn.one)
    n = sum(f.numel() for f in flags) + 1
    # written by a kernel straight into pinned host memory (no copy to queue), and read back
    # from there for the guard: a few values, one PCIe read
    flat = torch.cat(flags + [found.long()], out=turn.flags_out[:n])
    guard = flat[0:3 * tables:3].sum() + flat[-1]
    if before is not None:
        guard = guard + before
    turn.guard.copy_(guard.reshape(1))
    return n


def signature(t: torch.Tensor | None):
    """What a CUDA graph bakes in about a tensor it reads or writes."""
    if t is None:
        return None
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


class _Graphs:
    __slots__ = ("checks", "updates", "keep", "flags")

    def __init__(self, checks, updates, keep, flags):
        self.checks, self.updates, self.keep, self.flags = checks, updates, keep, flags


class StepGraphs:
    """CUDA graphs of steps' device work, by what they bake in (``key``: the turn, whether
    the step reads the guard of the one before, and every tensor's address, shape and
    dtype with each update's kernel options).

    A key is captured the ``after + 1``-th time it comes (the steps before it ran eagerly,
    so every kernel is compiled), and at most ``max_graphs`` keys are kept: a loop whose
    tensors never come back to the same addresses simply runs eagerly.
    """

    def __init__(self, after: int = 1, max_graphs: int = 12):
        self.after, self.max_graphs = after, max_graphs
        self._graphs: dict = {}
        self._seen: dict = {}
        self._failed: set = set()
        self.replays = 0              # steps that ran as graphs (for tests and diagnostics)
        self.errors: list = []        # why captures failed

    def clear(self) -> None:
        self._graphs.clear()
        self._seen.clear()
        self._failed.clear()

    def run(self, key, checks, updates, turn: Turn, keep) -> int | None:
        """Replay (capturing first if it is time) ``checks`` then ``updates``, recording
        ``turn.checked`` between them. Returns the number of flags, or None where the caller
        must queue them eagerly. ``keep``: objects the graphs' tensors belong to."""
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._failed or len(self._graphs) >= self.max_graphs:
                return None
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if len(self._seen) > 1000:        # tensors that never come back: forget them
                self._seen = {key: seen}
            if seen <= self.after:
                return None
            try:
                entry = self._capture(checks, updates, turn, keep)
            except RuntimeError as e:
                # this kind of step runs eagerly from now on (slower, not wrong); say why once
                self._failed.add(key)
                if not self.errors:
                    warnings.warn(f"nbtools: an optimizer step could not be captured as a CUDA "
                                  f"graph and runs op by op instead: {e}", RuntimeWarning,
                                  stacklevel=4)
                self.errors.append(str(e))
                return None
            self._graphs[key] = entry
        entry.checks.replay()
        devices.record(turn.checked, turn.device)
        entry.updates.replay()
        self.replays += 1
        return entry.flags

    @staticmethod
    def _capture(checks, updates, turn: Turn, keep) -> _Graphs:
        (first, second), (flags, _) = capture(checks, updates, device=turn.device)
        return _Graphs(first, second, keep, flags)
