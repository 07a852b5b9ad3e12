"""Row-wise optimizers (nbtools.rowwise) against a plain reference of FBGEMM's rules, on dense
parameters, sparse gradients and offloaded tables (generic and fused paths, fp32 and bf16
storage, a cache of hot rows, disk rows, write-behind, checkpoints, schedulers)."""
import copy
import math

import pytest
import torch
from torch import nn

import nbtools
from nbtools import OffloadConfig, OffloadedEmbedding, OffloadOptimizer
from nbtools.optim import UnsupportedOptimizerError
from nbtools.rowwise import PartialRowWiseAdam, RowWiseAdagrad


# --- the reference: the rules as written, one row at a time, in float64 --------------------
def ref_adagrad(w, s, grads, lr, eps=1e-10, weight_decay=0.0, maximize=False):
    """w [n, d], s [n] (in place); ``grads``: {row: gradient [d]} of one step."""
    for r, g in grads.items():
        g = -g if maximize else g
        g = g + weight_decay * w[r]
        s[r] += (g * g).mean()
        w[r] -= lr * g / (math.sqrt(s[r]) + eps)


def ref_adam(w, m, v, grads, t, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
             maximize=False):
    """w, m [n, d], v [n] (in place), step t (1-based)."""
    b1, b2 = betas
    for r, g in grads.items():
        g = -g if maximize else g
        w[r] *= 1 - lr * weight_decay
        m[r] = b1 * m[r] + (1 - b1) * g
        v[r] = b2 * v[r] + (1 - b2) * (g * g).mean()
        w[r] -= lr * (m[r] / (1 - b1 ** t)) / (math.sqrt(v[r] / (1 - b2 ** t)) + eps)


class Ref:
    """The reference optimizer over a dense [n, d] float64 copy; lr read at each step."""

    def __init__(self, cls, w, **kw):
        self.cls, self.kw = cls, dict(kw)
        self.w = w.detach().double().clone()
        n, d = self.w.shape
        self.s = torch.full((n,), float(kw.pop("initial_accumulator_value", 0.0)),
                            dtype=torch.float64)
        self.kw.pop("initial_accumulator_value", None)
        self.m = torch.zeros(n, d, dtype=torch.float64)
        self.v = torch.zeros(n, dtype=torch.float64)
        self.t = 0

    def step(self, grads: dict, lr=None):
        kw = dict(self.kw)
        if lr is not None:
            kw["lr"] = lr
        grads = {r: g.double() for r, g in grads.items()}
        if self.cls is RowWiseAdagrad:
            ref_adagrad(self.w, self.s, grads, **kw)
        else:
            self.t += 1
            ref_adam(self.w, self.m, self.v, grads, self.t, **kw)

    def state(self):
        if self.cls is RowWiseAdagrad:
            return {"sum": self.s.unsqueeze(1)}
        return {"exp_avg": self.m, "exp_avg_sq": self.v.unsqueeze(1)}


CASES = [
    (RowWiseAdagrad, dict(lr=0.3)),
    (RowWiseAdagrad, dict(lr=0.2, eps=1e-3, weight_decay=0.1, initial_accumulator_value=0.5,
                          maximize=True)),
    (PartialRowWiseAdam, dict(lr=0.05)),
    (PartialRowWiseAdam, dict(lr=0.05, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.2,
                              maximize=True)),
]
IDS = ["adagrad", "adagrad-wd-max", "adam", "adam-wd-max"]


def close(a, b, tol=1e-5):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a - b).abs().max().item()


# --- the optimizers themselves --------------------------------------------------------------
@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_dense_parameters_match_the_reference(cls, kw):
    gen = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(5, 4, generator=gen))
    ref = Ref(cls, w, **kw)
    opt = cls([w], **kw)
    for _ in range(4):
        g = torch.randn(5, 4, generator=gen)
        g[2] = 0                                 # a dense zero row still decays (weight decay)
        w.grad = g
        opt.step()
        ref.step({r: g[r] for r in range(5)})
    close(w, ref.w)
    for k, v in ref.state().items():
        assert opt.state[w][k].shape == v.shape
        close(opt.state[w][k], v)


