"""A recommender: matrix factorization with an optional NCF head, over two offloaded tables.

Explicit feedback (``loss="mse"`` on ratings) or implicit feedback (``"bce"``, ``"bpr"`` or
``"softmax"`` with negatives sampled on the compute device, uniformly or by popularity, skipping
the items a user has seen). :func:`fit` trains it through :func:`~nbtools.models.train`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..data import Ratings
from ..devices import resolve_device
from ..distributed import ShardedEmbedding, world_of
from ..loader import mix_int
from ..tables import OffloadedEmbedding
from .word2vec import check_generator_state
from .ranking import Interactions, leave_last_out, ranking_metrics, recency, sample_candidates, take

# --- recommender ------------------------------------------------------------------------------

@dataclasses.dataclass
class MFConfig:
    """Settings of :class:`MatrixFactorization`."""

    mlp_hidden: tuple = ()         # NCF head: hidden sizes of an MLP on [user, item]; () = none
    init_std: float = 0.01         # factors start ~ N(0, init_std²); biases at 0
    # L2 penalty on the factors of the rows a batch touches, per rating. None: 0.1 for "mse" and
    # 0.01 for the implicit losses, the values measured on MovieLens-100K (RATINGS_DEFAULTS,
    # RANKING_DEFAULTS); with no L2, "mse" overfits to a worse RMSE than the global mean.
    l2: float | None = None
    l2_bias: float = 0.0           # the same for the rows' biases
    # (low, high): clamp predictions (predict, evaluate_rmse). None: the lowest and highest
    # rating fit() trained on; clamp=False: never clamp.
    rating_range: tuple | None = None
    clamp: bool = True
    loss: str = "mse"              # "mse" on ratings; implicit, with sampled negatives: "bce",
                                   # "bpr" or "softmax" (cross-entropy over [positive, negatives])
    negatives: int = 4             # sampled items per positive (implicit losses)
    sampling: str = "uniform"      # "uniform", or "popularity": ∝ count ** popularity_power
    popularity_power: float = 0.75
    exclude_seen: bool = True      # redraw negatives the user has seen (after set_seen)
    recency_weight: float = 0.0    # implicit losses, in fit(): a user's latest interactions weigh
                                   # 1 + recency_weight * 0.5 ** (later ones / recency_half_life)
                                   # (then scaled to mean 1); tastes drift, and the next item is
                                   # closer to the last few than to the first (needs timestamps)
    recency_half_life: float = 5.0
    dtype: torch.dtype = torch.float32  # of both tables' weights (bf16: half the bytes)
    state_dtype: torch.dtype | None = None   # of their optimizer state (None: fp32 for bf16)
    rounding: str = "nearest"      # low-precision writes: "nearest" or "stochastic"
    pin: bool = True               # register host memory with CUDA (zero-copy)
    placement: str = "host"        # both tables (OffloadedEmbedding's placement: "host", "gpu",
                                   # "disk" with a RAM cache of hot rows, "auto")
    warm: bool = True              # fit() warms the tables' caches (a disk table's RAM) from the
                                   # training interactions' counts, most used rows first; a no-op
                                   # for tables without one; False: they start cold
    seed: int = 0                  # initial weights (tables, NCF head) and negatives: the same seed
                                   # gives the same model, whatever torch's global seed; the
                                   # negatives' generator is saved with the model

    def l2_value(self) -> float:
        """``l2``, or its default for ``loss`` when None."""
        if self.l2 is not None:
            return self.l2
        return 0.1 if self.loss == "mse" else 0.01


# Settings measured on MovieLens-100K (benchmarks/RESULTS.md, "Recommender"): what
# the notebook and the benchmark use, so that a user starts from defaults that beat the baselines.
# The ranking's recency weights were chosen on a validation split (each user's last training
# interaction), never on the test items.
# (rating_range None: predictions clamped to the training ratings' own range, 1..5 on ML-100K,
# 0.5..5 on MovieLens files with half stars)
RATINGS_DEFAULTS = dict(config=dict(l2=0.1, rating_range=None), dim=64,
                        fit=dict(epochs=20, batch_size=256, lr=0.003, lr_final=0.0003))
# Whether recency weights help depends on the data (MovieLens: yes; the synthetic sets, whose draw
# order carries no drift of taste: no), so fit() chooses: 4 epochs with each setting (4 negatives:
# faster to show the difference) on train less each user's latest item, judged by HR@10 on it.
# 8 negatives: better than 4 on the synthetic sets, and as good on ML-100K's validation split
# (figures in benchmarks/RESULTS.md, "Recommender").
RANKING_DEFAULTS = dict(config=dict(loss="bce", negatives=8, l2=0.01, recency_weight=16.0,
                                    recency_half_life=3.0), dim=64,
                        fit=dict(epochs=20, batch_size=256, lr=0.003,
                                 choices=({"recency_weight": 16.0}, {"recency_weight": 0.0}),
                                 choice_epochs=4, choice_trial={"negatives": 4}))


@torch.no_grad()
def _init_rows(table, dim: int, std: float, generator: torch.Generator,
               chunk_rows: int = 1 << 19) -> None:
    """Rows ``[N(0, std²) factors | 0 bias]``, drawn from ``generator`` (on the table's compute
    device). For host rows of a CUDA table the numbers are drawn on the GPU, ``chunk_rows``
    rows at a time, and copied over: the CPU's ``normal_`` is one thread at ~100M numbers/s, so
    10M x 129 rows would take ~15 s there. A :class:`~nbtools.distributed.ShardedEmbedding`
    draws the whole table that way, a chunk at a time, and keeps its rows (``rank, rank +
    world, ...``)."""
    rank, world = getattr(table, "rank", 0), getattr(table, "world", 1)
    w, n = table.weight, table.num_embeddings
    if world == 1 and (table.device.type != "cuda" or w.is_cuda):
        w[:, :dim].normal_(0.0, std, generator=generator)
        w[:, dim].zero_()
        return
    block = torch.empty(min(chunk_rows, n), dim + 1, device=table.device)
    for start in range(0, n, chunk_rows):
        rows = block[: min(chunk_rows, n - start)]
        rows[:, :dim].normal_(0.0, std, generator=generator)
        rows[:, dim].zero_()
        first = start + (rank - start) % world        # this rank's first row in the chunk
        mine = rows[first - start::world]
        # note: a CPU-GPU sync point per chunk
        w[first // world:first // world + mine.shape[0]].copy_(mine)


class _GlobalBias(nn.Module):
    """``μ`` of a sharded model, in a module of its own: ``data_parallel`` wraps it in
    DistributedDataParallel (a parameter beside the tables could not be), whose forward must
    run for its gradient to be averaged over the ranks."""

    def __init__(self, device):
        super().__init__()
        self.value = nn.Parameter(torch.zeros((), device=device))

    def forward(self) -> torch.Tensor:
        return self.value


class MatrixFactorization(nn.Module):
    """A recommender scoring ``μ + b_u + b_i + p_u·q_i [+ MLP([p_u, q_i])]``: a predicted
    rating (``loss="mse"``) or an interaction logit (implicit losses).

    Args:
        num_users, num_items: rows of the two tables.
        dim: factors per user and per item.
        config: :class:`MFConfig` (loss, negatives, NCF head, initialisation, L2, rating range).
        device: compute device (``"auto"``: the GPU when there is one).

    Each table row is ``[factors | bias]``: one lookup per side brings both (one gather
    instead of two; a 4-byte bias row alone would waste most of each transfer). ``μ``
    (:attr:`global_bias`) and the MLP are ordinary parameters on the compute device, trained
    by the same :class:`~nbtools.OffloadOptimizer`.

    Several processes (``process_group``, or ``torch.distributed`` initialised: a data-parallel
    job, docs/distributed.md): both tables are
    :class:`~nbtools.distributed.ShardedEmbedding` over the group, ``μ`` lives in a submodule
    (``model.mu``) so that ``data_parallel`` can wrap it with the MLP, and each rank draws its
    negatives from a stream of its own (rank 0's is the one-process stream). :func:`fit` then
    trains data-parallel: every rank passes the whole training set, each trains on its slice
    of every batch. Lookups are collectives: call ``predict``, ``recommend`` and the metrics on
    every rank with the same arguments.
    """

    def __init__(self, num_users: int, num_items: int, dim: int, *,
                 config: MFConfig | None = None, device="auto", process_group=None):
        super().__init__()
        self.config = cfg = config or MFConfig()
        self.device = resolve_device(device)
        self.group = process_group
        self.rank, self.world = world_of(process_group)
        self.dim = dim
        kw = dict(dtype=cfg.dtype, state_dtype=cfg.state_dtype, rounding=cfg.rounding,
                  device=self.device, pin=cfg.pin, placement=cfg.placement)
        # initial weights from the config's seed, not torch's global stream: the same seed makes
        # the same model, and building one leaves the caller's stream as it was (the tables'
        # own N(0, 1) rows, drawn from it, are overwritten below)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            if self.world == 1:
                self.users = OffloadedEmbedding(num_users, dim + 1, name="users", **kw)
                self.items = OffloadedEmbedding(num_items, dim + 1, name="items", **kw)
            else:
                self.users = ShardedEmbedding(num_users, dim + 1, name="users",
                                              process_group=process_group, **kw)
                self.items = ShardedEmbedding(num_items, dim + 1, name="items",
                                              process_group=process_group, **kw)
        init = torch.Generator(device=self.device).manual_seed(cfg.seed)
        for table in (self.users, self.items):
            _init_rows(table, dim, cfg.init_std, init)
        if self.world == 1:
            self.global_bias = nn.Parameter(torch.zeros((), device=self.device))
        else:
            self.mu = _GlobalBias(self.device)
        self.observed_range: tuple | None = None     # fit(): lowest and highest training rating
        self.mlp = None
        if cfg.mlp_hidden:
            layers, width = [], 2 * dim
            with torch.random.fork_rng(devices=[]):   # nn.Linear draws from the global stream:
                torch.manual_seed(cfg.seed)           # from the config's seed, the caller's left
                for h in cfg.mlp_hidden:
                    layers += [nn.Linear(width, h), nn.ReLU()]
                    width = h
                layers.append(nn.Linear(width, 1))
            nn.init.zeros_(layers[-1].weight)     # starts as plain MF; the head learns a correction
            nn.init.zeros_(layers[-1].bias)
            self.mlp = nn.Sequential(*layers).to(self.device)
        if cfg.loss not in ("mse", "bce", "bpr", "softmax"):
            raise ValueError(f"MFConfig.loss must be 'mse', 'bce', 'bpr' or 'softmax', "
                             f"got {cfg.loss!r}")
        if cfg.sampling not in ("uniform", "popularity"):
            raise ValueError(f"MFConfig.sampling must be 'uniform' or 'popularity', "
                             f"got {cfg.sampling!r}")
        self.seen: Interactions | None = None       # set_seen(): excluded from negatives, recommend
        self.register_buffer("_item_cdf", None, persistent=False)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed if self.rank == 0 else
                                   mix_int(mix_int(cfg.seed) + self.rank) & ((1 << 63) - 1))

    def _mu(self) -> torch.Tensor:
        """``μ``: the parameter, or (sharded) its module's output, through DDP once wrapped."""
        return self.global_bias if self.world == 1 else self.mu()

    def _mu_parameter(self) -> nn.Parameter:
        return self.global_bias if self.world == 1 else getattr(self.mu, "module", self.mu).value

    @property
    def num_users(self) -> int:
        return self.users.num_embeddings

    @property
    def num_items(self) -> int:
        return self.items.num_embeddings

    def set_global_bias(self, ratings) -> None:
        """Start ``μ`` at the mean training rating (saves the first epoch from learning it), and
        remember the lowest and highest rating (:attr:`observed_range`): without a
        ``config.rating_range``, predictions are clamped to them."""
        ratings = torch.as_tensor(ratings, dtype=torch.float64)
        with torch.no_grad():
            self._mu_parameter().fill_(float(ratings.mean()))
        if ratings.numel():
            self.observed_range = (float(ratings.min()), float(ratings.max()))

    @property
    def clamp_range(self) -> tuple | None:
        """What :meth:`predict` clamps to: ``config.rating_range``, else the training ratings'
        range (:meth:`set_global_bias`), None with ``config.clamp=False`` or before training."""
        if not self.config.clamp:
            return None
        return self.config.rating_range or self.observed_range

    def set_seen(self, users, items) -> None:
        """Tell the model which (user, item) pairs are known interactions (the training set).

        They are excluded from sampled negatives (``config.exclude_seen``) and from
        :meth:`recommend`; with ``sampling="popularity"`` their item counts are the noise
        distribution.
        """
        self.seen = Interactions(users, items, self.num_users, self.num_items, self.device)
        counts = torch.bincount(torch.as_tensor(items).long().reshape(-1).to(self.device),
                                minlength=self.num_items).double()
        noise = counts.pow(self.config.popularity_power).cpu()
        if noise.sum() <= 0:
            noise = torch.ones_like(noise)
        # on the CPU: a float cumsum on CUDA adds in an order that changes from run to run
        # (its scan looks back at whichever blocks are done), so the draws would too
        self._item_cdf = torch.cumsum(noise / noise.sum(), 0).to(self.device)

    def sample_negatives(self, users: torch.Tensor, k: int) -> torch.Tensor:
        """``k`` item ids per user [len(users), k], drawn on the compute device from the model's
        generator: uniform, or by popularity (needs :meth:`set_seen`). With
        ``config.exclude_seen`` (after :meth:`set_seen`), uniform draws are exact over the
        items the user has not seen; popularity draws that hit a seen item are redrawn, up to
        8 rounds (a fixed count: no host sync), so a rare few may remain."""
        users = users.to(self.device).long()
        popularity = self.config.sampling == "popularity"
        if popularity and self._item_cdf is None:
            raise RuntimeError("sampling='popularity' needs item counts: call "
                               "model.set_seen(train_users, train_items) first")

        def draw(shape):
            if popularity:
                u = torch.rand(shape, generator=self.generator, dtype=torch.float64,
                               device=self.device)
                return torch.searchsorted(self._item_cdf, u, right=True).clamp_(
                    max=self.num_items - 1)
            return torch.randint(self.num_items, shape, generator=self.generator,
                                 device=self.device)

        exclude = self.config.exclude_seen and self.seen is not None
        if exclude and not popularity:
            return self.seen.uniform_unseen(users[:, None].expand(-1, k), self.generator)
        negs = draw((users.numel(), k))
        if exclude:
            for _ in range(8):               # a fixed number of rounds: no sync, deterministic
                hit = self.seen.contains(users[:, None], negs)
                negs = torch.where(hit, draw(negs.shape), negs)
        return negs

    # Negatives' generator state travels with the model's state_dict (and so with checkpoints).
    def get_extra_state(self):
        return {"generator": self.generator.get_state(), "observed_range": self.observed_range}

    def check_extra_state(self, state) -> None:
        """Raise (ValueError, TypeError, KeyError) where :meth:`set_extra_state` would refuse
        ``state`` or take a value that breaks later calls; changes nothing."""
        check_generator_state(state, self.generator, "MatrixFactorization")
        rng = state.get("observed_range")
        if rng is not None and not (
                isinstance(rng, (tuple, list)) and len(rng) == 2
                and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in rng)):
            raise ValueError(f"MatrixFactorization state has observed_range={rng!r:.60}, "
                             "expected None or (lowest, highest) rating")

    def set_extra_state(self, state) -> None:
        self.check_extra_state(state)
        self.generator.set_state(state["generator"].cpu())
        rng = state.get("observed_range", self.observed_range)
        self.observed_range = None if rng is None else tuple(float(v) for v in rng)

    def _score(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Predictions from rows ``[factors | bias]`` of matching shapes [..., dim + 1]."""
        d = self.dim
        pred = (p[..., :d] * q[..., :d]).sum(-1) + p[..., d] + q[..., d] + self._mu()
        if self.mlp is not None:
            pf, qf = torch.broadcast_tensors(p[..., :d], q[..., :d])
            pred = pred + self.mlp(torch.cat((pf, qf), -1)).squeeze(-1)
        return pred

    def forward(self, users, items) -> torch.Tensor:
        """Predicted ratings for pairs of user and item ids (same shape as the ids)."""
        users = torch.as_tensor(users).to(self.device).long()
        items = torch.as_tensor(items).to(self.device).long()
        return self._score(self.users(users), self.items(items))

    def loss(self, users, items, ratings=None) -> torch.Tensor:
        """The batch's training loss, plus ``l2`` (``l2_bias``) times the squared norms of the
        touched rows' factors (biases).

        ``"mse"``: mean squared error of the ratings. ``"bce"``: per positive,
        ``-log σ(s⁺) - Σ_k log σ(-s⁻_k)`` over ``negatives`` sampled items. ``"bpr"``: mean over
        the sampled items of ``-log σ(s⁺ - s⁻_k)``. ``"softmax"``: sampled softmax,
        ``-log(exp(s⁺) / (exp(s⁺) + Σ_k exp(s⁻_k)))``. Implicit losses read ``ratings`` as
        per-positive weights (:func:`fit` passes recency weights; None: all 1).
        """
        cfg, d = self.config, self.dim
        users, items = users.to(self.device).long(), items.to(self.device).long()
        if cfg.loss == "mse":
            if ratings is None:
                raise ValueError("loss='mse' needs ratings: loss(users, items, ratings)")
            p, q = self.users(users), self.items(items)
            loss = (self._score(p, q) - ratings.to(self.device, p.dtype)).square().mean()
        else:
            negs = self.sample_negatives(users, cfg.negatives)
            p = self.users(users)                                           # [B, d + 1]
            q = self.items(torch.cat((items[:, None], negs), 1))            # [B, 1 + k, d + 1]
            s = self._score(p[:, None, :], q)                               # [B, 1 + k]
            if cfg.loss == "bce":
                per = F.softplus(-s[:, 0]) + F.softplus(s[:, 1:]).sum(1)
            elif cfg.loss == "softmax":
                per = torch.logsumexp(s, 1) - s[:, 0]
            else:
                per = F.softplus(s[:, 1:] - s[:, :1]).mean(1)
            if ratings is not None:
                per = per * ratings.to(self.device, per.dtype)
            loss = per.mean()
        l2 = cfg.l2_value()
        if l2 or cfg.l2_bias:
            rows = torch.cat((p[:, None, :], q.reshape(users.numel(), -1, d + 1)), 1)
            reg = l2 * rows[..., :d].square().sum(-1) + cfg.l2_bias * rows[..., d].square()
            loss = loss + reg.sum(1).mean()
        return loss

    @torch.no_grad()
    def predict(self, users, items, *, batch_size: int = 1 << 16) -> torch.Tensor:
        """Predictions (CPU float32), in batches, clamped to :attr:`clamp_range` (the
        config's ``rating_range``, else the training ratings' range) unless ``config.clamp`` is
        False."""
        users, items = torch.as_tensor(users), torch.as_tensor(items)
        out = torch.cat([self(users[s:s + batch_size], items[s:s + batch_size]).float().cpu()
                         for s in range(0, users.numel(), batch_size)]) if users.numel() else \
            torch.empty(0)
        if not bool(torch.isfinite(out).all()):
            self._raise_nonfinite("predict()")
        if self.clamp_range is not None:
            out.clamp_(*self.clamp_range)
        return out

    @torch.no_grad()
    def score_candidates(self, users, candidates, *, batch_size: int = 4096) -> torch.Tensor:
        """Raw scores (no clamping, so no ties made) of ``candidates`` [U, C] for ``users`` [U],
        computed on the compute device in batches of users. Returns float32 [U, C] (CPU)."""
        users = torch.as_tensor(users).long().reshape(-1)
        candidates = torch.as_tensor(candidates).long()
        if candidates.dim() != 2 or candidates.shape[0] != users.numel():
            raise ValueError(f"candidates must be [len(users)={users.numel()}, C], got shape "
                             f"{tuple(candidates.shape)}")
        out = [self._score(self.users(users[s:s + batch_size].to(self.device))[:, None, :],
                           self.items(candidates[s:s + batch_size].to(self.device))).float().cpu()
               for s in range(0, users.numel(), batch_size)]
        out = torch.cat(out) if out else torch.empty(0, candidates.shape[1])
        if not bool(torch.isfinite(out).all()):
            self._raise_nonfinite("score_candidates()")
        return out

    @torch.no_grad()
    def _nothing_left(self, users: torch.Tensor, k: int, excluded: int,
                      exclude_seen: bool) -> torch.Tensor:
        """[U, k]: True at the places past the items a user has left to recommend (where a -1
        pad is expected, not a sign of non-finite scores)."""
        left = torch.full((users.numel(),), self.num_items - excluded, dtype=torch.long)
        if exclude_seen and self.seen is not None:
            left -= self.seen.counts()[users.to(self.seen.device)].cpu()
        return torch.arange(k)[None, :] >= left[:, None]

    def _raise_nonfinite(self, caller: str = "recommend()") -> None:
        """Raise the ValueError that names the rows holding inf/nan (a diverged model):
        scores made from them are not finite."""
        rows = []
        for name, table in (("user", self.users), ("item", self.items)):
            with torch.no_grad():
                w = table.read_weight()
                bad = (~torch.isfinite(w)).any(1).nonzero().reshape(-1)
            if bad.numel():
                rows.append(f"{bad.numel():,} {name} rows (first: {name} {int(bad[0])})")
        raise ValueError(f"{caller}: scores are not finite, because the model holds non-finite "
                         f"values in {' and '.join(rows) or 'its head'}; retrain (a lower "
                         "learning rate, or check the data) or restore a checkpoint")

    @torch.no_grad()
    def recommend(self, users, k: int = 10, *, exclude=None, exclude_seen: bool = True,
                  batch_users: int = 1024, chunk_items: int = 65536):
        """The ``k`` best-scored items for one user or many at once.

        Args:
            users: a user id, or ids [U].
            k: items per user.
            exclude: for one user, item ids not to recommend.
            exclude_seen: leave out the pairs given to :meth:`set_seen`: the training set,
                which :func:`fit` gives for every loss, ratings too (False keeps them).
            batch_users, chunk_items: work sizes: scores of ``batch_users`` x ``chunk_items``
                pairs are computed at a time on the compute device (fewer with an NCF head).

        Returns:
            ``(item_ids, scores)`` on the CPU: [k] each for one user, [U, k] for many. Where a
            user has fewer than ``k`` items left, the ids are -1 and the scores -inf (for one
            user those entries are dropped).
        """
        single = not isinstance(users, torch.Tensor) or users.dim() == 0
        users = torch.as_tensor(users).long().reshape(-1)
        bad = (users < 0) | (users >= self.num_users)
        if bad.any():
            raise IndexError(f"user {int(users[bad][0])} is outside 0..{self.num_users - 1}")
        if self.mlp is not None:            # [B, chunk, 2 dim] inputs: keep them ~64M numbers
            chunk_items = max(1, min(chunk_items, (1 << 26) // (batch_users * 2 * self.dim)))
        skip = torch.as_tensor(exclude if exclude is not None else [], dtype=torch.long)
        ids_out, scores_out = [], []
        for s in range(0, users.numel(), batch_users):
            batch = users[s:s + batch_users].to(self.device)
            p = self.users(batch)[:, None, :]                              # [B, 1, dim + 1]
            rows, seen_items = (self.seen.items_of(batch) if exclude_seen and self.seen is not None
                                else (None, None))
            best_s = torch.empty(batch.numel(), 0, device=self.device)
            best_i = torch.empty(batch.numel(), 0, dtype=torch.long, device=self.device)
            for start in range(0, self.num_items, chunk_items):
                ids = torch.arange(start, min(start + chunk_items, self.num_items),
                                   device=self.device)
                sc = self._score(p, self.items(ids)[None]).float()         # [B, chunk]
                if rows is not None:
                    inside = (seen_items >= start) & (seen_items < start + ids.numel())
                    sc[rows[inside], seen_items[inside] - start] = -math.inf
                if skip.numel():
                    sc[:, torch.isin(ids, skip.to(self.device))] = -math.inf
                sc = torch.cat((best_s, sc), 1)
                cand = torch.cat((best_i, ids[None].expand(batch.numel(), -1)), 1)
                best_s, top = sc.topk(min(k, sc.shape[1]), 1)
                best_i = cand.gather(1, top)
            best_i = torch.where(torch.isfinite(best_s), best_i, -1)
            ids_out.append(best_i.cpu())
            scores_out.append(best_s.cpu())
        ids, scores = torch.cat(ids_out), torch.cat(scores_out)
        broken = torch.isnan(scores) | ((ids < 0) & ~self._nothing_left(
            users, scores.shape[1], skip.numel(), exclude_seen))
        if bool(broken.any()):
            self._raise_nonfinite()
        if single:
            keep = ids[0] >= 0
            return ids[0][keep], scores[0][keep]
        return ids, scores


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
    :attr:`MatrixFactorization.clamp_range`)."""
    pred = model.predict(users, items, batch_size=batch_size)
    ratings = torch.as_tensor(ratings, dtype=torch.float32).reshape(-1)
    if pred.numel() != ratings.numel():
        raise ValueError(f"{pred.numel():,} (user, item) pairs but {ratings.numel():,} ratings")
    return float((pred - ratings).square().mean().sqrt()) if ratings.numel() else math.nan


def recency_weights(train: Ratings, weight: float, half_life: float) -> torch.Tensor:
    """Per-interaction loss weights ``1 + weight * 0.5 ** (later / half_life)``, where ``later``
    counts the same user's interactions after this one (:func:`~nbtools.models.ranking.recency`),
    scaled to mean 1 so that the learning rate keeps its meaning. float32, in ``train``'s order.

    >>> r = Ratings(torch.tensor([0, 0, 0]), torch.tensor([0, 1, 2]), torch.ones(3), 1, 3,
    ...             torch.tensor([1, 2, 3]))
    >>> [round(w, 3) for w in recency_weights(r, 2.0, 1.0).tolist()]
    [0.692, 0.923, 1.385]
    """
    if train.timestamps is None:
        raise ValueError("recency_weight needs timestamps, and these ratings have none: load a "
                         "file with a timestamp column, or set MFConfig(recency_weight=0)")
    if half_life <= 0:
        raise ValueError(f"recency_half_life must be positive, got {half_life!r}")
    w = 1.0 + weight * torch.pow(0.5, recency(train).double() / half_life)
    return (w / w.mean()).float()


class _EpochDecay:
    """An optimizer that sets its learning rate from the loader's epoch before each step:
    ``lr * (lr_final / lr) ** (epoch / (epochs - 1))``. The rate depends only on the epoch, so
    a run resumed from a checkpoint uses the same rates as one never interrupted."""

    def __init__(self, optimizer, loader, lr: float, lr_final: float, epochs: int):
        self.optimizer, self.loader = optimizer, loader
        self.lr, self.lr_final, self.epochs = lr, lr_final, epochs

    def step(self):
        t = min(self.loader.epoch, self.epochs - 1) / max(1, self.epochs - 1)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * (self.lr_final / self.lr) ** t
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True):
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def check_state_dict(self, state):
        """The wrapped optimizer's check (a checkpoint's restore runs it before any write)."""
        check = getattr(self.optimizer, "check_state_dict", None)
        if check is not None:
            check(state)

    def load_state_dict(self, state):
        return self.optimizer.load_state_dict(state)


