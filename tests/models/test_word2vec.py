"""word2vec's recipe: per-epoch pairs, skipped negatives, linear lr decay, evaluation, resume."""
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from nbtools import CheckpointManager, OffloadOptimizer
from nbtools.checkpoint import CheckpointConfig
from nbtools.models import (CorpusLoader, SkipGram, SkipGramConfig, TrainConfig,
                            keep_probabilities, train, wordsim)
from nbtools.models.training import lr_factor


def _corpus(n=400, vocab=30, seed=0):
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
    ids[::37] = -1                                  # sentence breaks
    return ids


def _epoch_pairs(loader):
    batches = list(loader)
    return torch.cat([c for c, _ in batches]), torch.cat([x for _, x in batches]), batches


def _naive_allowed(ids, window):
    """Every (center, context) position pair within ``window`` inside one sentence."""
    allowed = {}
    ids = ids.tolist()
    for i, a in enumerate(ids):
        for j in range(max(0, i - window), min(len(ids), i + window + 1)):
            if j == i or a < 0 or ids[j] < 0 or any(t < 0 for t in ids[min(i, j):max(i, j)]):
                continue
            allowed[(a, ids[j])] = allowed.get((a, ids[j]), 0) + 1
    return allowed


# --- CorpusLoader ---------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_tokens", [1 << 22, 90])
def test_corpus_loader_redraws_each_epoch_within_the_windows(chunk_tokens):
    ids = _corpus()
    loader = CorpusLoader(ids, 64, window=3, device="cpu", seed=5, chunk_tokens=chunk_tokens)
    allowed = _naive_allowed(ids, 3)
    distance_one = _naive_allowed(ids, 1)
    epochs = []
    for e in range(3):
        assert loader.epoch == e
        n = len(loader)
        centers, contexts, batches = _epoch_pairs(loader)
        assert len(batches) == n and centers.numel() == sum(loader.piece_sizes(e))
        assert all(c.numel() == 64 for c, _ in batches[:-1]) and 0 < batches[-1][0].numel() <= 64
        got = {}
        for c, x in zip(centers.tolist(), contexts.tolist()):
            got[(c, x)] = got.get((c, x), 0) + 1
        # never more of a pair than the corpus holds within the window
        assert all(k in allowed and v <= allowed[k] for k, v in got.items())
        if chunk_tokens > ids.numel():
            # every center's window is at least 1: all neighbours are paired, both ways
            assert all(got.get(k, 0) >= v for k, v in distance_one.items())
        epochs.append((centers, contexts))
    assert not torch.equal(epochs[0][0], epochs[1][0])          # a new draw each epoch
    assert len({c.numel() for c, _ in epochs}) > 1 or not torch.equal(epochs[1][1], epochs[2][1])

    again = CorpusLoader(ids, 64, window=3, device="cpu", seed=5, chunk_tokens=chunk_tokens)
    for e in range(3):
        c, x, _ = _epoch_pairs(again)
        assert torch.equal(c, epochs[e][0]) and torch.equal(x, epochs[e][1])   # seeded
    other = CorpusLoader(ids, 64, window=3, device="cpu", seed=6, chunk_tokens=chunk_tokens)
    assert not torch.equal(_epoch_pairs(other)[0], epochs[0][0])


def test_corpus_loader_subsamples_afresh_each_epoch():
    ids = torch.tensor([0, 1] * 200 + [2, 3] * 10)
    keep = keep_probabilities(torch.bincount(ids), threshold=1e-2)   # 0 and 1 are frequent
    assert keep[0] < 0.5 and keep[2] == 1.0
    loader = CorpusLoader(ids, 32, window=2, keep_prob=keep, device="cpu", seed=0)
    counts = []
    for _ in range(4):
        centers = _epoch_pairs(loader)[0]
        counts.append(torch.bincount(centers.long(), minlength=4))
    # rare words always kept (10 of each, with at least one neighbour), frequent ones thinned
    assert all(int(c[2]) >= 10 and int(c[0]) < 200 for c in counts)
    assert len({tuple(c.tolist()) for c in counts}) > 1