@pytest.mark.parametrize("cls", [RowWiseAdagrad, PartialRowWiseAdam])
def test_one_and_three_dimensional_parameters(cls):
    # 1-D: each value is a row (so the rule is per value); 3-D: a row is everything after dim 0
    gen = torch.Generator().manual_seed(1)
    bias, conv = nn.Parameter(torch.randn(6, generator=gen)), \
        nn.Parameter(torch.randn(3, 2, 4, generator=gen))
    opt = cls([bias, conv], lr=0.1)
    refs = Ref(cls, bias.detach().view(6, 1), lr=0.1), Ref(cls, conv.detach().view(3, 8), lr=0.1)
    for _ in range(3):
        bias.grad, conv.grad = torch.randn(6, generator=gen), torch.randn(3, 2, 4, generator=gen)
        opt.step()
        for ref, p in zip(refs, (bias, conv)):
            g = p.grad.reshape(ref.w.shape)
            ref.step({r: g[r] for r in range(g.shape[0])})
    close(bias, refs[0].w.view(6))
    close(conv, refs[1].w.view(3, 2, 4))
    state = opt.state[bias]["sum" if cls is RowWiseAdagrad else "exp_avg_sq"]
    assert state.shape == (6, 1)


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_sparse_gradients_update_only_their_rows(cls, kw):
    gen = torch.Generator().manual_seed(2)
    emb = nn.Embedding(8, 3, sparse=True)
    ref = Ref(cls, emb.weight, **kw)
    opt = cls(emb.parameters(), **kw)
    for ids in ([1, 5, 5, 2], [5, 0, 1, 1, 1], [7, 7]):
        ids = torch.tensor(ids)
        coef = torch.randn(len(ids), 3, generator=gen)
        opt.zero_grad()
        (emb(ids) * coef).sum().backward()
        assert emb.weight.grad.is_sparse and not emb.weight.grad.is_coalesced()
        opt.step()
        grads = {}
        for i, c in zip(ids.tolist(), coef):
            grads[i] = grads.get(i, 0) + c
        ref.step(grads)
    close(emb.weight, ref.w)
    for k, v in ref.state().items():
        close(opt.state[emb.weight][k], v)
    assert emb.weight[3].tolist() == ref.w[3].float().tolist()      # never named: unchanged


def test_one_optimizer_trains_a_head_and_a_sparse_table():
    emb, head = nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1)
    opt = PartialRowWiseAdam([*emb.parameters(), *head.parameters()], lr=0.1)
    before = head.weight.detach().clone(), emb.weight.detach().clone()
    head(emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    assert not torch.equal(head.weight, before[0])
    assert opt.state[head.bias]["exp_avg_sq"].shape == (1, 1)
    assert torch.equal(emb.weight[5], before[1][5])


def test_bad_options_are_refused():
    p = [nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="learning rate"):
        RowWiseAdagrad(p, lr=-1.0)
    with pytest.raises(ValueError, match="epsilon"):
        PartialRowWiseAdam(p, eps=-1e-8)
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        PartialRowWiseAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        RowWiseAdagrad(p, weight_decay=-0.1)
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        RowWiseAdagrad(p, initial_accumulator_value=-1.0)
    with pytest.raises(TypeError, match="tensor"):
        RowWiseAdagrad(p, lr=torch.tensor(0.1))
    for cls, option in ((PartialRowWiseAdam, "amsgrad"), (RowWiseAdagrad, "lr_decay"),
                        (RowWiseAdagrad, "foreach")):
        with pytest.raises(TypeError, match=option):
            cls(p, **{option: True})
    c = nn.Parameter(torch.zeros(2, 2, dtype=torch.complex64))
    c.grad = torch.ones_like(c)
    with pytest.raises(TypeError, match="complex"):
        RowWiseAdagrad([c]).step()
    q = nn.Parameter(torch.zeros(3, 3))
    q.grad = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.ones(1), (3, 3),
                                    check_invariants=True)
    with pytest.raises(ValueError, match="sparse_dim"):
        RowWiseAdagrad([q]).step()
    table = OffloadedEmbedding(4, 2, device="cpu")
    with pytest.raises(ValueError, match="learning rate"):
        OffloadOptimizer(RowWiseAdagrad, [table], lr=-0.5)
    with pytest.raises(TypeError, match="amsgrad"):
        OffloadOptimizer(PartialRowWiseAdam, [table], lr=0.1, amsgrad=True)


