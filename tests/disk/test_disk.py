"""placement="disk": rows in a file under a RAM cache train exactly as in host RAM.

The reference is the same model with ``placement="host"`` (itself tested against SparseAdam,
sparse Adagrad and dense optimizers in test_optim.py / test_step.py): every comparison is
``torch.equal`` on weights and optimizer state.
"""
import os
import warnings

import pytest
import torch

import nbtools
from nbtools import OffloadConfig, OffloadedEmbedding, OffloadOptimizer, RowWiseAdagrad
from nbtools.devices import resolve_device
from nbtools.testing import assert_same_rows

DEVICE = resolve_device()
N, D = 300, 8


def _pair(tmp_path, opt_cls=torch.optim.Adam, steps=6, batch=64, lookups=1, seed=0,
          prefetch=False, opt_kwargs=None, table_kwargs=None, ids_fn=None, **disk_kwargs):
    """Train a host table and a disk table side by side on the same ids; return both."""
    opt_kwargs = opt_kwargs or {"lr": 0.05}
    table_kwargs = table_kwargs or {}
    torch.manual_seed(seed)
    init = torch.randn(N, D)
    tables, opts = [], []
    for placement, extra in (("host", {}), ("disk", dict(disk_dir=str(tmp_path), **disk_kwargs))):
        t = OffloadedEmbedding(N, D, name=f"t-{placement}", device=DEVICE, placement=placement,
                               **table_kwargs, **extra)
        with torch.no_grad():
            t.weight.copy_(init)
        tables.append(t)
        opts.append(OffloadOptimizer(opt_cls, t, **opt_kwargs))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = [[(ids_fn(gen) if ids_fn else torch.randint(0, N, (batch,), generator=gen))
                for _ in range(lookups)] for _ in range(steps)]
    for t, opt in zip(tables, opts):
        for i, step in enumerate(batches):
            out = sum((t(ids) * torch.linspace(-1, 1, D, device=DEVICE)).sum()
                      for ids in step)
            if prefetch and t.placement == "disk" and i + 1 < len(batches):
                t.prefetch(batches[i + 1][0])
            out.backward()
            opt.step()
            opt.zero_grad()
    return tables, opts


def _assert_same(tables):
    assert_same_rows(*tables)


@pytest.mark.parametrize("opt_cls,kwargs", [
    (torch.optim.Adam, {"lr": 0.05}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adagrad, {"lr": 0.1}),
    (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
])
def test_disk_trains_as_host(tmp_path, opt_cls, kwargs):
    tables, _ = _pair(tmp_path, opt_cls, opt_kwargs=kwargs, host_cache_bytes=100 * 3 * D * 4)
    _assert_same(tables)
    s = tables[1].disk.stats
    assert s["misses"] > 0 and s["evicted"] > 0 and s["written_back"] > 0   # the file is used


@pytest.mark.parametrize("cache_rows", [10, 150, 400])
def test_cache_sizes(tmp_path, cache_rows):
    """A RAM cache smaller than one batch (it grows to hold the step, with a warning), one
    that evicts every step, and one larger than the table."""
    row_bytes = 3 * D * 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tables, _ = _pair(tmp_path, host_cache_bytes=cache_rows * row_bytes, lookups=2)
    _assert_same(tables)
    grew = any("RAM cache" in str(w.message) for w in caught)
    assert grew == (cache_rows == 10)


def test_bf16_storage_and_padding(tmp_path):
    tables, _ = _pair(tmp_path, table_kwargs={"dtype": torch.bfloat16},
                      host_cache_bytes=80 * 80)
    _assert_same(tables)


def test_prefetch_reads_ahead_bit_identical(tmp_path):
    tables, _ = _pair(tmp_path, prefetch=True, host_cache_bytes=120 * 3 * D * 4, steps=8)
    _assert_same(tables)
    assert tables[1].disk.stats["read_ahead"] > 0


def test_bad_id_raises_and_writes_nothing(tmp_path):
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=40 * 3 * D * 4)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.1, config=OffloadConfig(checks="every_step"))
    before = t.weight.clone()
    t(torch.tensor([1, 2, N + 5])).sum().backward()
    with pytest.raises(IndexError, match=f"{N + 5}"):
        opt.step()
    opt.zero_grad()
    assert torch.equal(t.weight, before)
    with pytest.raises(IndexError, match="-3"):
        with torch.no_grad():
            t(torch.tensor([0, -3]))


