"""Checkpoints of disk tables (placement="disk"): bases and deltas of rows, file to file.

The reference everywhere is the same model with ``placement="host"`` trained on the same
batches (host tables are themselves tested against PyTorch's optimizers in test_optim.py and
test_step.py, and checkpointed through state_dict in test_checkpoint.py): every comparison is
``torch.equal`` on weights and optimizer state. The kill test SIGKILLs a training child at
random moments of its steps, write-backs and saves, and checks each restore against a replay.
"""
import multiprocessing as mp
import os
import random
import signal
import time
import warnings

import numpy as np
import pytest
import torch

import nbtools
import nbtools.checkpoint.format as ckformat
from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import (CheckpointConfig, CheckpointError, CheckpointManager,
                                CheckpointSpaceError, CheckpointWarning)
from nbtools.devices import resolve_device
from nbtools.rowfile import RowFile, RowFileError, leftovers, remove_leftovers
from test_checkpoint_faults import disk_fills, tiny_fs  # noqa: F401  (a disk that fills up)
from test_checkpoint_faults import start_child

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


@pytest.mark.parametrize("opt_cls,kwargs,dtype,d", [
    (torch.optim.Adam, {"lr": 0.05}, torch.float32, D),
    (torch.optim.Adagrad, {"lr": 0.1}, torch.bfloat16, D),      # bf16 weights packed in fp32 rows
    (nbtools.RowWiseAdagrad, {"lr": 0.1}, torch.bfloat16, 128),  # 260-byte rows, 288 in RAM
])
def test_a_disk_tables_checkpoint_restores_into_another_placement(tmp_path, opt_cls, kwargs,
                                                                  dtype, d):
    """Saved from a disk table, restored into the same model whose table now lives in RAM (as
    placement="auto" chooses on a machine with more of it, after a reconnect): the same rows,
    through a base and deltas, and the same training after."""
    host, hopt = _pair_member("host", tmp_path, d=d, opt_cls=opt_cls, dtype=dtype, **kwargs)
    disk, dopt = _pair_member("disk", tmp_path, d=d, opt_cls=opt_cls, dtype=dtype, **kwargs)
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg(base_every=3))
    for s in range(1, 6):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
        ck.save(s, model=disk, opt=dopt)
    assert disk.disk.stats["written_back"] > 0
    fresh, fopt = _pair_member("host", tmp_path, d=d, opt_cls=opt_cls, dtype=dtype, seed=5,
                               **kwargs)
    fresh(torch.tensor([1, 2], device=DEVICE)).sum().backward()   # a step before: state moves
    fopt.step()
    fopt.zero_grad()
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg(base_every=3))
    assert ck.restore(model=fresh, opt=fopt) == 5
    _assert_rows(_rows(fresh, fopt), _rows(host, hopt))
    _train(host, hopt, [6, 7])
    _train(fresh, fopt, [6, 7])
    _assert_rows(_rows(fresh, fopt), _rows(host, hopt))
    ck.save(7, model=fresh, opt=fopt)              # saved as an ordinary table now
    again, aopt = _pair_member("host", tmp_path, d=d, opt_cls=opt_cls, dtype=dtype, seed=6,
                               **kwargs)
    assert CheckpointManager(tmp_path / "ck", config=_cfg()).restore(model=again, opt=aopt) == 7
    _assert_rows(_rows(again, aopt), _rows(host, hopt))


def test_a_host_tables_checkpoint_restores_into_a_disk_table(tmp_path):
    """The other way: saved from a table in RAM, restored into the same model's disk table
    (a machine with less memory after a reconnect), trained on exactly as before."""
    host, hopt = _pair_member("host", tmp_path)
    _train(host, hopt, range(1, 4))
    ck = CheckpointManager(tmp_path / "ck", config=_cfg())
    ck.save(3, model=host, opt=hopt)
    disk, dopt = _pair_member("disk", tmp_path, seed=5)
    assert CheckpointManager(tmp_path / "ck", config=_cfg()).restore(model=disk, opt=dopt) == 3
    _assert_rows(_rows(disk, dopt), _rows(host, hopt))
    _train(host, hopt, [4, 5])
    _train(disk, dopt, [4, 5])
    _assert_rows(_rows(disk, dopt), _rows(host, hopt))


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


