"""Two models and one training loop, built from nbtools' parts: what the notebooks call.

* :class:`SkipGram`: word2vec with negative sampling (SGNS). Input and output vectors are
  :class:`~nbtools.OffloadedEmbedding` tables; negatives are drawn on the compute device from
  the unigram distribution raised to 3/4.
* :class:`MatrixFactorization`: a recommender. User and item tables (each row ends with the
  row's bias) plus an optional small NCF head, an MLP on the GPU trained by the same
  :class:`~nbtools.OffloadOptimizer` as the tables.
* :func:`train`: one loop for both. It feeds a :class:`~nbtools.Dashboard` from the loop's own
  thread, saves checkpoints every ``every`` steps and, when it starts, restores the newest one,
  so a Colab run that was disconnected continues where its last checkpoint left it.

A model here is an ``nn.Module`` with ``loss(*batch) -> scalar tensor``, where ``batch`` is
what the loader yields; :func:`train` needs nothing else.

>>> ids = torch.tensor([0, 1, 2, 1, 0, 3, 1, 2])
>>> centers, contexts = pairs_from_corpus(ids, window=1, dynamic=False)
>>> centers[:4].tolist(), contexts[:4].tolist()
([0, 1, 2, 1], [1, 2, 1, 0])
>>> model = SkipGram(4, 8, counts=torch.bincount(ids), device="cpu")
>>> opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.01)
>>> loader = PinnedLoader(centers, contexts, batch_size=4, device="cpu")
>>> history = train(model, loader, opt, epochs=2, progress=False)
>>> len(history["loss"]) > 0
True
"""
from __future__ import annotations

import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from .devices import resolve_device
from .loader import PinnedLoader
from .optim import OffloadOptimizer
from .tables import OffloadedEmbedding

__all__ = ["SkipGram", "SkipGramConfig", "MatrixFactorization", "MFConfig", "train",
           "pairs_from_corpus", "keep_probabilities", "evaluate_rmse", "holdout"]


# --- word2vec ---------------------------------------------------------------------------------

def keep_probabilities(counts, threshold: float = 1e-4) -> torch.Tensor:
    """Probability of keeping each occurrence of a word when subsampling frequent words.

    word2vec's formula: with ``z`` the word's share of the corpus, keep with probability
    ``(sqrt(z / threshold) + 1) * threshold / z`` (at most 1). Rare words are always kept;
    "the" in text8 (~6% of tokens) is kept ~5% of the time at ``threshold=1e-4``.

    >>> keep_probabilities(torch.tensor([1000, 10, 0]), threshold=1e-3)
    tensor([0.0328, 0.4188, 1.0000])
    """
    counts = torch.as_tensor(counts, dtype=torch.float64)
    z = counts / counts.sum().clamp_min(1)
    keep = ((z / threshold).sqrt() + 1) * threshold / z.clamp_min(1e-300)
    return keep.clamp(max=1.0).to(torch.float32)