def _train(model: MatrixFactorization, train: Ratings, *, epochs: int, batch_size: int, lr: float,
           lr_final: float | None, optimizer, seed: int, **loop) -> dict:
    """One training run of :func:`fit` with ``model.config`` as it is (no choice)."""
    from ..loader import PinnedLoader
    from ..optim import OffloadOptimizer
    from .training import train as train_loop

    model.set_seen(train.user_ids, train.item_ids)     # negatives and recommend() skip them
    if model.config.loss == "mse":
        model.set_global_bias(train.ratings)
        tensors = (train.user_ids, train.item_ids, train.ratings)
    else:
        tensors = (train.user_ids, train.item_ids)
        if model.config.recency_weight:
            tensors += (recency_weights(train, model.config.recency_weight,
                                        model.config.recency_half_life),)
    if model.world > 1:                  # sharded: the dense parameters in DDP
        from ..distributed import data_parallel
        data_parallel(model)
    opt = OffloadOptimizer(optimizer, model, lr=lr)
    loader = PinnedLoader(*tensors, batch_size=batch_size, seed=seed, device=model.device,
                          rank=model.rank, world=model.world)    # this rank's slice
    if model.config.warm:           # the most used users and items in the caches from the start
        for column, table in enumerate((model.users, model.items)):
            table.warm_cache(loader.id_counts(column, table.num_embeddings))
    if lr_final is not None:
        opt = _EpochDecay(opt, loader, lr, lr_final, epochs)
    return train_loop(model, loader, opt, epochs=epochs, **loop)


