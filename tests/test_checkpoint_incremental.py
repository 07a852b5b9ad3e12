"""Incremental checkpoints of tables in RAM and on the GPU: a base, then only the rows changed
since the previous save (deltas), as disk tables have (tests/test_checkpoint_disk.py).

References: the live table itself, a twin table trained on the same batches without a
checkpoint (the same placement on the same device, so the same arithmetic: a CUDA update need
not match the CPU's bit for bit), a full save (a base) taken at the same step, and the set of
ids the steps looked up, kept in Python; every comparison is ``torch.equal`` on weights and
optimizer state.
"""
import multiprocessing as mp
import os
import random
import signal
import time
import warnings

import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import CheckpointConfig, CheckpointManager, CheckpointSpaceError
from test_checkpoint_faults import disk_fills  # noqa: F401  (a disk that fills up)
from test_checkpoint_faults import start_child

QUIET = dict(verbose=False, progress=False)
N, D, BATCH = 2000, 8, 100
PLACEMENTS = {
    "host": {},
    "host-cached": {"cache_rows": 64},
    "host-write-behind": {"write_behind": True},
    "gpu": {"placement": "gpu"},
}
OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 0.05}, torch.float32),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, torch.float32),
    "adagrad-bf16": (torch.optim.Adagrad, {"lr": 0.1}, torch.bfloat16),
}


def _cfg(**kw):
    return CheckpointConfig(**{"chunk_bytes": 16 << 10, "file_bytes": 1 << 20, **QUIET, **kw})


def _table(placement, device, opt="adam", seed=0):
    cls, kwargs, dtype = OPTIMIZERS[opt]
    if placement == "gpu" and device.type != "cuda":
        pytest.skip("the GPU placement needs a CUDA device")
    t = OffloadedEmbedding(N, D, name="emb", device=device, dtype=dtype, **PLACEMENTS[placement])
    o = OffloadOptimizer(cls, t, **kwargs)
    with torch.no_grad():
        t.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(seed)))
    return t, o


def _ids(s):
    return torch.randint(0, N, (BATCH,), generator=torch.Generator().manual_seed(1000 + s))


def _train(t, opt, steps):
    for s in steps:
        (t(_ids(s).to(t.device)) * torch.linspace(-1, 1, D, device=t.device)).sum().backward()
        opt.step()
        opt.zero_grad()


def _rows(t, opt):
    """Weights and per-row state as saved (through state_dict: a read that does not count as
    a change of every row, as ``table.weight`` does)."""
    w = t.state_dict()["weight"].cpu().clone()
    st = opt.state_dict()["tables"]["emb"]["row_state"]
    return w, {k: v.cpu().clone() for k, v in st.items()}


def _assert_rows(a, b):
    (wa, sa), (wb, sb) = a, b
    assert torch.equal(wa, wb)
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _kind(info):
    return info["tables"]["emb"]["kind"], info["tables"]["emb"]["rows"]


@pytest.mark.parametrize("placement,opt", [("host", o) for o in OPTIMIZERS]
                         + [(p, "adam") for p in PLACEMENTS if p != "host"])
