"""Warming from the start: ``warm_cache`` with counts or shares, and the models and the loader
that give a table its counts themselves.

The reference for what a warm cache holds is the counts' own order (``argsort``): the GPU
level takes the hottest rows, RAM the next; a lookup misses exactly the rows outside them.
"""
import tempfile

import numpy as np
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer, PinnedLoader
from nbtools.data import Ratings
from nbtools.devices import resolve_device
from nbtools.models import MatrixFactorization, MFConfig, SkipGram, SkipGramConfig
from nbtools.models.recommender import fit

DEVICE = resolve_device()
N, D = 300, 8


def _counts(seed=0):
    """Distinct counts (no ties: the order is the counts' alone), a sixth of the rows unused."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randperm(N, generator=g) + 1
    counts[torch.randperm(N, generator=g)[: N // 6]] = 0
    return counts


def _disk_table(tmp_path, name, **extra):
    return OffloadedEmbedding(N, D, name=name, device=DEVICE, placement="disk",
                              disk_dir=str(tmp_path), **extra)


def _in_ram(table) -> set:
    return {int(i) for i in table.disk.ram.id_of if i >= 0}


def _in_gpu_level(table) -> set:
    return {int(i) for i in np.flatnonzero(table.disk.above.slot_of >= 0)}


@pytest.mark.parametrize("scale", [1.0, 1e-3, 1e6])
def test_shares_warm_the_rows_their_counts_do(tmp_path, scale):
    """Frequencies summing to 1 (or to any other total) warm the same rows, in both levels,
    as the counts they came from: the hottest 30 in the GPU level, the next 40 in RAM."""
    counts = _counts()
    order = torch.argsort(counts, descending=True).tolist()
    got = []
    for name, given in (("counts", counts), ("shares", counts.double() / counts.sum() * scale)):
        t = _disk_table(tmp_path, name, cache_rows=30, host_cache_bytes=40 * 3 * D * 4)
        t.warm_cache(given)                          # kept until the optimizer attaches
        OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
        got.append((_in_gpu_level(t), _in_ram(t)))
    assert got[0] == (set(order[:30]), set(order[30:70]))
    assert got[1] == got[0]


def test_shares_warm_a_host_tables_cache_as_counts_do():
    counts = _counts(1)
    cached = []
    for given in (counts, counts.float() / counts.sum(), (counts.double() / counts.sum()).numpy(),
                  counts.tolist()):
        t = OffloadedEmbedding(N, D, device=DEVICE, cache_rows=64)
        OffloadOptimizer(torch.optim.Adam, t, lr=0.05)
        t.warm_cache(given)
        cached.append(t.cache.cached_rows())
        t(torch.arange(N, device=DEVICE))            # each cached row's slot is found again
    assert cached[0] > 0 and cached == [cached[0]] * 4


def test_a_warm_disk_table_misses_only_the_rows_outside_ram(tmp_path):
    """The first lookup of a warm table reads from disk only the ids that are not among the
    hottest rows RAM holds; a cold table reads every id."""
    ram_rows = 150                                   # more than a step's distinct rows
    counts = torch.arange(N, 0, -1)                  # row 0 the hottest
    g = torch.Generator().manual_seed(3)
    ids = (torch.rand(256, generator=g) ** 3 * N).long()     # mostly low (hot) ids
    unique = set(ids.tolist())
    misses = {}
    for warm in (False, True):
        t = _disk_table(tmp_path, f"warm={warm}", host_cache_bytes=ram_rows * D * 4)
        OffloadOptimizer(torch.optim.SGD, t, lr=0.1)
        if warm:
            t.warm_cache(counts)
        t(ids.to(DEVICE)).sum().backward()
        misses[warm] = t.disk.stats["misses"]
    assert misses[False] == len(unique)
    assert misses[True] == len(unique - set(range(ram_rows))) < misses[False]


@pytest.mark.parametrize("bad,error,match", [
    (torch.ones(N + 1), ValueError, r"shape \(300,\)"),
    (torch.ones(N, 1), ValueError, r"shape \(300,\)"),
    (torch.full((N,), -1), ValueError, "must be >= 0.*row 0 is -1"),
    (torch.tensor([1.0] * (N - 1) + [float("nan")]), ValueError, "finite; row 299 is nan"),
    (torch.tensor([1.0] * (N - 1) + [float("inf")]), ValueError, "finite; row 299 is inf"),
    (torch.ones(N, dtype=torch.bool), TypeError, "integer counts or float shares"),
    ({i: 1 for i in range(N)}, TypeError, "tensor, numpy array or list.*got dict"),
    ("counts", TypeError, "got str"),
    (["a"] * N, TypeError, "numbers"),
])
def test_warm_cache_refuses_what_is_not_counts(bad, error, match):
    t = OffloadedEmbedding(N, D, device=DEVICE, cache_rows=64)
    with pytest.raises(error, match=match):
        t.warm_cache(bad)


def test_loader_id_counts_count_every_sample_of_a_column():
    g = torch.Generator().manual_seed(4)
    users = torch.randint(0, 50, (3_000_000,), generator=g, dtype=torch.int32)   # > 1M ids
    items = torch.randint(0, 7, (3_000_000, 2), generator=g)
    loader = PinnedLoader(users, items, batch_size=1024, device="cpu")
    values, freq = np.unique(users.numpy(), return_counts=True)
    want = np.zeros(60, dtype=np.int64)
    want[values] = freq
    assert loader.id_counts(0, 60).tolist() == want.tolist()
    assert loader.id_counts(1, 7).tolist() == np.bincount(items.numpy().ravel()).tolist()
    with pytest.raises(ValueError, match="outside 0..39"):
        loader.id_counts(0, 40)
    with pytest.raises(ValueError, match="column must be"):
        loader.id_counts(2, 60)
    with pytest.raises(TypeError, match="not ids"):
        PinnedLoader(torch.rand(10), batch_size=2, device="cpu").id_counts(0, 5)


@pytest.fixture
def default_disk_dir(tmp_path, monkeypatch):
    """Disk tables the models make go under tmp_path (their default folder is the system's
    temporary one)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


