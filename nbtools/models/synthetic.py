"""Synthetic interactions with planted structure and a known optimum (the oracle).

Each user ``u`` and item ``i`` have low-rank factors; items have a Zipf popularity. The
affinity is ``a(u, i) = p_u · q_i + b_i`` with ``b_i = -zipf · log(popularity rank of i)``.

* Each user's items are drawn one after another, without replacement, with probability
  ``∝ exp(a(u, i))`` over the items not drawn yet (Gumbel top-k: exact and vectorised). The draw
  order is the timestamp, so :func:`~nbtools.models.leave_last_out` holds out the last draw.
* A rating is a Gaussian around ``rating_mean(u, i)``, rounded to 1..5 and clipped.

The oracle knows the truth. Given the first draws, the last one is ``∝ exp(a(u, i))`` over the
rest, so ranking candidates by ``a`` is Bayes-optimal for HR@k and NDCG@k whenever the other
candidates are drawn uniformly (each candidate's chance of being the held-out item is then
``∝ exp(a)``). For ratings, the Bayes-optimal prediction under squared error is the expected
rating, computed in closed form from the normal CDF.

>>> d = make_synthetic(SyntheticConfig(num_users=50, num_items=40, per_user=8, rank=4))
>>> d.ratings.num_users, d.ratings.num_items, int(d.ratings.user_ids.bincount().min()) >= 5
(50, 40, True)
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..data import Ratings


@dataclasses.dataclass
class SyntheticConfig:
    """Shape and strength of the planted structure. Defaults: MovieLens-1M-sized."""

    num_users: int = 6040
    num_items: int = 3706
    per_user: int = 165            # mean interactions per user (log-normal, at least min_per_user)
    min_per_user: int = 5
    rank: int = 16                 # of the planted factors
    signal: float = 1.5            # std of p_u · q_i (larger: more personal, easier to rank)
    zipf: float = 0.8              # item bias -zipf * log(rank): Zipf-like popularity
    rating_center: float = 3.6     # ratings ~ round(N(center + slope * z + bias_weight * b, noise))
    rating_slope: float = 0.7      # per std of p_u · q_i
    rating_bias_weight: float = 0.15
    rating_noise: float = 0.9
    seed: int = 0


@dataclasses.dataclass
class SyntheticData:
    """The interactions and the truth behind them."""

    ratings: Ratings               # timestamps: the draw order within each user
    user_factors: torch.Tensor     # [users, rank]
    item_factors: torch.Tensor     # [items, rank]
    item_bias: torch.Tensor        # [items]
    config: SyntheticConfig

    def affinity(self, users, items) -> torch.Tensor:
        """``a(u, i)`` for broadcastable id tensors: the oracle's ranking score."""
        users, items = torch.as_tensor(users).long(), torch.as_tensor(items).long()
        return (self.user_factors[users] * self.item_factors[items]).sum(-1) + self.item_bias[items]

    def rating_mean(self, users, items) -> torch.Tensor:
        """Centre of the Gaussian that a rating of (u, i) is rounded from."""
        c = self.config
        users, items = torch.as_tensor(users).long(), torch.as_tensor(items).long()
        z = (self.user_factors[users] * self.item_factors[items]).sum(-1) / c.signal
        b = (self.item_bias[items] - self.item_bias.mean()) / self.item_bias.std().clamp_min(1e-12)
        return c.rating_center + c.rating_slope * z + c.rating_bias_weight * b

    def expected_rating(self, users, items) -> torch.Tensor:
        """The Bayes-optimal rating prediction: ``E[round(clip(N(mean, noise²)))]`` over 1..5."""
        m = self.rating_mean(users, items).double()
        s = self.config.rating_noise
        edges = torch.tensor([1.5, 2.5, 3.5, 4.5], dtype=torch.float64)
        below = torch.special.ndtr((edges - m[..., None]) / s)             # P(x < edge)
        # E[r] = 1 + Σ_edges P(x >= edge): each edge crossed adds one star
        return (1 + (1 - below).sum(-1)).float()

    def with_estimated_users(self, train: Ratings) -> "SyntheticData":
        """The truth with each user's factors replaced by their posterior mean given ``train``'s
        ratings, the item factors, item biases and rating link kept exact.

        Its :meth:`expected_rating` is what a model could reach that knew everything about the
        items and only had to estimate the users: a floor, measured, for any matrix
        factorisation's RMSE (which must estimate the items too). The posterior treats a rating
        as its Gaussian centre plus noise (rounding and clipping ignored) under the generator's
        prior on the factors (Bayesian ridge).
        """
        c = self.config
        slope = c.rating_slope / c.signal
        b = (self.item_bias - self.item_bias.mean()) / self.item_bias.std().clamp_min(1e-12)
        x = slope * self.item_factors.double()[train.item_ids]            # [N, rank]
        y = (train.ratings.double() - c.rating_center
             - c.rating_bias_weight * b.double()[train.item_ids])
        xtx = torch.zeros(c.num_users, c.rank, c.rank, dtype=torch.float64).index_add_(
            0, train.user_ids, x[:, :, None] * x[:, None, :])
        xty = torch.zeros(c.num_users, c.rank, dtype=torch.float64).index_add_(
            0, train.user_ids, x * y[:, None])
        prior_var = c.signal / math.sqrt(c.rank)       # of each planted user factor
        ridge = c.rating_noise ** 2 / prior_var * torch.eye(c.rank, dtype=torch.float64)
        users = torch.linalg.solve(xtx + ridge, xty).float()
        return dataclasses.replace(self, user_factors=users)