def test_nonfinite_step_skipped(tmp_path):
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path))
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.1,
                           config=OffloadConfig(nonfinite="skip"))
    before = t.weight.clone()
    with pytest.warns(RuntimeWarning, match="skipped"):
        (t(torch.tensor([4, 5])).sum() * float("nan")).backward()
        opt.step()
    opt.zero_grad()
    assert torch.equal(t.weight, before)
    assert opt.skipped_steps() == 1


def test_weight_writes_reach_lookups(tmp_path):
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=16 * D * 4)
    with torch.no_grad():
        t(torch.arange(10))                    # rows 0..9 cached in RAM
        t.weight[3] = 7.0                      # written through the file
        assert torch.equal(t(torch.tensor([3])).cpu(), torch.full((1, D), 7.0))


def test_state_dict_round_trip(tmp_path):
    tables, opts = _pair(tmp_path, host_cache_bytes=60 * 3 * D * 4)
    disk, opt = tables[1], opts[1]
    sd_t, sd_o = disk.state_dict(), opt.state_dict()
    fresh = OffloadedEmbedding(N, D, name="t-disk", device=DEVICE, placement="disk",
                               disk_dir=str(tmp_path / "b"))
    fopt = OffloadOptimizer(torch.optim.Adam, fresh, lr=0.05)
    fresh.load_state_dict(sd_t)
    fopt.load_state_dict(sd_o)
    assert torch.equal(fresh.weight, disk.weight)
    for name in disk.state_names:
        assert torch.equal(fresh.state_columns(name), disk.state_columns(name))
    ids = torch.randint(0, N, (50,))
    for t, o in ((disk, opt), (fresh, fopt)):     # and they go on identically
        t(ids).sum().backward()
        o.step()
        o.zero_grad()
    assert torch.equal(fresh.weight, disk.weight)


def test_eval_lookups_do_not_pin_ram(tmp_path):
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=32 * D * 4)
    OffloadOptimizer(torch.optim.SGD, t, lr=0.1)
    with torch.no_grad():
        for start in range(0, N, 20):
            t(torch.arange(start, start + 20))
    assert t.disk.ram.slots == 32          # never grew: evaluation holds no slot for a step


def test_file_lives_in_disk_dir_and_goes_with_close(tmp_path):
    t = OffloadedEmbedding(N, D, name="items", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path))
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("items")
    assert "disk" in repr(t) and "RAM cache" in repr(t)
    assert t.transfer_mode == "disk" and t.nbytes == N * D * 4
    t.close()
    assert os.listdir(tmp_path) == []


def test_bad_config_refused(tmp_path):
    with pytest.raises(ValueError, match="host_cache_bytes"):
        OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=-1)
    with pytest.raises(ValueError, match="placement"):
        OffloadedEmbedding(N, D, device=DEVICE, placement="ssd")
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path))
    with pytest.raises(TypeError, match="cannot be copied"):
        import copy
        copy.deepcopy(t)


