"""A table's kernels compile once per session, not again at some later step.

Triton compiles a kernel once per specialisation of its arguments: each integer's
divisibility by 16 (and whether it is 1), each pointer's 16-byte alignment. A compile takes
seconds (about 3 s a kernel on the GPU machine, more on two cores), so an argument that
changes from launch to launch (a lookup's row count) must not choose a specialisation, and
the tensors a step hands its kernels must start on 16-byte boundaries whatever the step's
sizes. Checked here on the CPU (the launchers' arguments, recorded; the batches' offsets)
and on CUDA (a loop of steps of changing sizes compiles nothing after its first steps).
"""
import numpy as np
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer, kernels
from nbtools.devices import resolve_device
from nbtools.rowwise import RowWiseAdagrad
from nbtools.store.rows import unique_ids
from test_compile_matrix import record_launches      # (this folder's: the launches, recorded)

DEVICE = resolve_device()
needs_triton = pytest.mark.skipif(not kernels.triton_ok(), reason="Triton is not installed")


def _unspecialised(fn) -> set:
    """The argument names ``fn`` (a JIT function, or the interpreter's) does not specialise."""
    given = getattr(fn, "do_not_specialize", None)
    if given is None:                       # (Triton's interpreter keeps the decorator's kwargs)
        given = getattr(fn, "kwargs", {}).get("do_not_specialize") or []
    return {fn.arg_names[g] if isinstance(g, int) else g for g in given}


def _launches(n: int, N: int = 4000) -> list:
    """Every launcher's launches for a lookup of ``n`` unique rows (of 2n positions) of a
    table of ``N`` rows."""
    def call():
        width, d = 96, 32
        ids = torch.arange(n)
        count = torch.tensor([n])
        src, out = torch.zeros(N, width), torch.zeros(n, width)
        kernels.gather_rows(src, ids, count, out)
        kernels.put_rows(src, ids, count, out)
        kernels.patch_rows(out, ids, count, N, out.clone(), ids, count)
        kernels.copy_rows(src, ids, out, ids)
        kernels.take_rows(src[:, :32].bfloat16(), ids, torch.float32)
        fused = kernels.fused_update_for(RowWiseAdagrad, dict(lr=0.1, eps=1e-10), ["sum"],
                                         torch.float32)
        _, consts = fused.scalars(dict(lr=0.1, eps=1e-10, weight_decay=0.0,
                                       maximize=False, initial_accumulator_value=0.0), 1, 0)
        view = torch.zeros(N, d + 1)
        target = kernels.Target(view, view[:, :d], d)
        fused(torch.zeros(n, d + 1), torch.zeros(n, d), torch.zeros(n, d), target, ids, count,
              torch.zeros(1, dtype=torch.int32), torch.zeros(kernels.HYPER, dtype=torch.float64),
              consts)
        i64 = dict(dtype=torch.int64)
        kernels.admit(ids, count, torch.zeros(N, 32), rows=torch.zeros(32, 32),
                      tags=torch.full((33,), -1, **i64),
                      slot_of=torch.full((N + 1,), -1, dtype=torch.int32),
                      freq=torch.zeros(N + 1, dtype=torch.int32),
                      stamp=torch.zeros(33, **i64), tick=torch.ones(1, **i64),
                      best=torch.full((8,), -1, **i64), stats=torch.zeros(4, **i64), ways=4)
        kernels.segment_sum(torch.zeros(2 * n, d), torch.arange(2 * n), torch.arange(2 * n) // 2,
                            torch.zeros(n, d))
    return record_launches(call)


@needs_triton
def test_no_kernel_specialises_on_a_size_that_changes_from_launch_to_launch():
    # sizes of every kind Triton tells apart: 1, a multiple of 16, neither; odd and even; and
    # tables of other row counts (a model's tables then share their kernels' compiles)
    runs = [_launches(n) for n in (1, 16, 37, 50, 1000)] + [_launches(37, N) for N in (4001, 4096)]
    assert all(len(r) == len(runs[0]) for r in runs)
    checked = 0
    for k, (family, name, args, _, _) in enumerate(runs[0]):
        fn = getattr(kernels.jit(family), name)
        free = _unspecialised(fn)
        for i, value in enumerate(args):
            if isinstance(value, bool) or not isinstance(value, int):
                continue
            values = {r[k][2][i] for r in runs}
            if len(values) > 1:
                checked += 1
                assert fn.arg_names[i] in free, (
                    f"{family}.{name}({fn.arg_names[i]}) takes {sorted(values)} at different "
                    "sizes: mark it do_not_specialize, or each change compiles the kernel again")
    assert checked >= 10


@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
def test_a_lookups_index_tensors_start_on_16_byte_boundaries(n):
    ids = torch.arange(n) % max(1, n // 2 + 1)
    batch = unique_ids(ids, 100)
    for t in (batch.ids, batch.inverse, batch.order, batch.slot):
        assert t.data_ptr() % 16 == 0


@pytest.mark.parametrize("uniques", [5, 6, 7, 8])
def test_a_disk_lookups_batch_starts_each_part_on_a_16_byte_boundary(tmp_path, uniques):
    """(address, meta, inverse) of a disk table's lookup share one buffer: where each part
    starts must not move with the parity of the lookup's unique rows."""
    t = OffloadedEmbedding(64, 4, device=DEVICE, placement="disk", disk_dir=str(tmp_path))
    OffloadOptimizer(torch.optim.Adagrad, t, lr=0.1)
    for padded in (False, True):               # with the sentinel's slot too
        ids = torch.arange(uniques).repeat(2)
        if padded:
            ids[0] = 64                         # out of range: the sentinel
        batch, slots = t.rows.batch_of(ids.to(DEVICE), False)
        for part in (batch.ids, batch.meta, batch.inverse):
            assert part.data_ptr() % 16 == 0, (uniques, padded)
        t.rows.used(slots)
    t.close()


@pytest.mark.gpu
@pytest.mark.kernels("rows")
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_steps_of_changing_sizes_compile_nothing_after_the_first_ones(tmp_path, placement):
    from nbtools.kernels.common import compiled

    extra = dict(disk_dir=str(tmp_path), cache_rows=256) if placement == "disk" else {}
    t = OffloadedEmbedding(5000, 40, device=DEVICE, placement=placement, dtype=torch.bfloat16,
                           **extra)
    opt = OffloadOptimizer(RowWiseAdagrad, t, lr=0.1)
    gen = np.random.default_rng(0)

    def step(n):
        ids = torch.from_numpy(gen.integers(0, 5000, n)).to(DEVICE)
        t(ids).square().sum().backward()
        opt.step()
        opt.zero_grad()

    for n in (64, 100):                 # the first steps: every kernel they launch compiles
        step(n)
    torch.cuda.synchronize()
    before = compiled()
    for n in (1, 2, 15, 16, 17, 31, 32, 33, 1000, 1001, 4095, 4096, 4097):
        step(n)
    torch.cuda.synchronize()
    assert compiled() == before
    t.close()
