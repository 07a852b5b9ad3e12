"""Checkpoints of disk tables (placement="disk"): bases and deltas of rows, file to file.

The reference everywhere is the same model with ``placement="host"`` trained on the same
batches (host tables are themselves tested against PyTorch's optimizers in test_optim.py and
test_step.py, and checkpointed through state_dict in test_checkpoint.py): every comparison is
``torch.equal`` on weights and optimizer state. The kill test SIGKILLs a training child at
random moments of its steps, write-backs and saves, and checks each restore against a replay.
"""
import errno
import multiprocessing as mp
import os
import random
import signal
import time
import warnings

import numpy as np
import pytest
import torch

import nbtools.checkpoint.format as ckformat
from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import (CheckpointConfig, CheckpointError, CheckpointManager,
                                CheckpointSpaceError, CheckpointWarning)
from nbtools.devices import resolve_device
from nbtools.rowfile import RowFile, RowFileError, leftovers, remove_leftovers
from test_checkpoint_faults import tiny_fs  # noqa: F401  (a 2 MiB tmpfs that fills up)

DEVICE = resolve_device()
QUIET = dict(verbose=False, progress=False)
N, D = 2000, 8


def _cfg(**kw):
    return CheckpointConfig(**{"chunk_bytes": 16 << 10, "file_bytes": 1 << 20, **QUIET, **kw})


def _pair_member(placement, tmp_path, n=N, d=D, opt_cls=torch.optim.Adam, cache_rows=250,
                 dtype=torch.float32, seed=0, init=True, **opt_kwargs):
    """One table and its optimizer; weights from ``seed`` (not from the global RNG)."""
    extra = {}
    if placement == "disk":
        extra = dict(disk_dir=str(tmp_path / "tables"), host_cache_bytes=cache_rows * 3 * d * 4)
    t = OffloadedEmbedding(n, d, name="emb", device=DEVICE, placement=placement, dtype=dtype,
                           **extra)
    opt = OffloadOptimizer(opt_cls, t, **(opt_kwargs or {"lr": 0.05}))
    if init:
        with torch.no_grad():
            t.weight.copy_(torch.randn(n, d, generator=torch.Generator().manual_seed(seed)))
    return t, opt


def _train(t, opt, steps, batch=200, n=N):
    """Steps ``steps`` (an iterable of step numbers): the batch of step s is a function of s."""
    d = t.embedding_dim
    for s in steps:
        ids = torch.randint(0, n, (batch,), generator=torch.Generator().manual_seed(1000 + s))
        (t(ids) * torch.linspace(-1, 1, d, device=DEVICE)).sum().backward()
        opt.step()
        opt.zero_grad()


def _rows(t, opt):
    """Weights and per-row state as saved (read through state_dict: the table's read-only
    view, which does not count as a change of every row as ``table.weight`` does)."""
    w = t.state_dict()["weight"].clone()
    st = opt.state_dict()["tables"]["emb"]["row_state"]
    return w, {k: v.clone() for k, v in st.items()}


def _assert_rows(a, b):
    (wa, sa), (wb, sb) = a, b
    assert torch.equal(wa.cpu(), wb.cpu())
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k].cpu(), sb[k].cpu()), k


@pytest.mark.parametrize("opt_cls,kwargs,dtype", [
    (torch.optim.Adam, {"lr": 0.05}, torch.float32),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float32),
    (torch.optim.Adagrad, {"lr": 0.1}, torch.bfloat16),       # bf16 weights packed in fp32 rows
])
def test_restore_equals_host_twin_through_bases_and_deltas(tmp_path, opt_cls, kwargs, dtype):
    host, hopt = _pair_member("host", tmp_path, opt_cls=opt_cls, dtype=dtype, **kwargs)
    disk, dopt = _pair_member("disk", tmp_path, opt_cls=opt_cls, dtype=dtype, **kwargs)
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg(base_every=3))
    kinds = []
    for s in range(1, 9):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
        kinds.append(ck.save(s, model=disk, opt=dopt)["disk_tables"]["emb"]["kind"])
    assert kinds == ["base", "delta", "delta", "base", "delta", "delta", "base", "delta"]
    assert disk.disk.stats["written_back"] > 0           # evictions wrote rows back
    want = _rows(host, hopt)
    _assert_rows(_rows(disk, dopt), want)
    # A fresh table restores the newest (a base and one delta) ...
    fresh, fopt = _pair_member("disk", tmp_path, opt_cls=opt_cls, dtype=dtype, seed=5, **kwargs)
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg(base_every=3))
    assert ck.restore(model=fresh, opt=fopt) == 8
    _assert_rows(_rows(fresh, fopt), want)
    # ... and trains on exactly as the twin, its next save a delta on the restored chain.
    _train(host, hopt, [9, 10])
    _train(fresh, fopt, [9, 10])
    _assert_rows(_rows(fresh, fopt), _rows(host, hopt))
    info = ck.save(10, model=fresh, opt=fopt)["disk_tables"]["emb"]
    assert info["kind"] == "delta" and info["needs"] == 3 and 0 < info["rows"] < N


def test_older_checkpoint_of_a_chain_restores_exactly(tmp_path):
    """Restoring step 5 (a delta in the middle of a chain) gives the twin at step 5."""
    host, hopt = _pair_member("host", tmp_path)
    disk, dopt = _pair_member("disk", tmp_path)
    ck = CheckpointManager(tmp_path / "ck", keep=10, config=_cfg(base_every=4))
    snaps = {}
    for s in range(1, 8):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
        ck.save(s, model=disk, opt=dopt)
        snaps[s] = _rows(host, hopt)
    # the newest six verify; make every checkpoint after 5 damaged so that 5 is the one restored
    for r in ck.checkpoints():
        if r["step"] > 5:
            os.remove(os.path.join(r["path"], "MANIFEST"))
    fresh, fopt = _pair_member("disk", tmp_path, seed=3)
    with pytest.warns(CheckpointWarning, match="damaged"):
        assert ck.restore(model=fresh, opt=fopt) == 5
    _assert_rows(_rows(fresh, fopt), snaps[5])