def pairs_from_corpus(ids, window: int = 5, *, keep_prob=None, dynamic: bool = True,
                      generator: torch.Generator | None = None, dtype=torch.int32):
    """(center, context) id pairs of a token stream, as two 1-D tensors; no Python loop over tokens.

    Args:
        ids: 1-D integer tensor of token ids. A negative id marks a sentence break: it is never
            paired, and no window reaches across it.
        window: the largest distance between a center and its context.
        keep_prob: per-id keep probabilities (:func:`keep_probabilities`); each token is kept
            with its probability *before* windows are taken, as in word2vec, so dropping a
            frequent word brings its neighbours closer.
        dynamic: as word2vec, draw each center's window uniformly from ``1..window`` (near
            words get paired more often). ``False`` pairs every word within ``window``.
        generator: ``torch.Generator`` for the subsampling and window draws (on ``ids``'s
            device). Subsampling draws first, one uniform per token, then one radius per kept
            token.
        dtype: id dtype of the result (int32 halves the loader's memory).

    Returns:
        ``(centers, contexts)``, ordered by distance (all pairs at distance 1, both directions,
        then distance 2, ...), then by position.

    Memory: at most ``2 * window * len(ids)`` pairs; dynamic windows average ``window + 1``
    pairs per kept token. For text8 (17M tokens, ``window=5``, subsampling at 1e-4), a Zipf
    estimate gives ~11M kept tokens and ~65M pairs: ~0.5 GB in int32.
    """
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"ids must be a 1-D integer tensor, got {ids.dtype} of shape "
                        f"{tuple(ids.shape)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    if keep_prob is not None:
        keep_prob = torch.as_tensor(keep_prob, device=ids.device)
        u = torch.rand(ids.shape, generator=generator, device=ids.device)
        is_break = ids < 0
        ids = ids[is_break | (u < keep_prob[ids.clamp_min(0)])]
    n = ids.numel()
    # Sentence number of each token: breaks start a new one, so a window never spans two.
    sentence = torch.cumsum((ids < 0).to(torch.int64), 0)
    if dynamic:
        radius = torch.randint(1, window + 1, (n,), generator=generator, device=ids.device)
    centers, contexts = [], []
    for d in range(1, min(window, n - 1) + 1):        # a loop over distances, not tokens
        left, right = ids[:-d], ids[d:]
        ok = (left >= 0) & (right >= 0) & (sentence[:-d] == sentence[d:])
        fwd = ok & (radius[:-d] >= d) if dynamic else ok     # center left, context right
        bwd = ok & (radius[d:] >= d) if dynamic else ok      # center right, context left
        # converted piece by piece: the int64 pieces of a large corpus would double the peak
        centers += [left[fwd].to(dtype), right[bwd].to(dtype)]
        contexts += [right[fwd].to(dtype), left[bwd].to(dtype)]
    if not centers:
        empty = torch.empty(0, dtype=dtype, device=ids.device)
        return empty, empty.clone()
    return torch.cat(centers), torch.cat(contexts)


@dataclasses.dataclass
class SkipGramConfig:
    """Settings of :class:`SkipGram` (word2vec's defaults where it has one)."""

    negatives: int = 5             # noise words per (center, context) pair
    noise_power: float = 0.75      # negatives ~ count ** noise_power (word2vec's 3/4)
    dtype: torch.dtype = torch.float32   # of both tables (and their optimizer state)
    pin: bool = True               # register host memory with CUDA (zero-copy)
    seed: int = 0                  # negatives; their generator is saved with the model


