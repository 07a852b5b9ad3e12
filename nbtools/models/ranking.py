"""Splits, candidate sampling and metrics for recommenders, explicit and implicit.

* :class:`Interactions`: who interacted with what, as sorted keys on a device; answers
  "has user u seen item i?" for many pairs at once and lists each user's items.
* Splits of a :class:`~nbtools.data.Ratings`: :func:`leave_last_out` (by timestamp),
  :func:`per_user_split` (each user's latest or a random fraction), :func:`kfold` (random
  folds of the ratings) and :func:`train_valid_test` (a split applied twice); :func:`recency`
  (each interaction's place from the end of its user's history).
* :func:`sample_candidates`: the NCF protocol's held-out item plus ``n`` items the user never
  interacted with, drawn from a seed, so that every system ranks the same candidates.
* Metrics: :func:`ranking_metrics` (HR@k, NDCG@k on candidate scores, ties split evenly),
  :func:`full_ranking_metrics` (recall@k, HR@k, NDCG@k over the whole catalogue, seen items
  excluded), :func:`rating_metrics` (RMSE, MAE).

>>> scores = torch.tensor([[0.9, 0.1, 0.5], [0.2, 0.7, 0.4]])   # column 0: the held-out item
>>> ranking_metrics(scores, k=1)
{'hr@1': 0.5, 'ndcg@1': 0.5}
"""
from __future__ import annotations

import math

import torch

from ..data import Ratings

# --- who saw what ---------------------------------------------------------------------------------