def test_corpus_loader_resumes_mid_epoch_from_its_state():
    ids = _corpus(600)
    straight = CorpusLoader(ids, 50, window=2, device="cpu", seed=3, chunk_tokens=200)
    full = [b for _ in range(2) for b in straight]
    first = CorpusLoader(ids, 50, window=2, device="cpu", seed=3, chunk_tokens=200)
    n0 = len(first)
    seen = []
    for b in first:
        seen.append(b)
        if len(seen) == n0 - 2:
            break
    state = first.state_dict()
    resumed = CorpusLoader(ids, 50, window=2, device="cpu", seed=0, chunk_tokens=200)
    resumed.load_state_dict(state)
    seen += [b for b in resumed] + [b for b in resumed]
    assert len(seen) == len(full)
    for (a, b), (c, d) in zip(seen, full):
        assert torch.equal(a, c) and torch.equal(b, d)
    with pytest.raises(ValueError, match="window"):
        CorpusLoader(ids, 50, window=3, device="cpu").load_state_dict(state)


def test_corpus_loader_rejects_bad_input():
    with pytest.raises(TypeError, match="1-D integer"):
        CorpusLoader(torch.rand(5), 4, device="cpu")
    with pytest.raises(ValueError, match="batch_size"):
        CorpusLoader(torch.arange(5), 0, device="cpu")
    with pytest.raises(ValueError, match="keep_prob has 3 entries"):
        CorpusLoader(torch.arange(5), 2, keep_prob=torch.ones(3), device="cpu")
    with pytest.raises(KeyError, match="missing"):
        CorpusLoader(torch.arange(5), 2, device="cpu").load_state_dict({"epoch": 1})


# --- negatives equal to the context ---------------------------------------------------------

def test_drawn_negative_equal_to_the_context_is_skipped():
    # all noise mass on word 2: every drawn negative is 2
    model = SkipGram(4, 3, counts=torch.tensor([0, 0, 5, 0]), device="cpu",
                     config=SkipGramConfig(negatives=2))
    w_in = torch.tensor([[0.1, 0.2, -0.3], [0.4, -0.1, 0.0], [0.2, 0.2, 0.2], [-0.5, 0.3, 0.1]])
    w_out = torch.tensor([[0.3, -0.2, 0.1], [0.0, 0.5, -0.4], [0.6, 0.1, -0.2], [0.2, 0.2, 0.2]])
    model.input.weight.copy_(w_in)
    model.output.weight.copy_(w_out)
    centers, contexts = torch.tensor([0, 1]), torch.tensor([2, 3])
    loss = model.loss(centers, contexts)

    def logsig(x):
        return -math.log1p(math.exp(-x))

    dot = lambda a, b: sum(x * y for x, y in zip(a.tolist(), b.tolist()))  # noqa: E731
    # pair (0, 2): both negatives are 2 = the context, skipped; pair (1, 3): two negatives 2
    by_hand = -(logsig(dot(w_out[2], w_in[0]))
                + logsig(dot(w_out[3], w_in[1])) + 2 * logsig(-dot(w_out[2], w_in[1]))) / 2
    assert loss.item() == pytest.approx(by_hand, rel=1e-6)

    opt = OffloadOptimizer(torch.optim.SGD, model, lr=1.0)
    loss.backward()
    opt.step()
    ref_in, ref_out = w_in.clone().requires_grad_(), w_out.clone().requires_grad_()
    ref = -(F.logsigmoid(ref_out[2] @ ref_in[0]) + F.logsigmoid(ref_out[3] @ ref_in[1])
            + 2 * F.logsigmoid(-ref_out[2] @ ref_in[1])) / 2
    ref.backward()
    torch.testing.assert_close(model.input.weight, w_in - ref_in.grad)
    torch.testing.assert_close(model.output.weight, w_out - ref_out.grad)


