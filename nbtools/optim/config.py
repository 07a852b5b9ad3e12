"""The options of :class:`nbtools.OffloadOptimizer` (a module of its own: the optimizer's step
machinery and its tables' slots both read it), and the check of saved hyper-parameters
that its ``check_state_dict`` and a checkpoint's restore share."""
from __future__ import annotations

import dataclasses
import inspect
import numbers

import torch


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


def _fits(saved, live) -> bool:
    """Whether the saved hyper-parameter ``saved`` can stand where ``live`` is: a number for a
    number (a one-element tensor too), a flag for a flag, a tuple of as many for a tuple, a
    string for a string; None on either side (torch's "unset") fits anything."""
    if saved is None or live is None:
        return True
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if isinstance(live, (numbers.Real, torch.Tensor)):
        if isinstance(saved, torch.Tensor):
            return saved.numel() == 1 and not saved.dtype.is_complex
        return isinstance(saved, numbers.Real) and not isinstance(saved, bool)
    if isinstance(live, (tuple, list)):
        return (isinstance(saved, (tuple, list)) and len(saved) == len(live)
                and all(_fits(a, b) for a, b in zip(saved, live)))
    if isinstance(live, str):
        return isinstance(saved, str)
    return True


def check_group(saved, live: dict, what: str) -> None:
    """Raise ValueError where the saved hyper-parameters ``saved`` (a dict) would not stand
    for ``live``'s: each value of a key both have must be of the same kind (``lr`` a number,
    ``betas`` a pair of numbers, ...); keys only one of them has are left to the optimizer.

    >>> check_group({"lr": 0.1, "betas": (0.9, 0.99)}, {"lr": 0.01, "betas": (0.9, 0.999)}, "x")
    >>> check_group({"lr": "0.1"}, {"lr": 0.01}, "group 0")
    Traceback (most recent call last):
    ValueError: group 0: lr is '0.1' (str), expected a value like 0.01 (float)
    """
    if not isinstance(saved, dict):
        raise ValueError(f"{what}: the hyper-parameters are a {type(saved).__name__}, "
                         "expected a dict")
    for key, value in live.items():
        if key != "params" and key in saved and not _fits(saved[key], value):
            raise ValueError(f"{what}: {key} is {saved[key]!r:.60} ({type(saved[key]).__name__}),"
                             f" expected a value like {value!r:.60} ({type(value).__name__})")


def check_groups(saved, live: list, what: str) -> None:
    """Raise ValueError where the saved ``param_groups`` would not load into an optimizer
    whose groups are ``live``: as many groups, each listing as many parameters (ints), and
    hyper-parameters of the same kinds (:func:`check_group`)."""
    if not isinstance(saved, list) or len(saved) != len(live):
        raise ValueError(f"{what}: the checkpoint has {len(saved) if isinstance(saved, list) else 'no'}"
                         f" parameter groups, this optimizer {len(live)}")
    for i, (g, h) in enumerate(zip(saved, live)):
        if not isinstance(g, dict) or not isinstance(g.get("params"), list) \
                or not all(isinstance(p, int) and not isinstance(p, bool) for p in g["params"]):
            raise ValueError(f"{what}: parameter group {i} has no list of parameter indices")
        if len(g["params"]) != len(h["params"]):
            raise ValueError(f"{what}: parameter group {i} holds {len(g['params'])} parameters, "
                             f"this optimizer's {len(h['params'])}")
        check_group(g, h, f"{what}, parameter group {i}")


def _ctor_args(cls, hyper: dict) -> dict:
    """The hyper-parameters that ``cls``'s constructor takes by name."""
    try:
        names = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
        return {k: v for k, v in hyper.items() if k != "params"}
    return {k: v for k, v in hyper.items() if k in names and k not in ("self", "params")}


def concrete(value):
    """``value`` with shape-only (meta) tensors replaced by zeros on the CPU: what a
    rehearsal can compute with (a checkpoint's preflight hands over shape-only tensors)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros(value.shape, dtype=value.dtype) if value.device.type == "meta" \
            else value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(concrete(v) for v in value)
    if isinstance(value, dict):
        return {k: concrete(v) for k, v in value.items()}
    return value


def rehearse_step(cls, groups: list, what: str, build=None, grad=None) -> list:
    """Raise ValueError where ``cls`` would refuse saved hyper-parameters or fail its next
    step on saved state: ``groups`` is ``[(hyper, [(stand-in parameter, state or None)])]``,
    small stand-ins (a row, one element per dimension) for the real parameters. Each
    group's hyper-parameters go through ``cls``'s own checks (its constructor: ``lr >= 0``,
    ``betas`` in [0, 1), ...), then one step runs on the stand-ins with a gradient of ones
    (``build(params) -> optimizer`` makes the optimizer as its owner does; default: ``cls``
    with the groups; ``grad(p)`` sets a stand-in's gradient). Returns each stand-in's state
    after the step."""
    try:
        for hyper, params in groups:
            cls([torch.zeros(1, requires_grad=True)], **_ctor_args(cls, hyper))
        if build is None:
            opt = cls([{"params": [p for p, _ in params], **hyper} for hyper, params in groups])
        else:
            opt = build([p for _, params in groups for p, _ in params])
        for _, params in groups:
            for p, state in params:
                if state is not None:
                    opt.state[p] = state
        for _, params in groups:
            for p, _ in params:
                if grad is None:
                    p.grad = torch.ones_like(p)
                else:
                    grad(p)
        opt.step()
        return [opt.state.get(p) for _, params in groups for p, _ in params]
    except Exception as e:
        text = str(e).strip().replace("\n", " ")[:200]
        raise ValueError(f"{what}: {cls.__name__} refuses the saved hyper-parameters or "
                         f"state ({type(e).__name__}: {text})") from None