def test_disk_full_refused_before_writing(tmp_path, monkeypatch):
    import shutil
    real = shutil.disk_usage

    def tiny(path):
        u = real(path)
        return type(u)(u.total, u.total - 1000, 1000)
    monkeypatch.setattr(shutil, "disk_usage", tiny)
    with pytest.raises(OSError, match="free"):
        OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_auto_places_on_disk_when_ram_is_short(tmp_path, monkeypatch):
    from nbtools import disk, placement
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: {"total": 1 << 20,
                                                                 "available": 1000})
    where, why = placement.auto_placement(10 ** 6, torch.device("cpu"), 0.5, str(tmp_path))
    assert where == "disk" and str(tmp_path) in why
    t = OffloadedEmbedding(N, D, device="cpu", placement="auto", disk_dir=str(tmp_path))
    assert t.placement == "disk" and t.transfer_mode == "disk"
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 5000)
    with pytest.raises(nbtools.NoRoomError, match="fit nowhere") as e:
        placement.auto_placement(10 ** 6, torch.device("cpu"), 0.5, str(tmp_path))
    assert "1000" in str(e.value) or "1,000" in str(e.value) or "KiB" in str(e.value)
    p = nbtools.plan(10 ** 6, 128, "adam", device="cpu", disk_dir=str(tmp_path))
    assert p.placement == "none" and "fit nowhere" in str(p)


def test_plan_names_a_disk_tables_levels(tmp_path, monkeypatch):
    """Where placement='auto' picks disk, plan() says what each level holds: the RAM cache's
    default rows (host_cache_bytes of rows as RAM holds them), the GPU cache's (none on the
    CPU), and the share of rows off the disk."""
    from nbtools import disk, placement
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: {"total": 1 << 20,
                                                                 "available": 1000})
    monkeypatch.setattr(disk, "DEFAULT_HOST_CACHE_BYTES", 288 * 250_000)
    p = nbtools.plan(10 ** 6, 128, "rowwise_adagrad", dtype=torch.bfloat16, device="cpu",
                     disk_dir=str(tmp_path))
    assert p.placement == "disk" and p.host_bytes == 288 * 10 ** 6
    assert p.ram_cache_rows == 250_000 and p.gpu_cache_rows is None
    assert "RAM cache 250,000 rows" in str(p) and "25% of the rows off the disk" in str(p)
    assert "no GPU cache" in str(p)
    monkeypatch.undo()
    small = nbtools.plan(1000, 8, "sgd", device="cpu", disk_dir=str(tmp_path))
    assert small.placement != "disk" and "levels" not in str(small)


def test_auto_counts_rows_rounded_up_to_sectors_on_disk(tmp_path, monkeypatch):
    """260-byte rows (bf16 x 128 and a row-wise accumulator) take 512 bytes each in the file:
    a disk with room for the rows but not for their sectors is refused, with both numbers."""
    from nbtools import disk, placement
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: {"total": 1 << 20,
                                                                 "available": 1000})
    rows = 10_000
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 400 * rows)
    assert placement.disk_bytes(260 * rows, rows) == 512 * rows
    with pytest.raises(nbtools.NoRoomError, match="512-byte sectors"):
        placement.auto_placement(260 * rows, torch.device("cpu"), 0.5, str(tmp_path), rows)
    where, _ = placement.auto_placement(260 * rows, torch.device("cpu"), 0.5, str(tmp_path))
    assert where == "disk"                  # counted without rows: the bytes alone fit
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 512 * rows)
    where, why = placement.auto_placement(260 * rows, torch.device("cpu"), 0.5, str(tmp_path),
                                          rows)
    assert where == "disk" and "on disk" in why


def test_auto_counts_a_packed_log_where_it_needs_less_than_rows_in_place():
    """100M rows of 260 bytes: 51.2 GB in 512-byte sectors, but a log of packed rows (288 bytes)
    with its least spare fits in ~33 GB; the disk's need is that, and a disk with exactly
    that much free gets the log (much less: rows in place, which do not fit either)."""
    from nbtools import placement
    from nbtools.disk import log as disklog
    n = 100_000_000
    need = placement.disk_bytes(260 * n, n)
    assert 31.7e9 < need < 34e9 < 512 * n
    stride = disklog.log_stride(260)
    assert stride == 288 and disklog.file_rows(n, stride, need) >= n * (1 + disklog.MIN_SPARE)
    assert disklog.file_rows(n, stride, need - 2 * 4096 - 10 ** 8) == n