# --- on offloaded tables --------------------------------------------------------------------
N, D = 12, 6
STEPS = [[1, 4, 4, 9, 1], [4, 0, 11, 11], [9, 9, 2, 4, 1, 7]]


def _train(table, opt, steps=STEPS, seed=3, lookups=2, sched=None):
    """Steps of two lookups each (duplicate ids within and across them); returns the
    per-step gradients {row: summed gradient} the table saw."""
    gen = torch.Generator().manual_seed(seed)
    seen = []
    for ids in steps:
        grads = {}
        for k in range(lookups):
            part = torch.tensor(ids[k::lookups])
            coef = torch.randn(len(part), D, generator=gen)
            (table(part) * coef).sum().backward()
            for i, c in zip(part.tolist(), coef):
                grads[i] = grads.get(i, 0) + c
        opt.step()
        opt.zero_grad()
        seen.append(grads)
        if sched is not None:
            sched.step()
    opt.synchronize()
    return seen


def _table(seed=0, **kw):
    torch.manual_seed(seed)
    return OffloadedEmbedding(N, D, device="cpu", name="t", **kw)


STORAGE = {
    "fp32": dict(),
    "bf16": dict(dtype=torch.bfloat16),                              # fp32 state
    "bf16-bf16": dict(dtype=torch.bfloat16, state_dtype=torch.bfloat16),
}


@pytest.mark.parametrize("cls,kw", [CASES[1], CASES[3]], ids=["adagrad", "adam"])
@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_offloaded_table_matches_the_reference(cls, kw, storage, fused):
    table = _table(**STORAGE[storage])
    ref = Ref(cls, table.weight.float(), **kw)
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=fused), **kw)
    assert table.layout.state_widths == ((1,) if cls is RowWiseAdagrad else (D, 1))
    for grads in _train(table, opt):
        ref.step(grads)
    tol = 1e-5 if storage == "fp32" else 3e-2      # bf16 keeps ~3 significant digits
    close(table.weight, ref.w, tol)
    for k, v in ref.state().items():
        got = opt.table_state(table)[k]
        assert got.shape == v.shape
        close(got, v, tol)


