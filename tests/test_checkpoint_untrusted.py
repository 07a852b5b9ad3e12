"""A checkpoint from someone else is data: what its manifest and side file hold can make a
restore refuse, or fall back to an older checkpoint, but never change a live object first,
crash out of the fallback, or take memory the files do not hold. And what a save creates is
the user's alone.

Each crafted checkpoint is a good one, edited and re-signed (as anyone who can write the folder
could), restored into objects that differ from it: the test compares every tensor and value a
restore could change before and after.
"""
from __future__ import annotations

import io
import json
import os
import stat
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from nbtools.checkpoint import CheckpointConfig, CheckpointError, CheckpointManager
from nbtools.checkpoint import format as ckformat

QUIET = CheckpointConfig(verbose=False, progress=False, chunk_bytes=4096, file_bytes=16384)


def dense(seed: int):
    """A small model with a BatchNorm (version metadata, buffers) and its Adam, trained."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3),
                                torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(model, opt) -> dict:
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            out[f"opt/{i}/{k}"] = v.clone() if torch.is_tensor(v) else v
    out["groups"] = repr([{k: v for k, v in g.items() if k != "params"}
                          for g in opt.param_groups])
    return out


def assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for k, v in before.items():
        if torch.is_tensor(v):
            assert v.dtype == after[k].dtype and torch.equal(v, after[k]), k
        else:
            assert v == after[k], k


def edit(ck: Path, change) -> None:
    m = json.loads((ck / ckformat.MANIFEST).read_bytes().partition(b"\n")[2])
    change(m)
    ckformat.write_manifest(ck, m, fsync=False)


def two(tmp_path, extra=None):
    """A root holding a good step 5 and a step 7 to craft."""
    model, opt = dense(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(5, model=model, opt=opt, extra=dict(extra or {}))
    mgr.save(7, model=model, opt=opt, extra=dict(extra or {}))
    return tmp_path / "ck" / "step-000000007"


def refused(newest: Path, match: str):
    """Restoring refuses with ``match`` and changes nothing (older checkpoints not tried)."""
    model, opt = dense(1)
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=match) as e:
        CheckpointManager(newest.parent, config=QUIET).restore(model=model, opt=opt, extra={})
    assert_unchanged(before, snapshot(model, opt))
    return e.value


def falls_back(newest: Path, match: str) -> None:
    """Restoring warns that ``newest`` is damaged (``match``) and restores step 5 instead."""
    model, opt = dense(1)
    with pytest.warns(Warning, match=match):
        step = CheckpointManager(newest.parent, config=QUIET).restore(model=model, opt=opt,
                                                                      extra={})
    assert step == 5


def _state(m, name):
    return m["objects"][name]["state"]


# --- what load_state_dict would refuse is refused before a byte is read -----------------------

def test_module_metadata_its_load_refuses_changes_nothing(tmp_path):
    """A BatchNorm's version metadata that is a string: torch's loader compares it with an int
    and raises. Before, the module's tensors (read in place) already held the checkpoint's."""
    newest = two(tmp_path)

    def change(m):
        meta = _state(m, "model")["$meta"]["$items"]
        version = next(v for k, v in meta if k == "1")
        version["version"] = "x"
    edit(newest, change)
    err = refused(newest, "'model'.*load_state_dict refuses")
    assert "TypeError" in str(err)


def test_optimizer_state_its_load_refuses_changes_nothing(tmp_path):
    """A NumPy array (a side-file value restores allow) in Adam's state of one parameter:
    torch's loader cannot cast it. Before, every parameter and moment was overwritten."""
    newest = two(tmp_path, extra={"arr": np.arange(3)})
    edit(newest, lambda m: _state(m, "opt")["state"]["$items"][0][1].__setitem__(
        "extra", {"$pickle": 0}))
    refused(newest, "'opt'.*load_state_dict refuses")