class Interactions:
    """The set of (user, item) pairs, as sorted ``user * num_items + item`` keys on ``device``.

    Args:
        users, items: ids of the pairs (duplicates are fine).
        num_users, num_items: id ranges.
        device: where lookups run (the model's compute device).

    >>> seen = Interactions(torch.tensor([0, 0, 2]), torch.tensor([3, 1, 0]), 3, 4)
    >>> seen.contains(torch.tensor([0, 0, 1]), torch.tensor([1, 2, 1])).tolist()
    [True, False, False]
    >>> seen.items_of(torch.tensor([2, 0]))
    (tensor([0, 1, 1]), tensor([0, 1, 3]))
    """

    def __init__(self, users, items, num_users: int, num_items: int, device="cpu"):
        users = torch.as_tensor(users).to(device).long().reshape(-1)
        items = torch.as_tensor(items).to(device).long().reshape(-1)
        if users.numel() != items.numel():
            raise ValueError(f"{users.numel():,} user ids but {items.numel():,} item ids")
        self.num_users, self.num_items = int(num_users), int(num_items)
        for what, ids, n in (("user", users, self.num_users), ("item", items, self.num_items)):
            bad = (ids < 0) | (ids >= n)
            if bool(bad.any()):          # a key users * num_items + items would be another pair's
                pos = int(bad.nonzero()[0, 0])
                raise IndexError(f"{what} id {int(ids[pos])} at position {pos:,} is outside "
                                 f"0..{n - 1:,} ({int(bad.sum()):,} such ids)")
        self.keys = torch.unique(users * self.num_items + items)            # sorted
        counts = torch.bincount(self.keys // self.num_items, minlength=self.num_users)
        self.indptr = torch.zeros(self.num_users + 1, dtype=torch.long, device=device)
        self.indptr[1:] = torch.cumsum(counts, 0)
        self._gaps = None                   # for uniform_unseen, built on first use

    def uniform_unseen(self, users, generator: torch.Generator | None = None) -> torch.Tensor:
        """One item per entry of ``users`` (any shape), uniform over the items that user has
        not seen; exact, with one uniform draw and one binary search each (no rejection).

        The ``j``-th unseen item of a user whose seen items are ``s_0 < s_1 < ...`` is ``j``
        plus the number of ``m`` with ``s_m - m <= j``. A user who has seen every item gets a
        uniform draw over all items.
        """
        users = torch.as_tensor(users, device=self.device).long()
        if self._gaps is None:
            within = torch.arange(self.keys.numel(), device=self.device) - \
                torch.repeat_interleave(self.indptr[:-1], self.counts())
            self._gaps = self.keys - within         # u * num_items + (s_m - m): still sorted
        free = (self.num_items - self.counts()[users]).clamp_min(0)
        everything = free == 0
        free = torch.where(everything, self.num_items, free)
        u = torch.rand(users.shape, generator=generator, dtype=torch.float64, device=self.device)
        j = (u * free).long().clamp_(max=free - 1)
        below = torch.searchsorted(self._gaps, users * self.num_items + j, right=True) - \
            self.indptr[users]
        return torch.where(everything, j, j + below)

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def __len__(self) -> int:
        return self.keys.numel()

    def counts(self) -> torch.Tensor:
        """Items seen per user (int64, ``num_users``)."""
        return self.indptr[1:] - self.indptr[:-1]

    def contains(self, users, items) -> torch.Tensor:
        """Whether each (user, item) pair was seen (broadcasts ``users`` against ``items``)."""
        users = torch.as_tensor(users, device=self.device).long()
        items = torch.as_tensor(items, device=self.device).long()
        key = users * self.num_items + items
        if self.keys.numel() == 0:
            return torch.zeros(key.shape, dtype=torch.bool, device=self.device)
        pos = torch.searchsorted(self.keys, key).clamp_(max=self.keys.numel() - 1)
        return self.keys[pos] == key

    def items_of(self, users) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row, item)`` of every seen pair of ``users``: ``row`` indexes into ``users``."""
        users = torch.as_tensor(users, device=self.device).long().reshape(-1)
        start, stop = self.indptr[users], self.indptr[users + 1]
        lengths = stop - start
        rows = torch.repeat_interleave(torch.arange(users.numel(), device=self.device), lengths)
        offsets = torch.arange(rows.numel(), device=self.device) - \
            torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        return rows, self.keys[start[rows] + offsets] % self.num_items


def interactions_of(*parts: Ratings, device="cpu") -> Interactions:
    """:class:`Interactions` of the union of several :class:`Ratings` of the same id space."""
    return Interactions(torch.cat([p.user_ids for p in parts]),
                        torch.cat([p.item_ids for p in parts]),
                        parts[0].num_users, parts[0].num_items, device)


# --- splits ---------------------------------------------------------------------------------------

def take(r: Ratings, index) -> Ratings:
    """The interactions of ``r`` at ``index`` (same id space)."""
    index = torch.as_tensor(index, dtype=torch.long)
    times = r.timestamps[index] if r.timestamps is not None else None
    return Ratings(r.user_ids[index], r.item_ids[index], r.ratings[index], r.num_users,
                   r.num_items, times)


def sample_users(r: Ratings, n: int | None, *, seed: int = 0) -> Ratings:
    """``n`` of ``r``'s interactions drawn without replacement (all of them when ``n`` is None
    or not smaller): an evaluation on a sample of held-out users, where scoring every user
    would take longer than training.

    >>> r = Ratings(torch.arange(10), torch.arange(10), torch.ones(10), 10, 10)
    >>> sample_users(r, 3).user_ids.numel(), sample_users(r, None).user_ids.numel()
    (3, 10)
    """
    total = r.user_ids.numel()
    if n is None or n >= total:
        return r
    index = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n]
    return take(r, index.sort().values)


def _user_order(r: Ratings, by_time: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Interaction indices grouped by user, each user's in time order (ties: file order) or in
    a seeded random order; and each interaction's position within its user."""
    n = r.user_ids.numel()
    if by_time:
        if r.timestamps is None:
            raise ValueError("these ratings have no timestamps, so there is no temporal order; "
                             "load a file with a timestamp column, or pass by_time=False")
        within = r.timestamps
    else:
        within = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    order = torch.argsort(within, stable=True)
    order = order[torch.argsort(r.user_ids[order], stable=True)]     # by user, then within
    counts = torch.bincount(r.user_ids, minlength=r.num_users)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(n) - starts[r.user_ids[order]]
    return order, position


def recency(r: Ratings) -> torch.Tensor:
    """How many of the same user's interactions came after each one (0: the user's latest), by
    timestamp (ties: the later in the file is the more recent). int64, in ``r``'s order.

    >>> r = Ratings(torch.tensor([0, 1, 0, 0]), torch.tensor([1, 2, 3, 4]), torch.ones(4), 2, 5,
    ...             torch.tensor([30, 5, 10, 20]))
    >>> recency(r).tolist()
    [0, 0, 2, 1]
    """
    order, position = _user_order(r, by_time=True, seed=0)
    counts = torch.bincount(r.user_ids, minlength=r.num_users)[r.user_ids[order]]
    age = torch.empty_like(position)
    age[order] = counts - 1 - position
    return age