def test_skipping_negatives_matches_a_masked_reference_on_random_draws():
    model = SkipGram(6, 4, counts=torch.tensor([5, 4, 3, 3, 2, 1]), device="cpu",
                     config=SkipGramConfig(negatives=5, seed=11))
    torch.nn.init.normal_(model.output.weight)
    centers, contexts = torch.randint(0, 6, (64,)), torch.randint(0, 6, (64,))
    state = model.generator.get_state()
    negatives = model.sample_negatives(64, 5)
    assert (negatives == contexts[:, None]).any()          # the case under test happens
    model.generator.set_state(state)
    loss = model.loss(centers, contexts)
    v, u = model.input.weight[centers], model.output.weight
    pos = F.logsigmoid((u[contexts] * v).sum(1))
    neg = F.logsigmoid(-(u[negatives] * v[:, None]).sum(2))
    expected = -(pos + (neg * (negatives != contexts[:, None])).sum(1)).mean()
    torch.testing.assert_close(loss, expected)
    model.generator.set_state(state)
    plain = SkipGram(6, 4, counts=torch.tensor([5, 4, 3, 3, 2, 1]), device="cpu",
                     config=SkipGramConfig(negatives=5, seed=11, skip_context_negatives=False))
    plain.load_state_dict(model.state_dict())
    unmasked = -(pos + neg.sum(1)).mean()
    torch.testing.assert_close(plain.loss(centers, contexts), unmasked)


# --- linear learning-rate decay -------------------------------------------------------------

