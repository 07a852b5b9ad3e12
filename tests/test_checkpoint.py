"""CheckpointManager: exact round trips, resume == never stopped, fallback, pruning, half, mirror."""
import errno
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import nbtools.checkpoint.manager as ckmod
from nbtools import OffloadedEmbedding, OffloadOptimizer, PinnedLoader
from nbtools.checkpoint import (CheckpointConfig, CheckpointError, CheckpointManager,
                                CheckpointSpaceError, CheckpointWarning)
from test_checkpoint_faults import disk_fills  # noqa: F401  (writes that fail: a full disk)

QUIET = dict(verbose=False, progress=False)
SMALL = CheckpointConfig(chunk_bytes=4096, file_bytes=16384, **QUIET)   # many chunks and files


def manager(path, keep=3, **kw):
    return CheckpointManager(path, keep=keep, config=CheckpointConfig(**{**SMALL.__dict__, **kw}))


def trained_dense(device, steps=3, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5),
                                torch.nn.Linear(5, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(8, 6, device=device)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def assert_same_tree(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.cpu(), b.cpu()), path
    elif isinstance(a, dict):
        assert sorted(map(str, a)) == sorted(map(str, b)), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}/{i}")
    else:
        assert a == b or (a != a and b != b), f"{path}: {a!r} != {b!r}"


def test_round_trip_is_bit_identical(tmp_path, device):
    model, opt, sched = trained_dense(device)
    extra = {"epoch": 3, "pair": (1, 2.5), 7: "int key", "nan": float("nan"), "none": None,
             "$odd": [1, {"x": torch.arange(5)}], "dtype": torch.float16}
    ck = manager(tmp_path)
    info = ck.save(3, model=model, opt=opt, sched=sched, extra=extra)
    assert info["step"] == 3 and info["bytes"] > 0 and info["bytes_per_s"] > 0
    expected = [random.random(), np.random.rand(), torch.rand(3)]
    if device.type == "cuda":
        expected.append(torch.rand(3, device=device))
    ref = ({k: v.clone() for k, v in model.state_dict().items()},
           {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
            "param_groups": opt.state_dict()["param_groups"]}, sched.state_dict())

    model2, opt2, sched2 = trained_dense(device, steps=1, seed=5)
    extra2 = {"stale": True}
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert ck.restore(model=model2, opt=opt2, sched=sched2, extra=extra2) == 3
    assert_same_tree(ref[0], model2.state_dict())
    assert_same_tree(ref[1], opt2.state_dict())
    assert_same_tree(ref[2], sched2.state_dict())
    assert_same_tree(extra, extra2)
    again = [random.random(), np.random.rand(), torch.rand(3)]
    if device.type == "cuda":
        again.append(torch.rand(3, device=device))
    assert again[:2] == expected[:2] and all(torch.equal(a, b) for a, b in zip(again[2:], expected[2:]))


def test_odd_tensors_and_in_place_restore(tmp_path):
    t = torch.randn(40, 30)
    odd = {"noncontig": t.t(), "strided": t[::3, 1::2], "scalar": torch.tensor(2.5),
           "empty": torch.empty(0, 4), "bool": torch.rand(50) > 0.5,
           "i8": torch.randint(-100, 100, (33,), dtype=torch.int8),
           "bf16": torch.randn(17, dtype=torch.bfloat16), "c64": torch.randn(9, dtype=torch.complex64),
           "i64": torch.arange(10**6, 10**6 + 777)}
    table = torch.randn(300, 7)                         # a raw tensor object: restored in place
    ck = manager(tmp_path)
    ck.save(1, odd=odd, table=table)
    want = table.clone()
    ptr = table.data_ptr()
    table.zero_()
    got = {}
    ck.restore(odd=got, table=table)
    assert table.data_ptr() == ptr and torch.equal(table, want)
    assert_same_tree({k: v.contiguous() for k, v in odd.items()}, got)