def leave_last_out(r: Ratings, n: int = 1) -> tuple[Ratings, Ratings]:
    """Hold out each user's ``n`` latest interactions (by timestamp; ties: the later in the file).

    Users with ``n`` interactions or fewer stay wholly in the training part.

    >>> r = Ratings(torch.tensor([0, 0, 1, 0]), torch.tensor([5, 6, 7, 8]), torch.ones(4), 2, 9,
    ...             torch.tensor([30, 10, 5, 20]))
    >>> train, test = leave_last_out(r)
    >>> train.item_ids.tolist(), test.item_ids.tolist()
    ([6, 8, 7], [5])
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n!r}")
    order, position = _user_order(r, by_time=True, seed=0)
    counts = torch.bincount(r.user_ids, minlength=r.num_users)[r.user_ids[order]]
    held = (position >= counts - n) & (counts > n)
    return take(r, order[~held]), take(r, order[held])


def per_user_split(r: Ratings, fraction: float = 0.2, *, by_time: bool = True,
                   seed: int = 0) -> tuple[Ratings, Ratings]:
    """Hold out ``round(fraction * count)`` interactions of each user: the latest ones
    (``by_time``) or a seeded random choice. Every user keeps at least one in training."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    order, position = _user_order(r, by_time=by_time, seed=seed)
    counts = torch.bincount(r.user_ids, minlength=r.num_users)[r.user_ids[order]]
    held_count = torch.minimum(torch.round(counts * fraction), counts - 1)
    held = position >= counts - held_count
    return take(r, order[~held]), take(r, order[held])


def kfold(r: Ratings, k: int = 5, *, seed: int = 0) -> list[tuple[Ratings, Ratings]]:
    """``k`` random folds of the interactions: ``[(train, test), ...]``, each interaction in
    exactly one test part (the usual k-fold RMSE protocol)."""
    if not 2 <= k <= r.user_ids.numel():
        raise ValueError(f"k must be in 2..{r.user_ids.numel()} (the number of ratings), got {k!r}")
    order = torch.randperm(r.user_ids.numel(), generator=torch.Generator().manual_seed(seed))
    folds = torch.tensor_split(order, k)
    return [(take(r, torch.cat(folds[:f] + folds[f + 1:])), take(r, folds[f])) for f in range(k)]


def train_valid_test(r: Ratings, how: str = "last", **kwargs) -> tuple[Ratings, Ratings, Ratings]:
    """A test split, then the same split of the rest for validation.

    ``how``: ``"last"`` (:func:`leave_last_out`) or ``"fraction"`` (:func:`per_user_split`);
    ``kwargs`` go to that function.
    """
    split = {"last": leave_last_out, "fraction": per_user_split}.get(how)
    if split is None:
        raise ValueError(f"how must be 'last' or 'fraction', got {how!r}")
    rest, test = split(r, **kwargs)
    train, valid = split(rest, **kwargs)
    return train, valid, test


# --- candidates -----------------------------------------------------------------------------------

def sample_candidates(seen: Interactions, users, positives, n: int = 99, *,
                      seed: int = 0) -> torch.Tensor:
    """For each (user, held-out item): that item in column 0, then ``n`` distinct items the
    user never interacted with (uniform; ``seen`` should hold the training *and* test pairs).

    Deterministic from ``seed`` (on the CPU), so every system ranks the same candidates.

    Returns:
        int64 [len(users), 1 + n] (CPU).
    """
    users = torch.as_tensor(users).long().cpu()
    positives = torch.as_tensor(positives).long().cpu()
    seen = Interactions(seen.keys.cpu() // seen.num_items, seen.keys.cpu() % seen.num_items,
                        seen.num_users, seen.num_items) if seen.device.type != "cpu" else seen
    short = seen.counts()[users] > seen.num_items - n
    if short.any():
        u = int(users[short][0])
        raise ValueError(f"user {u} has seen {int(seen.counts()[u]):,} of {seen.num_items:,} "
                         f"items: fewer than n={n} are left to sample; lower n")
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(users.numel(), n, dtype=torch.long)
    todo = torch.arange(users.numel())
    width = 2 * n + 16
    while todo.numel():
        draw = torch.randint(seen.num_items, (todo.numel(), width), generator=gen)
        ok = ~seen.contains(users[todo, None], draw)
        # duplicates within a row: keep the first occurrence (found by sorting, then mapped back)
        sorted_draw, idx = draw.sort(dim=1, stable=True)
        dup_sorted = torch.zeros_like(ok)
        dup_sorted[:, 1:] = sorted_draw[:, 1:] == sorted_draw[:, :-1]
        ok &= ~torch.zeros_like(ok).scatter_(1, idx, dup_sorted)
        done = ok.sum(1) >= n
        rank = torch.cumsum(ok, 1)
        pick = ok & (rank <= n) & done[:, None]
        out[todo[done]] = draw[pick].reshape(-1, n)
        todo = todo[~done]
    return torch.cat((positives[:, None], out), 1)


# --- metrics --------------------------------------------------------------------------------------

