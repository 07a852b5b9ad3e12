"""The fused updates against torch.optim's own rule, computed in float64 on the touched rows.

Each fused optimizer trains a table for 60 steps (ids with duplicates; some rows untouched in
some steps). The reference keeps a float64 copy of every row and its state and, each step, runs
the stock optimizer class itself (``torch.optim.Adam`` etc., or nbtools' row-wise classes) in
float64 on a parameter holding only the rows the step touched (lazy semantics: untouched rows
get nothing), with the global step count. Weights and every per-row state must agree to
2e-6 relative (the largest difference over the largest value of each tensor): float32 storage
and float32 arithmetic in the kernel, nothing coarser. A scalar such as ``1 - beta2`` computed in
float32 inside a kernel (0.00099998713 for beta2 = 0.999) is 1.3e-5 off and fails here.
"""
from __future__ import annotations

import pytest
import torch

from nbtools import OffloadConfig, OffloadedEmbedding, OffloadOptimizer
from nbtools.rowwise import PartialRowWiseAdam, RowWiseAdagrad

N, D, STEPS, BOUND = 300, 24, 60, 2e-6
O = torch.optim

CASES = {
    "sgd": (O.SGD, dict(lr=0.05)),
    "sgd-momentum-wd": (O.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (O.SGD, dict(lr=0.05, momentum=0.8, nesterov=True)),
    "adam": (O.Adam, dict(lr=0.01)),
    "adam-wd": (O.Adam, dict(lr=0.01, weight_decay=0.02)),
    "adam-amsgrad": (O.Adam, dict(lr=0.01, amsgrad=True, betas=(0.8, 0.997))),
    "adamw": (O.AdamW, dict(lr=0.01, weight_decay=0.05)),
    "sparse-adam": (O.SparseAdam, dict(lr=0.01)),
    "adagrad": (O.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.01)),
    "rowwise-adagrad": (RowWiseAdagrad, dict(lr=0.05, weight_decay=0.01)),
    "partial-rowwise-adam": (PartialRowWiseAdam, dict(lr=0.01, weight_decay=0.01)),
}


class Reference:
    """Rows and per-row state in float64; each step runs ``cls`` on the touched rows only."""

    def __init__(self, cls, kw, weight: torch.Tensor, state: dict):
        self.cls, self.kw = cls, kw
        self.w = weight.double().clone()
        self.state = {k: v.double().clone() for k, v in state.items()}
        self.t = 0

    def step(self, ids: torch.Tensor, grad_rows: torch.Tensor) -> None:
        self.t += 1
        uniq = torch.unique(ids)
        grad = torch.zeros(len(uniq), D, dtype=torch.float64).index_add_(
            0, torch.searchsorted(uniq, ids), grad_rows.double())
        p = torch.nn.Parameter(self.w[uniq].clone())
        opt = self.cls([p], **self.kw)
        if self.cls is O.SparseAdam:
            idx = torch.arange(len(uniq)).unsqueeze(0)
            p.grad = torch.sparse_coo_tensor(idx, grad, p.shape, is_coalesced=True)
        else:
            p.grad = grad
        st = {k: v[uniq].reshape(self._shape(k, p)).clone() for k, v in self.state.items()}
        if st:
            st["step"] = torch.tensor(float(self.t - 1), dtype=torch.float64)
            opt.state[p] = st
        opt.step()
        self.w[uniq] = p.detach()
        for k in self.state:
            self.state[k][uniq] = opt.state[p][k].reshape(len(uniq), -1)

    def _shape(self, name, p):
        cols = self.state[name].shape[1]
        return p.shape if cols == D else (p.shape[0], cols)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def train_and_compare(cls, kw, device, placement):
    torch.manual_seed(0)
    table = OffloadedEmbedding(N, D, device=device, placement=placement, name="t")
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=True), **kw)
    assert opt.slot(next(iter(opt.tables))).fused_update() is not None, "the fused path must be the one tested"
    state0 = {k: v.clone() for k, v in opt.table_state(table).items()}
    ref = Reference(cls, kw, table.weight.clone().cpu(), {k: v.cpu() for k, v in state0.items()})
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        # a hot range (duplicates in every step) and a cold tail some steps never touch
        hot = torch.randint(0, 40, (48,), generator=gen)
        cold = torch.randint(40, N, (16,), generator=gen)
        ids = torch.cat((hot, cold))
        coef = torch.randn(len(ids), D, generator=gen)
        (table(ids.to(device)) * coef.to(device)).sum().backward()
        opt.step()
        opt.zero_grad()
        ref.step(ids, coef)
    opt.synchronize()
    errors = {"weight": rel(table.weight, ref.w)}
    for k, v in opt.table_state(table).items():
        errors[k] = rel(v, ref.state[k])
    return errors


@pytest.mark.parametrize("case", list(CASES))
def test_fused_update_is_torchs_rule(case, device):
    cls, kw = CASES[case]
    from nbtools import kernels
    if not kernels.usable_on(device):
        pytest.skip(f"no fused kernels on {device} here (the CPU runs them through Triton's "
                    "interpreter where no GPU is visible: the CPU machine's run)")
    placements = ["host", "gpu"] if device.type == "cuda" else ["host"]
    for placement in placements:
        errors = train_and_compare(cls, kw, device, placement)
        worst = max(errors.values())
        assert worst <= BOUND, f"{case} ({placement}): {errors}"
