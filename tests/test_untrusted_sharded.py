"""A sharded checkpoint folder, a corpus loader's saved state and the word-similarity samples'
folder are data someone else may have filled: nothing is written through a planted link,
nothing blocks on a FIFO or eats memory from a device, a malformed SHARDS.json or loader state
is refused with a message before anything changes, and what is made is the user's alone."""
from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.optim as O

from nbtools import CheckpointManager, OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import CheckpointError
from nbtools.distributed import ShardedEmbedding, restore_sharded, save_sharded
from nbtools.distributed.checkpoints import SHARDS_FORMAT, SHARDS_MAX_BYTES
from nbtools.models.word2vec import CorpusLoader
from nbtools.models.wordsim import make_samples

ROWS, DIM = 11, 4
VICTIM = b"IMPORTANT USER DATA\n"


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM)
    return victim


def _trained(seed: int = 0):
    """A world-1 sharded table and its Adam, a step taken (so the state is not all zeros)."""
    table = ShardedEmbedding(ROWS, DIM, device="cpu", name="t")
    table.load_full_weight(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed)))
    opt = OffloadOptimizer(O.Adam, table, lr=0.05)
    ids = torch.tensor([0, 3, 3, 7, 10])
    (table(ids) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()
    return table, opt


def _snapshot(table, opt):
    return table.shard.rows.host.tensor.clone(), copy.deepcopy(opt.state_dict())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _assert_unchanged(table, opt, before):
    rows, state = _snapshot(table, opt)
    assert torch.equal(rows, before[0]), "the live table changed"
    assert _same(state, before[1]), "the live optimizer changed"


# --- save_sharded --------------------------------------------------------------------------------
def test_save_never_writes_through_a_planted_temporary_link(tmp_path):
    victim = _victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(victim, shared / "SHARDS.json.tmp")
    table, opt = _trained()
    save_sharded(shared, 1, table, opt)
    assert victim.read_bytes() == VICTIM
    manifest = shared / "SHARDS.json"
    assert not manifest.is_symlink() and _mode(manifest) == 0o600
    assert json.loads(manifest.read_text())["step"] == 1


def test_save_replaces_a_planted_manifest_link_and_makes_private_folders(tmp_path):
    victim = _victim(tmp_path)
    root = tmp_path / "new" / "ckpt"
    root.mkdir(parents=True)
    os.symlink(victim, root / "SHARDS.json")
    table, opt = _trained()
    save_sharded(root, 2, table, opt)
    assert victim.read_bytes() == VICTIM
    assert not (root / "SHARDS.json").is_symlink() and _mode(root / "SHARDS.json") == 0o600
    fresh = tmp_path / "fresh"
    save_sharded(fresh, 2, table, opt)
    assert _mode(fresh) == 0o700 and _mode(fresh / "rank0-of-1") == 0o700


def test_save_restore_round_trips_exactly(tmp_path):
    table, opt = _trained()
    before = _snapshot(table, opt)
    save_sharded(tmp_path, 3, table, opt)
    other, other_opt = _trained(seed=1)
    assert restore_sharded(tmp_path, other, other_opt) == 3
    _assert_unchanged(other, other_opt, before)


def test_no_manifest_is_no_checkpoint(tmp_path):
    table, opt = _trained()
    assert restore_sharded(tmp_path, table, opt) is None
    assert restore_sharded(tmp_path / "missing", table, opt) is None


# --- restore_sharded: SHARDS.json is data --------------------------------------------------------
def _manifest(**changes) -> dict:
    body = {"format": SHARDS_FORMAT, "step": 1, "world": 1, "layout": "round-robin",
            "name": "t", "num_embeddings": ROWS, "embedding_dim": DIM, "optimizer": "Adam"}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not ...}


BAD_MANIFESTS = {
    "list": "[1, 2]",
    "not json": "{nope",
    "not utf-8": b"\xff\xfe{}",
    "deep": "[" * 100_000 + "]" * 100_000,
    "no format": _manifest(format=...),
    "newer format": _manifest(format="nbtools.ShardedEmbedding/9"),
    "world 0": _manifest(world=0),
    "world negative": _manifest(world=-3),
    "world bool": _manifest(world=True),
    "world float": _manifest(world=1.0),
    "world string": _manifest(world="1"),
    "no world": _manifest(world=...),
    "step negative": _manifest(step=-1),
    "step string": _manifest(step="1"),
    "rows null": _manifest(num_embeddings=None),
    "dim 0": _manifest(embedding_dim=0),
    "optimizer list": _manifest(optimizer=["Adam"]),
    "name number": _manifest(name=3),
}