def test_offloaded_table_and_optimizer_restore_into_live_memory(tmp_path):
    emb = OffloadedEmbedding(500, 12, device="cpu", name="items")
    opt = OffloadOptimizer(torch.optim.Adam, emb, lr=0.1)
    for _ in range(3):
        emb(torch.randint(0, 500, (64,))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    manager(tmp_path).save(3, emb=emb, opt=opt)
    weight, state = emb.weight.clone(), {k: v.clone() for k, v in opt.table_state("items").items()}

    emb2 = OffloadedEmbedding(500, 12, device="cpu", name="items")
    opt2 = OffloadOptimizer(torch.optim.Adam, emb2, lr=0.7)
    ptrs = [emb2.weight.data_ptr()] + [v.data_ptr() for v in opt2.table_state("items").values()]
    assert manager(tmp_path).restore(emb=emb2, opt=opt2) == 3
    assert [emb2.weight.data_ptr()] + [v.data_ptr() for v in opt2.table_state("items").values()] == ptrs
    assert torch.equal(emb2.weight, weight)
    assert all(torch.equal(opt2.table_state("items")[k], v) for k, v in state.items())
    assert opt2.param_groups[0]["lr"] == 0.1


class _History:
    """Stands in for the dashboard's metric history: any state_dict()/load_state_dict()."""

    def __init__(self):
        self.rows = []

    def state_dict(self):
        return {"rows": list(self.rows)}

    def load_state_dict(self, sd):
        self.rows = list(sd["rows"])


def _train(device, ckdir, *, until, save_every=None, crash_at=None, resume=False):
    """A small run using every kind of state: offloaded table + Adam row state, dense layer,
    LR schedule, dropout (torch RNG), numpy and python RNG, a loader position, a history."""
    seed = 999 if resume else 123                     # a resumed run starts from other values
    torch.manual_seed(seed), random.seed(seed), np.random.seed(seed)
    model = torch.nn.ModuleDict({
        "emb": OffloadedEmbedding(64, 8, device=device, name="emb"),
        "out": torch.nn.Linear(8, 1).to(device), "drop": torch.nn.Dropout(0.3)})
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.7)
    ids = torch.arange(64)                            # unique ids per batch: exact on CUDA too
    target = torch.linspace(-1, 1, 64)
    loader = PinnedLoader(ids, target, batch_size=16, device=device, seed=3)
    history = _History()
    ck = manager(ckdir, keep=2)
    step = 0
    if resume:
        step = ck.restore(model=model, opt=opt, sched=sched, loader=loader, history=history)
    while step < until:
        for x, y in loader:
            noise = 1.0 + 0.01 * (random.random() + np.random.rand())
            pred = model["out"](model["drop"](model["emb"](x))).squeeze(1)
            loss = ((pred - y) ** 2).mean() * noise
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            step += 1
            history.rows.append(loss.item())
            if save_every and step % save_every == 0:
                ck.save(step, model=model, opt=opt, sched=sched, loader=loader, history=history)
            if step in (crash_at, until):
                break
        if step == crash_at:
            return None
    return model, opt, history, loader


def test_interrupted_and_resumed_run_ends_with_the_same_table(tmp_path, device):
    model_a, opt_a, hist_a, loader_a = _train(device, tmp_path / "a", until=22, save_every=5)
    assert _train(device, tmp_path / "b", until=22, save_every=5, crash_at=13) is None
    model_b, opt_b, hist_b, loader_b = _train(device, tmp_path / "b", until=22, save_every=5,
                                              resume=True)
    assert torch.equal(model_a["emb"].weight, model_b["emb"].weight)
    for k, v in opt_a.table_state("emb").items():
        assert torch.equal(v, opt_b.table_state("emb")[k]), k
    assert torch.equal(model_a["out"].weight, model_b["out"].weight)
    assert hist_a.rows == hist_b.rows
    assert loader_a.state_dict() == loader_b.state_dict()


