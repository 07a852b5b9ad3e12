"""OffloadOptimizer against independent references, on every device the machine has.

References:
  * torch's own sparse path: nn.Embedding(sparse=True) + SparseAdam / SGD / Adagrad;
  * the dense optimizer on nn.Embedding when every row is touched every step;
  * a "frozen untouched rows" reference for partial batches: the stock optimizer on the dense
    table, then untouched rows' weight and per-row state put back as they were.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from nbtools import OffloadedEmbedding, OffloadedEmbeddingBag, OffloadOptimizer
from nbtools.optim import NonFiniteGradientError, OffloadConfig, UnsupportedOptimizerError
from nbtools.engine import stepper

ROWS, DIM = 40, 8
O = torch.optim

# (optimizer class, kwargs) for every supported optimizer and its interesting variants.
CASES = [
    (O.SGD, dict(lr=0.1)),
    (O.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    (O.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    (O.Adam, dict(lr=0.05)),
    (O.Adam, dict(lr=0.05, amsgrad=True, weight_decay=0.01)),
    (O.AdamW, dict(lr=0.05, weight_decay=0.1)),
    (O.Adamax, dict(lr=0.05)),
    (O.NAdam, dict(lr=0.05)),
    (O.RAdam, dict(lr=0.05)),
    (O.Adadelta, dict(lr=1.0)),
    (O.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1)),
    (O.RMSprop, dict(lr=0.01)),
    (O.RMSprop, dict(lr=0.01, centered=True, momentum=0.5)),
    (O.Rprop, dict(lr=0.01)),
    (O.ASGD, dict(lr=0.05, t0=3)),
]
IDS = [f"{c.__name__}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for c, kw in CASES]


def batches(steps, *, full_first=True, seed=0, rows=ROWS):
    """Id batches with many duplicates; the first (optionally) touches every row."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        if t == 0 and full_first:
            ids = torch.cat([torch.randperm(rows, generator=gen), torch.randint(0, rows, (20,), generator=gen)])
        else:
            k = int(torch.randint(3, rows // 2, (1,), generator=gen))
            pool = torch.randperm(rows, generator=gen)[:k]
            ids = pool[torch.randint(0, k, (3 * k,), generator=gen)]   # duplicates galore
        out.append(ids.view(-1, 1) if t % 2 else ids)                  # 1-D and 2-D ids
    return out


def targets(steps, n_max=200, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n_max, DIM, generator=gen) for _ in range(steps)]


def loss_of(rows, target):
    rows = rows.reshape(-1, DIM)
    return ((rows - target[: rows.shape[0]]) ** 2).sum() + rows.pow(3).sum() * 0.01


def make_table(device, init):
    table = OffloadedEmbedding(ROWS, DIM, device=device, name="t")
    table.weight.copy_(init)
    return table


def run_reference(sparse, cls, kw, device, init, id_batches, tgts):
    """torch's own nn.Embedding (sparse or dense gradients) trained by ``cls``."""
    ref = nn.Embedding(ROWS, DIM, sparse=sparse).to(device)
    ref.weight.data.copy_(init)
    ref_opt = cls(ref.parameters(), **kw)
    for ids, tgt in zip(id_batches, tgts):
        ref_opt.zero_grad()
        loss_of(ref(ids.to(device)), tgt.to(device)).backward()
        ref_opt.step()
    return ref, ref_opt


def run_offloaded(cls, kw, device, init, id_batches, tgts, split=False, config=None):
    table = make_table(device, init)
    opt = OffloadOptimizer(cls, [table], config=config, **kw)
    for ids, tgt in zip(id_batches, tgts):
        opt.zero_grad()
        ids = ids.reshape(-1).to(device)
        if split:      # the same batch as two lookups (context + negatives, say)
            h = ids.numel() // 2
            rows = torch.cat([table(ids[:h]), table(ids[h:])])
        else:
            rows = table(ids)
        loss_of(rows, tgt.to(device)).backward()
        opt.step()
    return table.weight.clone().cpu(), opt


@pytest.mark.parametrize("cls,kw", [(O.SparseAdam, dict(lr=0.05)), (O.SGD, dict(lr=0.1)),
                                    (O.Adagrad, dict(lr=0.1)),
                                    (O.Adagrad, dict(lr=0.1, lr_decay=0.01, initial_accumulator_value=0.3))],
                         ids=["SparseAdam", "SGD", "Adagrad", "Adagrad-init"])
def test_matches_torch_sparse_path(cls, kw, device):
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))
    id_batches, tgts = batches(25, full_first=False), targets(25)
    ref, _ = run_reference(True, cls, kw, device, init, id_batches, tgts)
    got, _ = run_offloaded(cls, kw, device, init, id_batches, tgts)
    torch.testing.assert_close(got, ref.weight.detach().cpu(), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_matches_dense_when_every_row_is_touched(cls, kw, device):
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(4))
    gen = torch.Generator().manual_seed(5)
    id_batches = [torch.cat([torch.randperm(ROWS, generator=gen), torch.randint(0, ROWS, (25,), generator=gen)])
                  for _ in range(8)]
    tgts = targets(8)
    ref, ref_opt = run_reference(False, cls, kw, device, init, id_batches, tgts)
    got, opt = run_offloaded(cls, kw, device, init, id_batches, tgts)
    torch.testing.assert_close(got, ref.weight.detach().cpu(), rtol=2e-5, atol=2e-6)
    # per-row state matches too
    ref_state = ref_opt.state[ref.weight]
    for key, value in opt.table_state("t").items():
        torch.testing.assert_close(value.cpu(), ref_state[key].cpu(), rtol=2e-5, atol=2e-6)