class SkipGram(nn.Module):
    """word2vec skip-gram with negative sampling, with both tables in host memory.

    Args:
        vocab_size: number of words (rows of each table).
        dim: vector size.
        counts: occurrences of each word in the corpus: the noise distribution is
            ``counts ** 0.75``. ``None`` draws negatives uniformly.
        words: the word of each id (for :meth:`most_similar` and :meth:`analogy` by word).
        config: :class:`SkipGramConfig`.
        device: compute device (``"auto"``: the GPU when there is one).

    ``loss(centers, contexts)`` is the mean over pairs of
    ``-log σ(u_ctx·v_c) - Σ_k log σ(-u_neg_k·v_c)``, with ``v`` from the input table and ``u``
    from the output table. Input vectors start uniform in ±0.5/dim, output vectors at zero, as
    in word2vec. The word vectors are ``model.input.weight`` (host memory).
    """

    def __init__(self, vocab_size: int, dim: int, *, counts=None, words=None,
                 config: SkipGramConfig | None = None, device="auto"):
        super().__init__()
        self.config = cfg = config or SkipGramConfig()
        self.device = resolve_device(device)
        if words is not None and len(words) != vocab_size:
            raise ValueError(f"words has {len(words):,} entries but vocab_size is {vocab_size:,}")
        self.words = list(words) if words is not None else None
        self._index = None
        kw = dict(dtype=cfg.dtype, device=self.device, pin=cfg.pin)
        self.input = OffloadedEmbedding(vocab_size, dim, name="input", **kw)
        self.output = OffloadedEmbedding(vocab_size, dim, name="output", **kw)
        with torch.no_grad():
            self.input.weight.uniform_(-0.5 / dim, 0.5 / dim)
            self.output.weight.zero_()
        if counts is None:
            counts = torch.ones(vocab_size)
        counts = torch.as_tensor(counts, dtype=torch.float64).reshape(-1)
        if counts.numel() != vocab_size or (counts < 0).any() or counts.sum() <= 0:
            raise ValueError(f"counts must hold {vocab_size:,} non-negative numbers, not all "
                             f"zero; got shape {tuple(counts.shape)}")
        noise = counts.pow(cfg.noise_power)
        # Inverse-CDF sampling: one uniform and one binary search per negative, on the device.
        # Exact for any vocabulary size, and driven by our own generator, so a resumed run
        # draws the same negatives the uninterrupted one would have.
        cdf = torch.cumsum(noise / noise.sum(), 0)
        self.register_buffer("_noise_cdf", cdf.to(self.device), persistent=False)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed)

    @property
    def vocab_size(self) -> int:
        return self.input.num_embeddings

    @property
    def dim(self) -> int:
        return self.input.embedding_dim

    def sample_negatives(self, *shape) -> torch.Tensor:
        """Ids drawn from the noise distribution (unigram ** 0.75), on the compute device."""
        u = torch.rand(shape, generator=self.generator, dtype=torch.float64, device=self.device)
        ids = torch.searchsorted(self._noise_cdf, u, right=True)
        return ids.clamp_(max=self.vocab_size - 1)     # u within rounding of 1.0

    def loss(self, centers, contexts, negatives=None) -> torch.Tensor:
        """Mean SGNS loss of a batch of pairs; ``negatives`` [B, k] are drawn when not given."""
        # int64 on the device: tables take any integer ids, but their CPU scatter wants int64
        centers = centers.to(self.device).long()
        contexts = contexts.to(self.device).long()
        if negatives is None:
            negatives = self.sample_negatives(centers.shape[0], self.config.negatives)
        v = self.input(centers)                                          # [B, d]
        # Context and negatives in one lookup: one deduplication, one gather.
        targets = torch.cat((contexts.reshape(-1, 1), negatives.to(self.device).long()), 1)
        u = self.output(targets)                                         # [B, 1 + k, d]
        scores = torch.bmm(u, v.unsqueeze(2)).squeeze(2)                 # [B, 1 + k]
        sign = torch.ones_like(scores)
        sign[:, 1:] = -1
        return -F.logsigmoid(sign * scores).sum(1).mean()

    forward = loss

    # Negatives' generator state travels with the model's state_dict (and so with checkpoints).
    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def set_extra_state(self, state) -> None:
        self.generator.set_state(state["generator"].cpu())

    # --- looking at the vectors ---------------------------------------------------------------
    def _id(self, word) -> int:
        if isinstance(word, str):
            if self.words is None:
                raise KeyError(f"{word!r}: this model has no words; pass ids, or build it with "
                               "words=[...]")
            if self._index is None:
                self._index = {w: i for i, w in enumerate(self.words)}
            if word not in self._index:
                raise KeyError(f"{word!r} is not in the vocabulary ({self.vocab_size:,} words)")
            return self._index[word]
        i = int(word)
        if not 0 <= i < self.vocab_size:
            raise IndexError(f"id {i} is outside 0..{self.vocab_size - 1}")
        return i

    def _label(self, i: int):
        return self.words[i] if self.words is not None else i

    def vector(self, word_or_id) -> torch.Tensor:
        """The input vector of one word (a float32 CPU copy)."""
        return self.input.weight[self._id(word_or_id)].float().clone()

    def most_similar(self, word_or_id, k: int = 10, *, chunk_rows: int = 65536) -> list:
        """The ``k`` words whose input vectors have the highest cosine similarity.

        ``word_or_id``: a word, an id, or a vector. Computed on the host table in chunks of
        ``chunk_rows`` rows (never a full copy). Returns ``[(word or id, cosine), ...]``.
        """
        if isinstance(word_or_id, torch.Tensor) and word_or_id.dim() == 1 and \
                word_or_id.is_floating_point():
            query, exclude = word_or_id.float().cpu(), []
        else:
            i = self._id(word_or_id)
            query, exclude = self.vector(i), [i]
        return self._nearest(query, k, exclude, chunk_rows)

    def analogy(self, a, b, c, k: int = 5, *, chunk_rows: int = 65536) -> list:
        """``a`` is to ``b`` as ``c`` is to ...? (3CosAdd: nearest to ``b - a + c``, unit
        vectors; ``a``, ``b``, ``c`` themselves excluded). ``analogy("man", "king", "woman")``."""
        ids = [self._id(w) for w in (a, b, c)]
        va, vb, vc = (F.normalize(self.vector(i), dim=0) for i in ids)
        return self._nearest(vb - va + vc, k, ids, chunk_rows)

    @torch.no_grad()
    def _nearest(self, query: torch.Tensor, k: int, exclude, chunk_rows: int) -> list:
        weight = self.input.weight          # host view; reading it waits for the GPU once
        query = F.normalize(query, dim=0)
        k = min(k, self.vocab_size - len(exclude))
        best_scores = torch.empty(0)
        best_ids = torch.empty(0, dtype=torch.long)
        for start in range(0, self.vocab_size, chunk_rows):
            rows = weight[start:start + chunk_rows].float()
            sims = rows @ query / rows.norm(dim=1).clamp_min(1e-12)
            for i in exclude:
                if start <= i < start + rows.shape[0]:
                    sims[i - start] = -math.inf
            scores = torch.cat((best_scores, sims))
            ids = torch.cat((best_ids, torch.arange(start, start + rows.shape[0])))
            best_scores, top = scores.topk(min(k, scores.numel()))
            best_ids = ids[top]
        return [(self._label(int(i)), float(s)) for i, s in zip(best_ids, best_scores)]


