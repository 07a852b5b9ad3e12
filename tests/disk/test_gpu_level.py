"""A GPU cache over a disk table (nbtools.disk.gpu) trains exactly as the table in host RAM.

The reference is the same model with ``placement="host"`` (itself tested against torch's
optimizers in test_optim.py / test_exact_updates.py): weights and every state column are
compared with ``torch.equal``, with caches small enough that rows move between the GPU, RAM
and the file at every step. On a machine without CUDA the GPU level is a CPU tensor and the
same logic runs (the kernels in Triton's interpreter: tests/conftest.py).
"""
import types

import numpy as np
import pytest
import torch

import nbtools
from nbtools import OffloadedEmbedding, OffloadOptimizer, RowWiseAdagrad
from nbtools.devices import resolve_device
from nbtools.testing import assert_same_rows

DEVICE = resolve_device()
N, D = 400, 8


def _zipf(gen, k):
    """Skewed ids (a few hot rows, a long tail), as a real id stream."""
    u = torch.rand(k, generator=gen)
    return ((N ** u - 1).long() * 7919) % N


def _train(tmp_path, opt_cls=torch.optim.Adam, opt_kwargs=None, steps=12, batch=48,
           lookups=1, ram_rows=40, gpu_rows=30, prefetch=0, between=None, batch_down=None,
           **table_kwargs):
    """A host table and a disk table with a GPU level, trained on the same ids."""
    torch.manual_seed(0)
    init = torch.randn(N, D)
    gen = torch.Generator().manual_seed(1)
    batches = [[_zipf(gen, batch) for _ in range(lookups)] for _ in range(steps)]
    tables, opts = [], []
    for placement in ("host", "disk"):
        extra = {} if placement == "host" else dict(
            disk_dir=str(tmp_path), cache_rows=gpu_rows,
            host_cache_bytes=ram_rows * 3 * D * 4 * (2 if table_kwargs.get("dtype") else 1))
        t = OffloadedEmbedding(N, D, name=f"t-{placement}", device=DEVICE, placement=placement,
                               **table_kwargs, **extra)
        with torch.no_grad():
            t.weight.copy_(init.to(t.weight.dtype))
        opt = OffloadOptimizer(opt_cls, t, **(opt_kwargs or {"lr": 0.05}))
        if batch_down and placement == "disk":
            t.disk.above.batch_down = batch_down
        for i, step in enumerate(batches):
            if prefetch and placement == "disk":
                for ahead in batches[i + 1:i + 1 + prefetch]:
                    if i + prefetch < len(batches) and ahead is batches[i + prefetch]:
                        t.prefetch(ahead[0])
            loss = sum((t(ids) * torch.linspace(-1, 1, D, device=DEVICE)).pow(2).sum()
                       for ids in step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if between is not None:
                between(t, i)
        tables.append(t)
        opts.append(opt)
    return tables, opts


def _same(tables):
    assert_same_rows(*tables)


def _levels_hold_different_rows(table):
    """Every row the GPU holds has no dirty RAM copy (its RAM slot, if any, is a stale
    copy that is never written to the file as the row's value)."""
    gpu, disk = table.disk.above, table.disk
    held = np.flatnonzero(gpu.slot_of >= 0)
    ram = disk.ram.slot_of[held]
    assert not disk.ram.dirty[ram[ram >= 0]].any()
    assert (gpu.id_of[gpu.slot_of[held]] == held).all()


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adamax, {"lr": 0.05}),           # a generic (unfused) optimizer
    (RowWiseAdagrad, {"lr": 0.1}),
])
def test_gpu_level_trains_as_host(tmp_path, opt_cls, kwargs):
    tables, _ = _train(tmp_path, opt_cls, kwargs)
    disk = tables[1]
    _same(tables)
    stats = disk.cache_stats()
    # rows moved at every level: GPU hits and evictions, RAM misses, rows written to the file
    assert stats["hits"] > 0 and stats["evicted"] > 0 and stats["admitted"] > stats["evicted"]
    assert disk.disk.stats["misses"] > 0 and disk.disk.stats["written_back"] > 0
    assert 0 < stats["hit_rate"] < 1 and 0 <= stats["ram_hit_rate"] < 1


def test_levels_hold_different_rows(tmp_path):
    def check(t, i):
        if t.placement == "disk":
            _levels_hold_different_rows(t)
    tables, _ = _train(tmp_path, between=check)
    _same(tables)


def test_rows_moved_down_in_batches(tmp_path):
    """More victims than a lookup needs: the rest wait in the free list."""
    def check(t, i):
        if t.placement == "disk":
            _levels_hold_different_rows(t)
    tables, _ = _train(tmp_path, batch_down=12, between=check, gpu_rows=40, ram_rows=60)
    _same(tables)