def documented_initial_value(cls, kw, key):
    """Per-row state before a row's first update, as torch's optimizer docs define it."""
    if cls is O.Adagrad and key == "sum":
        return kw.get("initial_accumulator_value", 0.0)
    if cls is O.Rprop and key == "step_size":
        return kw["lr"]
    return 0.0


def frozen_reference(cls, kw, device, init, id_batches, tgts):
    """Stock dense optimizer; untouched rows (weight and per-row state) restored after each step."""
    w = nn.Parameter(init.clone().to(device))
    opt = cls([w], **kw)
    for ids, tgt in zip(id_batches, tgts):
        touched = torch.zeros(ROWS, dtype=torch.bool, device=device)
        touched[ids.reshape(-1).to(device)] = True
        keep_w = w.detach().clone()
        keep_state = {k: v.clone() for k, v in opt.state[w].items()
                      if torch.is_tensor(v) and v.shape == w.shape}
        first = not opt.state[w]
        opt.zero_grad()
        loss_of(F.embedding(ids.to(device), w), tgt.to(device)).backward()
        opt.step()
        with torch.no_grad():
            w[~touched] = keep_w[~touched]
            for k, v in keep_state.items():
                opt.state[w][k][~touched] = v[~touched]
            if first:      # rows not touched yet hold the optimizer's initial state
                for k, v in opt.state[w].items():
                    if torch.is_tensor(v) and v.shape == w.shape:
                        v[~touched] = documented_initial_value(cls, kw, k)
    return w.detach().cpu()


# full_first=True: every row gets the optimizer's own initial state at step 1, then partial
# batches; False: rows first touched late start from the documented initial state.
@pytest.mark.parametrize("full_first,seed", [(True, 6), (False, 11)], ids=["partial", "first-touch-late"])
@pytest.mark.parametrize("cls,kw", CASES, ids=IDS)
def test_partial_batches_match_frozen_rows_reference(cls, kw, full_first, seed, device):
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))
    id_batches = batches(22, full_first=full_first, seed=seed + 1)
    tgts = targets(22, seed=seed + 2)
    expected = frozen_reference(cls, kw, device, init, id_batches, tgts)
    got, _ = run_offloaded(cls, kw, device, init, id_batches, tgts)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=3e-6)