def test_plan_names_the_disk(tmp_path, monkeypatch):
    from nbtools import disk
    from nbtools.disk import log as disklog
    p = nbtools.plan(1000, 8, "sgd", disk_dir=str(tmp_path))
    assert p.disk_free_bytes > 0 and "placement='disk'" in str(p)
    slots = disklog.slots_for(1000)
    size = nbtools.units.human_bytes(slots * disklog.log_stride(32))     # packed 32-byte rows
    assert f"a file of {size} (log-structured, {slots / p.num_rows - 1:.0%} spare)" in str(p)
    monkeypatch.setenv("NBTOOLS_DISK_PACKED", "0")                        # 512-byte rows,
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1000 * 512 + 100)   # no spare room
    p = nbtools.plan(1000, 8, "sgd", disk_dir=str(tmp_path))
    assert "(rows in place)" in str(p), str(p)


def test_warm_cache_loads_the_most_frequent_rows(tmp_path):
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=20 * D * 4)
    counts = torch.zeros(N)
    counts[100:130] = torch.arange(30, 0, -1).float()
    t.warm_cache(counts)                # loaded now: a table used without an optimizer too
    resident = set(int(i) for i in t.disk.ram.id_of if i >= 0)
    assert resident == set(range(100, 120))
    OffloadOptimizer(torch.optim.SGD, t, lr=0.1)     # and again once the rows have moved
    resident = set(int(i) for i in t.disk.ram.id_of if i >= 0)
    assert resident == set(range(100, 120))


@pytest.mark.parametrize("chunk", [2, 1 << 20])
def test_warm_takes_the_first_new_rows_until_ram_is_full(tmp_path, monkeypatch, chunk):
    import numpy as np
    from nbtools.disk import access as diskaccess
    from nbtools.disk import DiskRows
    monkeypatch.setattr(diskaccess, "WARM_CHUNK", chunk)
    d = DiskRows(str(tmp_path), 50, 2, torch.float32, cache_rows=4, device="cpu")
    rows = torch.arange(100.0).reshape(50, 2)
    d.write_rows(np.arange(50), rows)
    d.resolve(np.array([9]), training=False)             # resident already: not counted
    with pytest.raises(ValueError, match="row ids must be in"):
        d.warm([3, 50])
    assert d.warm([9, 5, 5, 9, 7, 7, 3, 11, 12]) == 3     # 3 free slots: 5, 7, 3 (repeats once)
    resident = {int(i): int(s) for s, i in enumerate(d.ram.id_of) if i >= 0}
    assert set(resident) == {9, 5, 7, 3}
    assert all(torch.equal(d.slab.tensor[s], rows[i]) for i, s in resident.items())
    assert d.warm([20, 21]) == 0                          # full: nothing evicted
    d.close()


def test_host_budget_holds(tmp_path):
    """Every host allocation counts against nbtools.set_host_budget; placement="auto" turns
    to disk when RAM is past it, and an allocation past it is refused before it happens."""
    import gc
    from nbtools import devices
    gc.collect()                # other tests' tables freed now, not between here and the check
    held = devices.held_host_bytes()
    try:
        devices.set_host_budget(held + 16 * 1024)
        t = OffloadedEmbedding(N, D, device="cpu", placement="auto", disk_dir=str(tmp_path),
                               host_cache_bytes=8 * 1024)
        assert t.placement == "disk"        # 300 x 8 x 4 x 3 (Adam-sized) > the budget left
        assert devices.held_host_bytes() - held <= 16 * 1024
        with pytest.raises(devices.HostBudgetError, match="host budget"):
            nbtools.HostTensor((1000, 1000), torch.float32)
        with pytest.raises(nbtools.HostMemoryError, match="host memory"):
            OffloadedEmbedding(10 * N, D, device="cpu", placement="host")
    finally:
        devices.set_host_budget(None)
    assert devices.parse_bytes("12GiB") == 12 << 30


