"""The two models of nbtools.models trained data-parallel (2 gloo ranks; 2 and 4 CUDA GPUs over
NCCL where there are): word2vec (SkipGram over a CorpusLoader slice, through models.train) and
the recommender (MatrixFactorization with an NCF head, through fit), built in the process
group so that their tables are ShardedEmbedding, against one process trained on the
concatenation of the ranks' batches; and word2vec resumed from per-rank checkpoints against an
uninterrupted run."""
import numpy as np
import pytest
import torch

import nbtools
from nbtools.data import Ratings
from nbtools.distributed import ShardedEmbedding, data_parallel, spawn
from nbtools.models import (CorpusLoader, MatrixFactorization, MFConfig, SkipGram,
                            SkipGramConfig, TrainConfig, evaluate_rmse, fit, train)

VOCAB, DIM, B = 30, 8, 64                  # word2vec: words, vector size, pairs per rank
USERS, ITEMS, MF_B = 12, 15, 8             # recommender: 8 interactions per rank per step


def _corpus():
    """1,000 tokens, Zipf-like, with sentence breaks; cut into pieces of 400 tokens."""
    g = torch.Generator().manual_seed(11)
    p = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    ids = torch.multinomial(p, 1000, replacement=True, generator=g)
    ids[::97] = -1
    return ids, torch.bincount(ids[ids >= 0], minlength=VOCAB)


def _loader(rank, world, device, batch=B):
    ids, counts = _corpus()
    return CorpusLoader(ids, batch, window=3, seed=2, device=device, chunk_tokens=400,
                        keep_prob=nbtools.models.keep_probabilities(counts, 0.05),
                        rank=rank, world=world)


def _skipgram(device, seed=5):
    return SkipGram(VOCAB, DIM, counts=_corpus()[1], device=device,
                    config=SkipGramConfig(negatives=3, seed=seed, placement="host"))


def _ratings(n, seed):
    g = torch.Generator().manual_seed(seed)
    return Ratings(torch.randint(0, USERS, (n,), generator=g),
                   torch.randint(0, ITEMS, (n,), generator=g),
                   torch.randint(1, 6, (n,), generator=g).float(), USERS, ITEMS)


def _mf(device):
    model = MatrixFactorization(USERS, ITEMS, 4, device=device,
                                config=MFConfig(mlp_hidden=(6,), seed=3))
    g = torch.Generator().manual_seed(7)
    for table in (model.users, model.items):           # the same rows on every world size
        full = torch.randn(table.num_embeddings, 5, generator=g) * 0.1
        if isinstance(table, ShardedEmbedding):
            table.load_full_weight(full)
        else:
            with torch.no_grad():
                table.weight.copy_(full)
    return model


def _fit_mf(model, world, batch=MF_B):
    # 4 global batches an epoch on any world size: the same samples seen
    fit(model, _ratings(4 * MF_B * world, 1), epochs=2, batch_size=batch, lr=0.01,
        lr_final=0.005, seed=4)
    return evaluate_rmse(model, *_ratings(20, 2)[:3])  # lookups: every rank calls it


def _full(table):
    w = table.gather_full() if isinstance(table, ShardedEmbedding) else table.weight
    # NumPy: it travels back from a rank by value (a tensor would by shared memory)
    return w.detach().float().cpu().numpy().copy()


def _dense(model):
    return [p.detach().float().cpu().numpy().copy() for n, p in model.named_parameters()
            if "users" not in n and "items" not in n]


def job(rank, world, device, ckpt):
    """On each rank: word2vec straight through 2 epochs; again, stopped after one epoch and
    resumed from its checkpoints in new objects built from another seed; the recommender."""
    device = f"cuda:{rank}" if device == "cuda" else device
    cfg = TrainConfig(every=8, progress=False)

    def w2v(seed=5):
        model = data_parallel(_skipgram(device, seed))
        assert isinstance(model.input, ShardedEmbedding) and model.input.world == world
        return model, nbtools.OffloadOptimizer(torch.optim.Adam, model, lr=0.05), \
            _loader(rank, world, device)

    model, opt, loader = w2v()
    train(model, loader, opt, epochs=2, config=cfg)
    whole = (model.vectors().numpy(), _full(model.output))
    manager = nbtools.CheckpointManager(f"{ckpt}/rank{rank}")
    model, opt, loader = w2v()
    train(model, loader, opt, epochs=1, config=cfg, checkpoints=manager)
    model, opt, loader = w2v(seed=50)                  # only a restore gives the right rows
    train(model, loader, opt, epochs=2, config=cfg, checkpoints=manager)
    resumed = (model.vectors().numpy(), _full(model.output))
    try:
        model.most_similar(3)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    mf = _mf(device)
    rmse = _fit_mf(mf, world)
    return whole, resumed, refused, (_full(mf.users), _full(mf.items), _dense(mf), rmse)