@pytest.mark.parametrize("cls,kw", [CASES[1], CASES[4], CASES[10], CASES[13]],
                         ids=[IDS[1], IDS[4], IDS[10], IDS[13]])
def test_several_lookups_per_step_match_one(cls, kw, device):
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(14))
    id_batches, tgts = batches(12, full_first=False, seed=15), targets(12, seed=16)
    expected = frozen_reference(cls, kw, device, init, id_batches, tgts)
    got, _ = run_offloaded(cls, kw, device, init, id_batches, tgts, split=True)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=3e-6)


def test_rows_are_stored_as_weight_then_state(device):
    table = make_table(device, torch.randn(ROWS, DIM))
    pending = table(torch.tensor([1, 2], device=device))     # looked up before the optimizer
    opt = OffloadOptimizer(O.Adam, [table], lr=0.1)
    assert table.storage.tensor.shape == (ROWS, 3 * DIM)
    table(torch.tensor([1, 2], device=device)).sum().backward()
    opt.step()
    host = table.storage.tensor
    assert torch.equal(host[:, :DIM], table.weight)
    assert torch.equal(host[:, DIM:2 * DIM], opt.table_state(table)["exp_avg"])
    sd = opt.state_dict()["tables"]["t"]["row_state"]
    assert sd["exp_avg_sq"].data_ptr() == host[:, 2 * DIM:].data_ptr()
    with pytest.raises(ValueError, match="already carries optimizer state"):
        OffloadOptimizer(O.Adam, [table], lr=0.1)
    del pending


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_narrow_integer_ids_train(dtype, device):
    table = make_table(device, torch.randn(ROWS, DIM))
    opt = OffloadOptimizer(O.Adam, [table], lr=0.1)
    before = table.weight.clone()
    table(torch.tensor([1, 2, 2], dtype=dtype, device=device)).sum().backward()
    opt.step()
    assert (table.weight[1:3] != before[1:3]).all() and torch.equal(table.weight[3:], before[3:])


def test_untouched_rows_and_state_do_not_change(device):
    table = make_table(device, torch.randn(ROWS, DIM))
    opt = OffloadOptimizer(O.Adam, [table], lr=0.1, weight_decay=0.5)
    before = table.weight.clone()
    table(torch.tensor([1, 2], device=device)).sum().backward()
    opt.step()
    after = table.weight
    changed = (after != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [1, 2]
    state = opt.table_state(table)
    assert (state["exp_avg"][3:] == 0).all() and (state["exp_avg"][1:3] != 0).all()


def test_lookups_in_one_step_are_summed(device):
    """Context and negative sample hitting the same id in separate lookups: nothing is lost."""
    init = torch.randn(ROWS, DIM)
    table = make_table(device, init)
    opt = OffloadOptimizer(O.SGD, [table], lr=1.0)
    a, b = torch.tensor([1, 2, 2], device=device), torch.tensor([2, 5], device=device)
    (table(a).sum() + 2 * table(b).sum()).backward()
    opt.step()
    expected = init.clone()
    expected[1] -= 1
    expected[2] -= 4     # 2 from the first lookup, 2 from the second
    expected[5] -= 2
    torch.testing.assert_close(table.weight.cpu(), expected)


def test_model_with_dense_parameters(device):
    torch.manual_seed(0)

    class Model(nn.Module):
        def __init__(self, table):
            super().__init__()
            self.emb, self.out = table, nn.Linear(DIM, 1)

        def forward(self, ids):
            return self.out(self.emb(ids)).sum()

    init = torch.randn(ROWS, DIM)
    model = Model(make_table(device, init)).to(device)
    ref = Model(nn.Embedding(ROWS, DIM)).to(device)
    ref.emb.weight.data.copy_(init)
    ref.out.load_state_dict(model.out.state_dict())
    opt = OffloadOptimizer(O.SGD, model, lr=0.1)
    ref_opt = O.SGD(ref.parameters(), lr=0.1)
    assert len(opt.param_groups) == 2
    for ids in batches(5, full_first=False):
        ids = ids.to(device)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(ids).backward()
            o.step()
    torch.testing.assert_close(model.out.weight, ref.out.weight)
    torch.testing.assert_close(model.emb.weight.cpu(), ref.emb.weight.detach().cpu())


def test_state_dict_round_trip_with_scheduler(device):
    init = torch.randn(ROWS, DIM)
    id_batches, tgts = batches(12, seed=9), targets(12, seed=10)

    def build():
        table = make_table(device, init)
        opt = OffloadOptimizer(O.Adam, [table], lr=0.05)
        return table, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def train(table, opt, sched, rng):
        for ids, tgt in zip(id_batches[rng], tgts[rng]):
            opt.zero_grad()
            loss_of(table(ids.to(device)), tgt.to(device)).backward()
            opt.step()
            sched.step()

    table, opt, sched = build()
    train(table, opt, sched, slice(0, 6))
    saved = copy.deepcopy((table.state_dict(), opt.state_dict(), sched.state_dict()))
    train(table, opt, sched, slice(6, 12))

    table2, opt2, sched2 = build()
    table2.load_state_dict(saved[0])
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 3)
    train(table2, opt2, sched2, slice(6, 12))
    # CUDA sums a batch's gradients with atomics (index_add_): equal up to their order
    torch.testing.assert_close(table2.weight, table.weight, rtol=1e-6, atol=1e-7)