def test_auto_places_by_weights_when_adam_state_fits_nowhere(tmp_path, monkeypatch):
    """At construction the optimizer is unknown: a table that fits only without Adam-sized
    state is placed by its weights (its optimizer's attach decides for good)."""
    from nbtools import disk, placement
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: {"total": 1 << 20,
                                                                 "available": 1000})
    dim = 128                   # 512-byte rows: one sector each; with Adam's state three
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 2 * N * dim * 4)
    t = OffloadedEmbedding(N, dim, device="cpu", placement="auto", disk_dir=str(tmp_path))
    assert t.placement == "disk" and "weights alone" in t.placement_reason


def test_attaching_state_needs_room_for_one_file_only(tmp_path, monkeypatch):
    """A table never written has its weights drawn when the optimizer's state attaches: the
    weights-only file goes before the file with the state columns is made, so a disk with room
    for one file holds the table (a 100M-row table on a 64 GiB disk needs this)."""
    import collections
    import shutil
    from nbtools.disk import log as disklog
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(disklog, "LEAVE", 0)      # (a disk of KiB: no GiB left free)
    torch.manual_seed(3)
    t = OffloadedEmbedding(4000, D, name="t", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path), host_cache_bytes=64 * 3 * D * 4)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    # room for the file with the state (3x the row: 1.5x the weights' file at the least spare,
    # disklog.MIN_SPARE, rows packed) but not beside the weights' file
    capacity = int(2.0 * sum(p.stat().st_size for p in files))

    def usage(folder):
        used = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        return Usage(capacity, used, capacity - used)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
    torch.manual_seed(3)
    expected = torch.randn(4000, D, device=DEVICE).cpu()
    assert torch.equal(t.weight.cpu(), expected)
    assert t.state_names and len([p for p in tmp_path.rglob("*") if p.is_file()]) == 1
    t(torch.arange(10)).sum().backward()
    opt.step()


def test_rows_a_read_ahead_brought_in_are_not_ram_hits(tmp_path):
    """Every id new: every row comes from disk, whether the read-ahead or the lookup read it.
    The hit rate (table stats, disk_counters for the dashboard) says 0, not the share the
    read-ahead happened to bring in first."""
    from nbtools.disk import disk_counters
    t = OffloadedEmbedding(10_000, 8, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=640_000)
    opt = OffloadOptimizer(torch.optim.SGD, t, lr=0.1)
    batches = [torch.arange(i * 500, (i + 1) * 500) for i in range(10)]
    before = disk_counters()
    for i, ids in enumerate(batches):
        t(ids).sum().backward()
        if i + 1 < len(batches):
            t.prefetch(batches[i + 1])
        opt.step()
        opt.zero_grad()
    after = disk_counters()
    s = t.disk.stats
    assert s["read_ahead"] > 0 and s["ahead_hits"] > 0       # the read-ahead did bring rows in
    assert s["hits"] == 0 and after["hit_rows"] == before["hit_rows"]
    # the dashboard knows read-ahead is on (its disk-bound advice then leaves it out)
    assert after["ahead_rows"] - before["ahead_rows"] == s["read_ahead"]
    assert after["lookup_rows"] - before["lookup_rows"] == 5000
    assert "hit rate 0%" in repr(t)
    # cache_stats() (no GPU level: RAM's figures alone) says the same, the read-ahead's apart
    stats = t.cache_stats()
    assert stats["ram_hit_rate"] == 0.0 and stats["ram_ahead_hits"] == s["ahead_hits"] > 0