def ranking_metrics(scores, k: int = 10, *, positive: int = 0) -> dict:
    """HR@k and NDCG@k when column ``positive`` of ``scores`` [users, candidates] is the one
    relevant item.

    Ties count as broken at random: with ``g`` candidates scoring higher and ``t`` scoring the
    same as the relevant item, its rank is uniform on ``g .. g + t``, and the metrics are their
    expected values (a constant scorer gets ``k / candidates``, not 1 or 0).

    A NaN score never helps: a relevant item scored NaN is a miss (0 for that user), and a
    NaN-scored candidate ranks above the relevant item. A model whose scores are all NaN gets
    0, the worst score, not NaN.

    >>> ranking_metrics(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), k=1)['hr@1']
    0.5
    >>> ranking_metrics(torch.full((3, 4), float("nan")), k=1)
    {'hr@1': 0.0, 'ndcg@1': 0.0}
    """
    scores = torch.as_tensor(scores, dtype=torch.float64)
    if scores.dim() != 2 or not 0 <= positive < scores.shape[1]:
        raise ValueError(f"scores must be [users, candidates] with column {positive} the relevant "
                         f"item; got shape {tuple(scores.shape)}")
    if scores.shape[0] == 0:
        return {f"hr@{k}": math.nan, f"ndcg@{k}": math.nan}
    pos = scores[:, positive:positive + 1]
    nan = torch.isnan(scores)
    greater = (scores > pos).sum(1) + nan.sum(1) - nan[:, positive].long()   # NaNs rank above
    ties = ((scores == pos).sum(1) - 1).clamp(min=0)
    ranks = torch.arange(scores.shape[1], dtype=torch.float64)                  # 0-based
    possible = (ranks[None] >= greater[:, None]) & (ranks[None] <= (greater + ties)[:, None])
    weight = possible / (ties + 1)[:, None]
    weight[nan[:, positive]] = 0.0                                 # a NaN relevant item: a miss
    top = ranks < k
    hr = (weight * top).sum(1)
    ndcg = (weight * top / torch.log2(ranks + 2)).sum(1)
    return {f"hr@{k}": float(hr.mean()), f"ndcg@{k}": float(ndcg.mean())}


def full_ranking_metrics(top_items, relevant: Interactions, users, k: int = 10) -> dict:
    """Recall@k, HR@k and NDCG@k of top-k lists over the whole catalogue.

    Args:
        top_items: int64 [len(users), >= k], each user's recommendations, best first, with the
            items seen in training already left out (``model.recommend(users, k)`` does that);
            -1 pads short lists.
        relevant: the held-out pairs (:class:`Interactions`).
        users: whose lists these are.

    Recall@k divides the hits by the user's held-out count; NDCG@k divides by the best DCG a
    list of ``k`` could reach (binary relevance).
    """
    top = torch.as_tensor(top_items).long()[:, :k].to(relevant.device)
    users = torch.as_tensor(users, device=relevant.device).long()
    n_rel = relevant.counts()[users]
    keep = n_rel > 0
    top, users, n_rel = top[keep], users[keep], n_rel[keep].double()
    if users.numel() == 0:
        return {f"recall@{k}": math.nan, f"hr@{k}": math.nan, f"ndcg@{k}": math.nan}
    hit = relevant.contains(users[:, None], top.clamp_min(0)) & (top >= 0)
    discount = 1.0 / torch.log2(torch.arange(k, dtype=torch.float64) + 2)
    # the cumsum on the CPU: a float cumsum on CUDA may add in another order each run
    ideal = torch.cumsum(discount, 0).to(top.device)[(n_rel.clamp(max=k) - 1).long()]
    dcg = (hit * discount[: top.shape[1]].to(top.device)).sum(1)
    hits = hit.sum(1).double()
    return {f"recall@{k}": float((hits / n_rel).mean()), f"hr@{k}": float((hits > 0).double().mean()),
            f"ndcg@{k}": float((dcg / ideal).mean())}


def rating_metrics(predictions, ratings) -> dict:
    """RMSE and MAE (same units as the ratings).

    >>> {k: round(v, 6) for k, v in rating_metrics(torch.tensor([3.0, 4.0]),
    ...                                            torch.tensor([4.0, 4.0])).items()}
    {'rmse': 0.707107, 'mae': 0.5}
    """
    pred = torch.as_tensor(predictions, dtype=torch.float64).reshape(-1)
    true = torch.as_tensor(ratings, dtype=torch.float64).reshape(-1)
    if pred.numel() != true.numel():
        raise ValueError(f"{pred.numel():,} predictions but {true.numel():,} ratings")
    if true.numel() == 0:
        return {"rmse": math.nan, "mae": math.nan}
    err = pred - true
    return {"rmse": float(err.square().mean().sqrt()), "mae": float(err.abs().mean())}


def popularity_scores(train: Ratings, candidates) -> torch.Tensor:
    """The popularity baseline: each candidate's number of training interactions."""
    counts = torch.bincount(train.item_ids, minlength=train.num_items).double()
    return counts[torch.as_tensor(candidates).long()]
