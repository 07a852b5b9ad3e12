"""Tables on a GPU other than the current one train exactly as on the current one.

With ``cuda:0`` current, a table on ``cuda:1`` (and, the reverse, a table on ``cuda:0`` with
``cuda:1`` current) trains through every placement and path (zero-copy host rows, GPU rows, a
GPU cache of hot rows, write-behind, a prefetch, CUDA graphs of lookups and steps, a disk
table, a checkpoint saved and restored), and ends bit for bit where the same table on ``cuda:0``
with ``cuda:0`` current ends. Needs two CUDA GPUs of one host.
"""
from __future__ import annotations

import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import CheckpointConfig, CheckpointManager

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

ROWS, DIM, STEPS, BATCH = 3000, 32, 8, 512
PLACEMENTS = {
    "host": dict(placement="host"),
    "gpu": dict(placement="gpu"),
    "auto": dict(placement="auto"),
    "cache": dict(placement="host", cache_rows=400),
    "write-behind": dict(placement="host", write_behind=True),
    "no-graphs": dict(placement="host", cuda_graphs=False),
    "bf16": dict(placement="host", dtype=torch.bfloat16),
    "disk": dict(placement="disk", host_cache_bytes=1 << 20),
}


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, ROWS, (BATCH,), generator=g), torch.randn(BATCH, DIM, generator=g))
            for _ in range(STEPS)]


def train(where: str, current: int, options: dict, tmp_path, *, prefetch=False,
          cls=torch.optim.Adam, checkpoint_at=None):
    """The table's weights and state after STEPS steps, trained on ``where`` with device
    ``current`` current."""
    torch.cuda.set_device(current)
    torch.manual_seed(0)
    opts = dict(options)
    if opts.get("placement") == "disk":
        opts["disk_dir"] = str(tmp_path / f"disk-{where}-{current}")
    table = OffloadedEmbedding(ROWS, DIM, device=where, name="t", **opts)
    opt = OffloadOptimizer(cls, [table], lr=0.01)
    batches = _batches()
    dev = torch.device(where)
    for step, (ids, coef) in enumerate(batches):
        if checkpoint_at is not None and step == checkpoint_at:
            ck = CheckpointManager(tmp_path / f"ck-{where}-{current}",
                                   config=CheckpointConfig(verbose=False, progress=False))
            ck.save(step, table=table, opt=opt)
            torch.manual_seed(99)
            table = OffloadedEmbedding(ROWS, DIM, device=where, name="t", **opts)
            opt = OffloadOptimizer(cls, [table], lr=0.01)
            assert ck.restore(table=table, opt=opt) == step
        ids = ids.to(dev)
        out = table(ids)
        ((out * coef.to(dev)).sum()).backward()
        opt.step()
        opt.zero_grad()
        if prefetch and step + 1 < len(batches):     # the next batch read ahead of its step
            table.prefetch(batches[step + 1][0].to(dev))
    opt.synchronize()
    state = {k: v.cpu().clone() for k, v in opt.table_state(table).items()}
    result = table.weight.cpu().clone(), state
    torch.cuda.set_device(0)
    return result


def assert_same(a, b, what):
    assert torch.equal(a[0], b[0]), f"{what}: weights differ"
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), f"{what}: state {k} differs"


@pytest.mark.parametrize("kind", list(PLACEMENTS))
def test_a_table_on_another_gpu_trains_as_on_the_current_one(kind, tmp_path):
    options = PLACEMENTS[kind]
    reference = train("cuda:0", 0, options, tmp_path)
    assert_same(train("cuda:1", 0, options, tmp_path), reference, f"{kind} on cuda:1, 0 current")
    assert_same(train("cuda:0", 1, options, tmp_path), reference, f"{kind} on cuda:0, 1 current")


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.Adagrad, torch.optim.Adamax],
                         ids=["adam", "adagrad", "adamax-generic"])
def test_prefetch_and_optimizers_on_another_gpu(cls, tmp_path):
    options = dict(placement="host")
    reference = train("cuda:0", 0, options, tmp_path, prefetch=True, cls=cls)
    assert_same(train("cuda:1", 0, options, tmp_path, prefetch=True, cls=cls), reference,
                "prefetch on cuda:1")


@pytest.mark.parametrize("kind", ["host", "gpu", "disk"])
def test_a_checkpoint_on_another_gpu_resumes_exactly(kind, tmp_path):
    options = PLACEMENTS[kind]
    reference = train("cuda:0", 0, options, tmp_path)
    assert_same(train("cuda:1", 0, options, tmp_path, checkpoint_at=4), reference,
                f"{kind} on cuda:1 resumed")