def test_per_row_grad_scale(device):
    init = torch.randn(ROWS, DIM)
    table = make_table(device, init)
    scale = torch.rand(ROWS) + 0.5
    table.set_grad_scale(scale)
    opt = OffloadOptimizer(O.SGD, [table], lr=1.0)
    ids = torch.tensor([3, 3, 7], device=device)
    table(ids).sum().backward()
    opt.step()
    expected = init.clone()
    expected[3] -= 2 * scale[3]
    expected[7] -= scale[7]
    torch.testing.assert_close(table.weight.cpu(), expected)


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_nonfinite_gradient_leaves_table_intact(mode, device):
    table = make_table(device, torch.randn(ROWS, DIM))
    opt = OffloadOptimizer(O.Adam, [table], lr=0.1, config=OffloadConfig(nonfinite=mode))
    table(torch.tensor([1, 2], device=device)).sum().backward()
    opt.step()
    w, s = table.weight.clone(), {k: v.clone() for k, v in opt.table_state(table).items()}
    step = opt.state_dict()["tables"]["t"]["scalar_state"]["step"].item()
    (table(torch.tensor([2, 4], device=device)).sum() * float("inf")).backward()
    if mode == "raise":
        with pytest.raises(NonFiniteGradientError, match="left unchanged"):
            opt.step()
            opt.synchronize()   # fused tables on CUDA read their checks one step late
    else:
        opt.step()
        assert opt.skipped_steps(table) == 1
    assert torch.equal(table.weight, w)
    for k, v in opt.table_state(table).items():
        assert torch.equal(v, s[k])
    assert opt.state_dict()["tables"]["t"]["scalar_state"]["step"].item() == step
    # still usable
    table(torch.tensor([2], device=device)).sum().backward()
    opt.step()
    assert not torch.equal(table.weight, w)


