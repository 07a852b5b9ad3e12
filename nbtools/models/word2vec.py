"""word2vec: skip-gram with negative sampling (SGNS) over two offloaded tables.

Input and output vectors are :class:`~nbtools.OffloadedEmbedding` tables; negatives are drawn on
the compute device from the unigram distribution raised to 3/4.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import resolve_device
from ..tables import OffloadedEmbedding

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
