"""Low-precision storage with float32 math (nbtools.store.precision, TableConfig.dtype / state_dtype /
rounding): checked against an fp32 table whose stored values are rounded the same way after
every step, and the stochastic rounding against its definition."""
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer, RowWiseAdagrad
from nbtools.checkpoint import CheckpointConfig, CheckpointManager
from nbtools.optim import OffloadConfig
from nbtools.store.precision import round_to, stochastic_round_bf16
from test_cache import CPU_KERNELS, FUSABLE, expect_fused, insist

O = torch.optim
N, D = 64, 6
BF = torch.bfloat16


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096) * 3
    y = stochastic_round_bf16(x.repeat(64), gen).float().view(64, -1)
    lo = x.to(BF).float()
    up = torch.nextafter(lo.to(BF), torch.full_like(lo, float("inf")).to(BF)).float()
    dn = torch.nextafter(lo.to(BF), torch.full_like(lo, -float("inf")).to(BF)).float()
    assert ((y == lo) | (y == up) | (y == dn)).all()
    # the mean of 64 draws is x up to the sampling error (ulp / 16 for a fraction's variance)
    ulp = (up - lo).abs()
    assert ((y.mean(0) - x).abs() <= ulp * 0.5).float().mean() > 0.99
    # exact values stay exact
    exact = lo
    assert torch.equal(stochastic_round_bf16(exact, gen).float(), exact)


def test_round_to_nearest_is_tensor_to():
    x = torch.randn(1000)
    assert torch.equal(round_to(x, BF), x.to(BF))
    assert torch.equal(round_to(x, torch.float16), x.to(torch.float16))


CASES = [
    (O.Adam, dict(lr=0.05)),
    (O.SGD, dict(lr=0.1, momentum=0.9)),
    (O.Adagrad, dict(lr=0.1)),
    (O.RMSprop, dict(lr=0.01)),            # the generic path
]


def batches(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(48, generator=gen) ** 3 * N).long() for _ in range(steps)]


def loss_fn(rows):
    w = torch.arange(1, D + 1, dtype=torch.float32, device=rows.device)
    return ((rows * w).sin() + rows.pow(2)).sum()


def init():
    return torch.randn(N, D, generator=torch.Generator().manual_seed(1))


def train_lowp(device, cls, kw, steps, fused="auto", **table_kw):
    table = OffloadedEmbedding(N, D, device=device, name="t", **table_kw)
    table.weight.copy_(init())
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=insist(cls, fused)), **kw)
    assert (opt.slot(next(iter(opt.tables))).fused_update() is not None) == expect_fused(cls, fused, device)
    for ids in steps:
        opt.zero_grad()
        out = table(ids.to(device))
        assert out.dtype == torch.float32          # upcast on gather
        loss_fn(out).backward()
        opt.step()
    return table, opt


def train_reference(device, cls, kw, steps, state_dtype):
    """An fp32 table whose weights (and state, for bf16 state) are rounded to bf16 after
    every step: what bf16 storage with fp32 math and round-to-nearest must equal."""
    table = OffloadedEmbedding(N, D, device=device, name="t")
    table.weight.copy_(init().to(BF).float())
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=False), **kw)
    for ids in steps:
        opt.zero_grad()
        loss_fn(table(ids.to(device))).backward()
        opt.step()
        with torch.no_grad():
            table.weight.copy_(table.weight.to(BF).float())
            if state_dtype == BF:
                for v in opt.table_state("t").values():
                    v.copy_(v.to(BF).float())
    return table, opt