@pytest.mark.parametrize("cls,kw", [CASES[0], CASES[3]], ids=["adagrad", "adam"])
@pytest.mark.parametrize("where", ["cache", "cache-bf16", "write_behind", "disk"])
def test_fused_through_every_store_equals_generic(cls, kw, where, tmp_path):
    """The fused kernels writing through a cache of hot rows, behind the step, or a disk
    table's RAM slots equal the generic path on a plain host table."""
    bf16 = dict(dtype=torch.bfloat16) if where.endswith("bf16") else {}
    extra = {"cache": dict(cache_rows=4), "cache-bf16": dict(cache_rows=4),
             "write_behind": dict(write_behind=True),
             "disk": dict(placement="disk", disk_dir=str(tmp_path),
                          host_cache_bytes=6 * (D + D + 1) * 4)}[where]
    plain = _table(**bf16)
    opt = OffloadOptimizer(cls, [plain], config=OffloadConfig(fused=False), **kw)
    _train(plain, opt)
    table = _table(**extra, **bf16)
    opt2 = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=True), **kw)
    _train(table, opt2)
    tol = 3e-2 if bf16 else 1e-5
    close(table.weight, plain.weight, tol)
    for k, v in opt.table_state(plain).items():
        close(opt2.table_state(table)[k], v, tol)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_stochastic_rounding(fused):
    table = _table(dtype=torch.bfloat16, state_dtype=torch.bfloat16, rounding="stochastic")
    ref = Ref(PartialRowWiseAdam, table.weight.float(), lr=0.05)
    opt = OffloadOptimizer(PartialRowWiseAdam, [table], lr=0.05,
                           config=OffloadConfig(fused=fused))
    for grads in _train(table, opt):
        ref.step(grads)
    close(table.weight, ref.w, 3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("cls,kw", [CASES[1], CASES[3]], ids=["adagrad", "adam"])
@pytest.mark.parametrize("where", ["host", "host-bf16", "cache", "write_behind", "gpu",
                                   "gpu-bf16"])
def test_cuda_fused_matches_generic(cls, kw, where):
    """On CUDA: the fused kernels (zero-copy host rows, a cache of hot rows, write-behind,
    GPU-placed rows; fp32 and bf16) against the generic path on the same placement, over
    enough steps for the lookups and the step to be replayed as CUDA graphs."""
    placement = "gpu" if where.startswith("gpu") else "host"
    opts = dict(dtype=torch.bfloat16) if where.endswith("bf16") else {}
    opts.update({"cache": dict(cache_rows=64), "write_behind": dict(write_behind=True)}.get(
        where, {}))
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randint(0, 500, (256,), generator=gen).tolist() for _ in range(6)]
    results = []
    for fused in (False, "auto"):
        torch.manual_seed(0)
        t = OffloadedEmbedding(500, 40, device="cuda", placement=placement, name="t", **opts)
        opt = OffloadOptimizer(cls, [t], config=OffloadConfig(fused=fused), **kw)
        assert (opt.slot(next(iter(opt.tables))).fused_update() is not None) == (fused == "auto")
        g2 = torch.Generator().manual_seed(7)
        for ids in steps:
            ids = torch.tensor(ids, device="cuda")
            coef = torch.randn(len(ids), 40, generator=g2).cuda()
            (t(ids) * coef).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        results.append((t.weight.float().cpu(), {k: v.float().cpu() for k, v in
                                                 opt.table_state(t).items()}))
    tol = 3e-2 if "bf16" in where else 1e-4
    close(results[1][0], results[0][0], tol)
    for k, v in results[0][1].items():
        close(results[1][1][k], v, tol)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_state_dict_round_trip_and_resume(fused):
    cfg = OffloadConfig(fused=fused)
    first = _table()
    opt1 = OffloadOptimizer(PartialRowWiseAdam, [first], lr=0.05, config=cfg)
    _train(first, opt1, STEPS)
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in first.state_dict().items()}
    osd = opt1.state_dict()
    assert osd["tables"]["t"]["row_state"]["exp_avg_sq"].shape == (N, 1)
    osd = copy.deepcopy(osd)

    resumed = _table(seed=7)                   # different initial weights: overwritten below
    opt2 = OffloadOptimizer(PartialRowWiseAdam, [resumed], lr=0.05, config=cfg)
    resumed.load_state_dict(saved)
    opt2.load_state_dict(osd)
    _train(resumed, opt2, STEPS)
    ref = _table()                              # uninterrupted: the same six steps

    opt3 = OffloadOptimizer(PartialRowWiseAdam, [ref], lr=0.05, config=cfg)
    _train(ref, opt3, STEPS)
    _train(ref, opt3, STEPS)
    assert torch.equal(resumed.weight, ref.weight)
    for k, v in opt3.table_state(ref).items():
        assert torch.equal(opt2.table_state(resumed)[k], v), k
    bad = copy.deepcopy(osd)
    bad["tables"]["t"]["row_state"]["exp_avg_sq"] = torch.zeros(N, D)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt2.load_state_dict(bad)


