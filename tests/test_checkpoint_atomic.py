"""A restore that fails changes nothing, and a checkpoint is data: restoring runs no code.

Each mismatch kind (optimizer class, table shape, dtype, missing and extra tables, a dense
parameter's shape, a damaged data file) restores a checkpoint into objects trained elsewhere:
the restore raises, saying what it found, what it expected and that nothing changed, and every
table row, optimizer state, dense parameter and RNG state is exactly as before (torch.equal).
A checkpoint whose side file is replaced by a crafted pickle (its size and CRC updated in a
re-signed MANIFEST, as anyone who can write the folder could) is refused: the command it
carries does not run and nothing changes.
"""
from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path

import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from nbtools.checkpoint import format as ckformat

QUIET = CheckpointConfig(verbose=False, progress=False, chunk_bytes=4096, file_bytes=16384)


class Model(torch.nn.Module):
    def __init__(self, rows=(50, 30), dim=8, dtype=torch.float32, head=8, out=1):
        super().__init__()
        self.tables = torch.nn.ModuleList(
            OffloadedEmbedding(n, dim, device="cpu", name=f"t{i}", dtype=dtype)
            for i, n in enumerate(rows))
        self.head = torch.nn.Linear(head, out)

    def forward(self, ids):
        rows = sum(t(ids % t.num_embeddings) for t in self.tables)
        return self.head(rows).sum(-1)


def trained(seed, cls=torch.optim.Adam, steps=3, **kw):
    torch.manual_seed(seed)
    model = Model(**kw)
    opt = OffloadOptimizer(cls, model, lr=0.05)
    for _ in range(steps):
        model(torch.randint(0, 100, (16,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(model, opt):
    """Everything a restore could change, copied."""
    state = {f"param/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for t in model.tables:
        for k, v in opt.table_state(t).items():
            state[f"{t.name}/{k}"] = v.clone()
    sd = opt.state_dict()
    for name, tab in sd["tables"].items():
        state[f"group/{name}"] = repr(tab["group"]) + repr(tab["scalar_state"])
    state["dense"] = repr(sd["dense"])
    state["rng"] = torch.get_rng_state().clone()
    return state


def assert_unchanged(before, after):
    assert before.keys() == after.keys()
    for k, v in before.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == after[k].dtype and torch.equal(v, after[k]), k
        else:
            assert v == after[k], k


@pytest.fixture
def saved(tmp_path):
    model, opt = trained(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(7, model=model, opt=opt)
    return tmp_path / "ck"


MISMATCHES = {
    "optimizer class": dict(cls=torch.optim.SGD),
    "table rows": dict(rows=(50, 31)),
    "table dim": dict(dim=6, head=6),
    "dtype": dict(dtype=torch.bfloat16),
    "missing table": dict(rows=(50,)),
    "extra table": dict(rows=(50, 30, 20)),
    "dense shape": dict(out=2),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_a_mismatch_changes_nothing(saved, kind):
    model, opt = trained(1, **MISMATCHES[kind])
    torch.manual_seed(123)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match="Nothing was restored") as e:
        CheckpointManager(saved, config=QUIET).restore(model=model, opt=opt)
    assert "expected" in str(e.value) or "lacks" in str(e.value) or \
        "does not" in str(e.value), str(e.value)
    assert_unchanged(before, snapshot(model, opt))


def test_a_damaged_data_file_changes_nothing(saved):
    model, opt = trained(1)
    data = sorted(p for p in saved.iterdir() if p.is_dir() for p in p.iterdir()
                  if p.name.startswith("data"))
    # the last data file: the first ones hold the tables read in place, so a byte flipped
    # late in the stream is found only after earlier tensors would have been written
    target = data[-1]
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    target.write_bytes(bytes(raw))
    torch.manual_seed(5)
    before = snapshot(model, opt)
    with pytest.warns(Warning):
        with pytest.raises(CheckpointError):
            CheckpointManager(saved, config=QUIET).restore(model=model, opt=opt)
    assert_unchanged(before, snapshot(model, opt))


def test_every_data_file_damaged_in_turn_changes_nothing(saved):
    ck = next(p for p in saved.iterdir() if p.is_dir())
    files = sorted(p for p in ck.iterdir() if p.name.startswith("data"))
    assert len(files) > 1
    for f in files:
        good = f.read_bytes()
        bad = bytearray(good)
        bad[-1] ^= 0x01
        f.write_bytes(bytes(bad))
        try:
            model, opt = trained(2)
            before = snapshot(model, opt)
            with pytest.warns(Warning), pytest.raises(CheckpointError):
                CheckpointManager(saved, config=QUIET).restore(model=model, opt=opt)
            assert_unchanged(before, snapshot(model, opt))
        finally:
            f.write_bytes(good)
    model, opt = trained(2)
    assert CheckpointManager(saved, config=QUIET).restore(model=model, opt=opt) == 7


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _resign(ck: Path, blob: bytes) -> None:
    """Replace the side file and update the MANIFEST (sizes, CRC, its own checksum)."""
    head, _, data = (ck / ckformat.MANIFEST).read_bytes().partition(b"\n")
    m = json.loads(data)
    (ck / m["extras"]["file"]).write_bytes(blob)
    m["extras"].update(bytes=len(blob), crc32=zlib.crc32(blob))
    m["files"][m["extras"]["file"]] = len(blob)
    ckformat.write_manifest(ck, m, fsync=False)


def test_a_crafted_side_file_runs_nothing_and_changes_nothing(tmp_path):
    model, opt = trained(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    extra = {"seen": {1, 2, 3}}           # a set: JSON cannot hold it, so a side file exists
    mgr.save(7, model=model, opt=opt, extra=extra)
    ck = next(p for p in (tmp_path / "ck").iterdir() if p.is_dir())
    marker = tmp_path / "ran"
    _resign(ck, pickle.dumps([_Payload(marker)]))
    model2, opt2 = trained(1)
    mine = {"mine": 1}
    torch.manual_seed(9)
    before = snapshot(model2, opt2)
    with pytest.raises(CheckpointError, match="not data") as e:
        CheckpointManager(tmp_path / "ck", config=QUIET).restore(model=model2, opt=opt2,
                                                                 extra=mine)
    assert "system" in str(e.value)          # names what it refused
    assert not marker.exists(), "the crafted pickle ran"
    assert_unchanged(before, snapshot(model2, opt2))
    assert mine == {"mine": 1}


def test_values_restore_cannot_load_are_refused_when_saving(tmp_path):
    model, opt = trained(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    with pytest.raises(TypeError, match=r"extra/fn.*not plain data"):
        mgr.save(1, model=model, opt=opt, extra={"fn": _Payload(tmp_path / "x")})
    assert not (tmp_path / "x").exists()
    assert mgr.latest_step() is None


def test_plain_values_of_every_allowed_kind_round_trip(tmp_path):
    import numpy as np
    values = {"set": {1, 2}, "bytes": b"ab", "dtype": torch.bfloat16, "device": torch.device("cpu"),
              "size": torch.Size([2, 3]), "array": np.arange(5, dtype=np.int32),
              "scalar": np.float64(2.5), "npdtype": np.dtype("float16"), "complex": 1 + 2j}
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(1, extra=dict(values))
    got = {}
    assert mgr.restore(extra=got) == 1
    for k, v in values.items():
        if isinstance(v, np.ndarray):
            assert np.array_equal(got[k], v) and got[k].dtype == v.dtype
        else:
            assert got[k] == v and type(got[k]) is type(v), k