@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
@pytest.mark.parametrize("state_dtype", [None, BF], ids=["fp32state", "bf16state"])
@pytest.mark.parametrize("fused", ["auto", False], ids=["fused", "generic"])
def test_bf16_storage_equals_fp32_math_rounded_once(device, cls, kw, state_dtype, fused):
    steps = batches(6)
    table, opt = train_lowp(device, cls, kw, steps, fused=fused, dtype=BF,
                            state_dtype=state_dtype)
    ref, ref_opt = train_reference(device, cls, kw, steps, state_dtype)
    assert table.weight.dtype == BF
    want_state = state_dtype or torch.float32
    for name, v in opt.table_state("t").items():
        assert v.dtype == want_state, name
        r = ref_opt.table_state("t")[name]
        # one bf16 rounding of the same fp32 value; fp32 sums in another order can flip it
        torch.testing.assert_close(v.float().cpu(), r.cpu(), rtol=2 ** -7, atol=1e-6, msg=name)
    torch.testing.assert_close(table.weight.float().cpu(), ref.weight.cpu(), rtol=2 ** -7,
                               atol=1e-6)
    flips = (table.weight.float().cpu() != ref.weight.cpu()).float().mean()
    assert flips < 0.02


@pytest.mark.parametrize("fused", ["auto", False], ids=["fused", "generic"])
def test_updates_below_bf16_resolution(device, fused):
    """SGD steps of 1/8 of a bf16 ulp at 1.0: round-to-nearest loses every one of them,
    stochastic rounding keeps their mean."""
    rows = 2048
    ids = torch.arange(rows)
    got = {}
    for rounding in ("nearest", "stochastic"):
        table = OffloadedEmbedding(rows, D, device=device, name="t", dtype=BF, rounding=rounding)
        table.weight.fill_(1.0)
        opt = OffloadOptimizer(O.SGD, [table], config=OffloadConfig(fused=insist(O.SGD, fused)),
                               lr=2 ** -10)
        assert (opt.slot(next(iter(opt.tables))).fused_update() is not None) == expect_fused(O.SGD, fused, device)
        for _ in range(4):
            opt.zero_grad()
            table(ids.to(device)).sum().backward()      # gradient 1: a step of -2^-10
            opt.step()
        got[rounding] = table.weight.float().cpu()
    assert (got["nearest"] == 1.0).all()
    mean = got["stochastic"].mean().item()
    assert abs(mean - (1 - 4 * 2 ** -10)) < 2e-4, mean


@pytest.mark.parametrize("fused", ["auto", False], ids=["fused", "generic"])
@pytest.mark.parametrize("cls", [O.SGD, RowWiseAdagrad, O.Adam],
                         ids=["SGD", "RowWiseAdagrad", "Adam"])
def test_stochastic_rounding_draws_new_noise_every_step(device, cls, fused):
    """Two steps of 1/4 of a bf16 ulp down from 1.0 (at most that for RowWiseAdagrad's
    second): each value goes down a whole ulp with probability 1/4 each step. With the same
    noise both steps (the seed of an optimizer that keeps no step count, SGD's or
    RowWiseAdagrad's, once stood still), the values that went down in the second step are
    among those that did in the first; with new noise, about 3/4 of them are not. (Trained
    so, word2vec with SGD scored WS353 0.16 where rounding to nearest gave 0.60.)"""
    rows = 2048
    ids = torch.arange(rows).to(device)
    table = OffloadedEmbedding(rows, D, device=device, name="t", dtype=BF, rounding="stochastic")
    table.weight.fill_(1.0)
    mode = insist(cls, fused) if cls in FUSABLE else (True if fused == "auto" and CPU_KERNELS
                                                      else fused)
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=mode), lr=2 ** -10)
    before, down = table.weight.float().cpu(), []
    for _ in range(2):
        opt.zero_grad()
        table(ids).sum().backward()             # gradient 1: a step of -lr (RowWiseAdagrad's
        opt.step()                              # second: -lr / sqrt(2))
        after = table.weight.float().cpu()
        down.append(after < before)
        before = after
    assert 0.15 < down[0].float().mean() < 0.35
    assert (down[1] & ~down[0]).any(), "the second step rounded with the first step's noise"


def test_sgd_on_bf16_weights_rounded_to_nearest_warns():
    """The case above, said to the user when the optimizer is made: plain SGD on bfloat16
    weights rounded to nearest (stochastic rounding, float32 weights or Adam: no warning)."""
    import warnings

    def made(cls, **table_kw):
        table = OffloadedEmbedding(8, 4, name="words", **table_kw)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            OffloadOptimizer(cls, [table], lr=0.1)
        return [str(w.message) for w in caught if "round" in str(w.message)]
    said = made(O.SGD, dtype=BF)
    assert len(said) == 1 and "'words'" in said[0] and "rounding='stochastic'" in said[0]
    assert made(O.SGD, dtype=BF, rounding="stochastic") == []
    assert made(O.SGD) == []
    assert made(O.Adam, dtype=BF) == []