def test_checkpoint_manager_round_trip(tmp_path):
    table = _table()
    opt = OffloadOptimizer(RowWiseAdagrad, [table], lr=0.1, config=OffloadConfig(fused=True))
    _train(table, opt)
    ck = nbtools.CheckpointManager(tmp_path)
    ck.save(3, table=table, opt=opt)
    other = _table(seed=5)
    opt2 = OffloadOptimizer(RowWiseAdagrad, [other], lr=0.1, config=OffloadConfig(fused=True))
    assert ck.restore(table=other, opt=opt2) == 3
    assert torch.equal(other.weight, table.weight)
    assert torch.equal(opt2.table_state(other)["sum"], opt.table_state(table)["sum"])
    _train(table, opt, seed=9)
    _train(other, opt2, seed=9)
    assert torch.equal(other.weight, table.weight)


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_lr_scheduler(fused):
    table = _table()
    ref = Ref(RowWiseAdagrad, table.weight, lr=0.4)
    opt = OffloadOptimizer(RowWiseAdagrad, [table], lr=0.4, config=OffloadConfig(fused=fused))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i, grads in enumerate(_train(table, opt, sched=sched)):
        ref.step(grads, lr=0.4 * 0.5 ** i)
    close(table.weight, ref.w)
    assert opt.param_groups[-1]["lr"] == pytest.approx(0.4 * 0.5 ** 3)


def test_model_with_a_head_and_a_table():
    """One OffloadOptimizer(PartialRowWiseAdam) steps a dense head and a table."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = _table()
            self.head = nn.Linear(D, 1)

        def forward(self, ids):
            return self.head(self.emb(ids)).sum()

    model = Model()
    opt = OffloadOptimizer(PartialRowWiseAdam, model, lr=0.1)
    w0 = model.head.weight.detach().clone()
    model(torch.tensor([1, 2, 2])).backward()
    opt.step()
    assert not torch.equal(model.head.weight, w0)
    assert opt.table_state(model.emb)["exp_avg_sq"].shape == (N, 1)
    assert opt.state[model.head.weight]["exp_avg_sq"].shape == (1, 1)


# --- the row protocol's probe, with other optimizers ----------------------------------------
class PerRowSGD(torch.optim.Optimizer):
    """Momentum on each row's mean gradient, state [rows] (1-D): per row, stored in one column."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["speed"] = torch.zeros(p.shape[0], dtype=p.dtype, device=p.device)
                st["speed"].mul_(0.5).add_(p.grad.mean(1))
                p.add_(st["speed"].unsqueeze(1), alpha=-group["lr"])


