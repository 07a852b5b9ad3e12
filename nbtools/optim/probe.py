"""Which state of a ``torch.optim`` optimizer is per row, and whether its update treats each row
on its own: what decides that an optimizer can train an offloaded table.

:func:`probe_row_state` runs a few steps of the optimizer on a tiny parameter: the state whose
first dimension is the rows (``[rows, dim]``, ``[rows, k]`` or ``[rows]``) is stored with each
row in the table, state of one value (Adam's ``step``) is kept once per table, and anything
else is refused with :class:`UnsupportedOptimizerError`. It then checks that rows updated
together equal rows updated one at a time. :class:`nbtools.OffloadOptimizer` probes each table's
optimizer when it is created (``OffloadConfig(probe=...)``), and :func:`nbtools.plan` probes to
size the state before anything is allocated. docs/rowwise.md says what a row-wise optimizer's
``[rows, 1]`` state needs.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import NbtoolsError
from ..rowwise import RowWiseAdagrad


class UnsupportedOptimizerError(NbtoolsError, TypeError):
    """The optimizer's state or update is not per row, so it cannot train an offloaded table."""

    __module__ = "nbtools.optim"    # where users import it from, with the optimizer that raises it


# Per-row state that does not start at zero, as each optimizer itself initialises it.
# (group hyper-parameters -> {state name: initial value}); everything else starts at zero.
_NONZERO_INITIAL_STATE = {
    torch.optim.Adagrad: lambda g: {"sum": g["initial_accumulator_value"]},
    RowWiseAdagrad: lambda g: {"sum": g["initial_accumulator_value"]},
    torch.optim.Rprop: lambda g: {"step_size": g["lr"]},
}

# Never row-separable, refused without probing (their step needs a closure or mixes rows);
# nbtools.plan() leaves them out of the names it offers.
NOT_PER_ROW = tuple(c for c in (getattr(torch.optim, n, None)
                                for n in ("LBFGS", "Adafactor", "Muon")) if c is not None)

NOT_HYPER = ("params",)


def _sparse_rows_grad(grad: torch.Tensor) -> torch.Tensor:
    """Dense [U, dim] row gradients as the sparse gradient SparseAdam requires."""
    idx = torch.arange(grad.shape[0], device=grad.device).unsqueeze(0)
    return torch.sparse_coo_tensor(idx, grad, grad.shape, is_coalesced=True,
                                   check_invariants=False)


def set_grad(p: torch.Tensor, grad: torch.Tensor, sparse: bool) -> None:
    p.grad = _sparse_rows_grad(grad) if sparse else grad


def _step_rows(cls, hyper, weight, grad, sparse, steps=2):
    """Run ``steps`` steps of ``cls`` on ``weight``; each step's gradient is ``grad`` times one
    pseudo-random row broadcast over all rows, so any subset of rows sees the same gradients."""
    p = nn.Parameter(weight.clone())
    opt = cls([p], **hyper)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for _ in range(steps):
        noise = torch.randn((1, grad.shape[1]), generator=gen).to(grad)
        set_grad(p, grad * noise, sparse)
        opt.step()
    return p.detach(), opt


def probe_row_state(cls, hyper: dict, dim: int, device, dtype, check_separable: bool = True):
    """Find which state of ``cls`` is per row and check that rows update independently.

    Per-row state has the rows as its first dimension: shaped like the parameter (per
    element, ``dim`` columns), ``[rows, k]`` with ``k <= dim`` (a row-wise optimizer's
    ``[rows, 1]``) or ``[rows]``; it is stored in ``k`` columns (1 for ``[rows]``) after each
    row's weight. State of one value is scalar (Adam's ``step``); anything else is refused.

    Returns (row state names -> dtype, scalar state names, the optimizer's full param group,
    the probe's scalar state after its steps: its types are what the optimizer keeps, row
    state names -> their shape after the row dimension: ``(dim,)``, ``(k,)`` or ``()``).
    """
    if NOT_PER_ROW and issubclass(cls, NOT_PER_ROW):
        raise UnsupportedOptimizerError(
            f"{cls.__name__} cannot train an offloaded table: its update is not per row "
            "(it needs a closure or mixes rows). Use Adam, AdamW, SGD, Adagrad, RMSprop, ...")
    sparse = issubclass(cls, torch.optim.SparseAdam)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    n = 3 if dim != 3 else 5         # rows != dim: a state's first dim tells rows from columns
    weight = torch.randn(n, dim, generator=gen).to(device=device, dtype=dtype)
    grad = torch.randn(n, dim, generator=gen).to(device=device, dtype=dtype)
    try:                  # bad hyper-parameters (lr < 0, ...): the optimizer's own error
        cls([nn.Parameter(weight.clone())], **hyper)
    except (TypeError, ValueError):
        raise
    except Exception:     # anything else: reported by the probe step below
        pass
    try:
        together, probe_opt = _step_rows(cls, hyper, weight, grad, sparse)
        state = probe_opt.state[probe_opt.param_groups[0]["params"][0]]
    except TypeError:
        raise                    # a wrong keyword argument: torch's own message says which
    except Exception as e:
        raise UnsupportedOptimizerError(
            f"{cls.__name__}({hyper}) failed a probe step on a small parameter: {e}") from e
    group = {k: v for k, v in probe_opt.param_groups[0].items() if k not in NOT_HYPER}
    row_state, scalar_state = {}, []
    scalar_values, row_shapes = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() in (1, 2) and value.shape[0] == n and \
                (value.dim() == 1 or 1 <= value.shape[1] <= dim):
            row_state[key] = value.dtype         # per element ([n, dim]) or per row
            row_shapes[key] = tuple(value.shape[1:])
        elif not torch.is_tensor(value) or value.numel() == 1:
            scalar_state.append(key)
            scalar_values[key] = value
        else:
            raise UnsupportedOptimizerError(
                f"{cls.__name__} keeps state {key!r} of shape {tuple(value.shape)} for a parameter "
                f"of shape {tuple(weight.shape)}: neither per row ([rows, k] with k <= "
                f"{dim}, or [rows]) nor one value, so it cannot be offloaded by row")
    if check_separable:
        # Rows updated together must equal rows updated one at a time, with the same grads.
        for r in range(weight.shape[0]):
            alone, _ = _step_rows(cls, hyper, weight[r:r + 1], grad[r:r + 1], sparse)
            if not torch.allclose(alone.float(), together[r:r + 1].float(), rtol=1e-4, atol=1e-6):
                raise UnsupportedOptimizerError(
                    f"{cls.__name__} updates rows jointly (a row's update depends on other "
                    "rows), so lazy per-row offloading would change its results")
    return row_state, scalar_state, group, scalar_values, row_shapes


def initial_row_state(cls, group: dict, names) -> dict:
    for base, init in _NONZERO_INITIAL_STATE.items():
        if issubclass(cls, base):
            values = init(group)
            return {n: float(values.get(n, 0.0)) for n in names}
    return {n: 0.0 for n in names}


def check_hyper(cls, hyper: dict) -> None:
    if issubclass(cls, torch.optim.SGD) and hyper.get("momentum", 0) and hyper.get("dampening", 0):
        raise UnsupportedOptimizerError(
            "SGD with dampening > 0 is not supported for offloaded tables: torch starts each "
            "momentum buffer at the row's first gradient undamped, which a lazily touched row "
            "cannot reproduce exactly. Use dampening=0 (the default).")
