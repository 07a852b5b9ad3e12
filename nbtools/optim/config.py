"""The options of :class:`nbtools.OffloadOptimizer` (a module of its own: the optimizer's step
machinery and its tables' slots both read it)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class OffloadConfig:
    """nbtools-specific options of :class:`OffloadOptimizer` (not passed to the optimizer)."""

    # What a step does when any gradient (a table's or an ordinary parameter's) holds inf/nan:
    # "raise" a NonFiniteGradientError, or "skip" the whole step (counted in `skipped_steps`,
    # warned about once). Either way every gradient is checked before anything is updated,
    # so nothing changes.
    nonfinite: str = "raise"
    # Check on a tiny parameter that the optimizer updates rows independently (cheap; leave on).
    probe: bool = True
    # Fused Triton kernels for SGD, Adam/AdamW, SparseAdam, Adagrad, RowWiseAdagrad and
    # PartialRowWiseAdam on float32 tables (float32, bf16 or fp16 storage):
    # "auto" uses them where they run (CUDA with Triton), False always runs the stock optimizer
    # on the gathered rows (the reference path), True insists (an error where none applies).
    fused: object = "auto"
    # When a step reads its checks back (the bad-id and inf/nan flags, computed on the GPU).
    # "auto": one step late wherever that is safe (every table takes a fused kernel, all on
    # one device, with no ordinary parameters, and nonfinite="raise"), so the host never
    # waits for the GPU in steady state and the GPU never waits for the host; elsewhere, in
    # the step itself. "every_step": always in the step itself (one host synchronisation per
    # step). Read late or not, a bad step writes nothing: its kernels read the flags on the
    # GPU; read late, the next step writes nothing either, and its step() raises the error
    # (OffloadOptimizer.synchronize(), state_dict() and checkpoints read a pending check too).
    checks: str = "auto"
    # On CUDA, sum each id's gradient rows (an id looked up many times in a step) in a fixed
    # order, so that identical runs, a resumed run and one whose bad step was skipped end
    # bit-identical to their references (docs/step.md, "Reproducibility"). False: torch's
    # atomic additions (index_add_), whose order, and so the last bits, change from run to
    # run; kept as the fast path to compare with (benchmarks/bench_step.py --deterministic
    # both). The CPU adds in a fixed order either way.
    deterministic: bool = True