def test_close_gives_the_row_maps_back_to_the_host_budget(tmp_path):
    """The row -> slot map and the changed-rows flags (5 bytes a row: ~0.5 GB at 100M rows)
    leave the host budget when the table is closed, not when it is garbage-collected."""
    from nbtools.devices import held_host_bytes
    before = held_host_bytes()
    t = OffloadedEmbedding(100_000, 4, name="maps", device="cpu", placement="disk",
                           disk_dir=str(tmp_path), host_cache_bytes=4096)
    assert held_host_bytes() - before >= 5 * 100_000
    t.close()
    assert held_host_bytes() - before < 5 * 100_000
    assert t.ram_bytes == 0 and os.listdir(tmp_path) == []


def _fresh_pair(tmp_path, cache_rows: int, prefix: str):
    """A host table and a disk table (a RAM cache of ``cache_rows`` Adam rows) with the same
    initial rows, and an Adam optimizer each, for a loop to train side by side."""
    torch.manual_seed(0)
    init = torch.randn(N, D)
    tables, opts = [], []
    for placement, extra in (("host", {}), ("disk", dict(disk_dir=str(tmp_path),
                                                         host_cache_bytes=cache_rows * 3 * D * 4))):
        t = OffloadedEmbedding(N, D, name=f"{prefix}-{placement}", device=DEVICE,
                               placement=placement, **extra)
        with torch.no_grad():
            t.weight.copy_(init)
        tables.append(t)
        opts.append(OffloadOptimizer(torch.optim.Adam, t, lr=0.05))
    return tables, opts


def _step(t, opt, ids):
    (t(ids) * torch.linspace(-1, 1, D, device=DEVICE)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_an_interrupted_read_loses_no_slot_and_no_row(tmp_path):
    """A KeyboardInterrupt (a notebook's "interrupt kernel") while a lookup reads its misses:
    the lookup raises, nothing is half-placed, its slots are free again, and training the
    step again ends bit-identical to a host table that never stopped."""
    tables, opts = _fresh_pair(tmp_path, cache_rows=200, prefix="t")
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, N, (64,), generator=gen) for _ in range(8)]
    disk = tables[1].disk
    read = disk.file.read

    def interrupted(*args, **kwargs):
        disk.file.read = read
        raise KeyboardInterrupt

    for i, ids in enumerate(batches):
        _step(tables[0], opts[0], ids)
        if i in (3, 6):
            disk.file.read = interrupted
            with pytest.raises(KeyboardInterrupt):
                _step(tables[1], opts[1], ids)
            assert disk.file.read == read           # (the interruption was in a read)
            opts[1].zero_grad()
        _step(tables[1], opts[1], ids)               # the cell run again
    resident = int((disk.ram.id_of >= 0).sum())          # (before .weight empties the cache)
    free = sum(len(part) for part in disk.ram.free_slots)
    assert resident + free == disk.ram.slots, (resident, free, disk.ram.slots)
    _assert_same(tables)


def test_an_interrupt_while_a_lookup_waits_for_a_read_ahead_loses_nothing(tmp_path):
    """A KeyboardInterrupt while a lookup waits (outside the table's lock) for the loads of
    its rows, read-aheads running: the lookup raises, the loads go on, and the cell run again
    trains on, bit-identical to a host table that never stopped."""
    from nbtools.disk import readahead
    tables, opts = _fresh_pair(tmp_path, cache_rows=120, prefix="w")
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, N, (64,), generator=gen) for _ in range(8)]
    real = readahead.ReadAhead.pending_for
    hit = []

    class Interrupted:
        def exception(self):
            raise KeyboardInterrupt

    def pending_once(self, ids):
        got = real(self, ids)
        if not hit:
            hit.append(True)
            return [Interrupted()] + got
        return got

    disk = tables[1]
    for i, ids in enumerate(batches):
        _step(tables[0], opts[0], ids)
        if i + 1 < len(batches):
            disk.prefetch(batches[i + 1])
        if i == 4:
            readahead.ReadAhead.pending_for = pending_once
            try:
                with pytest.raises(KeyboardInterrupt):
                    _step(disk, opts[1], ids)
            finally:
                readahead.ReadAhead.pending_for = real
            opts[1].zero_grad()
        _step(disk, opts[1], ids)                    # the cell run again
    assert hit
    _assert_same(tables)


