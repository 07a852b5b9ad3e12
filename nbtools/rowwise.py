"""Row-wise optimizers: one second-moment value per row instead of one per value.

FBGEMM trains production embedding tables with ``EXACT_ROWWISE_ADAGRAD`` and
``PARTIAL_ROWWISE_ADAM``: the adaptive denominator is shared by a row's values, so the state
costs one float per row (Adagrad) or one row plus one float (Adam) instead of one or two rows.
For a bf16 table of dim 128, a row with :class:`RowWiseAdagrad` state is 256 + 4 = 260 bytes,
against 1,536 for fp32 weights with Adam (docs/rowwise.md).

Both are ordinary ``torch.optim.Optimizer`` subclasses:

* **Rows.** A parameter's rows are its first dimension; a row's values are everything else
  (``p.view(p.shape[0], -1)``). A 1-D parameter (a bias) has one value per row, so each value
  is its own row (the rule is then per-value Adagrad / Adam); a 0-D parameter is one row.
* **Per-row state** has shape ``[rows, 1]``: like every other state, its first dimension is
  the row, which is what lets :class:`nbtools.OffloadOptimizer` store it after each row's
  weight (``[weight | exp_avg | exp_avg_sq]``, the last one column wide).
* **Gradients** may be dense or sparse (COO with one sparse dimension, as
  ``nn.Embedding(sparse=True)`` makes them). A sparse gradient is coalesced first and only the
  rows it names change (their weight, their state, their weight decay): the lazy semantics
  of ``torch.optim.SparseAdam``. ``PartialRowWiseAdam``'s step count is global (one per
  ``step()``), so its bias corrections are those of the step, not of the row.

One optimizer object can therefore train a model's dense head and its (sparse or offloaded)
tables. Options torch's optimizers have and these do not (``foreach``, ``capturable``,
``differentiable``, ``amsgrad``, ...) are refused by Python as unexpected keyword arguments.
"""
from __future__ import annotations

import math

import torch


def _rows_of(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as [rows, values per row], a view: the first dim is the rows; a 0-D
    tensor is one row of one value."""
    if t.dim() == 0:
        return t.view(1, 1)
    return t.view(t.shape[0], -1)


def mean_square(g: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: each row's mean of g^2, as its sum divided by the row's length. The sum is
    a pairwise tree over neighbouring values (the row zero-padded to a power of two, at least
    16): the fused kernels' order (``nbtools.kernels._update._row_sum_sq``) whatever the rows'
    layout, so a table trains to the same bits in RAM, on disk or behind a cache. (On CUDA the
    kernels add each first pair as one FMA, ``fma(a, a, b * b)``, so this generic path can
    still differ from them in the last bit; torch's own sum and mean reduce in an order of their
    own.)"""
    n = g.shape[1]
    x = g.square()
    width = max(16, 1 << max(0, n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[1] > 1:
        x = x[:, 0::2] + x[:, 1::2]
    return x.div_(n)


def _row_state_shape(p: torch.Tensor) -> tuple:
    return (1 if p.dim() == 0 else p.shape[0], 1)


def _check(lr, eps, weight_decay, betas=None) -> None:
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if torch.is_tensor(value):
            raise TypeError(f"{name} must be a float, got a tensor; these optimizers take "
                            "plain numbers (an LR scheduler sets floats too)")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr} (expected lr >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps} (expected eps >= 0)")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay} (expected >= 0)")
    if betas is not None:
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b} (expected 0 <= beta < 1)")


def _sparse_rows(p: torch.Tensor, grad: torch.Tensor, who: str):
    """(row indices [k], gradient values [k, values per row]) of a sparse COO gradient,
    coalesced (each row once, duplicates summed)."""
    if grad.layout != torch.sparse_coo:
        raise TypeError(f"{who} takes dense or sparse COO gradients, got layout {grad.layout}")
    if grad.sparse_dim() != 1 or p.dim() == 0:
        raise ValueError(f"{who}: a sparse gradient must name rows (sparse_dim 1, as "
                         f"nn.Embedding(sparse=True) makes), got sparse_dim "
                         f"{grad.sparse_dim()} for a parameter of shape {tuple(p.shape)}")
    grad = grad.coalesce()
    idx = grad.indices()[0]
    return idx, grad.values().reshape(idx.numel(), -1)


class _RowWise(torch.optim.Optimizer):
    """What both optimizers share: parameter checks, and the step's walk over parameters."""

    def _check_param(self, p: torch.Tensor) -> None:
        if p.is_complex():
            raise TypeError(f"{type(self).__name__} does not support complex parameters "
                            f"(got {p.dtype}); view them as real (torch.view_as_real)")

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every parameter with a gradient. Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._check_param(p)
                grad = p.grad
                if grad.is_sparse:
                    idx, g = _sparse_rows(p, grad, type(self).__name__)
                else:
                    idx, g = None, _rows_of(grad.contiguous())
                if group["maximize"]:
                    g = -g
                state = self._state_of(group, p)
                if p.numel() == 0:
                    continue
                q = p if p.is_contiguous() else p.contiguous()     # rows are views of it
                self._update(group, q, state, idx, g)
                if q is not p:
                    p.copy_(q)
        return loss

    def _state_of(self, group, p) -> dict:
        raise NotImplementedError

    def _update(self, group, p, state, idx, g) -> None:
        raise NotImplementedError