def test_bf16_with_cache_and_stochastic_rounding_matches_without_cache(device):
    """The noise depends on the row, not on where it lives: a cache changes nothing."""
    from nbtools.store.cache import RowCache
    steps = batches(8)
    outs = []
    row_bytes = 4 * (D // 2 + 2 * D)          # bf16 weights packed, fp32 Adam state
    for cache in (None, RowCache.overhead_bytes(N) + 16 * RowCache.slot_bytes(row_bytes)):
        table, opt = train_lowp(device, O.Adam, dict(lr=0.05), steps, dtype=BF,
                                rounding="stochastic", cache_bytes=cache)
        if cache:
            assert table.cache_stats()["hits"] > 0
        outs.append((table.weight.clone(), {k: v.clone() for k, v in opt.table_state("t").items()}))
    assert torch.equal(outs[0][0], outs[1][0])
    for k in outs[0][1]:
        assert torch.equal(outs[0][1][k], outs[1][1][k])


def test_bf16_table_checkpoint_roundtrip(device, tmp_path):
    table, opt = train_lowp(device, O.Adam, dict(lr=0.05), batches(3), dtype=BF)
    ckpt = CheckpointManager(tmp_path, keep=1, config=CheckpointConfig(verbose=False))
    ckpt.save(3, table=table, opt=opt)
    table2, opt2 = train_lowp(device, O.Adam, dict(lr=0.05), batches(2, seed=5), dtype=BF)
    ckpt.restore(table=table2, opt=opt2)
    assert torch.equal(table.weight, table2.weight)
    for k, v in opt.table_state("t").items():
        assert torch.equal(v, opt2.table_state("t")[k])


@pytest.mark.parametrize("fused", ["auto", False], ids=["fused", "generic"])
def test_resumed_sgd_draws_the_noise_of_the_uninterrupted_run(device, tmp_path, fused):
    """SGD keeps no step count: the steps a table took (whose seeds its stochastic rounding
    draws) travel in the checkpoint, so a resumed run rounds as the uninterrupted one."""
    steps, kw = batches(6), dict(lr=0.05)
    whole, _ = train_lowp(device, O.SGD, kw, steps, fused, dtype=BF, rounding="stochastic")
    table, opt = train_lowp(device, O.SGD, kw, steps[:3], fused, dtype=BF, rounding="stochastic")
    ckpt = CheckpointManager(tmp_path, keep=1, config=CheckpointConfig(verbose=False))
    ckpt.save(3, table=table, opt=opt)
    table2, opt2 = train_lowp(device, O.SGD, kw, batches(2, seed=5), fused, dtype=BF,
                              rounding="stochastic")
    ckpt.restore(table=table2, opt=opt2)
    for ids in steps[3:]:
        opt2.zero_grad()
        loss_fn(table2(ids.to(device))).backward()
        opt2.step()
    assert torch.equal(table2.weight, whole.weight)


def test_low_precision_options_are_checked():
    with pytest.raises(ValueError, match="stochastic"):
        OffloadedEmbedding(N, D, device="cpu", dtype=torch.float16, rounding="stochastic")
    with pytest.raises(ValueError, match="rounding must be"):
        OffloadedEmbedding(N, D, device="cpu", dtype=BF, rounding="up")
    with pytest.raises(ValueError, match="as wide as the weights"):
        OffloadedEmbedding(N, D, device="cpu", dtype=torch.float32, state_dtype=BF)
    t = OffloadedEmbedding(N, 5, device="cpu", dtype=BF)           # an odd dim packs too
    OffloadOptimizer(O.Adam, [t], lr=0.1)
    assert t.layout.packed and t.layout.weight_cols == 3 and t.weight.shape == (N, 5)