def test_base_and_deltas_restore_what_a_full_save_and_the_live_table_hold(tmp_path, device,
                                                                         placement, opt):
    t, o = _table(placement, device, opt)
    twin, topt = _table(placement, device, opt)
    ck = CheckpointManager(tmp_path / "ck", keep=4, config=_cfg(base_every=3))
    kinds, since = [], set()
    for s in range(1, 6):
        _train(t, o, [s])
        _train(twin, topt, [s])
        since |= set(_ids(s).tolist())
        kinds.append(_kind(ck.save(s, model=t, opt=o)))
        since = set()
        if s == 3:                      # two steps between saves: a delta holds both
            _train(t, o, [30])
            _train(twin, topt, [30])
            since = set(_ids(30).tolist())
    assert [k for k, _ in kinds] == ["base", "delta", "delta", "base", "delta"]
    touched = lambda *steps: len(set().union(*(set(_ids(s).tolist()) for s in steps)))  # noqa
    assert [n for _, n in kinds] == [N, touched(2), touched(3), N, touched(5)]
    live = _rows(t, o)
    _assert_rows(live, _rows(twin, topt))
    full = CheckpointManager(tmp_path / "full", config=_cfg())
    assert _kind(full.save(5, model=t, opt=o))[0] == "base"
    for manager in (ck, full):            # the chain (base of 4, delta of 5) and the full copy
        fresh, fopt = _table(placement, device, opt, seed=9)
        m = CheckpointManager(manager.directory, config=_cfg(base_every=3))
        assert m.restore(model=fresh, opt=fopt) == 5
        _assert_rows(_rows(fresh, fopt), live)
    # the restored table trains on as the twin, and its next save extends the restored chain
    _train(fresh, fopt, [6])
    _train(twin, topt, [6])
    _assert_rows(_rows(fresh, fopt), _rows(twin, topt))
    fresh_ck = CheckpointManager(tmp_path / "ck", keep=4, config=_cfg(base_every=3))
    fresh_ck.restore(model=fresh, opt=fopt)
    _train(fresh, fopt, [6])
    assert _kind(fresh_ck.save(6, model=fresh, opt=fopt)) == ("delta", touched(6))


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_restore_into_the_live_table_drops_what_its_caches_hold(tmp_path, device, placement):
    """Restored into the table that saved it, after more steps (its cache of hot rows and its
    write-backs hold rows newer than the checkpoint's): the checkpoint's rows, and the same
    training after, as the twin that stopped there."""
    t, o = _table(placement, device)
    twin, topt = _table(placement, device)
    ck = CheckpointManager(tmp_path / "ck", config=_cfg())
    for s in (1, 2):
        _train(t, o, [s])
        _train(twin, topt, [s])
        ck.save(s, model=t, opt=o)
    _train(t, o, [3, 4])
    assert t.cache is None or t.cache.cached_rows() > 0
    assert ck.restore(model=t, opt=o) == 2
    _assert_rows(_rows(t, o), _rows(twin, topt))
    _train(t, o, [5])
    _train(twin, topt, [5])
    _assert_rows(_rows(t, o), _rows(twin, topt))
    assert _kind(ck.save(5, model=t, opt=o)) == ("delta", len(set(_ids(5).tolist())))


def test_a_step_between_saves_that_trains_nothing_saves_nothing(tmp_path, device):
    t, o = _table("host", device)
    ck = CheckpointManager(tmp_path / "ck", config=_cfg())
    assert _kind(ck.save(1, model=t, opt=o))[0] == "base"
    with torch.no_grad():
        t(torch.arange(N, device=t.device))              # an evaluation pass
    assert _kind(ck.save(2, model=t, opt=o)) == ("same", 0)
    _ = t.weight                                         # handed out writable: unknown writes
    assert _kind(ck.save(3, model=t, opt=o))[0] == "base"
    halves = CheckpointManager(tmp_path / "half", config=_cfg(half_min_bytes=1))
    half = halves.save(4, model=t, opt=o, half_tables=True)  # rounded copies: tensors
    assert half["tables"] == {} and half["half"]


def test_a_failed_save_loses_no_change(tmp_path, device, disk_fills):
    """A save that fails midway (the disk fills) leaves the last checkpoint restorable, and the
    next delta still holds every row changed since it."""
    t, o = _table("host-cached", device)
    twin, topt = _table("host-cached", device)
    ck = CheckpointManager(tmp_path / "ck", keep=3, config=_cfg())
    _train(t, o, [1, 2])
    _train(twin, topt, [1, 2])
    ck.save(2, model=t, opt=o)
    at_2 = _rows(twin, topt)
    _train(t, o, [3, 4])
    _train(twin, topt, [3, 4])
    disk_fills(1)
    with pytest.raises(CheckpointSpaceError, match="intact"):
        ck.save(4, model=t, opt=o)
    disk_fills.undo()
    assert [r["step"] for r in ck.checkpoints(verify=True)] == [2]
    fresh, fopt = _table("host", device, seed=4)
    assert CheckpointManager(tmp_path / "ck", config=_cfg()).restore(model=fresh, opt=fopt) == 2
    _assert_rows(_rows(fresh, fopt), at_2)
    _train(t, o, [5])
    _train(twin, topt, [5])
    kind, rows = _kind(ck.save(5, model=t, opt=o))
    assert kind == "delta" and rows == len(set().union(*(set(_ids(s).tolist()) for s in (3, 4, 5))))
    assert ck.restore(model=fresh, opt=fopt) == 5
    _assert_rows(_rows(fresh, fopt), _rows(twin, topt))