def test_rows_evicted_by_an_interrupted_lookup_reach_the_file(tmp_path):
    """A lookup interrupted after it evicted dirty rows and before it wrote them: whatever
    reads the whole table next (``.weight``, a checkpoint) finds them written."""
    tables, opts = _pair(tmp_path, host_cache_bytes=100 * 3 * D * 4, steps=4)
    disk = tables[1].disk
    load = disk.load_rows

    def interrupted(ids, slots):
        disk.load_rows = load
        raise KeyboardInterrupt
    disk.load_rows = interrupted
    gen = torch.Generator().manual_seed(7)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):          # until a lookup must evict
            tables[1](torch.randint(0, N, (64,), generator=gen)).sum().backward()
            opts[1].zero_grad()
    assert disk.ram.evicted_rows                 # (evicted, not written: the case under test)
    opts[1].zero_grad()
    _assert_same(tables)


@pytest.mark.parametrize("written", [False, True])
def test_auto_table_made_on_disk_moves_to_ram_when_its_optimizer_fits(tmp_path, monkeypatch,
                                                                      written):
    """Made with placement="auto" where Adam-sized state would not fit in RAM, a table goes to
    disk; an optimizer with less state (RowWiseAdagrad: one value a row) whose rows do fit
    brings it into RAM as it attaches, its weights kept (drawn, or written through .weight),
    its file removed; it then trains as a host table does."""
    from nbtools import placement
    dim = 64                      # 256 B of fp32 weights: Adam 768 B a row, row-wise 260
    memory = {"total": 1 << 30, "available": int(N * 600 / 0.9)}   # 600 B a row usable
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: dict(memory))
    t = OffloadedEmbedding(N, dim, device="cpu", placement="auto", disk_dir=str(tmp_path),
                           name="moved")
    assert t.placement == "disk"
    path = t.disk.file.path
    init = torch.randn(N, dim)
    if written:
        with torch.no_grad():
            t.weight.copy_(init)
    before = t.weight.detach().clone()
    opt = OffloadOptimizer(RowWiseAdagrad, t, lr=0.1)
    assert t.placement == "host" and t.disk is None and "moved to host" in t.placement_reason
    assert not os.path.exists(path)
    assert torch.equal(t.weight, before) and (not written or torch.equal(t.weight, init))
    ref = OffloadedEmbedding(N, dim, device="cpu", placement="host", name="ref")
    with torch.no_grad():
        ref.weight.copy_(before)
    ref_opt = OffloadOptimizer(RowWiseAdagrad, ref, lr=0.1)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, N, (40,), generator=gen)
        for table, o in ((t, opt), (ref, ref_opt)):
            (table(ids) * torch.linspace(-1, 1, dim)).sum().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(t.weight, ref.weight)
    assert torch.equal(t.state_columns("sum"), ref.state_columns("sum"))


def test_auto_table_moved_to_ram_draws_the_weights_a_disk_table_would(tmp_path, monkeypatch):
    """Never written before its optimizer attaches, the moved table draws its N(0, 1) weights
    straight into RAM, the same draws as the same table kept on disk, without writing them to
    the file first."""
    from nbtools import placement
    dim = 64
    memory = {"total": 1 << 30, "available": int(N * 600 / 0.9)}
    monkeypatch.setattr(placement, "host_memory_bytes", lambda: dict(memory))
    torch.manual_seed(123)
    t = OffloadedEmbedding(N, dim, device="cpu", placement="auto", disk_dir=str(tmp_path))
    assert t.placement == "disk"
    writes = []
    monkeypatch.setattr(t.disk.file, "write_range", lambda *a: writes.append(a))
    OffloadOptimizer(RowWiseAdagrad, t, lr=0.1)
    assert t.placement == "host" and not writes
    torch.manual_seed(123)
    ref = OffloadedEmbedding(N, dim, device="cpu", placement="disk", disk_dir=str(tmp_path))
    OffloadOptimizer(RowWiseAdagrad, ref, lr=0.1)
    assert torch.equal(t.weight, ref.weight)