@pytest.mark.parametrize("warm", [True, False])
def test_skipgram_warms_both_tables_from_its_counts(default_disk_dir, warm):
    counts = _counts(5)
    cfg = SkipGramConfig(placement="disk") if warm else SkipGramConfig(placement="disk",
                                                                       warm=False)
    model = SkipGram(N, D, counts=counts, config=cfg, device=DEVICE)
    OffloadOptimizer(torch.optim.Adagrad, model, lr=0.1)
    used = set(torch.nonzero(counts).view(-1).tolist())    # RAM holds every row of a small table
    for table in (model.input, model.output):
        assert _in_ram(table) == (used if warm else set())


@pytest.mark.parametrize("warm", [True, False])
def test_fit_warms_the_tables_from_the_interactions(default_disk_dir, warm):
    """A warm model's epoch reads nothing from disk: every user and item it trains on is in
    RAM already; a cold one reads each once (at its lookup, or read ahead of it)."""
    g = torch.Generator().manual_seed(6)
    users, items = torch.randint(0, 40, (200,), generator=g), torch.randint(0, 30, (200,),
                                                                            generator=g)
    train = Ratings(users, items, torch.randint(1, 6, (200,), generator=g).float(), 40, 30)
    model = MatrixFactorization(40, 30, 4, config=MFConfig(placement="disk", warm=warm),
                                device=DEVICE)
    fit(model, train, epochs=1, batch_size=32)
    for table, ids in ((model.users, users), (model.items, items)):
        stats = table.disk.stats                    # read at a lookup, or ahead of it
        assert stats["misses"] + stats["ahead_hits"] == (0 if warm else len(set(ids.tolist())))