class JointSGD(torch.optim.Optimizer):
    """An update that normalises by the whole tensor's gradient norm: rows are not independent."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                p -= g["lr"] * p.grad / p.grad.norm()


@pytest.mark.parametrize("cls,kw", [(O.LBFGS, {}), (O.Adafactor, {}), (JointSGD, {})])
def test_unsupported_optimizers_are_refused(cls, kw):
    table = OffloadedEmbedding(10, 4, device="cpu")
    with pytest.raises(UnsupportedOptimizerError, match=cls.__name__):
        OffloadOptimizer(cls, [table], **kw)


def test_bad_optimizer_arguments():
    table = OffloadedEmbedding(10, 4, device="cpu")
    with pytest.raises(TypeError, match="optimizer_class"):
        OffloadOptimizer("adam", [table])
    with pytest.raises(UnsupportedOptimizerError, match="dampening"):
        OffloadOptimizer(O.SGD, [table], lr=0.1, momentum=0.9, dampening=0.1)
    with pytest.raises(UnsupportedOptimizerError, match="SparseAdam only takes sparse"):
        OffloadOptimizer(O.SparseAdam, [table, nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="nonfinite"):
        OffloadOptimizer(O.SGD, [table], lr=0.1, config=OffloadConfig(nonfinite="ignore"))
    with pytest.raises(TypeError):
        OffloadOptimizer(O.SGD, [table], lr=0.1, not_an_argument=1)


def test_param_groups_per_table():
    a = OffloadedEmbedding(10, 4, device="cpu", name="a")
    b = OffloadedEmbedding(10, 4, device="cpu", name="b")
    opt = OffloadOptimizer(O.SGD, [{"params": [a], "lr": 1.0}, {"params": [b]}], lr=0.5)
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.5]
    wa, wb = a.weight.clone(), b.weight.clone()
    (a(torch.tensor([0])).sum() + b(torch.tensor([0])).sum()).backward()
    opt.step()
    torch.testing.assert_close(a.weight[0], wa[0] - 1.0)
    torch.testing.assert_close(b.weight[0], wb[0] - 0.5)


@pytest.mark.parametrize("fused", [False, "auto"])
def test_step_of_only_padding_ids_advances_the_step_count(fused):
    """A step whose lookups touch no row (only padding ids) still counts as a step, as in
    torch's sparse path (SparseAdam's step advances on an all-padding gradient): Adam's bias
    correction afterwards is the same. A ShardedEmbedding shard that no rank asked for in a
    step relies on this."""
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(9))
    init[0] = 0
    ref = nn.Embedding(ROWS, DIM, padding_idx=0, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(init)
    ref_opt = O.SparseAdam(ref.parameters(), lr=0.05)
    table = OffloadedEmbedding(ROWS, DIM, padding_idx=0, device="cpu", name="t")
    table.weight.copy_(init)
    opt = OffloadOptimizer(O.SparseAdam, table, lr=0.05, config=OffloadConfig(fused=fused))
    for ids in ([1, 2, 3], [0, 0], [1, 4]):
        for emb, o in ((ref, ref_opt), (table, opt)):
            emb(torch.tensor(ids)).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    assert ref_opt.state[ref.weight]["step"] == 3
    torch.testing.assert_close(table.weight, ref.weight.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("placement", ["host", "disk"])
@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "bag"])
@pytest.mark.parametrize("cls,kw", [(O.SGD, dict(lr=0.1)), (O.SGD, dict(lr=0.1, momentum=0.9)), (O.Adam, dict(lr=0.05)),
                                    (O.Adagrad, dict(lr=0.1, initial_accumulator_value=0.1))],
                         ids=["SGD", "SGD-momentum", "Adam", "Adagrad"])
def test_a_gradient_from_before_the_optimizer_is_applied_at_its_first_step(
        cls, kw, bag, placement, device, tmp_path):
    """``loss.backward()``, then the optimizer is made, then ``step()``: as torch's optimizers
    apply a ``.grad`` that exists when they are made, the table's pending gradient is applied
    (every optimizer alike, whether or not the table is rebuilt for its state). Reference:
    nn.Embedding / nn.EmbeddingBag and the stock optimizer; every row is touched every step,
    so the lazy and the dense update agree; padding ids are in the batches."""
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(12))
    init[0] = 0
    gen = torch.Generator().manual_seed(13)
    id_batches = [torch.cat([torch.randperm(ROWS, generator=gen),
                             torch.randint(0, ROWS, (24,), generator=gen)]).view(-1, 8)
                  for _ in range(3)]
    ref = (nn.EmbeddingBag(ROWS, DIM, mode="sum", padding_idx=0) if bag else
           nn.Embedding(ROWS, DIM, padding_idx=0)).to(device)
    options = dict(placement="disk", disk_dir=str(tmp_path)) if placement == "disk" else {}
    table = (OffloadedEmbeddingBag(ROWS, DIM, mode="sum", padding_idx=0, device=device, name="t",
                                   **options) if bag else
             OffloadedEmbedding(ROWS, DIM, padding_idx=0, device=device, name="t", **options))
    with torch.no_grad():
        ref.weight.copy_(init)
        table.weight.copy_(init)
    for emb in (ref, table):
        rows = emb(id_batches[0].to(device))
        loss_of(rows, targets(1)[0].to(device)).backward()      # before the optimizer exists
    ref_opt, opt = cls(ref.parameters(), **kw), OffloadOptimizer(cls, table, **kw)
    for step, ids in enumerate(id_batches):
        if step:
            for emb in (ref, table):
                loss_of(emb(ids.to(device)), targets(step + 1)[step].to(device)).backward()
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(table.weight.cpu(), ref.weight.detach().cpu(), rtol=2e-5,
                                   atol=2e-6, msg=f"after step {step + 1}")


@pytest.mark.parametrize("fused", [True, False])
def test_an_interrupt_during_the_step_lands_after_it(fused, device, monkeypatch):
    """Ctrl-C ("interrupt kernel") while step() waits for its checks: KeyboardInterrupt is
    raised once the step is recorded, so a loop continued from the next batch ends
    bit-identical to one never interrupted (interrupted in the middle, the step's rows moved
    on while its step count did not, and every later bias correction was off by one)."""
    import os
    import signal
    init = torch.randn(ROWS, DIM)
    id_batches, tgts = batches(6), targets(6)

    def run(interrupt_at):
        table = make_table(device, init)
        opt = OffloadOptimizer(O.Adam, [table], lr=0.05,
                               config=OffloadConfig(fused=True if fused else False))
        for t, (ids, tgt) in enumerate(zip(id_batches, tgts)):
            loss_of(table(ids.to(device)), tgt.to(device)).backward()
            if t == interrupt_at:
                read = stepper.Verdict.read

                def read_interrupted(self):
                    monkeypatch.setattr(stepper.Verdict, "read", read)
                    os.kill(os.getpid(), signal.SIGINT)      # arrives during the wait
                    return read(self)
                monkeypatch.setattr(stepper.Verdict, "read", read_interrupted)
                with pytest.raises(KeyboardInterrupt):
                    opt.step()
                    opt.step()      # (a check read one step late: the next step reads it)
                assert stepper.Verdict.read is read
            else:
                opt.step()
            opt.zero_grad()
        opt.synchronize()
        return table.weight.detach().clone(), opt.table_state(table)

    import threading
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    w_ref, s_ref = run(None)
    # Python's own handler (a test runner's worker may ignore SIGINT)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        w, s = run(2)
    finally:
        signal.signal(signal.SIGINT, before)
    assert torch.equal(w, w_ref)
    assert all(torch.equal(s[k], s_ref[k]) for k in s_ref)


def test_deferred_interrupts_leave_other_handlers_alone():
    """A Python SIGINT handler runs once the block ends, or at once when SIGINT comes twice;
    an ignored SIGINT stays ignored (and a handler installed outside Python is left alone)."""
    import signal
    import threading
    from nbtools.devices import deferred_interrupts
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    before = signal.getsignal(signal.SIGINT)
    seen = []
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
            assert seen == []                    # held back inside the block
        assert seen == [signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):   # pressed twice: at once
            with deferred_interrupts():
                signal.raise_signal(signal.SIGINT)
                signal.raise_signal(signal.SIGINT)
                seen.append("not reached")
        assert seen == [signal.SIGINT]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with deferred_interrupts():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)


def test_step_runs_torchs_step_hooks_and_profiler_scope_without_grad():
    """OffloadOptimizer.step keeps what torch.optim.Optimizer wraps around every step: its
    pre-hooks (which may replace the arguments) and post-hooks, per optimizer and global, in
    torch's order, the profiler's ``Optimizer.step#...`` scope while a profiler runs, and
    grad mode off inside the step, back as it was after it (an error included). (Global
    hooks also see the torch optimizers a generic step runs inside: counted apart.)"""
    table = OffloadedEmbedding(20, 4, device="cpu")
    opt = OffloadOptimizer(torch.optim.Adam, [table], lr=0.1)
    calls = []
    closures = []

    def pre(o, args, kwargs):
        calls.append(("pre", o is opt, torch.is_grad_enabled()))
        return ((closures[0],), {}) if closures else None

    handles = [opt.register_step_pre_hook(pre),
               opt.register_step_post_hook(lambda o, a, k: calls.append(("post", a))),
               register_optimizer_step_pre_hook(
                   lambda o, a, k: calls.append(("global pre",)) if o is opt else None),
               register_optimizer_step_post_hook(
                   lambda o, a, k: calls.append(("global post",)) if o is opt else None)]
    try:
        before = table.weight.clone()
        table(torch.tensor([1, 2])).sum().backward()
        opt.step()
        assert calls == [("global pre",), ("pre", True, True), ("post", ()), ("global post",)]
        assert not torch.equal(table.weight, before)
        assert torch.is_grad_enabled()

        def closure():
            calls.append(("closure", torch.is_grad_enabled()))
            loss = table(torch.tensor([3])).sum()
            loss.backward()
            return loss
        closures.append(closure)
        calls.clear()
        with torch.autograd.profiler.profile() as prof:
            loss = opt.step()
        assert loss is not None and ("closure", True) in calls
        assert calls[-2] == ("post", (closure,))        # the arguments the pre-hook gave
        assert any(e.name == "Optimizer.step#OffloadOptimizer.step"
                   for e in prof.function_events)
        closures[0] = lambda: 1 / 0                      # an error inside: grad mode restored
        with pytest.raises(ZeroDivisionError):
            opt.step()
        assert torch.is_grad_enabled()
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("cls,kw,applied", [(O.SGD, dict(lr=0.1), True),
                                            (O.Adam, dict(lr=0.05), False)])
def test_a_lookup_backward_reaches_after_the_optimizer_is_made(tmp_path, cls, kw, applied):
    """forward(), then the optimizer, then backward(): without per-row state the rows stay
    where they are and the step applies the gradient (as nn.Embedding + SGD does); with state
    they are rebuilt, and the lookup's gradient is dropped with a warning naming the fix."""
    from nbtools import UnconsumedGradientWarning
    torch.manual_seed(0)
    t = OffloadedEmbedding(20, 4, device="cpu")
    ref = nn.Embedding.from_pretrained(t.weight.detach().clone(), freeze=False)
    ids = torch.tensor([1, 3, 3, 7])
    loss, ref_loss = t(ids).pow(2).sum(), ref(ids).pow(2).sum()
    if applied:
        opt = OffloadOptimizer(cls, t, **kw)
    else:
        with pytest.warns(UnconsumedGradientWarning, match="before the forward pass"):
            opt = OffloadOptimizer(cls, t, **kw)
    ref_opt = cls(ref.parameters(), **kw)
    before = t.weight.detach().clone()
    loss.backward()
    ref_loss.backward()
    opt.step()
    ref_opt.step()
    if applied:
        torch.testing.assert_close(t.weight.detach(), ref.weight.detach())
    else:
        assert torch.equal(t.weight.detach(), before)
