"""Models and the training loop, each against the obvious dense reference."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nbtools import OffloadOptimizer, PinnedLoader
from nbtools.checkpoint import CheckpointConfig, CheckpointManager
from nbtools.models import (MatrixFactorization, MFConfig, SkipGram, SkipGramConfig,
                            evaluate_rmse, keep_probabilities, pairs_from_corpus, train)


def _dense_sgns_loss(emb_in, emb_out, centers, contexts, negatives):
    v = emb_in(centers)
    pos = (emb_out(contexts) * v).sum(-1)
    neg = (emb_out(negatives) * v.unsqueeze(1)).sum(-1)
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg).sum(-1)).mean()


# --- SGNS ------------------------------------------------------------------------------------

def test_sgns_loss_and_update_match_dense(device):
    torch.manual_seed(0)
    vocab, dim = 12, 6
    model = SkipGram(vocab, dim, counts=torch.arange(1, vocab + 1), device=device)
    w_in, w_out = torch.randn(vocab, dim), torch.randn(vocab, dim) * 0.5
    model.input.weight.copy_(w_in)
    model.output.weight.copy_(w_out)
    ref_in = nn.Embedding.from_pretrained(w_in.clone(), freeze=False).to(device)
    ref_out = nn.Embedding.from_pretrained(w_out.clone(), freeze=False).to(device)
    # duplicates on purpose: a repeated id must get the sum of its gradients
    centers = torch.tensor([1, 1, 3, 5, 7, 1], device=device)
    contexts = torch.tensor([2, 3, 3, 4, 1, 2], device=device)
    negatives = torch.tensor([[0, 2, 9], [11, 11, 0], [1, 3, 5], [2, 2, 2], [7, 8, 9], [3, 4, 3]],
                             device=device)

    loss = model.loss(centers, contexts, negatives)
    ref = _dense_sgns_loss(ref_in, ref_out, centers, contexts, negatives)
    torch.testing.assert_close(loss, ref)

    opt = OffloadOptimizer(torch.optim.SGD, model, lr=0.5)
    ref_opt = torch.optim.SGD([ref_in.weight, ref_out.weight], lr=0.5)
    loss.backward()
    ref.backward()
    opt.step()
    ref_opt.step()
    # (on CUDA the tables are small enough for placement="auto" to put them on the GPU)
    torch.testing.assert_close(model.input.weight.cpu(), ref_in.weight.detach().cpu())
    torch.testing.assert_close(model.output.weight.cpu(), ref_out.weight.detach().cpu())
    assert not torch.equal(model.input.weight.cpu(), w_in)        # something did change


def test_negative_sampler_follows_unigram_three_quarters():
    counts = torch.tensor([0.0] + [1000.0 / (r + 1) for r in range(49)])   # Zipf, one unused word
    model = SkipGram(50, 4, counts=counts, config=SkipGramConfig(seed=3), device="cpu")
    n = 200_000
    draws = model.sample_negatives(n)
    assert draws.shape == (n,) and draws.dtype == torch.int64
    observed = torch.bincount(draws, minlength=50).double()
    assert observed[0] == 0                                  # a word with count 0 is never noise
    p = counts.double() ** 0.75
    expected = n * p / p.sum()
    chi2 = ((observed[1:] - expected[1:]) ** 2 / expected[1:]).sum().item()
    dof = 48
    assert chi2 < dof + 6 * math.sqrt(2 * dof), chi2          # far tail of chi-square(48)
    # deterministic: the same seed gives the same negatives, another seed others
    again = SkipGram(50, 4, counts=counts, config=SkipGramConfig(seed=3), device="cpu")
    assert torch.equal(again.sample_negatives(n), draws)
    other = SkipGram(50, 4, counts=counts, config=SkipGramConfig(seed=4), device="cpu")
    assert not torch.equal(other.sample_negatives(n), draws)


def test_generator_state_travels_with_state_dict():
    model = SkipGram(20, 4, device="cpu")
    model.sample_negatives(100)
    state = model.state_dict()
    expected = model.sample_negatives(7, 3)
    other = SkipGram(20, 4, config=SkipGramConfig(seed=99), device="cpu")
    other.load_state_dict(state)
    assert torch.equal(other.sample_negatives(7, 3), expected)


def _naive_pairs(ids, window, radius=None):
    pairs = []
    n = len(ids)
    for i in range(n):
        if ids[i] < 0:
            continue
        r = window if radius is None else radius[i]
        for j in range(max(0, i - r), min(n, i + r + 1)):
            if j == i or ids[j] < 0:
                continue
            lo, hi = min(i, j), max(i, j)
            if any(ids[m] < 0 for m in range(lo, hi)):      # a sentence break in between
                continue
            pairs.append((ids[i], ids[j]))
    return sorted(pairs)


def _as_sorted(centers, contexts):
    return sorted(zip(centers.tolist(), contexts.tolist()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pairs_match_a_naive_loop(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (60,), generator=g)
    ids[torch.randint(0, 60, (4,), generator=g)] = -1          # sentence breaks
    for window in (1, 3):
        got = pairs_from_corpus(ids, window, dynamic=False, dtype=torch.int64)
        assert _as_sorted(*got) == _naive_pairs(ids.tolist(), window)

    # dynamic windows: one radius per token, drawn first from the generator
    got = pairs_from_corpus(ids, 4, generator=torch.Generator().manual_seed(7))
    assert got[0].dtype == torch.int32
    radius = torch.randint(1, 5, (60,), generator=torch.Generator().manual_seed(7)).tolist()
    assert _as_sorted(*got) == _naive_pairs(ids.tolist(), 4, radius)

    # subsampling: one uniform per token first, then the radii of the kept tokens
    keep = torch.rand(9, generator=g)
    got = pairs_from_corpus(ids, 2, keep_prob=keep, generator=torch.Generator().manual_seed(5))
    g2 = torch.Generator().manual_seed(5)
    u = torch.rand(60, generator=g2)
    kept = [t for t, x in zip(ids.tolist(), u.tolist()) if t < 0 or x < keep[t]]
    radius = torch.randint(1, 3, (len(kept),), generator=g2).tolist()
    assert _as_sorted(*got) == _naive_pairs(kept, 2, radius)


def test_pairs_edge_cases():
    empty = pairs_from_corpus(torch.tensor([4]), 3)
    assert empty[0].numel() == 0 and empty[1].numel() == 0
    with pytest.raises(TypeError, match="1-D integer"):
        pairs_from_corpus(torch.tensor([1.0, 2.0]), 2)
    with pytest.raises(ValueError, match="window"):
        pairs_from_corpus(torch.tensor([1, 2]), 0)


def test_keep_probabilities_follow_word2vec():
    counts = torch.tensor([600, 30, 3, 0])
    keep = keep_probabilities(counts, threshold=1e-2)
    z = counts.double() / counts.sum()
    expected = ((z[:2] / 1e-2).sqrt() + 1) * 1e-2 / z[:2]
    torch.testing.assert_close(keep[:2].double(), expected.clamp(max=1), rtol=1e-6, atol=0)
    assert keep[2:].tolist() == [1.0, 1.0]


def test_most_similar_and_analogy_equal_dense():
    torch.manual_seed(1)
    words = [f"w{i}" for i in range(40)]
    model = SkipGram(40, 5, words=words, device="cpu")
    model.input.weight.copy_(torch.randn(40, 5))
    unit = F.normalize(model.input.weight.clone(), dim=1)

    sims = unit @ unit[7]
    sims[7] = -math.inf
    scores, ids = sims.topk(6)
    got = model.most_similar("w7", k=6, chunk_rows=9)    # chunks that do not divide 40
    assert [w for w, _ in got] == [words[i] for i in ids]
    torch.testing.assert_close(torch.tensor([s for _, s in got]), scores)
    assert [w for w, _ in model.most_similar(7, k=6)] == [w for w, _ in got]

    query = unit[3] - unit[1] + unit[2]
    sims = unit @ F.normalize(query, dim=0)
    sims[[1, 3, 2]] = -math.inf
    got = model.analogy("w1", "w3", "w2", k=4, chunk_rows=16)
    assert [w for w, _ in got] == [words[i] for i in sims.topk(4).indices]

    with pytest.raises(KeyError, match="not in the vocabulary"):
        model.most_similar("nope")


# --- recommender -----------------------------------------------------------------------------

def _low_rank_ratings(num_users=120, num_items=90, rank=3, n=5000, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(num_users, rank, generator=g)
    v = torch.randn(num_items, rank, generator=g)
    bu = 0.3 * torch.randn(num_users, generator=g)
    bi = 0.3 * torch.randn(num_items, generator=g)
    users = torch.randint(0, num_users, (n,), generator=g)
    items = torch.randint(0, num_items, (n,), generator=g)
    ratings = 3.0 + (u[users] * v[items]).sum(1) + bu[users] + bi[items] \
        + 0.1 * torch.randn(n, generator=g)
    return users, items, ratings


@pytest.mark.parametrize("mlp_hidden", [(), (16,)])
def test_mf_training_lowers_rmse(device, mlp_hidden):
    torch.manual_seed(0)
    users, items, ratings = _low_rank_ratings()
    split = 4500
    model = MatrixFactorization(120, 90, 8, config=MFConfig(mlp_hidden=mlp_hidden),
                                device=device)
    model.set_global_bias(ratings[:split])
    before = evaluate_rmse(model, users[split:], items[split:], ratings[split:])
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.05)
    loader = PinnedLoader(users[:split], items[:split], ratings[:split], batch_size=256,
                          device=device)
    # 8 epochs of 18 steps: after / before is 0.17 (no MLP) and 0.25-0.29 (MLP) over seeds 0-2
    history = train(model, loader, opt, epochs=8, progress=False)
    after = evaluate_rmse(model, users[split:], items[split:], ratings[split:])
    assert history["loss"][-1] < history["loss"][0]
    assert after < 0.6 * before, (before, after)


def test_recommend_equals_dense_scoring():
    torch.manual_seed(2)
    model = MatrixFactorization(5, 30, 4, config=MFConfig(mlp_hidden=(6,)), device="cpu")
    model.users.weight.copy_(torch.randn(5, 5))
    model.items.weight.copy_(torch.randn(30, 5))
    with torch.no_grad():
        for p in model.mlp.parameters():
            p.copy_(torch.randn_like(p))
        all_scores = model.predict(torch.full((30,), 2), torch.arange(30))
    seen = torch.tensor([0, 5, 6])
    dense = all_scores.clone()
    dense[seen] = -math.inf
    ids, scores = model.recommend(2, k=4, exclude=seen, chunk_items=7)
    assert ids.tolist() == dense.topk(4).indices.tolist()
    torch.testing.assert_close(scores, dense.topk(4).values)
    ids, _ = model.recommend(2, k=50)                     # k larger than the catalogue
    assert sorted(ids.tolist()) == list(range(30))


def test_predict_clamps_to_rating_range():
    model = MatrixFactorization(2, 2, 2, config=MFConfig(rating_range=(1.0, 5.0)), device="cpu")
    with torch.no_grad():
        model.global_bias.fill_(9.0)
    assert model.predict([0, 1], [1, 0]).tolist() == [5.0, 5.0]
    assert evaluate_rmse(model, [0], [0], [4.0]) == pytest.approx(1.0)


# --- the loop --------------------------------------------------------------------------------

class _Recorder:
    """Dashboard stand-in: counts samples; raises at one step to simulate a disconnect."""

    def __init__(self, fail_at=None):
        self.samples, self.steps, self.fail_at = 0, 0, fail_at

    def step(self, n):
        self.steps += 1
        self.samples += n
        if self.steps == self.fail_at:
            raise ConnectionError("runtime disconnected")


def _w2v_setup(seed):
    torch.manual_seed(seed)     # initial tables differ per run: the restore must overwrite them
    ids = torch.randint(0, 30, (300,), generator=torch.Generator().manual_seed(0))
    centers, contexts = pairs_from_corpus(ids, 2, generator=torch.Generator().manual_seed(1))
    model = SkipGram(30, 6, counts=torch.bincount(ids, minlength=30), device="cpu")
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.02)
    loader = PinnedLoader(centers, contexts, batch_size=64, device="cpu", seed=3)
    return model, opt, loader


def _mf_setup(seed):
    torch.manual_seed(seed)
    users, items, ratings = _low_rank_ratings(40, 30, n=700)
    model = MatrixFactorization(40, 30, 4, config=MFConfig(mlp_hidden=(8,), l2=1e-3),
                                device="cpu")
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.02)
    loader = PinnedLoader(users, items, ratings, batch_size=64, device="cpu", seed=3)
    return model, opt, loader


@pytest.mark.parametrize("setup", [_w2v_setup, _mf_setup], ids=["skipgram", "mf"])
def test_train_resumes_after_a_disconnect_exactly(tmp_path, setup):
    cfg = CheckpointConfig(verbose=False, fsync=False)
    epochs, every = 3, 5

    model, opt, loader = setup(0)
    dash = _Recorder()
    straight = train(model, loader, opt, epochs=epochs, dashboard=dash, every=every,
                     checkpoints=CheckpointManager(tmp_path / "a", config=cfg), log_every=2)
    assert dash.samples == epochs * loader.num_samples
    expected = {k: v.clone() for k, v in model.state_dict().items()
                if isinstance(v, torch.Tensor)}
    total_steps = dash.steps

    model, opt, loader = setup(0)
    ckpt = CheckpointManager(tmp_path / "b", config=cfg)
    with pytest.raises(ConnectionError):
        train(model, loader, opt, epochs=epochs, dashboard=_Recorder(fail_at=13), every=every,
              checkpoints=ckpt, log_every=2)
    assert ckpt.latest_step() == 10
    del model, opt, loader                    # the runtime is gone

    model, opt, loader = setup(1)             # a new runtime, other initial weights
    dash = _Recorder()
    resumed = train(model, loader, opt, epochs=epochs, dashboard=dash, every=every,
                    checkpoints=CheckpointManager(tmp_path / "b", config=cfg), log_every=2)
    assert dash.steps == total_steps - 10
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert resumed["step"] == straight["step"]
    assert resumed["loss"] == straight["loss"]

    # running the cell again after the end restores the last checkpoint and trains nothing
    model, opt, loader = setup(2)
    dash = _Recorder()
    train(model, loader, opt, epochs=epochs, dashboard=dash, every=every,
          checkpoints=CheckpointManager(tmp_path / "b", config=cfg))
    assert dash.steps == 0
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k


def test_train_without_checkpoints_counts_every_sample():
    model, opt, loader = _w2v_setup(0)
    dash = _Recorder()
    history = train(model, loader, opt, epochs=2, dashboard=dash)
    assert dash.samples == 2 * loader.num_samples
    assert history["step"] == sorted(history["step"]) and len(history["loss"]) >= 2
    assert all(math.isfinite(x) for x in history["loss"])
    with pytest.raises(ValueError, match="every"):
        train(model, loader, opt, epochs=1, every=0)


@pytest.mark.parametrize("loop_thread", [True, False])
def test_train_runs_backward_on_its_own_thread_and_restores_autograds_setting(loop_thread):
    """TrainConfig.backward_on_loop_thread: each backward on the loop's thread (autograd's
    multithreading off while the loop runs) or torch's default; the setting is as it was
    after the loop, an error included, and the weights trained are the same either way."""
    model, opt, loader = _w2v_setup(0)
    seen = []
    loss = model.loss

    def recording(*batch):
        seen.append(torch._C._is_multithreading_enabled())
        return loss(*batch)
    model.loss = recording
    assert torch._C._is_multithreading_enabled()
    train(model, loader, opt, epochs=1, backward_on_loop_thread=loop_thread, progress=False)
    assert seen and set(seen) == {not loop_thread}
    assert torch._C._is_multithreading_enabled()
    with pytest.raises(ConnectionError):
        train(model, loader, opt, epochs=2, dashboard=_Recorder(fail_at=2),
              backward_on_loop_thread=loop_thread)
    assert torch._C._is_multithreading_enabled()
    other, opt2, loader2 = _w2v_setup(0)
    train(other, loader2, opt2, epochs=1, backward_on_loop_thread=not loop_thread,
          progress=False)
    trained, opt3, loader3 = _w2v_setup(0)
    train(trained, loader3, opt3, epochs=1, backward_on_loop_thread=loop_thread,
          progress=False)
    for k, v in trained.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(other.state_dict()[k], v), k
    with pytest.raises(TypeError, match="backward_on_loop_thread"):
        train(model, loader, opt, epochs=1, backward_on_loop_thread="yes")


def test_the_progress_bar_says_the_first_steps_compile_the_gpu_kernels(monkeypatch):
    """A session's first steps on a GPU compile the kernels, tens of seconds with the GPU idle:
    the bar says so until the first step is done, and only where that is what happens."""
    from nbtools.kernels import common
    from nbtools.models import training
    model, opt, loader = _w2v_setup(0)
    assert training.compile_note(model) is None               # the CPU: nothing compiles
    monkeypatch.setattr(common, "triton_ok", lambda: True)
    monkeypatch.setattr(common, "compiled", lambda: 0)
    probe = torch.nn.Module()                    # (a part on a GPU, as a table there shows it;
    probe.device = torch.device("cuda")          # the model still runs on the CPU)
    model.add_module("probe", probe)
    assert training.compile_note(model) == training.COMPILE_NOTE
    monkeypatch.setattr(common, "compiled", lambda: 12)         # compiled already
    assert training.compile_note(model) is None
    monkeypatch.setattr(common, "compiled", lambda: 0)
    shown = []

    class Bar:
        def __init__(self, *a, **kw):
            pass

        def set_postfix_str(self, text):
            shown.append(text)

        def set_postfix(self, **kw):
            shown.append(kw)

        def update(self, n):
            shown.append(n)

        def close(self):
            pass
    import tqdm.auto
    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    train(model, loader, opt, epochs=1, log_every=1000)
    assert shown[:3] == [training.COMPILE_NOTE, "", 1] and training.COMPILE_NOTE not in shown[3:]