class _Picky(torch.nn.Linear):
    """Loads in its own way (so it is not rehearsed) and refuses a value only its loader sees."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        if float(state_dict[prefix + "bias"].sum()) > 1e3:
            raise ValueError("bias too large")
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_refusal_only_the_values_show_names_what_changed(tmp_path):
    torch.manual_seed(0)
    model = _Picky(3, 2)
    with torch.no_grad():
        model.bias.fill_(1e4)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(1, model=model)
    fresh = _Picky(3, 2)
    with pytest.raises(CheckpointError, match="'model' refused its state after the tensors "
                                              "were read.*ValueError: bias too large"):
        mgr.restore(model=fresh)


def test_modules_that_load_as_torch_does_still_restore_exactly(tmp_path):
    model, opt = dense(0)
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(3, model=model, opt=opt)
    model2, opt2 = dense(1)
    assert mgr.restore(model=model2, opt=opt2) == 3
    assert_unchanged(snapshot(model, opt), snapshot(model2, opt2))


# --- a state tree no save writes: damaged, the older checkpoint restored ----------------------

def test_a_state_nested_past_what_a_save_writes_is_damaged(tmp_path):
    newest = two(tmp_path, extra={"deep": [1]})

    def change(m):
        deep = 0
        for _ in range(900):
            deep = [deep]
        _state(m, "extra")["deep"] = deep
    edit(newest, change)
    falls_back(newest, "nested over")


def test_saves_refuse_what_restores_would_call_damaged(tmp_path):
    """Save and restore agree on depth: a mapping of int keys (the deepest JSON a level takes)
    nested as deep as a save allows round-trips; one level more is refused at save, naming
    where."""
    def nested(levels):
        x = {0: 1}
        for _ in range(levels - 1):
            x = {0: x}
        return x
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    deepest = nested(ckformat.TREE_MAX_DEPTH - 1)      # (under the object's own dict)
    mgr.save(1, extra={"x": deepest})
    got = {}
    assert mgr.restore(extra=got) == 1 and got == {"x": deepest}
    with pytest.raises(TypeError, match=r"extra/x.*nests over"):
        mgr.save(2, extra={"x": nested(ckformat.TREE_MAX_DEPTH)})


def test_a_mapping_key_that_cannot_be_one_is_damaged(tmp_path):
    newest = two(tmp_path)
    edit(newest, lambda m: _state(m, "opt")["state"]["$items"][0].__setitem__(0, [1, 2]))
    falls_back(newest, "key that is not a number")


def test_a_side_file_value_that_cannot_be_a_key_is_damaged(tmp_path):
    newest = two(tmp_path, extra={"arr": np.arange(3)})
    edit(newest, lambda m: _state(m, "opt")["state"]["$items"][0].__setitem__(
        0, {"$pickle": 0}))
    falls_back(newest, "key is a ndarray")


# --- the side file: its size is the file's, and nothing in it inflates ------------------------

def test_a_side_file_size_past_its_file_is_damaged_not_a_memory_error(tmp_path):
    newest = two(tmp_path, extra={"seen": {1, 2}})
    edit(newest, lambda m: m["extras"].__setitem__("bytes", 1 << 50))
    falls_back(newest, "side file")


def test_a_compressed_side_file_is_damaged_before_it_inflates(tmp_path):
    """A record DEFLATEd: 64 MiB of zeros in a file of ~65 KB. torch.save stores records as
    they are, so a compressed one is not ours; it is refused before torch.load reads it."""
    newest = two(tmp_path, extra={"seen": {1, 2}})
    buf = io.BytesIO()
    torch.save([torch.zeros(16 << 20)], buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    blob = out.getvalue()
    assert len(blob) < 1 << 20
    m = json.loads((newest / ckformat.MANIFEST).read_bytes().partition(b"\n")[2])
    (newest / m["extras"]["file"]).write_bytes(blob)

    def change(m):
        m["extras"].update(bytes=len(blob), crc32=zlib.crc32(blob))
        m["files"][m["extras"]["file"]] = len(blob)
    edit(newest, change)
    falls_back(newest, "compressed")


# --- what a save creates is the user's alone --------------------------------------------------

def _modes(root: Path) -> dict:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode)
            for p in sorted(root.rglob("*"))}


def test_a_checkpoint_and_its_mirror_are_private_whatever_the_umask(tmp_path):
    model, opt = dense(0)
    old = os.umask(0o022)
    try:
        mgr = CheckpointManager(tmp_path / "ck", mirror=tmp_path / "drive", config=QUIET)
        mgr.save(1, model=model, opt=opt)
        mgr.finalize(unmount=False)
    finally:
        os.umask(old)
    for root in ("ck", "drive"):
        modes = _modes(tmp_path / root)
        assert modes and stat.S_IMODE((tmp_path / root).stat().st_mode) == 0o700
        for name, mode in modes.items():
            want = 0o700 if (tmp_path / root / name).is_dir() else 0o600
            assert mode == want, (root, name, oct(mode))


def test_a_root_the_user_made_keeps_its_mode(tmp_path):
    """A folder the user shares on purpose (mode 0755) stays so; the checkpoints in it are
    still private until the user says otherwise."""
    (tmp_path / "ck").mkdir(mode=0o755)
    os.chmod(tmp_path / "ck", 0o755)
    model, opt = dense(0)
    CheckpointManager(tmp_path / "ck", config=QUIET).save(1, model=model, opt=opt)
    assert stat.S_IMODE((tmp_path / "ck").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "ck" / "step-000000001").stat().st_mode) == 0o700


# --- a training history from someone else ------------------------------------------------------

def test_a_history_that_is_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    import threading
    from nbtools.meters import History
    fifo = tmp_path / "history.jsonl"
    os.mkfifo(fifo)
    dev = tmp_path / "zero.jsonl"
    dev.symlink_to("/dev/zero")
    for path in (fifo, dev):
        got = {}

        def load(path=path, got=got):
            try:
                History.load(path)
            except ValueError as e:
                got["error"] = str(e)
        t = threading.Thread(target=load, daemon=True)
        t.start()
        t.join(20)
        if t.is_alive():                       # (release the reader stuck on the FIFO)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)) if path == fifo else None
        assert "not a regular file" in got.get("error", ""), path
    real = tmp_path / "real.jsonl"
    real.write_text('{"step": 1}\n')
    (tmp_path / "link.jsonl").symlink_to(real)
    assert History.load(tmp_path / "link.jsonl").records == [{"step": 1}]


def test_a_history_writes_through_no_link_and_blocks_on_no_fifo(tmp_path):
    """Appending, saving and appending after a load never write into the file a planted link
    names; a FIFO at the path is refused at once; what is written is 0600."""
    import threading
    from nbtools.files import UnsafeFileError
    from nbtools.meters import History
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")

    def refused(make, path):
        with pytest.raises((UnsafeFileError, ValueError)):
            make(path)
        assert victim.read_bytes() == b"precious\n"
    link = tmp_path / "run.jsonl"
    link.symlink_to(victim)
    refused(lambda p: History(p).append({"step": 1}), link)
    refused(lambda p: History.load(p, append=True), link)
    dangling = tmp_path / "new.jsonl"
    dangling.symlink_to(tmp_path / "made-through-the-link.jsonl")
    refused(lambda p: History(p).append({"step": 1}), dangling)
    assert not (tmp_path / "made-through-the-link.jsonl").exists()
    # save() replaces a link at its path (never writes through it) and a planted temporary name
    # cannot catch the write (it is a new, unpredictable name made O_EXCL)
    h = History()
    h.append({"step": 2})
    h.save(link)
    assert victim.read_bytes() == b"precious\n" and not link.is_symlink()
    assert History.load(link).records == [{"step": 2}]
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    done = {}

    def append():
        try:
            History(fifo).append({"step": 1})
        except (UnsafeFileError, ValueError) as e:
            done["error"] = e
    t = threading.Thread(target=append, daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive() and "error" in done
    old = os.umask(0o022)
    try:
        mine = History(tmp_path / "logs" / "mine.jsonl")
        mine.append({"step": 1})
        mine.close()
        h.save(tmp_path / "saved.jsonl")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
    for p in (tmp_path / "logs" / "mine.jsonl", tmp_path / "saved.jsonl"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p


class _Unpicklable(torch.nn.Module):
    """A model that refuses to be pickled (it holds a handle, say): its twin is still made."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))

    def __getstate__(self):
        raise TypeError("this model holds a handle and cannot be pickled")


def test_a_model_that_cannot_be_pickled_is_rehearsed_too(tmp_path):
    torch.manual_seed(0)
    model = _Unpicklable()
    mgr = CheckpointManager(tmp_path / "ck", config=QUIET)
    mgr.save(1, model=model)
    ck = tmp_path / "ck" / "step-000000001"

    def change(m):
        meta = _state(m, "model")["$meta"]["$items"]
        next(v for k, v in meta if k == "body.1")["version"] = "x"
    edit(ck, change)
    torch.manual_seed(1)
    other = _Unpicklable()
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match="load_state_dict refuses"):
        mgr.restore(model=other)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k