def make_synthetic(config: SyntheticConfig | None = None, *, chunk_users: int = 512) -> SyntheticData:
    """Draw a synthetic data set (deterministic from ``config.seed``; CPU).

    Cost: one Gumbel-perturbed score per (user, item) pair, ``chunk_users`` users at a time;
    about 3 s for the MovieLens-1M-sized default on one CPU core.
    """
    c = config or SyntheticConfig()
    if c.per_user >= c.num_items:
        raise ValueError(f"per_user ({c.per_user}) must be below num_items ({c.num_items})")
    g = torch.Generator().manual_seed(c.seed)
    scale = math.sqrt(c.signal / math.sqrt(c.rank))          # std of p · q = signal
    p = torch.randn(c.num_users, c.rank, generator=g) * scale
    q = torch.randn(c.num_items, c.rank, generator=g) * scale
    popularity_rank = torch.randperm(c.num_items, generator=g) + 1
    bias = -c.zipf * popularity_rank.double().log().float()
    bias -= bias.mean()
    sigma = 1.0                                               # spread of per-user counts
    mu = math.log(c.per_user) - sigma ** 2 / 2
    counts = torch.exp(mu + sigma * torch.randn(c.num_users, generator=g)).round().long()
    counts = counts.clamp(c.min_per_user, c.num_items // 2)
    data = SyntheticData(None, p, q, bias, c)
    users, items, times = [], [], []
    for start in range(0, c.num_users, chunk_users):
        u = torch.arange(start, min(start + chunk_users, c.num_users))
        a = data.affinity(u[:, None], torch.arange(c.num_items)[None])
        gumbel = -torch.log(-torch.log(torch.rand(a.shape, generator=g).clamp_min(1e-20)))
        n = counts[u]
        # Gumbel top-k = sequential draws without replacement ∝ exp(a), in draw order
        order = (a + gumbel).topk(int(n.max()), 1).indices
        keep = torch.arange(order.shape[1])[None] < n[:, None]
        users.append(u[:, None].expand_as(order)[keep])
        items.append(order[keep])
        times.append(torch.arange(order.shape[1])[None].expand_as(order)[keep])
    users, items, times = torch.cat(users), torch.cat(items), torch.cat(times)
    noise = torch.randn(users.numel(), generator=g) * c.rating_noise
    ratings = (data.rating_mean(users, items) + noise).round().clamp(1, 5)
    data.ratings = Ratings(users, items, ratings, c.num_users, c.num_items, times)
    return data


def gap_normalised(model: float, popularity: float, oracle: float) -> float:
    """``(model - popularity) / (oracle - popularity)``: 0 is popularity, 1 the oracle.

    >>> gap_normalised(0.5, 0.25, 0.75)
    0.5
    """
    return (model - popularity) / (oracle - popularity)