class PerColumn(torch.optim.Optimizer):
    """State of one value per column: not per row."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["col"] = torch.zeros(p.shape[1:], dtype=p.dtype)
                st["col"].add_(p.grad.sum(0))
                p.sub_(group["lr"] * p.grad)


def test_probe_takes_any_state_whose_first_dim_is_the_row():
    table = _table()
    dense = table.weight.clone()
    opt = OffloadOptimizer(PerRowSGD, [table], lr=0.1)
    assert table.layout.state_widths == (1,)
    speed = torch.zeros(N)
    for grads in _train(table, opt):
        for r, g in grads.items():
            speed[r] = 0.5 * speed[r] + g.mean()
            dense[r] -= 0.1 * speed[r]
    close(table.weight, dense)
    close(opt.table_state(table)["speed"], speed.unsqueeze(1))
    with pytest.raises(UnsupportedOptimizerError, match="neither per row"):
        OffloadOptimizer(PerColumn, [_table()], lr=0.1)


# --- exports and sizing -----------------------------------------------------------------------
def test_exports_and_plan():
    assert nbtools.RowWiseAdagrad is RowWiseAdagrad is nbtools.rowwise.RowWiseAdagrad
    assert nbtools.PartialRowWiseAdam is PartialRowWiseAdam
    rows = 1000
    bf16 = nbtools.plan(rows, 128, "rowwise_adagrad", dtype=torch.bfloat16, device="cpu")
    # 256 + 4 bytes of values, padded to 288 in RAM (whole 32-byte sectors: rowlayout.row_padding)
    assert bf16.row_state == ["sum"] and bf16.host_bytes == rows * 288
    adam = nbtools.plan(rows, 128, "adam", device="cpu")
    assert adam.host_bytes == rows * 1536
    assert bf16.host_bytes / adam.host_bytes < 0.2
    partial = nbtools.plan(rows, 128, "partial_rowwise_adam", device="cpu")
    assert partial.host_bytes == rows * 1056            # (128 + 128 + 1) x 4 = 1,028 -> 1,056
    # and the table allocates what plan() said
    t = OffloadedEmbedding(rows, 128, device="cpu", dtype=torch.bfloat16)
    OffloadOptimizer(RowWiseAdagrad, [t], lr=0.1)
    assert t.rows.row_bytes == 288


def test_rows_in_ram_are_padded_to_sectors_and_the_padding_stays_zero():
    """bf16 weights + one accumulator (260 B) sit in 288-byte rows in RAM (nbtools.store.rows
    .row_padding: whole 32-byte sectors cross the link at ~1.3x the rate); the padding holds
    zeros through steps and never reaches the weights, the state or a state_dict."""
    from nbtools.store.layout import row_padding
    t = OffloadedEmbedding(50, 128, device="cpu", dtype=torch.bfloat16)
    opt = OffloadOptimizer(RowWiseAdagrad, [t], lr=0.1)
    assert t.layout.used == 65 and t.layout.pad == 7 == row_padding(t.layout)
    host = t.storage.tensor
    assert host.shape == (50, 72)
    for _ in range(3):
        t(torch.tensor([1, 7, 7, 49])).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert host[:, 65:].abs().sum() == 0
    assert host[[1, 7, 49], 64].abs().sum() > 0          # the accumulators did move
    (entry,) = opt.state_dict()["tables"].values()
    assert entry["row_state"]["sum"].shape == (50, 1)
    assert torch.equal(entry["row_state"]["sum"][:, 0], host[:, 64])
    assert t.weight.shape == (50, 128)


@pytest.mark.parametrize("placement,available", [("auto", 300_000), ("host", 50_000)])
def test_padding_never_costs_a_table_its_place_in_ram(tmp_path, monkeypatch, placement,
                                                      available):
    """Rows that fit in RAM unpadded but not padded stay in RAM, unpadded (the padding buys
    ~1.3x on the link; a file on disk, or a refusal, would cost far more). "auto": 90% of the
    300,000 bytes available holds the 260,000 bytes of rows but not 288,000 padded; "host":
    the weights already there (256,000) are handed back as the rows grow, so 90% of 306,000."""
    rows = 1000                       # 260 B of values a row: 260,000 B; padded 288,000 B
    memory = {"total": 1 << 34, "available": 1 << 33}           # plenty, at creation
    fake = lambda: dict(memory)
    monkeypatch.setattr(nbtools.placement, "host_memory_bytes", fake)
    monkeypatch.setattr(nbtools.optim.planner, "host_memory_bytes", fake)
    t = OffloadedEmbedding(rows, 128, device="cpu", dtype=torch.bfloat16, placement=placement,
                           disk_dir=str(tmp_path))
    assert t.placement == "host"
    memory["available"] = available                             # then less, as it attaches
    if placement == "auto":
        p = nbtools.plan(rows, 128, "rowwise_adagrad", dtype=torch.bfloat16, device="cpu",
                         disk_dir=str(tmp_path))
        assert (p.placement, p.pad_bytes, p.host_bytes) == ("host", 0, rows * 260)
        assert "not padded" in p.placement_reason
    opt = OffloadOptimizer(RowWiseAdagrad, [t], lr=0.1)
    assert t.placement == "host" and t.layout.pad == 0 and t.rows.row_bytes == 260
    if placement == "auto":
        assert "not padded" in t.placement_reason
    t(torch.tensor([3, 5])).sum().backward()
    opt.step()
    # with room for the padding, the same table is padded
    memory["available"] = 1 << 33
    t2 = OffloadedEmbedding(rows, 128, device="cpu", dtype=torch.bfloat16, placement=placement,
                            disk_dir=str(tmp_path))
    OffloadOptimizer(RowWiseAdagrad, [t2], lr=0.1)
    assert t2.placement == "host" and t2.rows.row_bytes == 288


@pytest.mark.parametrize("cls,kw", [CASES[0], CASES[3]], ids=["adagrad", "adam-wd-max"])
@pytest.mark.parametrize("d", [128, 100, 40, 300])
def test_a_rows_mean_square_does_not_depend_on_its_layout(device, tmp_path, cls, kw, d):
    """A row's mean(g^2) is summed in one fixed order (a pairwise tree, nbtools.rowwise.mean_square)
    by the fused kernels and the generic path alike. On CUDA, Triton's own tl.sum ordered the
    sum by the tile's layout, which follows the strides of the rows: a disk table (260-byte
    rows) and the same table in RAM (padded to 288 bytes) trained apart by an ulp of the
    state."""
    n, gen = 300, torch.Generator().manual_seed(11)
    init = torch.randn(n, d, generator=gen)
    batches = [(torch.randint(0, n, (96,), generator=gen), torch.randn(96, d, generator=gen))
               for _ in range(4)]

    def run(placement, fused, steps):
        extra = dict(disk_dir=str(tmp_path / "t"), host_cache_bytes=160 * 4 * (d + 1)) \
            if placement == "disk" else {}
        t = OffloadedEmbedding(n, d, device=device, placement=placement, name="t",
                               dtype=torch.bfloat16, **extra)
        opt = OffloadOptimizer(cls, [t], config=OffloadConfig(fused=fused), **kw)
        with torch.no_grad():
            t.weight.copy_(init)
        for ids, coef in batches[:steps]:
            (t(ids.to(device)) * coef.to(device)).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        w = t.state_dict()["weight"].cpu()
        return w, {k: v.cpu() for k, v in opt.table_state(t).items()}

    # fused=True: on the CPU, the kernels in Triton's interpreter
    host, disk = run("host", True, 4), run("disk", True, 4)
    assert torch.equal(host[0], disk[0])
    for k in host[1]:
        assert torch.equal(host[1][k], disk[1][k]), k
    if device.type == "cpu":
        # one step: the per-row state of the generic path (torch ops) equals the fused
        # kernels' (in Triton's interpreter; on CUDA the kernels fuse g*g into the first
        # additions, an FMA, so the last bit may differ from the generic path there)
        key = "sum" if cls is RowWiseAdagrad else "exp_avg_sq"
        assert torch.equal(run("host", False, 1)[1][key], run("host", True, 1)[1][key])


def test_mean_square_is_a_pairwise_tree():
    """mean_square's order, spelled out: neighbours first, the row zero-padded to 16 values."""
    from nbtools.rowwise import mean_square
    g = torch.randn(5, 20, dtype=torch.float32)
    x = torch.cat([g.square(), torch.zeros(5, 12)], 1)
    for _ in range(5):
        x = torch.stack([x[:, i] + x[:, i + 1] for i in range(0, x.shape[1], 2)], 1)
    assert torch.equal(mean_square(g), x / 20)
    assert torch.allclose(mean_square(g), g.double().square().mean(1, keepdim=True).float())