# --- recommender ------------------------------------------------------------------------------

@dataclasses.dataclass
class MFConfig:
    """Settings of :class:`MatrixFactorization`."""

    mlp_hidden: tuple = ()         # NCF head: hidden sizes of an MLP on [user, item]; () = none
    init_std: float = 0.01         # factors start ~ N(0, init_std²); biases at 0
    l2: float = 0.0                # L2 penalty on the rows a batch touches, per rating
    rating_range: tuple | None = None   # (low, high): clamp predictions when evaluating
    dtype: torch.dtype = torch.float32  # of both tables (and their optimizer state)
    pin: bool = True               # register host memory with CUDA (zero-copy)


class MatrixFactorization(nn.Module):
    """Explicit-feedback recommender: ``r̂ = μ + b_u + b_i + p_u·q_i [+ MLP([p_u, q_i])]``.

    Args:
        num_users, num_items: rows of the two tables.
        dim: factors per user and per item.
        config: :class:`MFConfig` (NCF head, initialisation, L2, rating range).
        device: compute device (``"auto"``: the GPU when there is one).

    Each table row is ``[factors | bias]``: one lookup per side brings both (one gather
    instead of two; a 4-byte bias row alone would waste most of each transfer). ``μ``
    (:attr:`global_bias`) and the MLP are ordinary parameters on the compute device, trained
    by the same :class:`~nbtools.OffloadOptimizer`.
    """

    def __init__(self, num_users: int, num_items: int, dim: int, *,
                 config: MFConfig | None = None, device="auto"):
        super().__init__()
        self.config = cfg = config or MFConfig()
        self.device = resolve_device(device)
        self.dim = dim
        kw = dict(dtype=cfg.dtype, device=self.device, pin=cfg.pin)
        self.users = OffloadedEmbedding(num_users, dim + 1, name="users", **kw)
        self.items = OffloadedEmbedding(num_items, dim + 1, name="items", **kw)
        with torch.no_grad():
            for table in (self.users, self.items):
                table.weight[:, :dim].normal_(0.0, cfg.init_std)
                table.weight[:, dim].zero_()
        self.global_bias = nn.Parameter(torch.zeros((), device=self.device))
        self.mlp = None
        if cfg.mlp_hidden:
            layers, width = [], 2 * dim
            for h in cfg.mlp_hidden:
                layers += [nn.Linear(width, h), nn.ReLU()]
                width = h
            layers.append(nn.Linear(width, 1))
            nn.init.zeros_(layers[-1].weight)     # starts as plain MF; the head learns a correction
            nn.init.zeros_(layers[-1].bias)
            self.mlp = nn.Sequential(*layers).to(self.device)

    @property
    def num_users(self) -> int:
        return self.users.num_embeddings

    @property
    def num_items(self) -> int:
        return self.items.num_embeddings

    def set_global_bias(self, ratings) -> None:
        """Start ``μ`` at the mean training rating (saves the first epoch from learning it)."""
        with torch.no_grad():
            self.global_bias.fill_(float(torch.as_tensor(ratings, dtype=torch.float64).mean()))

    def _score(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Predictions from rows ``[factors | bias]`` of matching shapes [..., dim + 1]."""
        d = self.dim
        pred = (p[..., :d] * q[..., :d]).sum(-1) + p[..., d] + q[..., d] + self.global_bias
        if self.mlp is not None:
            pf, qf = torch.broadcast_tensors(p[..., :d], q[..., :d])
            pred = pred + self.mlp(torch.cat((pf, qf), -1)).squeeze(-1)
        return pred

    def forward(self, users, items) -> torch.Tensor:
        """Predicted ratings for pairs of user and item ids (same shape as the ids)."""
        users = torch.as_tensor(users).to(self.device).long()
        items = torch.as_tensor(items).to(self.device).long()
        return self._score(self.users(users), self.items(items))

    def loss(self, users, items, ratings) -> torch.Tensor:
        """Mean squared error of a batch (plus ``l2`` times the touched rows' squared norms)."""
        p, q = self.users(users.to(self.device).long()), self.items(items.to(self.device).long())
        err = self._score(p, q) - ratings.to(self.device, p.dtype)
        loss = err.square().mean()
        if self.config.l2:
            d = self.dim
            loss = loss + self.config.l2 * (p[:, :d].square().sum(1) + q[:, :d].square().sum(1)).mean()
        return loss

    @torch.no_grad()
    def predict(self, users, items, *, batch_size: int = 1 << 16) -> torch.Tensor:
        """Predictions (CPU float32), in batches, clamped to ``config.rating_range`` if set."""
        users, items = torch.as_tensor(users), torch.as_tensor(items)
        out = torch.cat([self(users[s:s + batch_size], items[s:s + batch_size]).float().cpu()
                         for s in range(0, users.numel(), batch_size)]) if users.numel() else \
            torch.empty(0)
        if self.config.rating_range is not None:
            out.clamp_(*self.config.rating_range)
        return out

    @torch.no_grad()
    def recommend(self, user: int, k: int = 10, *, exclude=None, chunk_items: int = 65536):
        """The ``k`` items with the highest predicted rating for ``user``.

        ``exclude``: item ids not to recommend (e.g. the ones the user already rated).
        Scores items in chunks on the compute device. Returns ``(item_ids, scores)`` (CPU).
        """
        if not 0 <= int(user) < self.num_users:
            raise IndexError(f"user {user} is outside 0..{self.num_users - 1}")
        p = self.users(torch.tensor([int(user)], device=self.device))       # [1, dim + 1]
        best_scores = torch.empty(0)
        best_ids = torch.empty(0, dtype=torch.long)
        skip = torch.as_tensor(exclude if exclude is not None else [], dtype=torch.long)
        for start in range(0, self.num_items, chunk_items):
            ids = torch.arange(start, min(start + chunk_items, self.num_items))
            scores = self._score(p, self.items(ids.to(self.device))).float().cpu()
            scores[torch.isin(ids, skip)] = -math.inf
            scores, ids = torch.cat((best_scores, scores)), torch.cat((best_ids, ids))
            best_scores, top = scores.topk(min(k, scores.numel()))
            best_ids = ids[top]
        keep = torch.isfinite(best_scores)
        return best_ids[keep], best_scores[keep]


def holdout(*tensors, fraction: float = 0.1, seed: int = 0):
    """Split samples at random into ``(train, test)``, each a tuple of the tensors' rows.

    The split depends only on ``seed``, so a resumed run trains on the same samples.

    >>> (tr_x, tr_y), (te_x, te_y) = holdout(torch.arange(10), torch.arange(10) * 2, fraction=0.2)
    >>> len(tr_x), len(te_x), torch.equal(te_y, te_x * 2)
    (8, 2, True)
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    n = tensors[0].shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    test, train_ = order[: round(n * fraction)], order[round(n * fraction):]
    return tuple(t[train_] for t in tensors), tuple(t[test] for t in tensors)


@torch.no_grad()
def evaluate_rmse(model: MatrixFactorization, users, items, ratings, *,
                  batch_size: int = 1 << 16) -> float:
    """Root mean squared error of ``model`` on held-out ratings (predictions clamped to
    ``model.config.rating_range`` when set)."""
    pred = model.predict(users, items, batch_size=batch_size)
    ratings = torch.as_tensor(ratings, dtype=torch.float32).reshape(-1)
    if pred.numel() != ratings.numel():
        raise ValueError(f"{pred.numel():,} (user, item) pairs but {ratings.numel():,} ratings")
    return float((pred - ratings).square().mean().sqrt()) if ratings.numel() else math.nan


# --- the training loop ------------------------------------------------------------------------

def train(model: nn.Module, loader: PinnedLoader, optimizer: OffloadOptimizer, *, epochs: int,
          dashboard=None, checkpoints=None, every: int = 1000, log_every: int | None = None,
          progress: bool = True) -> dict:
    """Train ``model`` for ``epochs`` passes over ``loader``, resuming from a checkpoint.

    Args:
        model: a module with ``loss(*batch) -> scalar``.
        loader: a :class:`~nbtools.PinnedLoader` (its position is part of each checkpoint).
        optimizer: an :class:`~nbtools.OffloadOptimizer` over the model.
        epochs: total passes over the data, counting those done before a resume.
        dashboard: a :class:`~nbtools.Dashboard` (or anything with ``step(n)``); updated from
            this loop's thread, which is what works in Colab.
        checkpoints: a :class:`~nbtools.CheckpointManager`. The newest checkpoint is restored
            first (model, optimizer, loader, step, history); then one is saved every ``every``
            steps and at the end. A disconnect loses at most ``every`` steps. Running the cell
            again after training finished restores the last checkpoint and trains nothing.
        every: steps between checkpoints.
        log_every: steps between loss records (default: ~100 records over the run, at most
            one per 100 steps). Reading the loss is a GPU sync, so not every step.
        progress: a tqdm bar when there is no dashboard.

    Returns:
        The history, ``{"step": [...], "epoch": [...], "loss": [...], "time_s": [...]}``: mean
        loss over each ``log_every`` steps, and training seconds so far (across resumes).
    """
    if every < 1:
        raise ValueError(f"every must be a positive number of steps, got {every!r}")
    history = {"step": [], "epoch": [], "loss": [], "time_s": []}
    step = 0
    if checkpoints is not None:
        step = checkpoints.restore(model=model, optimizer=optimizer, loader=loader,
                                   history=history) or 0
    per_epoch = len(loader)
    total = epochs * per_epoch
    if log_every is None:
        log_every = min(100, max(1, total // 100))
    elapsed = history["time_s"][-1] if history["time_s"] else 0.0
    bar = None
    if progress and dashboard is None:
        from tqdm.auto import tqdm     # only when asked: import nbtools stays light
        bar = tqdm(total=total, initial=min(step, total), unit="step", desc="training")
    running, count = None, 0            # loss summed on the device since the last record
    t0 = time.perf_counter()
    try:
        while True:
            if loader.position >= per_epoch:       # saved after an epoch's last batch
                loader.set_epoch(loader.epoch + 1)
            if loader.epoch >= epochs:
                break
            for batch in loader:
                loss = model.loss(*batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                running = loss.detach() if running is None else running + loss.detach()
                count += 1
                if dashboard is not None:
                    dashboard.step(batch[0].shape[0])
                if bar is not None:
                    bar.update(1)
                if step % log_every == 0:
                    mean = float(running) / count       # note: a CPU-GPU sync point
                    history["step"].append(step)
                    history["epoch"].append(step / per_epoch)
                    history["loss"].append(mean)
                    history["time_s"].append(elapsed + time.perf_counter() - t0)
                    running, count = None, 0
                    if bar is not None:
                        bar.set_postfix(loss=f"{mean:.4f}")
                if checkpoints is not None and step % every == 0:
                    checkpoints.save(step, model=model, optimizer=optimizer, loader=loader,
                                     history=history)
        if checkpoints is not None and checkpoints.latest_step() != step:
            checkpoints.save(step, model=model, optimizer=optimizer, loader=loader,
                             history=history)
    finally:
        if bar is not None:
            bar.close()
    return history
