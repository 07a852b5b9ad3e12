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
from nbtools.checkpoint import (CheckpointConfig, CheckpointError, CheckpointManager, DriveSync,
                                copy_checkpoint)
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


# --- a checkpoint from someone else: what its manifest names is data ---------------------------

def _edit(ck: Path, change) -> None:
    """Change a checkpoint's manifest with ``change(body)`` and re-sign it, as anyone who can
    write the folder could."""
    m = json.loads((ck / ckformat.MANIFEST).read_bytes().partition(b"\n")[2])
    change(m)
    ckformat.write_manifest(ck, m, fsync=False)


def _two(tmp_path, **objects_of):
    """A root with a good checkpoint at step 5 and a newer one at step 7 (to be crafted)."""
    model, opt = trained(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(5, model=model, opt=opt, extra={"seen": {1}})
    mgr.save(7, model=model, opt=opt, extra={"seen": {1, 2}})
    return tmp_path / "ck" / "step-000000005", tmp_path / "ck" / "step-000000007"


def _falls_back(tmp_path, newest: Path, match: str) -> None:
    """Restoring the root warns that ``newest`` is damaged (``match``) and restores step 5."""
    model, opt = trained(1)
    with pytest.warns(Warning, match=match):
        step = CheckpointManager(newest.parent, config=QUIET).restore(model=model, opt=opt,
                                                                      extra={})
    assert step == 5


OUTSIDE_NAMES = ["../../x", "/tmp/nbtools-outside-x", "sub/data-0000.bin", "..", "MANIFEST",
                 "data-0000.bin/../../x", "notes.txt"]


@pytest.mark.parametrize("name", OUTSIDE_NAMES)
def test_a_manifest_naming_a_file_outside_the_format_is_damaged(tmp_path, name):
    older, newest = _two(tmp_path)
    planted = (newest / name) if not name.startswith("/") else Path(name)
    _edit(newest, lambda m: m["files"].__setitem__(name, 3))
    _falls_back(tmp_path, newest, "a checkpoint holds only MANIFEST|lists file 'MANIFEST'")
    assert not (tmp_path / "x").exists() and not Path("/tmp/nbtools-outside-x").exists()
    del planted


def test_copy_checkpoint_never_reads_or_writes_outside_its_folders(tmp_path):
    """The manifest lists ``../../x``: the old copy read ``src/../../x`` and wrote
    ``tmp/../../x`` (beside the mirror folder). Now it refuses before opening anything."""
    _, newest = _two(tmp_path)
    secret = tmp_path / "x"                       # what src/../../x reaches
    secret.write_bytes(b"secret bytes")
    _edit(newest, lambda m: m["files"].__setitem__("../../x", 12))
    mirror = tmp_path / "drive" / "runs"
    with pytest.raises(CheckpointError, match="a checkpoint holds only"):
        copy_checkpoint(newest, mirror)
    assert sorted(p.name for p in tmp_path.joinpath("drive").rglob("*")) == ["runs"]
    assert secret.read_bytes() == b"secret bytes"


@pytest.mark.parametrize("link_dir", ["../evil/step-000000005", "sub/step-000000005",
                                      "/tmp/step-000000005", "step-5", ".."])
def test_a_chain_link_that_is_not_a_step_directory_is_damaged(tmp_path, link_dir):
    """A disk table's chain names its base and deltas by directory: only a step directory of
    the same root is one; anything else makes the checkpoint damaged, and a mirror never
    copies it."""
    model = torch.nn.Module()
    model.emb = OffloadedEmbedding(40, 4, placement="disk", disk_dir=tmp_path / "t", name="emb")
    opt = OffloadOptimizer(torch.optim.Adagrad, model, lr=0.1)
    model.emb(torch.arange(8)).sum().backward()
    opt.step()
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(5, model=model, opt=opt)
    model.emb(torch.arange(4)).sum().backward()
    opt.step()
    mgr.save(7, model=model, opt=opt)
    newest = tmp_path / "ck" / "step-000000007"

    def relink(m):
        m["rows"][0]["chain"][0]["dir"] = link_dir
    _edit(newest, relink)
    with pytest.warns(Warning, match="a link names a step directory"):
        assert mgr.restore(model=model, opt=opt) == 5
    sync = DriveSync(tmp_path / "drive", background=False)
    with pytest.raises(CheckpointError, match="a link names a step directory"):
        sync.submit(newest)
    assert [p.name for p in (tmp_path / "drive").iterdir()] == []
    assert not (tmp_path / "evil").exists()


def test_a_segment_naming_a_device_is_damaged(tmp_path):
    """A segment naming /dev/zero (whose zeros have a known CRC) restored a table of zeros."""
    older, newest = _two(tmp_path)

    def to_dev_zero(m):
        m["files"]["/dev/zero"] = 1 << 20
        for e in m["tensors"]:
            e["segments"] = [["/dev/zero", 0, s[2], zlib.crc32(bytes(s[2]))]
                             for s in e["segments"]]
    _edit(newest, to_dev_zero)
    _falls_back(tmp_path, newest, "a checkpoint holds only")


def _runs_within(seconds, fn):
    """``fn()``'s result, or a failure when it blocks longer than ``seconds``."""
    import threading
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:       # (re-raised in the test's thread)
            out["error"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), f"blocked for more than {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("what", ["fifo", "outside symlink", "symlinked directory"])
def test_fifos_and_links_are_refused_without_blocking(tmp_path, what):
    older, newest = _two(tmp_path)
    data = newest / "data-0000.bin"
    if what == "fifo":                  # opening a FIFO to read blocks until a writer comes
        data.unlink()
        os.mkfifo(data)
        match = "FIFO"
    elif what == "outside symlink":    # the same bytes, read through a link to outside
        outside = tmp_path / "outside.bin"
        data.rename(outside)
        data.symlink_to(outside)
        match = "symbolic link"
    else:                               # the whole step directory a link to another folder
        elsewhere = tmp_path / "elsewhere"
        newest.rename(elsewhere)
        newest.symlink_to(elsewhere, target_is_directory=True)
        match = "symbolic link"
    _runs_within(20, lambda: _falls_back(tmp_path, newest, match))
    mgr = CheckpointManager(newest.parent, config=QUIET)
    rows = _runs_within(20, lambda: mgr.checkpoints(verify=True))
    (row,) = [r for r in rows if r["path"] == str(newest)]
    assert row["status"].startswith("damaged") and match in row["status"]


def test_a_damaged_warning_never_reveals_a_file_outside(tmp_path):
    """``files["/etc/passwd"] = 1`` made the warning say the real file's size."""
    older, newest = _two(tmp_path)
    _edit(newest, lambda m: m["files"].__setitem__("/etc/passwd", 1))
    model, opt = trained(1)
    with pytest.warns(Warning) as record:
        CheckpointManager(newest.parent, config=QUIET).restore(model=model, opt=opt, extra={})
    text = " ".join(str(w.message) for w in record)
    assert "/etc/passwd" in text and "bytes" not in text
    assert str(os.stat("/etc/passwd").st_size) not in text.replace("/etc/passwd", "")


@pytest.mark.parametrize("change, match", [
    (lambda m: m["tensors"][0]["segments"][0].__setitem__(2, 10 ** 12), "outside its files"),
    (lambda m: m["tensors"][0].__setitem__("dtype", "Tensor"), "unknown dtype"),
    (lambda m: m["tensors"][0].__setitem__("shape", [-1]), "describes tensor 0"),
    (lambda m: m["objects"]["model"].__setitem__("state", {"$tensor": 10 ** 6}),
     "refers to tensor"),
    (lambda m: m["objects"]["extra"].__setitem__("state", {"$pickle": 50}),
     "the state refers to 51"),
], ids=["segment past its file", "dtype", "shape", "tensor index", "side-file index"])
def test_manifest_entries_out_of_range_are_damaged(tmp_path, change, match):
    """Every index and size a manifest holds is checked before it is used: a crafted one is
    a damaged checkpoint (a warning and the older one), never an IndexError or a read."""
    older, newest = _two(tmp_path)
    _edit(newest, change)
    _falls_back(tmp_path, newest, match)


@pytest.mark.parametrize("blob", [b"PK\x03\x04" + bytes(300), b"hello world" * 30,
                                  b"", pickle.dumps(5)],
                         ids=["broken zip", "text", "empty", "not a list"])
def test_a_side_file_that_is_not_one_nbtools_wrote_is_damaged(tmp_path, blob):
    """An extras.pt of other bytes (its CRC re-signed) surfaced as an IndexError or KeyError."""
    older, newest = _two(tmp_path)
    _resign(newest, blob)
    _falls_back(tmp_path, newest, "not a side file nbtools wrote|holds int of no values")


# --- a refused restore changes nothing -----------------------------------------------------------

def snapshot_all(model, opt, loader):
    """:func:`snapshot`, the loader's position and every generator's state."""
    import random

    import numpy as np
    state = snapshot(model, opt)
    state["loader"] = repr(loader.state_dict())
    state["python rng"] = repr(random.getstate())
    state["numpy rng"] = repr(np.random.get_state())
    return state


def _saved_with_loader(tmp_path, batch_size=32):
    from nbtools import PinnedLoader
    model, opt = trained(0)
    loader = PinnedLoader(torch.arange(256), batch_size=batch_size, device="cpu")
    for _, _ in zip(range(3), loader):
        pass
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(7, model=model, opt=opt, loader=loader, extra={"seen": {1}})
    return mgr


def _refused(tmp_path, mgr, loader, match, loader_first=False):
    model, opt = trained(1)
    for _, _ in zip(range(2), loader):
        pass
    before = snapshot_all(model, opt, loader)
    objects = dict(model=model, opt=opt, loader=loader, extra={})
    if loader_first:
        objects = {"loader": loader, **objects}
    with pytest.raises(CheckpointError, match=match) as e:
        mgr.restore(**objects)
    assert "Nothing was restored" in str(e.value)
    assert_unchanged(before, snapshot_all(model, opt, loader))


@pytest.mark.parametrize("loader_first", [False, True])
def test_a_loader_that_does_not_resume_changes_nothing(tmp_path, loader_first):
    """A checkpoint saved with batch_size=32 restored into a loader of 64: the loader's check
    ran after 13 tensors (8 with the loader first) had been read into the live model."""
    from nbtools import PinnedLoader
    mgr = _saved_with_loader(tmp_path)
    loader = PinnedLoader(torch.arange(256), batch_size=64, device="cpu")
    _refused(tmp_path, mgr, loader, "batch_size=32", loader_first)


@pytest.mark.parametrize("change, match", [
    (lambda r: r["python"]["$tuple"].__setitem__(0, 99), "RNG states do not load"),
    (lambda r: r["numpy"].__setitem__("kind", "PCG64"), "RNG states do not load"),
    (lambda r: r.__setitem__("numpy", 3), "RNG states do not load"),
], ids=["python version 99", "numpy kind", "numpy not a dict"])
def test_rng_states_that_do_not_load_change_nothing(tmp_path, change, match):
    from nbtools import PinnedLoader
    mgr = _saved_with_loader(tmp_path)
    ck = tmp_path / "ck" / "step-000000007"
    _edit(ck, lambda m: change(m["rng"]))
    _refused(tmp_path, mgr, PinnedLoader(torch.arange(256), batch_size=32, device="cpu"), match)


def _dense_groups(m):
    return m["objects"]["opt"]["state"]["dense"]["param_groups"]


@pytest.mark.parametrize("change, match", [
    (lambda m: _dense_groups(m)[0].pop("params"), "no list of parameter indices"),
    (lambda m: _dense_groups(m)[0].__setitem__("lr", "0.1"), "lr is '0.1'"),
    (lambda m: _dense_groups(m)[0].__setitem__("betas", {"$tuple": [0.9]}), "betas"),
    (lambda m: next(iter(m["objects"]["opt"]["state"]["tables"].values()))["group"]
     .__setitem__("eps", [1]), "eps is"),
    (lambda m: m["objects"]["opt"]["state"].__setitem__("tables", 5), "has no tables"),
], ids=["params missing", "lr a string", "betas short", "table eps a list", "tables not a dict"])
def test_optimizer_state_of_the_wrong_kinds_changes_nothing(tmp_path, change, match):
    """``KeyError: 'params'`` from a group without params; ``lr`` as a string was accepted."""
    from nbtools import PinnedLoader
    mgr = _saved_with_loader(tmp_path)
    _edit(tmp_path / "ck" / "step-000000007", change)
    _refused(tmp_path, mgr, PinnedLoader(torch.arange(256), batch_size=32, device="cpu"), match)


def test_a_staged_object_that_fails_to_load_is_put_back(tmp_path):
    """An object nbtools cannot check ahead (a user's, with only load_state_dict) is loaded
    before anything live; when a later one refuses, it gets its state back."""
    class Counter:
        def __init__(self, n):
            self.n = n

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            if state["n"] < 0:
                raise ValueError("a count is never negative")
            self.n = state["n"]

    model, opt = trained(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(7, model=model, opt=opt, first=Counter(1), second=Counter(2))
    _edit(tmp_path / "ck" / "step-000000007",
          lambda m: m["objects"]["second"]["state"].__setitem__("n", -1))
    model2, opt2 = trained(1)
    first, second = Counter(10), Counter(20)
    before = snapshot(model2, opt2)
    with pytest.raises(CheckpointError, match="never negative"):
        mgr.restore(model=model2, opt=opt2, first=first, second=second)
    assert (first.n, second.n) == (10, 20)
    assert_unchanged(before, snapshot(model2, opt2))


def test_what_an_interrupted_prune_leaves_is_removed_and_links_are_not_followed(tmp_path):
    """A prune renames a directory to ``.del-...`` and then deletes it: one killed in between
    leaves it behind. The next save (local folder) and the next prune (the mirror too) remove
    such leftovers, and a link standing there is removed, never followed."""
    model, opt = trained(0)
    mgr = CheckpointManager(tmp_path / "ck", keep=1, mirror=tmp_path / "drive", config=QUIET)
    mgr.save(1, model=model, opt=opt)
    mgr.sync.wait()
    keep_me = tmp_path / "precious"
    keep_me.mkdir()
    (keep_me / "file").write_text("mine")
    for root in (tmp_path / "ck", tmp_path / "drive"):
        (root / ".del-step-000000000-1-1").mkdir()
        (root / ".del-step-000000000-1-1" / "data-0000.bin").write_bytes(b"x" * 100)
        (root / ".del-step-000000000-2-2").symlink_to(keep_me, target_is_directory=True)
    mgr.save(2, model=model, opt=opt)
    mgr.sync.wait()
    for root in (tmp_path / "ck", tmp_path / "drive"):        # (step 2 needs step 1's rows)
        assert sorted(p.name for p in root.iterdir()) == ["step-000000001",
                                                          "step-000000002"], root
    assert (keep_me / "file").read_text() == "mine"