def test_bf16_rows_several_lookups_and_padding(tmp_path):
    tables, _ = _train(tmp_path, RowWiseAdagrad, {"lr": 0.1}, lookups=3, dtype=torch.bfloat16,
                       padding_idx=0)
    _same(tables)


def test_gpu_level_smaller_than_a_step(tmp_path):
    """Rows that find no GPU slot (every slot holds a row of this step) stay in RAM for it."""
    tables, _ = _train(tmp_path, gpu_rows=5, batch=64)
    _same(tables)


def test_read_ahead_skips_rows_the_gpu_holds(tmp_path):
    tables, _ = _train(tmp_path, prefetch=2, steps=14)
    _same(tables)
    assert tables[1].disk.stats["read_ahead"] > 0
    _levels_hold_different_rows(tables[1])


def test_weight_reads_and_writes_between_steps(tmp_path):
    """``.weight`` mid-training (the GPU's rows copied down, then the level emptied), a state
    dict (copied down, kept), and a write through ``.weight`` that lookups must see."""
    def poke(t, i):
        if i == 3:
            t.weight[5].add_(1.0)               # a write through the mapping
        if i == 6:
            t.state_dict()
        if i == 8:
            t.state_columns(t.state_names[0], keep_cache=True)
    tables, _ = _train(tmp_path, between=poke)
    _same(tables)


def test_evaluation_lookups_read_both_levels(tmp_path):
    tables, _ = _train(tmp_path, steps=6)
    host, disk = tables
    ids = torch.arange(N)
    with torch.no_grad():
        assert torch.equal(host(ids), disk(ids))
        assert torch.equal(host(ids[::3]), disk(ids[::3]))


def test_checkpoint_resume_is_bit_identical(tmp_path):
    """Save mid-training with rows in every level, restore into a fresh table, go on: the same
    as never stopping."""
    gen = torch.Generator().manual_seed(3)
    batches = [_zipf(gen, 48) for _ in range(10)]

    def make(name):
        torch.manual_seed(0)
        t = OffloadedEmbedding(N, D, name="t", device=DEVICE, placement="disk",
                               disk_dir=str(tmp_path / name), cache_rows=30,
                               host_cache_bytes=40 * 3 * D * 4)
        return t, OffloadOptimizer(torch.optim.Adam, t, lr=0.05)

    def run(t, opt, part):
        for ids in part:
            t(ids).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    t1, o1 = make("a")
    run(t1, o1, batches)
    t2, o2 = make("b")
    run(t2, o2, batches[:5])
    nbtools.CheckpointManager(tmp_path / "ckpt").save(5, table=t2, opt=o2)
    run(t2, o2, batches[5:7])                  # (changes after the save are not restored)
    t3, o3 = make("c")
    assert nbtools.CheckpointManager(tmp_path / "ckpt").restore(table=t3, opt=o3) == 5
    run(t3, o3, batches[5:])
    # and into the table it was saved from, whose levels hold rows changed since
    assert nbtools.CheckpointManager(tmp_path / "ckpt").restore(table=t2, opt=o2) == 5
    run(t2, o2, batches[5:])
    for t in (t2, t3):
        assert torch.equal(t1.weight, t.weight)
        assert torch.equal(t1.state_columns("exp_avg"), t.state_columns("exp_avg"))


def test_repr_and_stats_name_both_levels(tmp_path):
    tables, _ = _train(tmp_path, steps=4)
    text = repr(tables[1])
    assert "GPU cache 30 rows" in text and "RAM cache" in text and "hit rate" in text
    stats = tables[1].cache_stats()
    assert stats["capacity_rows"] == 30 and stats["lookups"] > 0


def test_auto_gives_a_disk_table_a_gpu_cache(tmp_path, monkeypatch):
    """placement="auto" that lands on disk takes gpu_fraction of the free GPU memory as a
    cache above the RAM slots (here a CPU stand-in: cache_fraction on a CPU is refused, so
    the budget function is checked directly)."""
    from nbtools.store import cache
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           cache_fraction=0.25)
    monkeypatch.setattr(cache, "gpu_free_bytes", lambda device: 1 << 20)
    rows = types.SimpleNamespace(device=torch.device("cuda"), row_bytes=t.rows.row_bytes)
    budget, why = cache.cache_budget(rows, t.config, name=t.name, placement=t.placement,
                                     asked=t.requested_placement, num_rows=t.num_embeddings)
    assert budget == 1 << 18 and "cache_fraction" in why