def test_a_fresh_tables_first_whole_write_shows_a_progress_bar(tmp_path, monkeypatch):
    """The one write of every row a fresh disk table makes (its initial rows at the first
    lookup; with the optimizer's state when the optimizer attaches) is minutes for tens of
    GB: it shows a bar of its bytes, filled to the end."""
    from nbtools.disk import access
    bars = []

    class Bar:
        def __init__(self, total, desc):
            self.total, self.desc, self.done, self.closed = total, desc, 0, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True
    monkeypatch.setattr(access, "progress_bar", lambda total, desc, progress: Bar(total, desc))
    t = OffloadedEmbedding(5000, D, name="fresh", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path))
    t(torch.tensor([3, 4000], device=DEVICE))        # the first lookup writes the initial rows
    (bar,) = bars
    assert bar.desc == "table 'fresh': its initial rows, written once"
    assert bar.total == bar.done == 5000 * D * 4 and bar.closed
    u = OffloadedEmbedding(5000, D, name="with-state", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path))
    OffloadOptimizer(torch.optim.Adam, u, lr=0.1)    # rows and Adam's two state columns
    assert bars[1].desc == "table 'with-state': its rows with the optimizer's state, written once"
    assert bars[1].total == bars[1].done == 5000 * 3 * D * 4 and bars[1].closed
    t.close()
    u.close()
    # warming a RAM cache reads the rows it loads: a stretch whole where they are dense in it
    w = OffloadedEmbedding(40_000, D, name="warmed", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path), host_cache_bytes=4_000 * 3 * D * 4)
    OffloadOptimizer(torch.optim.Adam, w, lr=0.1)
    counts = torch.zeros(40_000, dtype=torch.long)
    counts[torch.arange(0, 40_000, 40)] = 5                # one row in 40: sparse
    w.warm_cache(counts)
    warm = bars[-1]
    assert warm.desc == "table 'warmed': warming its caches" and warm.closed
    assert warm.total == warm.done == 1_000 * 3 * D * 4
    w.close()


def test_write_all_writes_every_chunk_once_in_order_and_raises_either_sides_error():
    """The first write of every row: each chunk made in the caller's thread while the one
    before is written by another; an error of either side is raised, after the writer stops."""
    import threading
    from types import SimpleNamespace

    from nbtools.disk.access import chunk_rows, write_all
    disk = SimpleNamespace(name="t", num_rows=10, row_bytes=(64 << 20) // 3)   # 3 rows a chunk
    assert chunk_rows(disk) == 3
    made, written, caller = [], [], threading.get_ident()

    def make(a, b):
        assert threading.get_ident() == caller
        made.append((a, b))
        return torch.arange(a, b)

    def write(start, rows):
        assert threading.get_ident() != caller
        written.append((start, rows.tolist()))
    write_all(disk, make, write, "rows")
    assert made == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert written == [(0, [0, 1, 2]), (3, [3, 4, 5]), (6, [6, 7, 8]), (9, [9])]
    here = []                                           # overlap=False: all in this thread
    write_all(disk, lambda a, b: torch.arange(a, b),
              lambda start, rows: here.append((threading.get_ident(), start)), "rows",
              overlap=False)
    assert here == [(caller, 0), (caller, 3), (caller, 6), (caller, 9)]

    def bad_write(start, rows):
        if start == 3:
            raise OSError("disk full")
    with pytest.raises(OSError, match="disk full"):
        write_all(disk, make, bad_write, "rows")

    def bad_make(a, b):
        if a == 6:
            raise RuntimeError("out of memory")
        return torch.arange(a, b)
    written.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        write_all(disk, bad_make, write, "rows")
    assert [s for s, _ in written] == [0, 3]           # the writer finished what it had
