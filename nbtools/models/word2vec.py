"""word2vec: skip-gram with negative sampling (SGNS) over two offloaded tables.

Input and output vectors are :class:`~nbtools.OffloadedEmbedding` tables; negatives are drawn on
the compute device from the unigram distribution raised to 3/4. :class:`CorpusLoader` redraws
word2vec's subsampling and dynamic windows every epoch, on the compute device.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import resolve_device
from ..distributed import ShardedEmbedding, world_of
from ..loader import mix_int, check_resume, permutation
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
    centers, contexts = [], []
    for _, left, right, fwd, bwd in _windows(ids, window, keep_prob, dynamic, generator):
        # converted piece by piece: the int64 pieces of a large corpus would double the peak
        centers += [left[fwd].to(dtype), right[bwd].to(dtype)]
        contexts += [right[fwd].to(dtype), left[bwd].to(dtype)]
    if not centers:
        empty = torch.empty(0, dtype=dtype, device=torch.as_tensor(ids).device)
        return empty, empty.clone()
    return torch.cat(centers), torch.cat(contexts)


def count_pairs(ids, window: int = 5, *, keep_prob=None, dynamic: bool = True,
                generator: torch.Generator | None = None) -> int:
    """How many pairs :func:`pairs_from_corpus` would return with the same arguments and
    generator state, without making them (the same draws, one count per distance).

    >>> ids = torch.tensor([0, 1, 2, 1, 0, 3, 1, 2])
    >>> count_pairs(ids, 2, dynamic=False), pairs_from_corpus(ids, 2, dynamic=False)[0].numel()
    (26, 26)
    """
    total = torch.zeros((), dtype=torch.int64, device=torch.as_tensor(ids).device)
    for _, left, right, fwd, bwd in _windows(ids, window, keep_prob, dynamic, generator):
        total += fwd.sum() + bwd.sum()
    return int(total)                 # one sync, after every distance


def _windows(ids, window, keep_prob, dynamic, generator):
    """Draw subsampling and windows; yield ``(d, left, right, fwd, bwd)`` for each distance
    ``d``: ``fwd`` masks the pairs (center ``left``, context ``right``), ``bwd`` the reverse."""
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
    for d in range(1, min(window, n - 1) + 1):        # a loop over distances, not tokens
        left, right = ids[:-d], ids[d:]
        ok = (left >= 0) & (right >= 0) & (sentence[:-d] == sentence[d:])
        fwd = ok & (radius[:-d] >= d) if dynamic else ok     # center left, context right
        bwd = ok & (radius[d:] >= d) if dynamic else ok      # center right, context left
        yield d, left, right, fwd, bwd


def check_generator_state(state, generator: torch.Generator, kind: str) -> None:
    """Raise (ValueError) where ``state["generator"]`` would not load into ``generator``
    (a model's extra state; :meth:`SkipGram.set_extra_state`): not a dict, no generator
    state, or one of another dtype or size. A state with its values (not shape-only) is tried
    on a scratch generator of the same kind."""
    if not isinstance(state, dict) or "generator" not in state:
        raise ValueError(f"{kind} extra state is {type(state).__name__}"
                         f"{'' if not isinstance(state, dict) else ' without a generator'}, "
                         "expected a dict holding the negatives' generator state")
    saved, live = state["generator"], generator.get_state()
    if not isinstance(saved, torch.Tensor) or saved.dtype != live.dtype \
            or tuple(saved.shape) != tuple(live.shape):
        shown = f"{saved.dtype} {tuple(saved.shape)}" if isinstance(saved, torch.Tensor) \
            else type(saved).__name__
        raise ValueError(f"{kind} extra state's generator state is {shown}, expected "
                         f"{live.dtype} {tuple(live.shape)}")
    if saved.device.type != "meta":
        try:
            torch.Generator(device=generator.device).set_state(saved.cpu())
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{kind} extra state's generator state does not load "
                             f"({type(e).__name__}: {str(e)[:120]})") from None


class CorpusLoader:
    """Batches of (center, context) pairs whose subsampling and windows are redrawn each epoch.

    word2vec draws which frequent words to drop and each word's window afresh on every pass
    over the corpus; pairs made once and reshuffled would show the model one draw five times.
    This loader keeps only the token ids (int32, on the compute device) and makes each epoch's
    pairs there when the epoch starts, with :func:`pairs_from_corpus`, then hands out shuffled
    batches as views. The corpus is cut into pieces of ``chunk_tokens`` tokens, and only one
    piece's pairs exist at a time (at most ``6 * chunk_tokens`` pairs at ``window=5``: 200 MB of
    int32 for the default 4M tokens, plus ~1 GB for a moment while they are shuffled), so memory
    does not grow with the corpus; a piece's edge acts as a sentence break.

    Everything an epoch draws depends only on ``(seed, epoch, piece)``: a run resumed from
    :meth:`state_dict` sees the same batches as one never interrupted. The number of pairs (so
    ``len(loader)``, batches per epoch) varies a little from epoch to epoch.

    Args:
        ids: 1-D integer tensor of token ids (``-1`` marks a sentence break, as in
            :func:`pairs_from_corpus`).
        batch_size: pairs per batch; batches run across pieces, only the epoch's last one is
            smaller.
        window: largest distance between a center and its context (each center draws its own
            window from ``1..window``, as word2vec).
        keep_prob: per-id keep probabilities (:func:`keep_probabilities`), or ``None`` to keep
            every token.
        seed: the draws of epoch ``e`` depend only on ``(seed, e)``.
        device: where pairs are made and batches live (``"auto"``: the GPU when there is one).
        chunk_tokens: tokens per piece.

        rank, world: a data-parallel job (docs/distributed.md): rank ``rank`` of ``world`` gets
            its own slice of every global batch. Every rank builds the loader from the same
            ids and seed and makes the same pairs; global batch ``b`` is the ranks' batches
            ``b`` in rank order (``batch_size`` is per rank), so ``world`` ranks of
            ``batch_size`` see the batches of one loader of ``world * batch_size``. The last
            global batch of an epoch is split evenly (its last ``< world`` pairs are left out):
            every rank gets the same number of batches, of the same size.

    The loop protocol is :class:`~nbtools.PinnedLoader`'s (``epoch``, ``position``,
    ``len()``, ``set_epoch``, ``state_dict``), so :func:`~nbtools.models.train` takes either.

    >>> ids = torch.tensor([0, 1, 2, 1, 0, 3, 1, 2] * 4)
    >>> loader = CorpusLoader(ids, batch_size=16, window=2, device="cpu", seed=1)
    >>> first = torch.cat([c for c, _ in loader]); second = torch.cat([c for c, _ in loader])
    >>> loader.epoch, first.numel() > 0, torch.equal(first, second)
    (2, True, False)
    """

    def __init__(self, ids, batch_size: int, *, window: int = 5, keep_prob=None, seed: int = 0,
                 device="auto", chunk_tokens: int = 1 << 22, rank: int = 0, world: int = 1):
        ids = torch.as_tensor(ids)
        if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"ids must be a 1-D integer tensor, got {ids.dtype} of shape "
                            f"{tuple(ids.shape)}")
        for name, value in (("batch_size", batch_size), ("window", window),
                            ("chunk_tokens", chunk_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (rank, world)) \
                or world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank must be in 0..world-1 and world at least 1, got rank="
                             f"{rank!r}, world={world!r}")
        self.rank, self.world = rank, world
        self.device = resolve_device(device)
        if ids.numel() and int(ids.max()) >= 2**31:
            raise ValueError(f"ids go up to {int(ids.max()):,}; CorpusLoader keeps int32 ids")
        self.ids = ids.to(self.device, torch.int32)
        self.keep_prob = None if keep_prob is None else \
            torch.as_tensor(keep_prob, dtype=torch.float32).to(self.device)
        if self.keep_prob is not None and self.ids.numel() and \
                int(self.ids.max()) >= self.keep_prob.numel():
            raise ValueError(f"keep_prob has {self.keep_prob.numel():,} entries but ids go up to "
                             f"{int(self.ids.max()):,}; pass one probability per word")
        self.batch_size, self.window, self.seed = batch_size, window, seed
        self.chunk_tokens = chunk_tokens
        self.epoch = 0
        self.position = 0          # batches of `epoch` already handed out
        self._sizes = None         # (epoch, pairs in each piece)
        self._piece = None         # (epoch, piece, centers, contexts): the last piece made

    @property
    def num_pieces(self) -> int:
        return max(1, -(-self.ids.numel() // self.chunk_tokens))

    def _piece_args(self, epoch: int, piece: int, seed: int | None = None):
        """(token ids, seeded generator, key) of one piece in ``epoch`` (with ``seed``, default
        the loader's)."""
        key = mix_int(mix_int(mix_int(self.seed if seed is None else seed) + epoch) + piece)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(key & ((1 << 63) - 1))
        lo = piece * self.chunk_tokens
        return self.ids[lo:lo + self.chunk_tokens], gen, key

    def _draw(self, epoch: int, piece: int):
        """Shuffled (centers, contexts) of one piece of the corpus in ``epoch``, int32."""
        if self._piece is not None and self._piece[:2] == (epoch, piece):
            return self._piece[2:]
        self._piece = None           # free the previous piece's pairs first
        ids, gen, key = self._piece_args(epoch, piece)
        centers, contexts = pairs_from_corpus(ids, self.window, keep_prob=self.keep_prob,
                                              generator=gen)
        # pairs come ordered by distance: shuffle them (the same order on every device)
        order = permutation(centers.numel(), key, 0, self.device)
        self._piece = (epoch, piece, centers[order], contexts[order])
        return self._piece[2:]

    def piece_sizes(self, epoch: int | None = None) -> list:
        """Pairs in each piece of the corpus in ``epoch`` (default: the current one), counted
        with the draws that will make them, without making them."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self._sizes is None or self._sizes[0] != epoch:
            self._sizes = (epoch, self._count_pairs(epoch, self.seed))
        return self._sizes[1]

    def _count_pairs(self, epoch: int, seed: int) -> list:
        sizes = []
        for p in range(self.num_pieces):
            ids, gen, _ = self._piece_args(epoch, p, seed)
            sizes.append(count_pairs(ids, self.window, keep_prob=self.keep_prob, generator=gen))
        return sizes

    @property
    def num_samples(self) -> int:
        """Pairs in the current epoch."""
        return sum(self.piece_sizes())

    def __len__(self) -> int:
        """Batches in the current epoch (the same on every rank)."""
        return self._batches(self.epoch, self.seed)

    def _batches(self, epoch: int, seed: int) -> int:
        """Batches in ``epoch`` drawn with ``seed`` (pairs differ from epoch to epoch with
        ``keep_prob``); the loader's caches are kept for its own seed."""
        sizes = self.piece_sizes(epoch) if seed == self.seed else self._count_pairs(epoch, seed)
        n, step = sum(sizes), self.batch_size * self.world
        return n // step + (n % step >= self.world)

    def _bounds(self, b: int, total: int) -> tuple[int, int]:
        """Pairs ``[lo, hi)`` of the epoch's ``total`` that this rank's batch ``b`` holds: its
        slice of global batch ``b`` (the last one split evenly over the ranks)."""
        start = b * self.batch_size * self.world
        size = min(self.batch_size, (total - start) // self.world)
        lo = start + self.rank * size
        return lo, lo + size

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch at the next iteration."""
        self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict:
        """``{"seed", "epoch", "position", "batch_size", "window", "tokens", "chunk_tokens"}``;
        ``position`` counts the batches of ``epoch`` already handed out."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch_size": self.batch_size, "window": self.window,
                "tokens": self.ids.numel(), "chunk_tokens": self.chunk_tokens,
                "rank": self.rank, "world": self.world}

    def check_state_dict(self, state: dict) -> None:
        """Raise (KeyError, ValueError) where ``state`` would not resume this loader: another
        corpus or settings, a seed, epoch or position that is not a whole number, or a
        position outside its epoch. Changes nothing; a checkpoint's restore runs it before it
        touches any object."""
        if not isinstance(state, dict):
            raise ValueError(f"CorpusLoader state is a {type(state).__name__}, expected the "
                             "dict returned by CorpusLoader.state_dict()")
        check_resume(state, self.state_dict(),
                     ("batch_size", "window", "tokens", "chunk_tokens", "rank", "world"),
                     "CorpusLoader", "corpus")
        for key in ("seed", "epoch", "position"):
            value = state[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"CorpusLoader state has {key}={value!r} "
                                 f"({type(value).__name__}), expected a whole number (int)")
        if state["epoch"] < 0:
            raise ValueError(f"CorpusLoader state has epoch={state['epoch']}, expected >= 0")
        batches = self._batches(state["epoch"], state["seed"])
        if not 0 <= state["position"] <= batches:
            raise ValueError(f"CorpusLoader state has position={state['position']}, outside "
                             f"0..{batches} (batches in its epoch {state['epoch']})")

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one that would have followed."""
        self.check_state_dict(state)
        if state["seed"] != self.seed:        # the pieces made and counted were another seed's
            self._sizes = self._piece = None
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self.position = int(state["position"])

    def __iter__(self):
        nb = len(self)
        if 0 < nb <= self.position:   # a state saved after the last batch means the next epoch
            self.epoch, self.position = self.epoch + 1, 0
            nb = len(self)
        epoch, b = self.epoch, self.position
        sizes = self.piece_sizes(epoch)
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        while b < nb:
            lo, hi = self._bounds(b, starts[-1])
            parts = []
            for p in range(len(sizes)):           # the pieces this batch overlaps
                if starts[p] < hi and lo < starts[p + 1]:
                    centers, contexts = self._draw(epoch, p)
                    a, z = max(lo, starts[p]) - starts[p], min(hi, starts[p + 1]) - starts[p]
                    parts.append((centers[a:z], contexts[a:z]))
            batch = parts[0] if len(parts) == 1 else \
                tuple(torch.cat(t) for t in zip(*parts))
            b += 1
            self.position = b
            yield batch
        self.epoch, self.position = epoch + 1, 0

    def __repr__(self):
        ranks = f", rank={self.rank} of {self.world}" if self.world > 1 else ""
        return (f"CorpusLoader({self.ids.numel():,} tokens, batch_size={self.batch_size}, "
                f"window={self.window}, device={self.device}, seed={self.seed}{ranks}, "
                f"epoch={self.epoch}, position={self.position})")


@dataclasses.dataclass
class SkipGramConfig:
    """Settings of :class:`SkipGram` (word2vec's defaults where it has one)."""

    negatives: int = 5             # noise words per (center, context) pair
    noise_power: float = 0.75      # negatives ~ count ** noise_power (word2vec's 3/4)
    dtype: torch.dtype = torch.float32   # of both tables' weights (bf16: half the bytes)
    state_dtype: torch.dtype | None = None   # of their optimizer state (None: fp32 for bf16)
    rounding: str = "nearest"      # low-precision writes: "nearest" or "stochastic"
    pin: bool = True               # register host memory with CUDA (zero-copy)
    seed: int = 0                  # negatives; their generator is saved with the model
    skip_context_negatives: bool = True   # drop a drawn negative equal to the context (word2vec)
    placement: str = "auto"        # both tables: "host" (pinned RAM), "gpu", "auto" (GPU if fits)
    # Host tables: keep this share of each table's rows (the most frequent words, from the
    # counts) in a GPU cache of hot rows, with their optimizer state. None: no cache.
    cache_share: float | None = None
    # Warm both tables' caches (a GPU cache, a disk table's GPU level and RAM) from the counts,
    # the most frequent words first, when the optimizer attaches: the first steps hit as a
    # long run's do. A no-op for tables without a cache; False: they start cold.
    warm: bool = True


@torch.no_grad()
def _uniform_rows(table, bound: float, generator: torch.Generator,
                  chunk_rows: int = 1 << 18) -> None:
    """Rows uniform in ``±bound``, drawn in float32 on the CPU from ``generator``, ``chunk_rows``
    rows at a time: the same values whatever the table's placement, device and dtype. A
    :class:`~nbtools.distributed.ShardedEmbedding` keeps its rows of the whole table's draw
    (global rows ``rank, rank + world, ...``): the same vectors on any number of ranks."""
    rank, world = getattr(table, "rank", 0), getattr(table, "world", 1)
    w, n = table.weight, table.num_embeddings
    block = torch.empty(min(chunk_rows, n), w.shape[1])
    for start in range(0, n, chunk_rows):
        rows = block[: min(chunk_rows, n - start)]
        rows.uniform_(-bound, bound, generator=generator)
        first = start + (rank - start) % world        # this rank's first row in the chunk
        mine = rows[first - start::world]
        w[first // world:first // world + mine.shape[0]].copy_(mine)


class SkipGram(nn.Module):
    """word2vec skip-gram with negative sampling, with both tables in host memory.

    Args:
        vocab_size: number of words (rows of each table).
        dim: vector size.
        counts: occurrences of each word in the corpus (or their shares): the noise
            distribution is ``counts ** 0.75``, and tables with a cache start with the most
            frequent words in it (``config.warm``). ``None`` draws negatives uniformly.
        words: the word of each id (for :meth:`most_similar` and :meth:`analogy` by word).
        config: :class:`SkipGramConfig`.
        device: compute device (``"auto"``: the GPU when there is one).

    ``loss(centers, contexts)`` is the mean over pairs of
    ``-log σ(u_ctx·v_c) - Σ_k log σ(-u_neg_k·v_c)``, with ``v`` from the input table and ``u``
    from the output table. Input vectors start uniform in ±0.5/dim, output vectors at zero, as
    in word2vec, drawn from ``config.seed`` (as the negatives are). The word vectors are
    ``model.input.weight`` (host memory), or :meth:`vectors`.

    Several processes (``process_group``, or ``torch.distributed`` initialised: a data-parallel
    job, docs/distributed.md): both tables are
    :class:`~nbtools.distributed.ShardedEmbedding` over the group, each rank holding every
    ``world``-th word; the initial vectors are the one-process model's. Each rank draws the
    negatives of the whole global batch and keeps its slice, so ``world`` ranks of ``B`` pairs
    (``CorpusLoader(..., rank=, world=)``, ``nbtools.distributed.data_parallel(model)``) train
    as one process on their ``world * B`` pairs. :meth:`vectors` gathers the vectors (every
    rank calls it); :meth:`most_similar` and :meth:`analogy` need one process.
    """

    def __init__(self, vocab_size: int, dim: int, *, counts=None, words=None,
                 config: SkipGramConfig | None = None, device="auto", process_group=None):
        super().__init__()
        self.config = cfg = config or SkipGramConfig()
        self.device = resolve_device(device)
        self.rank, self.world = world_of(process_group)
        if words is not None and len(words) != vocab_size:
            raise ValueError(f"words has {len(words):,} entries but vocab_size is {vocab_size:,}")
        self.words = list(words) if words is not None else None
        self._index = None
        kw = dict(dtype=cfg.dtype, state_dtype=cfg.state_dtype, rounding=cfg.rounding,
                  device=self.device, pin=cfg.pin, placement=cfg.placement)
        if cfg.cache_share is not None:
            if not 0 < cfg.cache_share <= 1:
                raise ValueError(f"cache_share must be in (0, 1], got {cfg.cache_share!r}")
            shard_rows = len(range(self.rank, vocab_size, self.world))
            kw["cache_rows"] = max(1, int(cfg.cache_share * shard_rows))
        # initial vectors from the config's seed, not torch's global stream: the same seed makes
        # the same model on every placement and device, and building one leaves the caller's
        # stream as it was (the tables' own N(0, 1) rows, drawn from it, are overwritten)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if self.world == 1:
                self.input = OffloadedEmbedding(vocab_size, dim, name="input", **kw)
                self.output = OffloadedEmbedding(vocab_size, dim, name="output", **kw)
            else:
                self.input = ShardedEmbedding(vocab_size, dim, name="input",
                                              process_group=process_group, **kw)
                self.output = ShardedEmbedding(vocab_size, dim, name="output",
                                               process_group=process_group, **kw)
        _uniform_rows(self.input, 0.5 / dim, torch.Generator().manual_seed(cfg.seed))
        with torch.no_grad():
            self.output.weight.zero_()
        given = counts is not None
        if counts is None:
            counts = torch.ones(vocab_size)
        # on the CPU: the noise CDF below is a float cumsum, which on CUDA adds in an order
        # that changes from run to run
        counts = torch.as_tensor(counts, dtype=torch.float64).reshape(-1).cpu()
        if counts.numel() != vocab_size or (counts < 0).any() or counts.sum() <= 0:
            raise ValueError(f"counts must hold {vocab_size:,} non-negative numbers, not all "
                             f"zero; got shape {tuple(counts.shape)}")
        if cfg.warm and (given or cfg.cache_share is not None):   # the most frequent words
            for table in (self.input, self.output):                 # first (each rank its own)
                table.warm_cache(counts)
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
        return self._noise_ids(u)

    def _noise_ids(self, u: torch.Tensor) -> torch.Tensor:
        """The noise distribution's ids at uniforms ``u`` (inverse CDF)."""
        ids = torch.searchsorted(self._noise_cdf, u, right=True)
        return ids.clamp_(max=self.vocab_size - 1)     # u within rounding of 1.0

    def loss(self, centers, contexts, negatives=None) -> torch.Tensor:
        """Mean SGNS loss of a batch of pairs; ``negatives`` [B, k] are drawn when not given.

        A drawn negative equal to its pair's context is skipped, as word2vec does: it adds
        nothing to the loss nor to any gradient (``config.skip_context_negatives``). Negatives
        passed in are used as given.
        """
        # int64 on the device: tables take any integer ids, but their CPU scatter wants int64
        centers = centers.to(self.device).long()
        contexts = contexts.to(self.device).long().reshape(-1, 1)
        keep = None
        if negatives is None:
            n, k = centers.shape[0], self.config.negatives
            if self.world == 1:
                negatives = self.sample_negatives(n, k)
            else:       # the global batch's draws, this rank's rows: one process's negatives
                u = torch.rand((n * self.world, k), generator=self.generator,
                               dtype=torch.float64, device=self.device)
                negatives = self._noise_ids(u[self.rank * n:(self.rank + 1) * n])
            if self.config.skip_context_negatives:
                keep = negatives != contexts                             # [B, k]
                # A skipped negative looks up its pair's context instead: that row is read
                # anyway, so no extra row is touched (a lazy optimizer would otherwise step
                # it with a zero gradient).
                negatives = torch.where(keep, negatives, contexts)
        v = self.input(centers)                                          # [B, d]
        # Context and negatives in one lookup: one deduplication, one gather.
        u = self.output(torch.cat((contexts, negatives.to(self.device).long()), 1))  # [B, 1+k, d]
        scores = torch.bmm(u, v.unsqueeze(2)).squeeze(2)                 # [B, 1 + k]
        negative = F.logsigmoid(-scores[:, 1:])
        if keep is not None:
            negative = negative * keep
        return -(F.logsigmoid(scores[:, 0]) + negative.sum(1)).mean()

    forward = loss

    # Negatives' generator state travels with the model's state_dict (and so with checkpoints).
    def get_extra_state(self):
        return {"generator": self.generator.get_state()}

    def check_extra_state(self, state) -> None:
        """Raise (ValueError, TypeError, KeyError) where :meth:`set_extra_state` would refuse
        ``state``; changes nothing."""
        check_generator_state(state, self.generator, "SkipGram")

    def set_extra_state(self, state) -> None:
        self.check_extra_state(state)
        self.generator.set_state(state["generator"].cpu())

    # --- looking at the vectors ---------------------------------------------------------------
    def vectors(self) -> torch.Tensor:
        """Every word's input vector, ``[vocab_size, dim]`` float32 on the CPU (a copy). A
        sharded model gathers them from every rank: a collective, call it on every rank
        (``wordsim.evaluate((model.words, model.vectors()))``)."""
        if self.world > 1:
            return self.input.gather_full().float()
        return self.input.read_weight().detach().float().cpu().clone()

    def _one_process(self, what: str) -> None:
        if self.world > 1:
            raise RuntimeError(
                f"{what}: this model's vectors are split over {self.world} ranks; gather them "
                "with model.vectors() (on every rank) and look words up in one process, e.g. "
                "wordsim.evaluate((model.words, vectors)), or restore a checkpoint there")

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
        self._one_process("vector()")
        return self.input.read_weight()[self._id(word_or_id)].float().cpu().clone()

    def most_similar(self, word_or_id, k: int = 10, *, chunk_rows: int = 65536) -> list:
        """The ``k`` words whose input vectors have the highest cosine similarity.

        ``word_or_id``: a word, an id, or a vector. Computed on the host table in chunks of
        ``chunk_rows`` rows (never a full copy). Returns ``[(word or id, cosine), ...]``.
        """
        self._one_process("most_similar()")
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
        self._one_process("analogy()")
        ids = [self._id(w) for w in (a, b, c)]
        va, vb, vc = (F.normalize(self.vector(i), dim=0) for i in ids)
        return self._nearest(vb - va + vc, k, ids, chunk_rows)

    @torch.no_grad()
    def _nearest(self, query: torch.Tensor, k: int, exclude, chunk_rows: int) -> list:
        weight = self.input.read_weight()   # host view (waits for the GPU once) or GPU rows
        query = F.normalize(query, dim=0).to(weight.device)
        k = min(k, self.vocab_size - len(exclude))
        best_scores = torch.empty(0)
        best_ids = torch.empty(0, dtype=torch.long)
        for start in range(0, self.vocab_size, chunk_rows):
            rows = weight[start:start + chunk_rows].float()
            sims = (rows @ query / rows.norm(dim=1).clamp_min(1e-12)).cpu()
            for i in exclude:
                if start <= i < start + rows.shape[0]:
                    sims[i - start] = -math.inf
            scores = torch.cat((best_scores, sims))
            ids = torch.cat((best_ids, torch.arange(start, start + rows.shape[0])))
            best_scores, top = scores.topk(min(k, scores.numel()))
            best_ids = ids[top]
        return [(self._label(int(i)), float(s)) for i, s in zip(best_ids, best_scores)]