def choose_config(model: MatrixFactorization, train: Ratings, choices, *, epochs: int,
                  batch_size: int = 256, lr: float = 0.003, optimizer=torch.optim.Adam,
                  seed: int = 0, trial: dict | None = None, negatives: int = 99) -> dict:
    """Pick among ``choices`` (dicts of :class:`MFConfig` fields to change) the one whose
    short run ranks best on a validation split carved from ``train`` alone.

    Each user's latest interaction in ``train`` (by timestamp) is held out
    (:func:`~nbtools.models.ranking.leave_last_out`), so the validation items are training
    items, never test items. For each choice a fresh model (``model``'s sizes and config with
    the choice applied, so initialised from the config's seed) trains ``epochs`` epochs on the rest and
    ranks each held-out item among ``negatives`` items the user has not interacted with in
    ``train`` (drawn with ``seed + 1``); HR@10 decides, the earlier choice winning a tie.
    ``trial``: more :class:`MFConfig` fields for these short runs only (e.g. ``{"negatives":
    4}``: fewer negatives learn faster per epoch, so a short run already shows the difference).
    Deterministic from ``seed``; the caller's random stream is left as it was. ``model`` is
    not changed.

    Returns:
        ``{"chosen": dict, "valid_hr@10": [per choice], "choice_s": wall seconds}``.
    """
    t0 = time.perf_counter()
    choices = [dict(c) for c in choices]
    if not choices:
        raise ValueError("choices is empty: pass at least one dict of MFConfig fields")
    if model.config.loss == "mse":
        raise ValueError("choosing by validation HR@10 needs an implicit loss ('bce', 'bpr' or "
                         "'softmax'); this model's config has loss='mse'")
    if train.timestamps is None:
        raise ValueError("choosing a setting holds out each user's latest training interaction, "
                         "and these ratings have no timestamps: load a file with a timestamp "
                         "column, or call fit without choices")
    part, valid = leave_last_out(train)
    seen = Interactions(train.user_ids, train.item_ids, train.num_users, train.num_items)
    # small catalogues: at most a quarter of the items, and only users with twice that many
    # unseen (sample_candidates draws at random until it has them: a nearly full user would
    # take very long)
    negatives = min(negatives, train.num_items // 4)
    roomy = train.num_items - seen.counts()[valid.user_ids] >= 2 * negatives
    valid = take(valid, torch.nonzero(roomy).reshape(-1))
    if negatives < 1 or valid.user_ids.numel() == 0:
        raise ValueError(f"no validation split to choose on: {train.num_items} items, and no user "
                         f"with 2 or more training interactions and {2 * max(negatives, 1)} unseen "
                         f"items")
    cand = sample_candidates(seen, valid.user_ids, valid.item_ids, negatives, seed=seed + 1)
    scores = []
    for change in choices:
        config = dataclasses.replace(model.config, **{**(trial or {}), **change})
        with torch.random.fork_rng(devices=[]):    # the trial leaves the caller's stream
            run = MatrixFactorization(model.num_users, model.num_items, model.dim,
                                      config=config, device=model.device,
                                      process_group=model.group)
            _train(run, part, epochs=epochs, batch_size=batch_size, lr=lr, lr_final=None,
                   optimizer=optimizer, seed=seed, progress=False)
        scores.append(ranking_metrics(run.score_candidates(valid.user_ids, cand))["hr@10"])
        del run
    best = max(range(len(choices)), key=lambda j: (scores[j], -j))
    return {"chosen": choices[best], "valid_hr@10": scores,
            "choice_s": time.perf_counter() - t0}


def check_ratings(model: MatrixFactorization, data: Ratings) -> None:
    """Refuse, before any training, interactions ``model`` cannot learn from: a user or item id
    outside its tables, a rating that is NaN or infinite, or (``loss="mse"`` with
    ``config.rating_range``) outside that range. The message names the first bad row."""
    users, items, ratings = (torch.as_tensor(x) for x in data[:3])
    n = users.numel()
    if items.numel() != n or ratings.numel() != n:
        raise ValueError(f"user_ids, item_ids and ratings must have one entry per interaction, "
                         f"got {n:,}, {items.numel():,} and {ratings.numel():,}")

    def first(bad: torch.Tensor, what: str, values: torch.Tensor, want: str):
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"interaction {row:,} has {what} {values[row].item()!r}: {want} "
                             f"({int(bad.sum()):,} such rows in all). Fix or drop those rows "
                             "before fit(): nothing was trained.")
    for what, ids in (("user_ids", users), ("item_ids", items)):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"{what} must be integers, got dtype {ids.dtype}; convert with "
                            ".long() where they are whole numbers. Nothing was trained.")
    first((users < 0) | (users >= model.num_users), "user id", users,
          f"the model has users 0..{model.num_users - 1:,}")
    first((items < 0) | (items >= model.num_items), "item id", items,
          f"the model has items 0..{model.num_items - 1:,}")
    first(~torch.isfinite(ratings), "rating", ratings, "ratings must be finite numbers")
    times = getattr(data, "timestamps", None)
    if times is not None and torch.as_tensor(times).is_floating_point():
        times = torch.as_tensor(times)      # (recency weights and temporal splits read them)
        first(~torch.isfinite(times), "timestamp", times, "timestamps must be finite numbers")
    low_high = model.config.rating_range
    if model.config.loss == "mse" and low_high is not None:
        lo, hi = low_high
        first((ratings < lo) | (ratings > hi), "rating", ratings,
              f"config.rating_range is {lo}..{hi} (rating_range=None: the training ratings' "
              "own range)")
    elif model.config.loss != "mse":
        first(ratings < 0, "weight", ratings, "implicit losses read ratings as weights >= 0")