def test_keep_last_k_and_same_step_twice(tmp_path):
    x = {"v": torch.zeros(3)}
    ck = manager(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        x["v"] += 1
        ck.save(step, x=x)
    x["v"] += 1
    ck.save(4, x=x)                                    # again at the same step: a revision
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000000004", "step-000000004-r1"]
    got = {}
    assert ck.restore(x=got) == 4 and got["v"].tolist() == [5.0] * 3
    assert [r["status"] for r in ck.checkpoints(verify=True)] == ["verified", "verified"]


def test_new_run_in_the_same_directory_counts_as_newest(tmp_path):
    ck = manager(tmp_path, keep=2)
    ck.save(100, x={"run": 1})
    fresh = manager(tmp_path, keep=2)                  # a run that started over from step 0
    fresh.save(10, x={"run": 2})
    got = {}
    assert manager(tmp_path).restore(x=got) == 10 and got == {"run": 2}


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _two_checkpoints(tmp_path):
    ck = manager(tmp_path)
    ck.save(1, x={"w": torch.arange(3000.0)})
    ck.save(2, x={"w": torch.arange(3000.0) * 2})
    return ck, tmp_path / "step-000000002"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest", "empty_manifest"])
def test_damaged_newest_falls_back_to_older(tmp_path, damage):
    ck, newest = _two_checkpoints(tmp_path)
    data = newest / "data-0000.bin"
    if damage == "truncate":
        os.truncate(data, data.stat().st_size - 100)
    elif damage == "flip":
        _flip_byte(data, 5000)
    elif damage == "delete":
        data.unlink()
    elif damage == "manifest":
        _flip_byte(newest / "MANIFEST", 200)
    else:
        (newest / "MANIFEST").write_bytes(b"")         # what Drive leaves after a disconnect
    got = {}
    with pytest.warns(CheckpointWarning, match="damaged"):
        assert ck.restore(x=got) == 1
    assert torch.equal(got["w"], torch.arange(3000.0))
    statuses = {r["step"]: r["status"] for r in ck.checkpoints(verify=True)}
    assert statuses[2].startswith("damaged") and statuses[1] == "verified"


def test_all_damaged_raises_and_none_returns_none(tmp_path):
    assert manager(tmp_path / "empty").restore(x={}) is None
    ck, newest = _two_checkpoints(tmp_path)
    for d in tmp_path.glob("step-*"):
        _flip_byte(d / "data-0000.bin", 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match="every one is damaged"):
            ck.restore(x={})


def test_clear_errors_for_names_and_types(tmp_path):
    ck = manager(tmp_path)
    with pytest.raises(TypeError, match="state_dict"):
        ck.save(1, thing=[1, 2])
    with pytest.raises(TypeError, match="option"):
        ck.save(1, rng=torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="step"):
        ck.save(-1, x={})
    ck.save(1, x={"a": 1})
    with pytest.raises(CheckpointError, match="has no 'model'"):
        ck.restore(model=torch.nn.Linear(2, 2))


def test_half_tables_are_marked_and_need_opt_in(tmp_path):
    table = torch.randn(256, 16)
    small = torch.randn(10)
    ck = manager(tmp_path, half_min_bytes=4096)
    ck.save(1, t={"table": table, "small": small}, half_tables=True, rng=False)
    assert ck.checkpoints()[0]["half"] is True
    with pytest.raises(CheckpointError, match="allow_half=True"):
        ck.restore(t={})
    got = {}
    with pytest.warns(CheckpointWarning, match="half-precision"):
        ck.restore(t=got, allow_half=True)
    assert got["table"].dtype == torch.float32
    assert torch.equal(got["table"], table.to(torch.bfloat16).float())
    assert torch.equal(got["small"], small)            # small tensors stay exact
    assert ck.checkpoints()[0]["bytes"] < table.numel() * 3       # 2 bytes a value, plus the rest


def test_refuses_when_it_would_not_fit(tmp_path, monkeypatch):
    ck = manager(tmp_path)
    ck.save(1, x={"w": torch.zeros(1000)})
    real = shutil.disk_usage
    monkeypatch.setattr(ckmod.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=10_000))
    with pytest.raises(CheckpointSpaceError, match="not enough space") as e:
        ck.save(2, x={"w": torch.zeros(1000)})
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]


def test_failing_write_leaves_earlier_checkpoints_intact(tmp_path, disk_fills):
    ck = manager(tmp_path)
    ck.save(1, x={"w": torch.arange(5000.0)})
    disk_fills(3)
    with pytest.raises(CheckpointSpaceError, match="disk full"):
        ck.save(2, x={"w": torch.arange(5000.0) * 2})
    disk_fills.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001"]
    got = {}
    assert ck.restore(x=got) == 1 and torch.equal(got["w"], torch.arange(5000.0))