def test_what_resets_the_change_count_makes_the_next_save_a_base(tmp_path):
    """Changes are counted from the checkpoint that last took every row; anything else that
    consumes or hides them (take_changed, a write through table.weight, another manager)
    makes the next save a full base rather than a delta that would miss rows."""
    disk, dopt = _pair_member("disk", tmp_path)
    ck = CheckpointManager(tmp_path / "ck", keep=2, config=_cfg())
    kind = lambda s, m=ck: m.save(s, model=disk, opt=dopt)["disk_tables"]["emb"]["kind"]  # noqa
    assert kind(1) == "base"
    assert kind(2) == "same"                  # nothing changed: no rows written at all
    _train(disk, dopt, [1])
    assert kind(3) == "delta"
    _train(disk, dopt, [2])
    disk.disk.take_changed()
    assert kind(4) == "base"
    _ = disk.weight                           # a writable map: what was written is unknown
    assert kind(5) == "base"
    other = CheckpointManager(tmp_path / "ck2", config=_cfg())
    assert kind(6, other) == "base" and kind(7) == "base"


def test_save_moves_rows_file_to_file_not_through_ram(tmp_path):
    """The peak RSS of a save (and of a restore) stays far below the table's size: no
    state_dict tensor of the table is ever read, and rows pass through bounded buffers."""
    n, d = 60_000, 64                         # Adam rows: 768 bytes, 46 MB of rows
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
    m = ckformat.read_manifest(ck.directory / os.path.basename(info["path"]))
    small = [e for e in m["tensors"] if not e["path"].startswith("<rows")]
    assert sum(e["bytes"] for e in small) < 4096, small
    fresh, fopt = _pair_member("disk", tmp_path, n=n, d=d, cache_rows=256, init=False)
    grew = peak_growth(lambda: ck.restore(model=fresh, opt=fopt))
    print("restore grew", grew)
    assert grew < table_bytes / 4, (grew, table_bytes)
    assert torch.equal(fresh.state_dict()["weight"], t.state_dict()["weight"])


def test_failed_save_loses_no_change(tmp_path, disk_fills):
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
    disk_fills(2)
    with pytest.raises(CheckpointSpaceError, match="disk full while saving step 4.*intact"):
        ck.save(4, model=disk, opt=dopt)
    disk_fills.undo()
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


@pytest.mark.parametrize("placement", ["disk", "host"])
def test_mirror_copies_what_a_checkpoint_needs_and_restores_alone(tmp_path, placement):
    """Drive: each checkpoint arrives with the base and deltas it needs; a fresh machine (no
    local checkpoints) restores from the mirror alone, and its next local save is a delta
    on the mirror's chain, restorable too. Pruning keeps every link a kept checkpoint needs.
    (A table in RAM has the same chain as one on disk.)"""
    host, hopt = _pair_member("host", tmp_path)
    disk, dopt = _pair_member(placement, tmp_path)
    local, drive = tmp_path / "local", tmp_path / "drive"
    ck = CheckpointManager(local, keep=1, mirror=drive, config=_cfg(base_every=10))
    for s in range(1, 5):
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
        ck.save(s, model=disk, opt=dopt)
        ck.sync.wait()
    rows = {r["step"]: r for r in ck.checkpoints() if r["where"] == "local"}
    assert sorted(rows) == [1, 2, 3, 4]           # keep=1, and step 4 needs the other three
    assert rows[4]["needs"] == ["step-000000001", "step-000000002", "step-000000003"]
    assert sorted(p.name for p in drive.iterdir()) == [f"step-00000000{i}" for i in (1, 2, 3, 4)]
    import shutil
    shutil.rmtree(local)                          # a new runtime: only Drive is left
    fresh, fopt = _pair_member(placement, tmp_path, seed=2)
    ck2 = CheckpointManager(local, keep=1, mirror=drive, config=_cfg(base_every=10))
    assert ck2.restore(model=fresh, opt=fopt) == 4
    _assert_rows(_rows(fresh, fopt), _rows(host, hopt))
    _train(host, hopt, [5])
    _train(fresh, fopt, [5])
    assert ck2.save(5, model=fresh, opt=fopt)["disk_tables"]["emb"]["kind"] == "delta"
    assert sorted(p.name for p in local.iterdir()) == ["step-000000005"]   # the rest is on Drive
    ck2.sync.wait()
    fresh2, fopt2 = _pair_member(placement, tmp_path, seed=3)
    ck3 = CheckpointManager(local, keep=1, mirror=drive, config=_cfg())
    assert ck3.restore(model=fresh2, opt=fopt2) == 5
    _assert_rows(_rows(fresh2, fopt2), _rows(host, hopt))
    assert all(r["status"] == "verified" for r in ck3.checkpoints(verify=True))
    # without the mirror, the local step 5 lacks its base: damaged, said so, none restored
    alone = CheckpointManager(local, config=_cfg())
    assert alone.checkpoints()[0]["status"].startswith("damaged: it needs step-000000001")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match="every one is damaged"):
            alone.restore(model=fresh2, opt=fopt2)