def _single_w2v(world, device):
    """One process, one table, on the concatenation of the ranks' batches."""
    model = _skipgram(device)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, model, lr=0.05)
    loaders = [_loader(r, world, device) for r in range(world)]
    for _ in range(2):
        for parts in zip(*loaders):
            model.loss(*(torch.cat(t) for t in zip(*parts))).backward()
            opt.step()
            opt.zero_grad()
    return model.vectors().numpy(), _full(model.output)


def _single_mf(world, device):
    """One process on batches of ``world * MF_B``: the ranks' batches together."""
    mf = _mf(device)
    rmse = _fit_mf(mf, world, batch=world * MF_B)
    return _full(mf.users), _full(mf.items), _dense(mf), rmse


def _close(a, b, tol):
    for x, y in zip(a, b):
        if isinstance(x, list):
            _close(x, y, tol)
        else:
            assert np.abs(np.asarray(x) - np.asarray(y)).max() <= tol, \
                np.abs(np.asarray(x) - np.asarray(y)).max()


def _ranks(world, device, tmp, backend="gloo"):
    try:
        return spawn(job, world, args=(device, str(tmp)), timeout=240, backend=backend)
    except TimeoutError as e:
        pytest.fail(str(e))


def _check(got, world, device, tol):
    """Each rank's runs against one process on ``device`` trained on the ranks' batches."""
    one_w2v, one_mf = _single_w2v(world, device), _single_mf(world, device)
    assert np.abs(one_w2v[1]).max() > 1e-2            # trained: output vectors start at zero
    assert np.abs(one_mf[1] - _full(_mf("cpu").items)).max() > 1e-3
    for rank, (whole, resumed, refused, mf) in enumerate(got):
        _close(whole, one_w2v, tol)                  # word2vec, through models.train
        assert all(np.array_equal(x, y) for x, y in zip(whole, resumed)), \
            f"rank {rank}: the resumed word2vec run differs from the uninterrupted one"
        assert "split over" in refused and "vectors()" in refused, refused
        _close(mf, one_mf, tol)                      # the recommender, through fit


def test_models_trained_on_two_ranks_equal_one_process(tmp_path):
    """word2vec on 2 ranks equals one process on the ranks' batches together, and resumed from
    per-rank checkpoints equals itself uninterrupted; the recommender (its tables sharded, its
    NCF head and global bias in DDP) fitted on 2 ranks equals one process; a sharded SkipGram
    refuses a lookup by word. One start of the processes for all."""
    _check(_ranks(2, "cpu", tmp_path), 2, "cpu", 1e-6)


def test_corpus_loader_ranks_split_every_global_batch():
    whole = _loader(0, 1, "cpu", batch=2 * B)
    parts = [_loader(r, 2, "cpu") for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(whole)
    got = list(zip(whole, *parts))
    for i, ((gc, gx), (ac, ax), (bc, bx)) in enumerate(got):
        assert ac.numel() == bc.numel()
        n = ac.numel() + bc.numel()
        assert torch.equal(gc[:n], torch.cat((ac, bc))) and torch.equal(gx[:n], torch.cat((ax, bx)))
        assert n == gc.numel() or i == len(got) - 1     # the last one: at most 1 pair left out
    assert gc.numel() - n < 2
    with pytest.raises(ValueError, match="rank"):
        _loader(2, 2, "cpu")
    with pytest.raises(ValueError, match="cannot resume"):
        parts[0].load_state_dict(parts[1].state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(n, marks=pytest.mark.gpus(n)) for n in (2, 4)])
def test_nccl_models_train_as_one_process(world, tmp_path):
    """One rank a GPU over NCCL (2 and 4 CUDA GPUs): the same checks
    against one process on cuda:0."""
    _check(_ranks(world, "cuda", tmp_path, backend="nccl"), world, "cuda", 1e-5)