# --- SIGKILL while training and saving -------------------------------------------------------
KILLS = int(os.environ.get("NBTOOLS_CKPT_KILLS", "25")) // 6 + 1
KCFG = CheckpointConfig(chunk_bytes=4096, file_bytes=8192, base_every=4, **QUIET)


def _trainer(directory, conn) -> None:
    """Child: restore the newest checkpoint, report its rows, then train a step and save,
    again and again, until killed."""
    torch.set_num_threads(1)
    t, o = _table("host", torch.device("cpu"))
    ck = CheckpointManager(directory, keep=2, config=KCFG)
    step = ck.restore(model=t, opt=o) or 0
    conn.send(("ready", step, _rows(t, o)))
    while True:
        step += 1
        _train(t, o, [step])
        conn.send(("saved", step, _kind(ck.save(step, model=t, opt=o))[0]))


@pytest.mark.slow
def test_sigkill_while_saving_deltas_loses_no_row(tmp_path):
    ctx = mp.get_context("forkserver")
    # torch._dynamo: what the first optimizer of a process imports (seconds a child without it)
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "pytest", "nbtools.checkpoint",
                                "nbtools.tables", "nbtools.optim", _trainer.__module__])
    rnd = random.Random(int(os.environ.get("NBTOOLS_CKPT_SEED", "58")))
    directory = str(tmp_path / "ck")
    twin, topt = _table("host", torch.device("cpu"))
    # a kill within a step and a save's time (a save of tiny files: most of it), as timed here
    t0 = time.perf_counter()
    _train(twin, topt, [0])
    CheckpointManager(tmp_path / "timing", config=KCFG).save(0, model=twin, opt=topt)
    window = 2 * (time.perf_counter() - t0)
    twin, topt = _table("host", torch.device("cpu"))
    twin_step, kinds, mid_save, threads = 0, set(), 0, torch.get_num_threads()
    for trial in range(KILLS):
        proc, parent = start_child(ctx, _trainer, directory)
        with warnings.catch_warnings():
            warnings.simplefilter("error")      # no checkpoint may ever look damaged
            kind, step, got = parent.recv()
        assert step >= twin_step, (trial, step, twin_step)
        torch.set_num_threads(1)                # as the child: the same float sums
        try:
            _train(twin, topt, range(twin_step + 1, step + 1))
        finally:
            torch.set_num_threads(threads)
        twin_step = step
        _assert_rows(got, _rows(twin, topt))     # the newest checkpoint: exactly its steps
        saved, saves = 0, rnd.randint(1, 3)
        while saved < saves and parent.poll(60):     # some saves, then a kill
            kinds.add(parent.recv()[2])
            saved += 1
        time.sleep(rnd.uniform(0, window))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        parent.close()
        mid_save += any(n.startswith(".tmp-") for n in os.listdir(directory))
    assert twin_step >= KILLS and {"base", "delta"} <= kinds
    assert mid_save >= 1, "no kill landed inside a save; the test would prove nothing"




def test_reading_the_weights_keeps_the_next_save_incremental(tmp_path, device):
    """read_weight() (what nearest neighbours and the models' inf/nan checks use) neither
    empties a cache of hot rows nor counts every row as changed; .weight (writable) does both."""
    t, o = _table("host-cached", device)
    ck = CheckpointManager(tmp_path / "ck", config=_cfg())
    _train(t, o, [1])
    assert _kind(ck.save(1, model=t, opt=o)) == ("base", N)

    def hits_of_step_2_again():
        before = t.cache_stats()["hits"]
        _train(t, o, [2])
        return t.cache_stats()["hits"] - before

    _train(t, o, [2])
    assert torch.equal(t.read_weight().cpu(), t.state_dict()["weight"].cpu())
    assert hits_of_step_2_again() > 0                   # the cache stayed warm
    assert _kind(ck.save(2, model=t, opt=o)) == ("delta", len(set(_ids(2).tolist())))
    t.weight                                            # handed out writable
    assert hits_of_step_2_again() == 0                  # the cache was emptied
    assert _kind(ck.save(3, model=t, opt=o)) == ("base", N)     # every row counts as changed