def test_damaged_base_falls_back_to_an_older_chain(tmp_path):
    host, hopt = _pair_member("host", tmp_path)
    disk, dopt = _pair_member("disk", tmp_path)
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg(base_every=2))
    for s in (1, 2, 3, 4):                        # bases at 1 and 3, deltas at 2 and 4
        _train(host, hopt, [s])
        _train(disk, dopt, [s])
        ck.save(s, model=disk, opt=dopt)
        if s == 2:
            want = _rows(host, hopt)
    base = tmp_path / "ck" / "step-000000003"
    m = ckformat.read_manifest(base)
    name, offset, nbytes, _ = next(e for e in m["tensors"] if e["path"].endswith("/base"))[
        "segments"][1]
    with open(base / name, "r+b") as f:           # flip a byte in the middle of the base
        f.seek(offset + nbytes // 2)
        b = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([b[0] ^ 1]))
    fresh, fopt = _pair_member("disk", tmp_path, seed=6)
    with pytest.warns(CheckpointWarning) as caught:
        assert ck.restore(model=fresh, opt=fopt) == 2     # 4 and 3 share the damaged base
    said = [str(w.message) for w in caught]
    assert len(said) == 2 and all("step-000000003: base of disk table 'emb': checksum mismatch"
                                  in m for m in said), said
    _assert_rows(_rows(fresh, fopt), want)