def test_warm_cache_fills_the_gpu_then_ram(tmp_path):
    """Known frequencies load the hottest rows into the GPU's free slots, the next into RAM's;
    training from there equals the host table."""
    counts = torch.arange(N, 0, -1)               # row 0 the hottest
    tables = []
    for placement in ("host", "disk"):
        torch.manual_seed(0)
        extra = {} if placement == "host" else dict(
            disk_dir=str(tmp_path), cache_rows=30, host_cache_bytes=40 * 3 * D * 4)
        t = OffloadedEmbedding(N, D, name="t", device=DEVICE, placement=placement, **extra)
        opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
        t.warm_cache(counts)
        if placement == "disk":
            gpu, disk = t.disk.above, t.disk
            assert sorted(np.flatnonzero(gpu.slot_of >= 0)) == list(range(30))
            in_ram = np.flatnonzero(disk.ram.slot_of >= 0)
            assert sorted(in_ram.tolist()) == list(range(30, 70))
        gen = torch.Generator().manual_seed(2)
        for _ in range(6):
            t(_zipf(gen, 48)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        tables.append(t)
    _same(tables)


def test_slots_a_lookup_moves_up_stay_locked_until_its_step(tmp_path):
    """A row moved up into the GPU leaves its RAM slot (a stale copy) in the step's list of
    slots, which unlocks them when the step is queued. Unlocked earlier, CLOCK could hand the
    slot to a read-ahead's row, which the step would then unlock while it loads (weights came
    out different from host RAM in about 1 run in 6 with read-ahead)."""
    t = OffloadedEmbedding(N, D, name="t", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path), cache_rows=30, host_cache_bytes=60 * 3 * D * 4)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
    gen = torch.Generator().manual_seed(1)
    d, level = t.disk, t.disk.above
    left = 0
    for _ in range(6):
        ids = _zipf(gen, 48)
        ram_before, gpu_before = d.ram.slot_of.copy(), level.slot_of.copy()
        out = t(ids)
        uniq = np.unique(ids.numpy())
        up = uniq[(gpu_before[uniq] < 0) & (level.slot_of[uniq] >= 0) & (ram_before[uniq] >= 0)]
        stale = d.ram.slot_of[up]
        stale = stale[stale >= 0]
        left += len(stale)
        assert d.ram.locked[stale].all(), \
            "a slot left by a row moved up was unlocked before its step"
        out.pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert left > 0


@pytest.mark.parametrize("rows,ram_rows,gpu_rows,hot", [
    (N, 40, 30, 90), (60_000, 45_000, 10_000, 60_000)], ids=["sparse", "dense"])
def test_warming_both_levels_in_one_pass_equals_two_warms(tmp_path, rows, ram_rows, gpu_rows,
                                                         hot):
    """``warm(ids, level, ram_too=True)`` reads the file once and leaves both levels exactly as
    warming the GPU level and then RAM does: the same rows in the same slots with the same
    bytes, whatever RAM held before (rows trained first, some of them going up). "dense":
    enough wanted rows that the file is read in whole 64 MiB stretches (the one pass reads
    them so; the GPU's own warm reads its rows one by one)."""
    from nbtools.disk.gpu import attach
    ids = (np.arange(rows, dtype=np.int64) * 7919) % rows if hot == rows else \
        np.random.default_rng(3).permutation(rows)[:hot]
    states = []
    for one_pass in (False, True):
        torch.manual_seed(0)
        t = OffloadedEmbedding(rows, D, name="t", device=DEVICE, placement="disk",
                               disk_dir=str(tmp_path / f"p{one_pass}"),
                               host_cache_bytes=ram_rows * 3 * D * 4)
        opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):                      # RAM holds trained (dirty) rows
            t(_zipf(gen, 48)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        level = attach(t.disk, gpu_rows, t.device)
        t.sync_slab()
        d = t.disk
        if one_pass:
            loaded = d.warm(ids, level=level, ram_too=True)
        else:
            loaded = d.warm(ids, level=level) + d.warm(ids)
        ram = d.ram
        held = np.flatnonzero(ram.id_of >= 0)
        states.append((loaded, level.slot_of.copy(), ram.slot_of.copy(),
                       level.rows.cpu().clone(), ram.slab_bytes[held].copy()))
        t.close()
    (n0, g0, r0, gr0, rb0), (n1, g1, r1, gr1, rb1) = states
    assert n0 == n1 > gpu_rows
    assert np.array_equal(g0, g1) and np.array_equal(r0, r1)
    assert torch.equal(gr0, gr1) and np.array_equal(rb0, rb1)