def fit(model: MatrixFactorization, train: Ratings, *, epochs: int, batch_size: int = 256,
        lr: float = 0.003, lr_final: float | None = None, optimizer=torch.optim.Adam,
        dashboard=None, checkpoints=None, every: int = 1000, progress: bool = False,
        seed: int = 0, choices=None, choice_epochs: int = 4, choice_trial: dict | None = None
        ) -> dict:
    """Train ``model`` on ``train`` with an :class:`~nbtools.OffloadOptimizer` (tables lazy).

    With ``choices`` (implicit losses: a list of dicts of :class:`MFConfig` fields, e.g.
    ``[{"recency_weight": 16.0}, {"recency_weight": 0.0}]``), first picks one by
    :func:`choose_config`: ``choice_epochs`` epochs per choice on ``train`` less each user's
    latest interaction (with ``choice_trial``'s fields too, for those short runs only), judged
    by HR@10 on those latest interactions. The pick is applied to
    ``model.config`` and reported in the history. Whether recency weights help depends on the
    data (on MovieLens the next item resembles a user's latest ones; on data without drift of
    taste they only thin it), so the ranking defaults let the data say.

    Then sets what the loss needs: the mean rating as ``μ`` (``"mse"``), or the seen pairs
    for negative sampling and :meth:`~MatrixFactorization.recommend` (implicit losses), and
    with ``config.recency_weight`` each interaction's weight (:func:`recency_weights`), and
    with ``config.warm`` fills the tables' caches with the rows ``train`` uses most
    (:meth:`~nbtools.PinnedLoader.id_counts`, :meth:`~nbtools.OffloadedEmbedding.warm_cache`).
    Then runs :func:`~nbtools.models.train` (dashboard, checkpoints, resume) over shuffled batches
    of ``batch_size`` interactions. With ``lr_final``, the learning rate falls geometrically
    from ``lr`` in the first epoch to ``lr_final`` in the last (it depends only on the epoch,
    so a resumed run gets the same rates; a resumed run also makes the same choice again).

    A sharded model (built in a process group) trains data-parallel: every rank calls ``fit``
    with the same ``train``; the model goes through ``nbtools.distributed.data_parallel`` and
    each rank trains on its slice of every global batch (``batch_size`` interactions per rank;
    the interactions past the last whole global batch wait for another epoch's order).

    Returns:
        The training history, plus ``"fit_s"``: wall seconds of this call (the choice
        included), and with ``choices`` ``"choice"`` (:func:`choose_config`'s answer).
    """
    t0 = time.perf_counter()
    check_ratings(model, train)
    choice = None
    if choices:
        choice = choose_config(model, train, choices, epochs=choice_epochs,
                               batch_size=batch_size, lr=lr, optimizer=optimizer, seed=seed,
                               trial=choice_trial)
        model.config = dataclasses.replace(model.config, **choice["chosen"])
    history = _train(model, train, epochs=epochs, batch_size=batch_size, lr=lr,
                     lr_final=lr_final, optimizer=optimizer, seed=seed, dashboard=dashboard,
                     checkpoints=checkpoints, every=every, progress=progress)
    if choice is not None:
        history["choice"] = choice
    history["fit_s"] = time.perf_counter() - t0
    return history