def test_restore_rewrites_a_torn_table_file(tmp_path):
    """Whatever the table file and its RAM cache hold (garbage rows, dirty rows not written
    back, evicted rows waiting to be written), a restore leaves exactly the checkpoint."""
    host, hopt = _pair_member("host", tmp_path)
    disk, dopt = _pair_member("disk", tmp_path)
    ck = CheckpointManager(tmp_path / "ck", config=_cfg())
    _train(host, hopt, [1, 2])
    _train(disk, dopt, [1, 2])
    ck.save(2, model=disk, opt=dopt)
    want = _rows(host, hopt)
    _train(disk, dopt, [3, 4])                    # dirty rows in RAM, others written back
    f = disk.disk.file
    junk = np.random.default_rng(0).integers(0, 256, (N // 2, f.row_bytes), dtype=np.uint8)
    f.write(np.arange(0, N, 2), junk)             # torn: half the rows are garbage
    assert disk.disk.ram.dirty.any()
    assert ck.restore(model=disk, opt=dopt) == 2
    _assert_rows(_rows(disk, dopt), want)
    _train(host, hopt, [3])
    _train(disk, dopt, [3])
    _assert_rows(_rows(disk, dopt), _rows(host, hopt))


def test_restore_into_a_different_table_says_what_differs(tmp_path):
    disk, dopt = _pair_member("disk", tmp_path)
    ck = CheckpointManager(tmp_path / "ck", config=_cfg())
    ck.save(1, model=disk, opt=dopt)
    bare = OffloadedEmbedding(N, D, name="emb", device=DEVICE, placement="disk",
                              disk_dir=str(tmp_path / "tables"))      # no optimizer state
    with pytest.raises(CheckpointError, match=r"2,000 rows of 24 float32 \(96 bytes.*expected "
                       r"2,000 rows of 8 float32 \(32 bytes\).*optimizer.*Nothing was restored"):
        ck.restore(model=bare)
    host = OffloadedEmbedding(N, D, name="emb", device=DEVICE, placement="host")
    with pytest.raises(CheckpointError, match=r"table 'emb'.*expected 2,000 rows of 8 "
                       r"float32 \(32 bytes\)"):      # another placement, no optimizer state
        ck.restore(model=host)
    with pytest.raises(CheckpointError, match="none of the objects restored here holds "
                       "one.*any placement"):
        ck.restore(model=torch.nn.Linear(2, 2))


def test_row_file_left_open_by_a_killed_process_is_detected(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "t.nbrows"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from nbtools.rowfile import RowFile; "
         f"RowFile.create({str(path)!r}, 100, 64, {{'dtype': 'uint8'}}); print('open', "
         "flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "open"
        assert leftovers(tmp_path) == []         # its writer is alive: in use, not left over
        RowFile.open(path, writable=False).close()
    finally:
        proc.kill()
        proc.wait(10)
    [left] = leftovers(tmp_path)
    assert left["path"] == str(path) and left["writer"]["pid"] == proc.pid
    with pytest.raises(RowFileError, match=r"not closed cleanly: its writer \(process "
                       rf"{proc.pid} .*killed.*CheckpointManager.restore.*unclean_ok=True"):
        RowFile.open(path)
    with RowFile.open(path, unclean_ok=True) as f:           # rewrite it: ours until closed
        f.write_range(0, np.full((100, 64), 3, dtype=np.uint8))
        assert leftovers(tmp_path) == []
    with RowFile.open(path) as f:                            # closed cleanly now
        back = np.zeros((100, 64), dtype=np.uint8)
        f.read_range(0, back)
        assert (back == 3).all()
    RowFile.create(tmp_path / "u.nbrows", 10, 8).close()
    assert leftovers(tmp_path) == [] and remove_leftovers(tmp_path) == 0


# --- SIGKILL at random points of steps, write-backs and saves ------------------------------------

KILLS = int(os.environ.get("NBTOOLS_DISK_KILLS", "9"))    # 3 aimed at each phase
KN, KD, KBATCH, KSAVE = 4_000, 16, 512, 3           # rows, dim, ids per step, steps per save
KCFG = CheckpointConfig(chunk_bytes=1 << 20, file_bytes=1 << 20, base_every=4, **QUIET)
STEP, WRITEBACK, SAVE = 1, 2, 3
PHASES = {STEP: "step", WRITEBACK: "write-back", SAVE: "save"}


def _kill_table(disk_dir):
    """The kill test's model: a disk table whose RAM cache (600 rows) holds one step's distinct
    rows (~480 of the 4,000) but far fewer than a few steps touch, so rows are evicted and
    written back every step. (Small, for time: the 10 children's restores through the log's
    cleaner are most of the test; with 20,000 rows it took twice as long.)"""
    place = dict(placement="disk", disk_dir=disk_dir, host_cache_bytes=600 * 3 * KD * 4) \
        if disk_dir else dict(placement="host")
    t = OffloadedEmbedding(KN, KD, name="emb", device=DEVICE, **place)
    return t, OffloadOptimizer(torch.optim.Adam, t, lr=0.02)


def _kill_init(t):
    with torch.no_grad():
        t.weight.copy_(torch.randn(KN, KD, generator=torch.Generator().manual_seed(7)))


def _kill_step(t, opt, s):
    ids = torch.randint(0, KN, (KBATCH,), generator=torch.Generator().manual_seed(5000 + s))
    (t(ids) * torch.linspace(-1, 1, KD, device=DEVICE)).sum().backward()
    opt.step()
    opt.zero_grad()


def _trainer(directory, disk_dir, phase, conn) -> None:
    """Child: restore the newest checkpoint, report its rows, then train and save until killed,
    saying in ``phase`` what it is doing (a step, a write-back of evicted rows, a save)."""
    import nbtools.disk as nbdisk
    torch.set_num_threads(1)
    write = nbdisk.DiskRows.file_write

    def traced(self, *args, **kwargs):              # write-backs: evictions and flushes
        was, phase.value = phase.value, WRITEBACK
        try:
            return write(self, *args, **kwargs)
        finally:
            phase.value = was
    nbdisk.DiskRows.file_write = traced
    t, opt = _kill_table(disk_dir)
    ck = CheckpointManager(directory, keep=2, config=KCFG)
    step = ck.restore(model=t, opt=opt)
    if step is None:
        _kill_init(t)
        step = 0
    conn.send(("ready", step, _rows(t, opt), t.disk.file.path))
    while True:
        phase.value = STEP
        step += 1
        _kill_step(t, opt, step)
        if step % KSAVE == 0:
            phase.value = SAVE
            info = ck.save(step, model=t, opt=opt)
            conn.send(("saved", step, info["disk_tables"]["emb"]["kind"],
                       getattr(t.disk.file, "stats", {}).get("cleaned_segments", 0)))


def _forkserver(modules):
    """The forkserver context, its server started with ``modules`` imported. Python 3.11's
    forkserver ignores sys.path when preloading, so this test module itself is imported again
    in each child: preloading what it imports keeps that cheap. torch._dynamo is what the first
    optimizer of a process imports (~2 s a child without it). A server another test started
    with other modules is stopped first (the next user starts it again)."""
    from multiprocessing import forkserver
    ctx = mp.get_context("forkserver")
    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None and \
            list(getattr(server, "_preload_modules", ())) != modules:
        server._stop()
    ctx.set_forkserver_preload(modules)
    return ctx


def _complete_steps(directory):
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n.split("-")[1]) for n in names if n.startswith("step-")
                  and os.path.exists(os.path.join(directory, n, "MANIFEST")))


@pytest.mark.slow
def test_sigkill_in_steps_write_backs_and_saves_loses_no_row(tmp_path, monkeypatch):
    # the table file is log-structured (the default) with little spare room and small
    # segments: the cleaner runs in every write-back, so kills land in it too
    monkeypatch.setenv("NBTOOLS_DISK_LAYOUT", "log")
    monkeypatch.setenv("NBTOOLS_DISK_SEGMENT_ROWS", "64")
    monkeypatch.setenv("NBTOOLS_DISK_SPARE", "0.05")
    from multiprocessing import forkserver
    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        forkserver._forkserver._stop()        # its children take the environment above
    ctx = _forkserver(["torch", "torch._dynamo", "pytest", "nbtools.checkpoint",
                       "nbtools.tables", "nbtools.optim", "nbtools.disk", _trainer.__module__])
    rnd = random.Random(int(os.environ.get("NBTOOLS_CKPT_SEED", "4321")))
    directory, disk_dir = str(tmp_path / "ck"), str(tmp_path / "tables")
    twin, twin_opt = _kill_table(None)          # the reference: a host table, replayed
    _kill_init(twin)
    twin_step, last_reported = 0, 0
    killed_in = {p: 0 for p in PHASES}
    kinds, deltas_after_restore, files, cleaned = [], 0, [], 0
    threads = torch.get_num_threads()
    for trial in range(KILLS + 1):
        phase = ctx.Value("i", 0, lock=False)
        complete = _complete_steps(directory)  # (before the child starts saving more)
        proc, parent = start_child(ctx, _trainer, directory, disk_dir, phase)
        kind, step, got, path = parent.recv()
        # the newest complete checkpoint was restored, in a fresh process: its rows are the
        # replay's of exactly that many steps (zero lost or torn rows)
        assert step == (complete[-1] if complete else 0), (trial, step, complete)
        assert last_reported <= step <= last_reported + KSAVE, (trial, step, last_reported)
        assert step >= twin_step, (trial, step, twin_step)
        torch.set_num_threads(1)                # as the child: the same float sums
        try:
            for s in range(twin_step + 1, step + 1):
                _kill_step(twin, twin_opt, s)
        finally:
            torch.set_num_threads(threads)
        twin_step = last_reported = step
        _assert_rows(got, _rows(twin, twin_opt))
        # the table files of killed children: marked as not closed cleanly
        left = [f["path"] for f in leftovers(disk_dir)]
        assert sorted(left) == sorted(files), (trial, left, files)
        for p in left:
            with pytest.raises(RowFileError, match="not closed cleanly.*restore"):
                RowFile.open(p)
        remove_leftovers(disk_dir)
        files = [path]
        if trial == KILLS:
            proc.kill()
            proc.join(10)
            break
        saves = []                              # what this child saved: (step, kind)

        def take(timeout):
            if parent.poll(timeout):
                msg = parent.recv()
                if msg[0] == "saved":
                    saves.append(msg[1:])
                return True
            return False
        # every other child saves once before the kill is armed: the runs make progress
        # however slow the machine (a loaded CI runner), and the first save after a restore
        # is seen to be a delta on the restored chain
        if trial % 2:
            assert take(60), "trainer child saved nothing in 60 s"
        # kill it in the phase this trial aims at, at a random moment of it: a random delay
        # after the phase is seen, aimed again if the phase has ended by then (a step's and a
        # save's write-backs are phases of their own)
        target = (STEP, WRITEBACK, SAVE)[trial % 3]
        time.sleep(rnd.uniform(0.0, 0.15))
        deadline = time.monotonic() + 10
        while True:
            while phase.value != target and time.monotonic() < deadline and proc.is_alive():
                time.sleep(0.0002)          # polled, not spun: the child needs the core
            time.sleep(rnd.uniform(0.0, 0.002))
            now = phase.value
            if now == target or time.monotonic() >= deadline or not proc.is_alive():
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        killed_in[now] = killed_in.get(now, 0) + 1
        try:
            while take(0):
                pass
        except EOFError:
            pass
        parent.close()
        if saves:
            last_reported = saves[-1][0]
            kinds += [x[1] for x in saves]
            cleaned += saves[-1][2]
            deltas_after_restore += saves[0][1] == "delta"
    counts = {PHASES.get(p, p): n for p, n in killed_in.items()}
    print(f"killed in {counts}; saves: {kinds.count('base')} bases, {kinds.count('delta')} deltas;"
          f" {cleaned} segments cleaned in the children")
    assert cleaned > 0                         # the log's cleaner ran in the children
    assert all(killed_in[p] >= 2 for p in PHASES), counts
    assert "base" in kinds and "delta" in kinds and deltas_after_restore, (kinds, counts)
    assert twin_step >= KILLS, twin_step       # the runs made progress between kills