class RowWiseAdagrad(_RowWise):
    """Exact row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row.

    For each row with gradient ``g`` (its values) and weight ``w``, in this order::

        g = -g                         (maximize=True)
        g = g + weight_decay * w       (weight_decay > 0: L2, as torch.optim.Adagrad)
        s = s + mean(g * g)            (one value per row; mean over the row's values)
        w = w - lr * g / (sqrt(s) + eps)

    State: ``sum``, shape ``[rows, 1]``, starting at ``initial_accumulator_value``. No step
    count and no learning-rate decay. With a sparse gradient only the rows it names are
    updated (weight decay included); with a dense gradient every row is.

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0).
        eps: added to the denominator (>= 0).
        weight_decay: L2 penalty, added to the gradient (>= 0).
        initial_accumulator_value: where ``sum`` starts (>= 0).
        maximize: maximize the objective instead.

    >>> w = torch.nn.Parameter(torch.ones(2, 4))
    >>> opt = RowWiseAdagrad([w], lr=0.5)
    >>> w.grad = torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0]])
    >>> opt.step()
    >>> opt.state[w]["sum"].flatten().tolist(), w[1].tolist()
    ([1.0, 1.0], [0.0, 1.0, 1.0, 1.0])
    """

    # the offloaded step's fused Triton update for this class (nbtools.kernels
    # fused_update_for); a subclass names its own, or takes the generic path
    fused_kernel = "rowwise_adagrad"

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, *, maximize: bool = False):
        _check(lr, eps, weight_decay)
        if not 0.0 <= initial_accumulator_value:
            raise ValueError(f"Invalid initial_accumulator_value: {initial_accumulator_value} "
                             "(expected >= 0)")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value,
                                      maximize=maximize))

    def _state_of(self, group, p) -> dict:
        state = self.state[p]
        if not state:
            state["sum"] = torch.full(_row_state_shape(p), float(group["initial_accumulator_value"]),
                                      dtype=p.dtype, device=p.device)
        return state

    def _update(self, group, p, state, idx, g) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        w = _rows_of(p)
        s = state["sum"]
        if idx is None:
            if wd:
                g = g.add(w, alpha=wd)
            s.add_(mean_square(g))
            w.addcdiv_(g, s.sqrt().add_(eps), value=-lr)
            return
        rows = w.index_select(0, idx)
        if wd:
            g = g.add(rows, alpha=wd)
        s_rows = s.index_select(0, idx).add_(mean_square(g))
        s.index_copy_(0, idx, s_rows)
        w.index_copy_(0, idx, rows.addcdiv_(g, s_rows.sqrt().add_(eps), value=-lr))


class PartialRowWiseAdam(_RowWise):
    """Partial row-wise Adam (FBGEMM's ``PARTIAL_ROWWISE_ADAM``): a first moment per value,
    a second moment per row.

    At step ``t`` (counted per parameter, one per ``step()``), for each row with gradient
    ``g`` and weight ``w``, in this order::

        g = -g                                          (maximize=True)
        w = w * (1 - lr * weight_decay)                 (weight_decay > 0: decoupled, AdamW)
        m = beta1 * m + (1 - beta1) * g                 (per value)
        v = beta2 * v + (1 - beta2) * mean(g * g)       (one value per row)
        w = w - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    which is FBGEMM's ``w - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)`` with
    ``m_hat = m / (1 - beta1^t)``, ``v_hat = v / (1 - beta2^t)``, in the order of operations
    of ``torch.optim.AdamW``. State: ``exp_avg`` (the parameter's shape), ``exp_avg_sq``
    (``[rows, 1]``) and ``step`` (a float tensor, as torch's Adam keeps it). With a sparse
    gradient only the rows it names are updated (the lazy semantics of
    ``torch.optim.SparseAdam``; ``step`` still counts every step).

    Args:
        params: parameters or param groups.
        lr: learning rate (>= 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (>= 0).
        weight_decay: decoupled weight decay (>= 0), as above.
        maximize: maximize the objective instead.

    >>> w = torch.nn.Parameter(torch.zeros(2, 3))
    >>> opt = PartialRowWiseAdam([w], lr=0.1)
    >>> w.grad = torch.ones(2, 3)
    >>> opt.step()
    >>> [round(x, 4) for x in w[0].tolist()], opt.state[w]["exp_avg_sq"].shape
    ([-0.1, -0.1, -0.1], torch.Size([2, 1]))
    """

    # the offloaded step's fused Triton update for this class (nbtools.kernels
    # fused_update_for); a subclass names its own, or takes the generic path
    fused_kernel = "partial_rowwise_adam"

    def __init__(self, params, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, maximize: bool = False):
        _check(lr, eps, weight_decay, betas)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, maximize=maximize))

    def _state_of(self, group, p) -> dict:
        state = self.state[p]
        if not state:
            # exp_avg before exp_avg_sq: the order an offloaded row stores them in
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros(_row_state_shape(p), dtype=p.dtype,
                                              device=p.device)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        return state

    def _update(self, group, p, state, idx, g) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        state["step"] += 1
        t = float(state["step"])
        step_size = lr / (1 - beta1 ** t)
        bc2_sqrt = math.sqrt(1 - beta2 ** t)
        w, m, v = _rows_of(p), _rows_of(state["exp_avg"]), state["exp_avg_sq"]
        if idx is None:
            rows, m_rows, v_rows = w, m, v
        else:
            rows, m_rows, v_rows = (x.index_select(0, idx) for x in (w, m, v))
        if wd:
            rows.mul_(1 - lr * wd)
        m_rows.lerp_(g, 1 - beta1)
        v_rows.mul_(beta2).add_(mean_square(g), alpha=1 - beta2)
        denom = (v_rows.sqrt() / bc2_sqrt).add_(eps)
        rows.addcdiv_(m_rows, denom, value=-step_size)
        if idx is not None:
            w.index_copy_(0, idx, rows)
            m.index_copy_(0, idx, m_rows)
            v.index_copy_(0, idx, v_rows)


__all__ = ["RowWiseAdagrad", "PartialRowWiseAdam"]