@pytest.mark.parametrize("case", list(BAD_MANIFESTS))
def test_malformed_manifest_is_refused_changing_nothing(tmp_path, case):
    table, opt = _trained()
    save_sharded(tmp_path, 1, table, opt)
    body = BAD_MANIFESTS[case]
    data = body if isinstance(body, bytes) else \
        (body if isinstance(body, str) else json.dumps(body)).encode()
    (tmp_path / "SHARDS.json").write_bytes(data)
    live, live_opt = _trained(seed=2)
    before = _snapshot(live, live_opt)
    with pytest.raises(CheckpointError, match="SHARDS.json"):
        restore_sharded(tmp_path, live, live_opt)
    _assert_unchanged(live, live_opt, before)


@pytest.mark.parametrize("field", ["world", "step", "embedding_dim", "optimizer", "format"])
def test_refusal_names_the_field(tmp_path, field):
    (tmp_path / "SHARDS.json").write_text(json.dumps(_manifest(**{field: None})))
    table, opt = _trained()
    with pytest.raises(CheckpointError, match=field):
        restore_sharded(tmp_path, table, opt)


def test_oversized_manifest_is_refused(tmp_path):
    (tmp_path / "SHARDS.json").write_bytes(b" " * (SHARDS_MAX_BYTES + 1))
    table, opt = _trained()
    with pytest.raises(CheckpointError, match="bytes"):
        restore_sharded(tmp_path, table, opt)


def test_world_beyond_the_saved_folders_is_refused_at_once(tmp_path):
    table, opt = _trained()
    save_sharded(tmp_path, 1, table, opt)
    for world in (2, 10**12):
        (tmp_path / "SHARDS.json").write_text(json.dumps(_manifest(world=world)))
        before = _snapshot(table, opt)
        with pytest.raises(CheckpointError, match="missing"):
            restore_sharded(tmp_path, table, opt)
        _assert_unchanged(table, opt, before)


def test_manifest_step_other_than_the_shards_is_refused_changing_nothing(tmp_path):
    table, opt = _trained()
    save_sharded(tmp_path, 1, table, opt)
    save_sharded(tmp_path, 2, table, opt)
    (tmp_path / "SHARDS.json").write_text(json.dumps(_manifest(step=1)))
    live, live_opt = _trained(seed=3)
    before = _snapshot(live, live_opt)
    with pytest.raises(CheckpointError, match="step 2"):
        restore_sharded(tmp_path, live, live_opt)
    _assert_unchanged(live, live_opt, before)


def _saved_on_two_ranks(root: Path, step: int, name: str) -> torch.Tensor:
    """What save_sharded writes on 2 ranks, made in one process; returns the full rows."""
    full = None
    for k in range(2):
        part = OffloadedEmbedding(len(range(k, ROWS, 2)), DIM, device="cpu", name=name)
        part_opt = OffloadOptimizer(O.Adam, part, lr=0.05)
        (part(torch.arange(part.num_embeddings)) ** 2).sum().backward()
        part_opt.step()
        CheckpointManager(root / f"rank{k}-of-2").save(step, table=part, opt=part_opt, rng=False)
        if full is None:
            full = torch.empty(ROWS, DIM)
        full[k::2] = part.weight.detach()
    (root / "SHARDS.json").write_text(json.dumps(_manifest(step=step, world=2)))
    return full


def test_resharded_restore_refuses_a_stale_shard_before_copying_any_row(tmp_path):
    table, opt = _trained()
    full = _saved_on_two_ranks(tmp_path, 5, table.shard.name)
    live, live_opt = _trained(seed=4)
    assert restore_sharded(tmp_path, live, live_opt) == 5      # 2 ranks onto 1
    assert torch.equal(live.shard.weight.detach(), full)
    # rank 1 moves on to step 6 (a save cut off before the manifest): refused, nothing copied
    part = OffloadedEmbedding(len(range(1, ROWS, 2)), DIM, device="cpu", name=table.shard.name)
    CheckpointManager(tmp_path / "rank1-of-2").save(
        6, table=part, opt=OffloadOptimizer(O.Adam, part, lr=0.05), rng=False)
    live, live_opt = _trained(seed=5)
    before = _snapshot(live, live_opt)
    with pytest.raises(CheckpointError, match="rank 1"):
        restore_sharded(tmp_path, live, live_opt)
    _assert_unchanged(live, live_opt, before)


