"""Data-parallel training on gloo: two ranks, each on its own slice of every batch
(PinnedLoader rank/world), tables sharded (ShardedEmbedding), the dense head in
DistributedDataParallel (nbtools.distributed.data_parallel), the shared training loop
(nbtools.models.train) with checkpoints; against one process trained on the whole batches
(their concatenation, a mean loss), and against itself resumed from a checkpoint."""
import numpy as np
import pytest
import torch
from torch import nn

import nbtools
from nbtools import OffloadedEmbedding, OffloadOptimizer, PinnedLoader
from nbtools.distributed import ShardedEmbedding, data_parallel, spawn
from nbtools.models import TrainConfig, train

ROWS, DIM, B, SAMPLES = 40, 4, 6, 7 * 12 + 5       # 7 global batches of 12 (5 samples left over)


class Net(nn.Module):
    def __init__(self, table):
        super().__init__()
        self.table = table
        self.head = nn.Sequential(nn.Linear(DIM, 1))

    def loss(self, ids, y):
        return (self.head(self.table(ids)).squeeze(-1) - y).pow(2).mean()


class Stray(nn.Module):
    """A table and a parameter of its own beside it: data_parallel cannot wrap that."""

    def __init__(self):
        super().__init__()
        self.table = ShardedEmbedding(ROWS, DIM, device="cpu")
        self.scale = nn.Parameter(torch.ones(1))


def _data():
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, ROWS, (SAMPLES,), generator=g), torch.randn(SAMPLES, generator=g)


def _model(table, seed=3):
    torch.manual_seed(seed - 1)
    net = Net(table)
    w = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed))
    if isinstance(table, ShardedEmbedding):
        table.load_full_weight(w)
    else:
        with torch.no_grad():
            table.weight.copy_(w)
    return net


def _result(net):
    table = net.table
    full = table.gather_full() if isinstance(table, ShardedEmbedding) else table.weight.clone()
    head = net.head.module if hasattr(net.head, "module") else net.head
    # NumPy arrays: they travel back from a rank by value (a tensor would by shared memory)
    return full.numpy().copy(), [p.detach().numpy().copy() for p in head.parameters()]


def _build(rank, world, seed=3):
    net = data_parallel(_model(ShardedEmbedding(ROWS, DIM, name="t", device="cpu"), seed))
    opt = OffloadOptimizer(torch.optim.Adam, net, lr=0.05)
    loader = PinnedLoader(*_data(), batch_size=B, device="cpu", seed=1, rank=rank, world=world)
    return net, opt, loader


def job(rank, world, epochs, ckpt):
    """Two runs on each rank: one straight through ``epochs``, and one stopped after the first
    epoch (checkpoints every 3 steps) and resumed in new objects from its checkpoints."""
    cfg = TrainConfig(every=3, progress=False)
    net, opt, loader = _build(rank, world)
    train(net, loader, opt, epochs=epochs, config=cfg)
    whole = _result(net)
    manager = nbtools.CheckpointManager(f"{ckpt}/rank{rank}")
    net, opt, loader = _build(rank, world)
    train(net, loader, opt, epochs=1, config=cfg, checkpoints=manager)
    # built anew (with other initial weights: only the restore can give the right rows)
    net, opt, loader = _build(rank, world, seed=30)
    train(net, loader, opt, epochs=epochs, config=cfg, checkpoints=manager)
    try:
        data_parallel(Stray())
        refused = ""
    except ValueError as e:
        refused = str(e)
    return whole, _result(net), refused


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both runs on 2 ranks, one start of the processes for the tests below."""
    try:
        return spawn(job, 2, args=(2, str(tmp_path_factory.mktemp("ckpt"))), timeout=120)
    except TimeoutError as e:
        pytest.fail(str(e))


def _single(epochs):
    net = _model(OffloadedEmbedding(ROWS, DIM, name="t", device="cpu"))
    opt = OffloadOptimizer(torch.optim.Adam, net, lr=0.05)
    loader = PinnedLoader(*_data(), batch_size=2 * B, device="cpu", seed=1, drop_last=True)
    train(net, loader, opt, epochs=epochs, config=TrainConfig(progress=False))
    return _result(net)


def _close(a, b):
    (ta, ha), (tb, hb) = a, b
    assert np.abs(ta - tb).max() <= 1e-6, np.abs(ta - tb).max()
    for x, y in zip(ha, hb):
        assert np.abs(x - y).max() <= 1e-6, np.abs(x - y).max()


def test_two_ranks_train_as_one_process_on_the_whole_batches(ranks):
    one = _single(2)
    for whole, _, _ in ranks:
        _close(whole, one)
    # and it trained: the rows differ from the start
    start = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)).numpy()
    assert np.abs(one[0] - start).max() > 1e-2


def test_a_resumed_data_parallel_run_equals_an_uninterrupted_one(ranks):
    for whole, resumed, _ in ranks:
        assert np.array_equal(whole[0], resumed[0])
        assert all(np.array_equal(x, y) for x, y in zip(whole[1], resumed[1]))


def test_parameters_beside_a_table_are_named(ranks):
    for _, _, refused in ranks:
        assert "['scale']" in refused and "submodule" in refused, refused


def test_loader_ranks_split_every_global_batch():
    ids, y = _data()
    whole = PinnedLoader(ids, y, batch_size=2 * B, device="cpu", seed=1, drop_last=True)
    parts = [PinnedLoader(ids, y, batch_size=B, device="cpu", seed=1, rank=r, world=2)
             for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole) == 7
    for (g, _), (a, _), (b, _) in zip(whole, *parts):
        assert torch.equal(g, torch.cat((a, b)))
    with pytest.raises(ValueError, match="rank"):
        PinnedLoader(ids, batch_size=B, device="cpu", rank=2, world=2)
    with pytest.raises(ValueError, match="cannot resume"):
        parts[0].load_state_dict({**parts[1].state_dict()})


def test_in_one_process_data_parallel_and_init_change_nothing(monkeypatch):
    net = Net(OffloadedEmbedding(ROWS, DIM, device="cpu"))
    assert data_parallel(net) is net and isinstance(net.head, nn.Sequential)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert nbtools.distributed.init() == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert nbtools.distributed.init() == (0, 1)