def test_save_moves_rows_file_to_file_not_through_ram(tmp_path):
    """The peak RSS of a save (and of a restore) stays far below the table's size: no
    state_dict tensor of the table is ever read, and rows pass through bounded buffers."""
    n, d = 120_000, 64                        # Adam rows: 768 bytes, 92 MB of rows
    t, opt = _pair_member("disk", tmp_path, n=n, d=d, cache_rows=256, init=False)
    _train(t, opt, [1], batch=64, n=n)
    cfg = _cfg(chunk_bytes=1 << 20)
    ck = CheckpointManager(tmp_path / "ck", config=cfg)
    table_bytes = n * t.disk.row_bytes

    def peak_growth(fn):
        with open("/proc/self/status") as f:
            before = int(next(x for x in f if x.startswith("VmRSS")).split()[1]) << 10
        with open("/proc/self/clear_refs", "w") as f:       # restart VmHWM from here
            f.write("5")
        fn()
        with open("/proc/self/status") as f:
            peak = int(next(x for x in f if x.startswith("VmHWM")).split()[1]) << 10
        return peak - before

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux's /proc/self/clear_refs to measure peak RSS")
    grew = peak_growth(lambda: ck.save(1, model=t, opt=opt, rng=False))
    print("save grew", grew)
    info = ck.checkpoints()[0]
    assert info["bytes"] >= table_bytes                     # the base is there, whole ...
    assert grew < table_bytes / 4, (grew, table_bytes)     # ... and never was in RAM
    # the checkpoint's own tensors (not rows) are tiny: no state_dict tensor of the table
    m = ckformat._read_manifest(ck.directory / os.path.basename(info["path"]))
    small = [e for e in m["tensors"] if not e["path"].startswith("<rows")]
    assert sum(e["bytes"] for e in small) < 4096, small
    fresh, fopt = _pair_member("disk", tmp_path, n=n, d=d, cache_rows=256, init=False)
    grew = peak_growth(lambda: ck.restore(model=fresh, opt=fopt))
    print("restore grew", grew)
    assert grew < table_bytes / 4, (grew, table_bytes)
    assert torch.equal(fresh.state_dict()["weight"], t.state_dict()["weight"])


def test_failed_save_loses_no_change(tmp_path, monkeypatch):
    """A save that fails (the disk fills) leaves the last checkpoint intact, and the next
    delta still holds every row changed since it."""
    host, hopt = _pair_member("host", tmp_path)
    disk, dopt = _pair_member("disk", tmp_path)
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg())
    for s in (1, 2):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
    ck.save(2, model=disk, opt=dopt)
    for s in (3, 4):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
    calls = {"n": 0}
    real = ckformat._write_all

    def failing(f, mv):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(f, mv)
    monkeypatch.setattr(ckformat, "_write_all", failing)
    with pytest.raises(CheckpointSpaceError, match="disk full while saving step 4.*intact"):
        ck.save(4, model=disk, opt=dopt)
    monkeypatch.undo()
    assert [r["step"] for r in ck.checkpoints(verify=True)] == [2]
    for s in (5,):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
    info = ck.save(5, model=disk, opt=dopt)
    assert info["disk_tables"]["emb"]["kind"] == "delta"     # rows of steps 3-5, not just 5
    fresh, fopt = _pair_member("disk", tmp_path, seed=9)
    assert ck.restore(model=fresh, opt=fopt) == 5
    _assert_rows(_rows(fresh, fopt), _rows(host, hopt))


def test_disk_full_mid_save_clear_error_last_checkpoint_intact(tmp_path, tiny_fs, monkeypatch):
    import shutil

    import nbtools.checkpoint.manager as ckmod
    host, hopt = _pair_member("host", tmp_path)
    disk, dopt = _pair_member("disk", tmp_path)               # table file on the big disk
    ck = CheckpointManager(tiny_fs, keep=5, config=_cfg(free_space_margin_bytes=0))
    _train(host, hopt, [1])
    _train(disk, dopt, [1])
    ck.save(1, model=disk, opt=dopt)                           # a base: 2000 x 96 bytes
    want = _rows(host, hopt)
    real = shutil.disk_usage       # let the pre-check pass: the writes themselves hit ENOSPC
    monkeypatch.setattr(ckmod.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))
    filler = tiny_fs / "filler"
    free = real(tiny_fs).free
    filler.write_bytes(bytes(max(0, free - (8 << 10))))        # leave less than a delta needs
    _train(host, hopt, [2, 3])
    _train(disk, dopt, [2, 3])
    with pytest.raises(CheckpointSpaceError, match="disk full while saving step 3"):
        ck.save(3, model=disk, opt=dopt)
    monkeypatch.undo()
    filler.unlink()
    assert [r["status"] for r in ck.checkpoints(verify=True)] == ["verified"]
    assert not [p for p in os.listdir(tiny_fs) if p.startswith(".tmp")]
    fresh, fopt = _pair_member("disk", tmp_path, seed=4)
    assert ck.restore(model=fresh, opt=fopt) == 1
    _assert_rows(_rows(fresh, fopt), want)
    # training goes on: the next save (room again) is exact too
    assert ck.save(3, model=disk, opt=dopt)["disk_tables"]["emb"]["kind"] == "delta"
    assert ck.restore(model=fresh, opt=fopt) == 3
    _assert_rows(_rows(fresh, fopt), _rows(host, hopt))