class _LrSpy(SkipGram):
    """A SkipGram that records the optimizer's lr at each loss (set before the step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lrs, self.opt = [], None

    def loss(self, *batch):
        self.lrs.append(self.opt.param_groups[-1]["lr"])
        return super().loss(*batch)


def test_linear_decay_hits_start_middle_and_end():
    from nbtools import PinnedLoader
    model = _LrSpy(10, 4, device="cpu")
    model.opt = opt = OffloadOptimizer(torch.optim.SGD, model, lr=0.4)
    pairs = torch.randint(0, 10, (2, 100))
    loader = PinnedLoader(pairs[0], pairs[1], batch_size=10, device="cpu")
    train(model, loader, opt, epochs=4, progress=False,
          config=TrainConfig(lr_decay="linear", min_lr_ratio=0.1))
    total = 40
    assert len(model.lrs) == total
    assert model.lrs[0] == pytest.approx(0.4)                        # start
    assert model.lrs[total // 2] == pytest.approx(0.4 * (1 - 0.9 * 0.5))   # middle: 0.22
    assert model.lrs[-1] == pytest.approx(0.4 * (1 - 0.9 * 39 / 40))      # last step
    assert all(a > b for a, b in zip(model.lrs, model.lrs[1:]))
    assert lr_factor(TrainConfig(lr_decay="linear", min_lr_ratio=0.1), 1.0) == pytest.approx(0.1)


def test_the_decayed_lr_is_the_one_the_optimizer_uses():
    from nbtools import PinnedLoader
    pairs = torch.randint(0, 10, (2, 30), generator=torch.Generator().manual_seed(0))

    def fresh():
        torch.manual_seed(0)
        model = SkipGram(10, 4, device="cpu", config=SkipGramConfig(seed=1))
        torch.nn.init.normal_(model.output.weight)
        return (model, OffloadOptimizer(torch.optim.SGD, model, lr=0.3),
                PinnedLoader(pairs[0], pairs[1], batch_size=10, device="cpu", seed=2))

    model, opt, loader = fresh()
    train(model, loader, opt, epochs=2, progress=False,
          config=TrainConfig(lr_decay="linear", min_lr_ratio=0.0))
    ref, ref_opt, ref_loader = fresh()            # the same steps, lr set by hand
    for t, batch in enumerate(b for _ in range(2) for b in ref_loader):
        ref_opt.param_groups[-1]["lr"] = ref_opt.param_groups[-2]["lr"] = 0.3 * (1 - t / 6)
        ref.loss(*batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    torch.testing.assert_close(model.input.weight, ref.input.weight, rtol=0, atol=1e-7)
    torch.testing.assert_close(model.output.weight, ref.output.weight, rtol=0, atol=1e-7)


def test_linear_decay_follows_epochs_of_different_lengths():
    ids = _corpus(500)
    model = _LrSpy(30, 4, device="cpu")
    model.opt = opt = OffloadOptimizer(torch.optim.SGD, model, lr=1.0)
    loader = CorpusLoader(ids, 40, window=3, device="cpu", seed=2)
    lengths = [-(-loader.piece_sizes(e)[0] // 40) for e in range(3)]
    train(model, loader, opt, epochs=3, progress=False,
          config=TrainConfig(lr_decay="linear", min_lr_ratio=0.0))
    expected = [1 - (e + b / n) / 3 for e, n in enumerate(lengths) for b in range(n)]
    assert len(model.lrs) == sum(lengths)
    torch.testing.assert_close(torch.tensor(model.lrs), torch.tensor(expected), rtol=0, atol=1e-12)


def test_train_config_and_old_keywords():
    model = SkipGram(10, 4, device="cpu")
    opt = OffloadOptimizer(torch.optim.SGD, model, lr=0.1)
    pairs = torch.randint(0, 10, (2, 30))
    from nbtools import PinnedLoader
    loader = PinnedLoader(pairs[0], pairs[1], batch_size=10, device="cpu")
    h = train(model, loader, opt, epochs=1, log_every=1, progress=False)    # the old keywords
    assert h["step"] == [1, 2, 3] and h["lr"] == [0.1] * 3
    with pytest.raises(TypeError, match="lr_decy"):
        train(model, loader, opt, epochs=1, lr_decy="linear")
    with pytest.raises(ValueError, match="lr_decay"):
        TrainConfig(lr_decay="cosine")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        TrainConfig(min_lr_ratio=2)


# --- resume -------------------------------------------------------------------------------

class _Dash:
    def __init__(self, fail_at=None):
        self.steps, self.fail_at = 0, fail_at

    def step(self, n):
        self.steps += 1
        if self.steps == self.fail_at:
            raise ConnectionError("runtime disconnected")


def _setup(seed):
    torch.manual_seed(seed)           # other initial tables: the restore must overwrite them
    ids = _corpus(500)
    counts = torch.bincount(ids.clamp_min(0), minlength=30)
    model = SkipGram(30, 6, counts=counts, device="cpu")
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.05)
    loader = CorpusLoader(ids, 64, window=3, keep_prob=keep_probabilities(counts, 1e-2),
                          device="cpu", seed=4, chunk_tokens=200)
    return model, opt, loader


def test_resume_with_per_epoch_pairs_and_decay_equals_a_straight_run(tmp_path):
    cfg = CheckpointConfig(verbose=False, fsync=False)
    tc = TrainConfig(every=5, log_every=2, lr_decay="linear")
    model, opt, loader = _setup(0)
    straight = train(model, loader, opt, epochs=3, config=tc, dashboard=_Dash(),
                     checkpoints=CheckpointManager(tmp_path / "a", config=cfg))
    expected = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}

    model, opt, loader = _setup(0)
    with pytest.raises(ConnectionError):
        train(model, loader, opt, epochs=3, config=tc, dashboard=_Dash(fail_at=13),
              checkpoints=CheckpointManager(tmp_path / "b", config=cfg))
    del model, opt, loader

    model, opt, loader = _setup(1)
    resumed = train(model, loader, opt, epochs=3, config=tc, dashboard=_Dash(),
                    checkpoints=CheckpointManager(tmp_path / "b", config=cfg))
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert resumed["loss"] == straight["loss"] and resumed["lr"] == straight["lr"]
    assert resumed["step"] == straight["step"] and straight["lr"][-1] < 0.05 / 2


# --- evaluation -----------------------------------------------------------------------------

def test_average_ranks_and_spearman_by_hand():
    assert wordsim.average_ranks([3.0, 1.0, 3.0, 2.0, 3.0]).tolist() == [4.0, 1.0, 4.0, 2.0, 4.0]
    # x ranks 1, 2.5, 2.5, 4; y ranks 1, 2, 3, 4 -> Pearson of ranks = 4.5 / sqrt(4.5 * 5)
    assert wordsim.spearman([1, 5, 5, 9], [2, 3, 4, 5]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert wordsim.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(wordsim.spearman([1, 1, 1], [1, 2, 3]))


def test_spearman_equals_scipy():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    for n in (7, 50, 333):
        x = torch.randint(0, 6, (n,), generator=g).float()     # many ties
        y = torch.randn(n, generator=g)
        assert wordsim.spearman(x, y) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-12)


def _write_eval(d):
    d.mkdir()
    (d / "wordsim353.tsv").write_text("# comment\n# Word 1\tWord 2\tHuman\n"
                                      "King\tqueen\t9\nman\twoman\t8\ncat\tking\t1\n"
                                      "dog\tcat\t5\n")
    (d / "simlex999.txt").write_text("# c\nking\tman\t2\nqueen\twoman\t3\ncat\tman\t1\n")
    (d / "questions-words.txt").write_text(": family\nman king woman queen\nking man queen woman\n"
                                          "man woman king queen\n: other\nman king cat dog\n"
                                          "cat king man queen\n")


WORDS = ["king", "queen", "man", "woman", "cat"]
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0],
                  [0.2, -1.0, 0.3]])


def test_evaluate_on_hand_made_files(tmp_path):
    _write_eval(tmp_path / "eval")
    r = wordsim.evaluate((WORDS, M), tmp_path / "eval")
    # WS353: 3 of 4 pairs known; cosines king-queen 0.5 > man-woman 0 > cat-king (negative),
    # humans 9 > 8 > 1: the same order
    assert r["ws353"] == {"spearman": pytest.approx(1.0), "coverage": 0.75, "pairs": 3}
    # SimLex: cosines king-man 0.707, queen-woman 0.707 (a tie), cat-man -0.95;
    # humans 2, 3, 1 -> ranks x (2.5, 2.5, 1), y (2, 3, 1): 1.5 / sqrt(1.5 * 2)
    assert r["simlex"]["spearman"] == pytest.approx(1.5 / math.sqrt(3.0))
    assert r["simlex"]["coverage"] == 1.0
    # analogies: 4 of 5 questions have known words (dog is unknown).
    # man:king = woman:? -> king - man + woman = (1, 0, 1) = queen: right.
    # king:man = queen:? -> (0, 0, 1) + ... = man - king + queen = (0, 0, 1)/.. -> woman: right.
    # man:woman = king:? -> woman - man + king = (1, 0, 1) -> queen: right.
    # cat:king = man:? -> unit(king) - unit(cat) + unit(man) = (0.52, 2.65, -0.28); of queen
    # and woman (a, b, c excluded), queen (0.707, 0, 0.707) scores 0.17, woman -0.28: right.
    assert r["analogy"]["questions"] == 4 and r["analogy"]["coverage"] == 0.8
    assert r["analogy"]["correct"] == 4
    # restricted to the top 4 words, cat drops out: 3 questions, all right
    top4 = wordsim.analogies((WORDS, M), wordsim.load_analogies(tmp_path / "eval" /
                                                               "questions-words.txt"), restrict=4)
    assert (top4["questions"], top4["correct"], top4["accuracy"]) == (3, 3, 1.0)
    assert "WS353 1.000" in wordsim.format_scores(r)


def test_evaluate_takes_a_skipgram_and_checks_its_input(tmp_path):
    _write_eval(tmp_path / "eval")
    model = SkipGram(5, 3, words=WORDS, device="cpu")
    model.input.weight.copy_(M)
    assert wordsim.evaluate(model, tmp_path / "eval") == wordsim.evaluate((WORDS, M),
                                                                          tmp_path / "eval")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        wordsim.evaluate(model, tmp_path / "nowhere")
    with pytest.raises(ValueError, match="one row per word"):
        wordsim.word_similarity((WORDS, M[:3]), [])
    (tmp_path / "bad.tsv").write_text("a b 3\n")
    with pytest.raises(ValueError, match="bad.tsv:1"):
        wordsim.load_word_pairs(tmp_path / "bad.tsv")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_cache_of_frequent_words_changes_nothing(dtype):
    """SkipGram with a quarter of its vocabulary in a cache of hot rows (warmed from the word
    counts) trains exactly as without one."""
    vocab = 200
    counts = (1e4 / torch.arange(1, vocab + 1)).round()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.multinomial(counts, 64, True, generator=gen),
                torch.multinomial(counts, 64, True, generator=gen)) for _ in range(6)]
    got = []
    for share in (None, 0.25):
        torch.manual_seed(0)
        model = SkipGram(vocab, 8, counts=counts, device="cpu",
                         config=SkipGramConfig(cache_share=share, dtype=dtype, placement="host"))
        opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.05)
        if share:
            cache = model.input.cache
            assert cache.capacity == 50 and cache.ways == 1    # a small cache: direct-mapped
            # warm: each set holds its most frequent word
            slots = cache.locate(torch.arange(vocab)).long()
            sets = cache.set_of(torch.arange(vocab))
            for s in sets.unique()[:10]:
                words = (sets == s).nonzero().flatten()
                assert slots[words[0]] >= 0 and (slots[words[1:]] < 0).all()
        for centers, contexts in batches:
            opt.zero_grad()
            model.loss(centers, contexts).backward()
            opt.step()
        if share:
            assert model.output.cache_stats()["hits"] > 0
        got.append((model.input.weight.clone(), model.output.weight.clone()))
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


# --- the evaluation sets from the data registry --------------------------------------------------

def _sample_vectors():
    from nbtools import data
    words = data.load("text8-sample", min_count=1).vocab
    return words, torch.randn(len(words), 8, generator=torch.Generator().manual_seed(0))


def test_evaluate_without_a_folder_fetches_the_registry_sets(eval_server, tmp_path, monkeypatch):
    files, hits = eval_server
    monkeypatch.setenv("NBTOOLS_DATA_DIR", str(tmp_path / "cache"))
    vectors = _sample_vectors()
    r = wordsim.evaluate(vectors, quiet=True)
    assert sorted(hits.values()) == [1, 1, 1]
    assert sorted(p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()
                  and not p.name.startswith(".")) == sorted(wordsim.FILES.values())
    # the same scores as from a folder holding the same files
    (tmp_path / "eval").mkdir()
    for key, name in wordsim.FILES.items():
        (tmp_path / "eval" / name).write_bytes(files[f"/gensim/{name}"])
    assert r == wordsim.evaluate(vectors, tmp_path / "eval")
    assert r["ws353"]["pairs"] == 30 and r["analogy"]["questions"] == 24
    assert wordsim.evaluate(vectors) == r and sorted(hits.values()) == [1, 1, 1]   # cached


def test_evaluate_on_the_bundled_samples_needs_no_network(monkeypatch):
    import urllib.request

    def no_network(*args, **kwargs):
        raise AssertionError("the bundled samples must not be downloaded")
    monkeypatch.setattr(urllib.request, "urlopen", no_network)      # plain URLs
    monkeypatch.setitem(sys.modules, "gdown", None)                 # Drive links
    r = wordsim.evaluate(_sample_vectors(), sample=True)
    assert (r["ws353"]["pairs"], r["simlex"]["pairs"], r["analogy"]["questions"]) == (30, 30, 24)
    assert r["ws353"]["coverage"] == pytest.approx(30 / 31)
    assert "WS353" in wordsim.format_scores(r) and "analogy" in wordsim.format_scores(r)
    with pytest.raises(TypeError, match="only without eval_dir"):
        wordsim.evaluate(_sample_vectors(), "eval", sample=True)


def test_bundled_eval_samples_are_what_make_samples_makes(tmp_path):
    from nbtools import data
    wordsim.make_samples(tmp_path)
    for name in ("ws353-sample", "simlex999-sample", "questions-words-sample"):
        filename = data.REGISTRY[name].filename
        assert (tmp_path / filename).read_bytes() == (data.SAMPLES_DIR / filename).read_bytes()