_CHILD = """
import os, resource, sys, torch
from nbtools import OffloadOptimizer
from nbtools.distributed import ShardedEmbedding, restore_sharded
table = ShardedEmbedding(10, 4, device="cpu", name="t")
opt = OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
try:
    restore_sharded(sys.argv[1], table, opt)
except Exception as e:
    print("raised", type(e).__name__, e)
"""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero link"])
def test_fifo_or_device_is_refused_without_blocking_or_reading(tmp_path, kind):
    manifest = tmp_path / "SHARDS.json"
    if kind == "fifo":
        os.mkfifo(manifest)
    else:
        os.symlink("/dev/zero", manifest)
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHILD), str(tmp_path)],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"restore_sharded blocked on a {kind} at SHARDS.json")
    assert "raised CheckpointError" in done.stdout, done.stdout + done.stderr
    assert "SHARDS.json" in done.stdout


# --- CorpusLoader's saved state --------------------------------------------------------------------
def _loader():
    ids = torch.randint(0, 50, (2000,), generator=torch.Generator().manual_seed(0))
    return CorpusLoader(ids, batch_size=16, window=2, device="cpu", seed=1)


@pytest.mark.parametrize("key,value", [
    ("position", -1), ("position", -10**6), ("position", "len+1"), ("position", True),
    ("position", 1.5), ("position", "3"), ("position", None), ("epoch", -1),
    ("epoch", 2.0), ("seed", False), ("seed", "1")])
def test_corpus_loader_refuses_a_forged_state_changing_nothing(key, value):
    loader = _loader()
    state = loader.state_dict()
    state[key] = len(loader) + 1 if value == "len+1" else value
    next(iter(loader))                           # mid-epoch: position 1
    before = loader.state_dict()
    with pytest.raises(ValueError, match=key):
        loader.check_state_dict(state)
    with pytest.raises(ValueError, match=key):
        loader.load_state_dict(state)
    assert loader.state_dict() == before


def test_corpus_loader_accepts_its_own_positions():
    loader = _loader()
    for position in (0, 5, len(loader)):
        state = {**loader.state_dict(), "position": position}
        other = _loader()
        other.load_state_dict(state)
        assert other.position == position
    other.epoch = 3
    other.load_state_dict({**loader.state_dict(), "epoch": 2, "position": 0})
    assert (other.epoch, other.position) == (2, 0)


def test_checkpoint_restore_of_a_forged_loader_position_changes_nothing(tmp_path):
    loader = _loader()
    table = OffloadedEmbedding(5, 2, device="cpu", name="e")
    manager = CheckpointManager(tmp_path)
    forged = _loader()
    forged.position = -10**6
    manager.save(1, table=table, loader=forged, rng=False)
    with torch.no_grad():
        table.weight.add_(1)
    before_rows, before_state = table.weight.detach().clone(), loader.state_dict()
    with pytest.raises((ValueError, CheckpointError), match="position"):
        manager.restore(table=table, loader=loader, rng=False)
    assert torch.equal(table.weight.detach(), before_rows)
    assert loader.state_dict() == before_state


# --- wordsim.make_samples ------------------------------------------------------------------------
def test_make_samples_never_writes_through_planted_links(tmp_path):
    victim = _victim(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    names = ("wordsim353-sample.tsv", "simlex999-sample.txt", "questions-words-sample.txt")
    for name in names:
        os.symlink(victim, shared / name)
    make_samples(shared)
    clean = tmp_path / "clean" / "samples"
    make_samples(clean)
    assert victim.read_bytes() == VICTIM
    assert _mode(clean) == 0o700
    for name in names:
        assert not (shared / name).is_symlink() and _mode(shared / name) == 0o600
        assert (shared / name).read_bytes() == (clean / name).read_bytes()