def test_mirror_copies_and_restores_after_local_loss(tmp_path):
    local, mirror = tmp_path / "local", tmp_path / "drive"
    ck = CheckpointManager(local, keep=2, mirror=mirror, config=SMALL)
    for step in range(1, 5):
        ck.save(step, x={"w": torch.full((1000,), float(step))})
    ck.finalize(unmount=False)
    assert sorted(p.name for p in mirror.iterdir()) == ["step-000000003", "step-000000004"] or \
        sorted(p.name for p in mirror.iterdir())[-1] == "step-000000004"
    assert not [p for p in mirror.iterdir() if p.name.startswith(".")]
    shutil.rmtree(local)                               # a new Colab runtime: local disk is gone
    ck2 = CheckpointManager(local, keep=2, mirror=mirror, config=SMALL)
    got = {}
    assert ck2.restore(x=got) == 4 and got["w"][0] == 4.0
    assert {r["where"] for r in ck2.checkpoints()} == {"mirror"}
    ck2.save(5, x=got)                                 # continues after the mirror's newest
    assert ck2.checkpoints()[0]["step"] == 5


def test_progress_and_throughput_reported(tmp_path, capsys):
    ck = CheckpointManager(tmp_path, config=CheckpointConfig(progress=True, chunk_bytes=4096))
    info = ck.save(7, x={"w": torch.zeros(10_000)})
    out = capsys.readouterr()
    assert "saved step 7" in out.out and "/s" in out.out
    assert info["bytes_per_s"] > 0
    ck.restore(x={})
    assert "restored step 7" in capsys.readouterr().out
    assert ck.last_restore["bytes_per_s"] > 0


@pytest.mark.gpu
def test_cuda_tensors_stream_through_staging_and_restore_in_place(tmp_path):
    dev = torch.device("cuda")
    big = torch.randn(300, 70, device=dev)
    emb = OffloadedEmbedding(2000, 24, device=dev, name="pinned")     # pinned, zero-copy
    state = {"big": big, "strided": big[:, ::3], "half_me": torch.randn(512, 64, device=dev)}
    ck = manager(tmp_path, half_min_bytes=100_000)
    ck.save(1, s=state, emb=emb)
    ck.save(2, s=state, emb=emb, half_tables=True)
    want = {k: v.clone() for k, v in state.items()}
    weight = emb.weight.clone()
    live = {"big": torch.zeros_like(big), "strided": torch.zeros(300, 24, device=dev),
            "half_me": torch.zeros(512, 64, device=dev)}
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    emb2 = OffloadedEmbedding(2000, 24, device=dev, name="pinned")
    ptr = emb2.weight.data_ptr()
    with pytest.warns(CheckpointWarning, match="half-precision"):
        assert ck.restore(s=live, emb=emb2, allow_half=True) == 2
    assert torch.equal(live["half_me"], want["half_me"].to(torch.bfloat16).float())
    shutil.rmtree(tmp_path / "step-000000002")
    assert ck.restore(s=live, emb=emb2) == 1
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs and emb2.weight.data_ptr() == ptr
    assert all(torch.equal(live[k], want[k]) for k in want) and live["big"].is_cuda
    assert torch.equal(emb2.weight, weight)


def test_a_file_where_the_directory_should_be_is_a_clear_error(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(NotADirectoryError, match=r"expected a directory .* is a file"):
        CheckpointManager(path, config=CheckpointConfig(**QUIET))
    with pytest.raises(NotADirectoryError, match="is a file"):        # a parent that is a file
        CheckpointManager(path / "run1", config=CheckpointConfig(**QUIET))
    assert path.read_text() == "not a folder"


def test_list_is_a_deprecated_name_of_checkpoints(tmp_path):
    ck = manager(tmp_path)
    ck.save(1, x={"w": torch.zeros(3)})
    with pytest.warns(DeprecationWarning, match="checkpoints"):
        rows = ck.list()
    assert rows == ck.checkpoints() and [r["step"] for r in rows] == [1]
