"""A plain loop over a PinnedLoader reads a disk table's coming batches ahead by itself
(nbtools.engine.ahead): the same results as the table in host RAM, and each lookup takes the
deduplication its read-ahead made (none of its own) across epochs."""
import torch

import nbtools
from nbtools import OffloadedEmbedding, OffloadOptimizer, PinnedLoader
from nbtools.devices import resolve_device
from nbtools.engine import ahead
from nbtools.testing import assert_same_rows

DEVICE = resolve_device()
N, D = 2000, 8


def _data(samples=6000):
    g = torch.Generator().manual_seed(0)
    ids = ((torch.rand(samples, generator=g) ** 3) * N).long()       # skewed: hot rows
    return ids, torch.randn(samples, generator=g)


def _train(tmp_path, placement, loop, epochs=2, **kw):
    torch.manual_seed(0)
    extra = dict(disk_dir=str(tmp_path), host_cache_bytes=400 * 3 * D * 4) \
        if placement == "disk" else {}
    t = OffloadedEmbedding(N, D, name="t", device=DEVICE, placement=placement, **extra, **kw)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.01)
    loader = PinnedLoader(*_data(), batch_size=500, device=DEVICE, seed=3)
    for _ in range(epochs):
        for b, (ids, y) in enumerate(loader):
            ((t(loop(ids)).sum(1) - y) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return t


def test_a_plain_loop_reads_ahead_and_trains_as_host(tmp_path, monkeypatch):
    from nbtools.disk import store
    own = []
    real = store.prepare
    monkeypatch.setattr(store, "prepare", lambda *a, **k: own.append(1) or real(*a, **k))
    on_disk = _train(tmp_path, "disk", lambda ids: ids)
    stats = on_disk.disk.stats
    assert stats["read_ahead"] > 0 and stats["ahead_hits"] > 0
    # only the first batch of the run was deduplicated by its lookup: every later one (the
    # second epoch's too) by the read-ahead started ahead of it
    assert len(own) == 1
    assert_same_rows(_train(tmp_path, "host", lambda ids: ids), on_disk)


def test_ids_that_are_not_the_loaders_tensor_are_looked_up_as_they_come(tmp_path):
    t = _train(tmp_path, "disk", lambda ids: ids + 0, epochs=1)
    assert t.disk.stats["read_ahead"] == 0


def test_a_loop_that_prefetches_itself_is_left_to_it(tmp_path):
    torch.manual_seed(0)
    t = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                           host_cache_bytes=400 * 3 * D * 4)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.01)
    loader = PinnedLoader(*_data(), batch_size=500, device=DEVICE, seed=3, shuffle=False)
    batches = list(_data()[0].split(500))
    for b, (ids, y) in enumerate(loader):
        if b + 1 < len(batches):
            t.prefetch(batches[b + 1])
        t(ids).sum().backward()
        opt.step()
        opt.zero_grad()
    # one read-ahead a step (its own), none started by the loader's batches
    assert 0 < t.disk.stats["read_ahead"]
    assert ahead.reads_ahead_itself(t.lookups)


def test_coming_is_the_batch_the_loop_gets():
    ids, y = _data(1234)
    loader = PinnedLoader(ids, y, batch_size=100, device="cpu", seed=5)
    got = [b for b, _ in loader] + [b for b, _ in loader]
    nb = len(loader)
    for p, batch in enumerate(got):
        assert torch.equal(loader.coming(p // nb, p % nb, 0), batch)
    assert loader.coming(0, nb, 0) is None
