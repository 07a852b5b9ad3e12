"""The whole-table face of a table's tier (``table.rows.whole()``): rows read and written as
stored, and the rows changed since a checkpoint mark, for every placement and tier stack.

References: the rows as ``state_dict()`` hands them out (weights and each optimizer state,
laid side by side as a row stores them), and the set of ids the training steps looked up,
kept in Python."""
import numpy as np
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer

N, D = 300, 4
STACKS = {
    "host": {},
    "host-write-behind": {"write_behind": True},
    "host-cached": {"cache_rows": 32},
    "gpu": {"placement": "gpu"},
    "disk": {"placement": "disk", "host_cache_bytes": 40 * 3 * D * 4},
}


def _table(stack, device, tmp_path, padding_idx=None):
    opts = dict(STACKS[stack])
    if stack == "gpu" and device.type != "cuda":
        pytest.skip("the GPU placement needs a CUDA device")
    if opts.get("placement") == "disk":
        opts["disk_dir"] = str(tmp_path)
    t = OffloadedEmbedding(N, D, name="emb", device=device, padding_idx=padding_idx, **opts)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
    with torch.no_grad():
        t.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(0)))
    return t, opt


def _step(t, opt, ids):
    t(torch.as_tensor(ids, device=t.device)).sum().backward()
    opt.step()
    opt.zero_grad()


def _stored(t, opt) -> np.ndarray:
    """Every row as stored, ``[weight | exp_avg | exp_avg_sq]``, from the state dicts."""
    w = t.state_dict()["weight"]
    st = opt.state_dict()["tables"]["emb"]["row_state"]
    cols = [w] + [st[k] for k in t.state_names]
    return torch.cat([c.cpu() for c in cols], 1).contiguous().view(torch.uint8).numpy()


@pytest.mark.parametrize("stack", list(STACKS))
def test_changed_rows_are_the_rows_the_steps_trained(stack, device, tmp_path):
    t, opt = _table(stack, device, tmp_path, padding_idx=7)
    face = t.rows.whole()
    assert face.changed_since("a") is None           # no mark yet: every row counts
    face.mark_checkpointed("a")
    assert face.changed_since("a") == 0 and face.changed_since("b") is None
    rng = np.random.default_rng(1)
    touched = set()
    for _ in range(4):
        ids = rng.integers(0, N, 25)
        ids[0] = 7                                   # the padding row is never written
        _step(t, opt, ids)
        touched |= set(ids.tolist()) - {7}
    face = t.rows.whole()
    assert face.changed_since("a") == len(touched)
    got = np.concatenate([face.changed_ids(a, min(N, a + 100)) for a in range(0, N, 100)])
    assert got.tolist() == sorted(touched)
    with torch.no_grad():                            # evaluation lookups change nothing
        t(torch.arange(N, device=t.device))
    assert t.rows.whole().changed_since("a") == len(touched)
    _ = t.weight                                     # handed out writable: every row may change
    assert t.rows.whole().changed_since("a") == N


@pytest.mark.parametrize("stack", list(STACKS))
def test_rows_read_and_written_as_stored(stack, device, tmp_path):
    t, opt = _table(stack, device, tmp_path)
    _step(t, opt, [1, 5, 9, 5, 200])
    want = _stored(t, opt)
    face = t.rows.whole()
    assert (face.num_rows, face.row_bytes) == (N, want.shape[1])
    out = np.zeros_like(want)
    face.read_bytes(0, out[:100])
    face.read_bytes(100, out[100:])
    assert np.array_equal(out, want)
    ids = np.array([0, 5, 9, 299])
    some = np.zeros((4, want.shape[1]), np.uint8)
    face.copy_rows(ids, some)
    assert np.array_equal(some, want[ids])
    # every row rewritten through the face (as a restore does): the state dicts read it back
    new = np.random.default_rng(2).standard_normal((N, want.shape[1] // 4)).astype(np.float32)
    new = new.view(np.uint8)
    face = t.rows.whole(writes=True)
    face.discard_cache()
    face.mark_checkpointed("x")
    face.write_bytes(0, new[:150])
    face.write_records(np.arange(299, 149, -1), new[150:][::-1].copy())
    assert np.array_equal(_stored(t, opt), new)
    assert t.rows.whole().changed_since("x") == N
