"""A recommender: matrix factorization with an optional NCF head, over two offloaded tables."""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..devices import resolve_device
from ..tables import OffloadedEmbedding

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
