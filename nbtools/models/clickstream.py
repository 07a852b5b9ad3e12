"""A click stream of any size with planted structure, and item2vec trained on it.

For tables too big for RAM there is rarely a data set at hand that needs them, so
:class:`ClickStream` makes one up, step by step, for any number of items, without storing
anything: item popularities follow a Zipf-like law (a few items take most clicks, as in real
logs), and every item belongs to one of ``topics`` planted topics. Each sample is a triple
``(anchor, positive, negative)``: two items clicked in one session (the same topic) and an item
drawn by popularity alone (the noise a word2vec-style model contrasts with).

:class:`Item2Vec` learns one vector per item from those triples (skip-gram with negative
sampling on one table, as item2vec does); :func:`fit_stream` trains it with the disk tier's
read-ahead and records the loss, the share of triples ranked right before the step that trains
on them, and the RAM cache's hit rate; :func:`topic_recovery` measures how much of the planted
structure the vectors recovered: the share of popular items whose nearest neighbour is in the
same topic, against chance.

Facts it rests on: ranks map to ids by a multiplication modulo the number of items, so the hot
rows are spread over the whole table (and its file), not packed at its start; a batch is a
pure function of ``(seed, step)``, so any step can be made again.

>>> stream = ClickStream(1000, 8, topics=4, seed=0)
>>> batch = stream.batch(0)
>>> batch.shape, batch.dtype
(torch.Size([3, 8]), torch.int64)
>>> bool((stream.topic_of(batch[0]) == stream.topic_of(batch[1])).all())
True
>>> torch.equal(stream.batch(5), stream.batch(5))
True
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..disk import readahead
from ..devices import synchronize

# Multipliers that map popularity ranks to ids (rank * P mod n is a bijection when P and n share
# no factor): primes, the first that does not divide n is used.
_PRIMES = (1_000_000_007, 2_147_483_647, 998_244_353)
_MAX_ITEMS = 1 << 31           # rank * P and id * P^-1 stay inside int64


class ClickStream:
    """Triples ``(anchor, positive, negative)`` of item ids, ``batch_size`` per step.

    Args:
        num_items: items (rows of the table the stream trains), 2**31 at most.
        batch_size: triples per step.
        topics: planted topics; an item's topic is its popularity rank modulo ``topics``.
        exponent: of the Zipf-like popularity, ``P(rank r) ~ r**-exponent`` (1.1: a few
            thousand items take half the clicks of a hundred million).
        seed: the stream; batch ``t`` depends only on ``(seed, t)``.

    Ranks are drawn from the continuous power law on ``[1, num_items + 1)`` by its inverse
    distribution function and rounded down: Zipf's law up to the shape of its first few ranks,
    in a handful of tensor operations for any ``num_items``. The positive is a second draw moved
    to the anchor's topic (its rank's remainder set to the anchor's), so it keeps nearly the
    same popularity; the negative is an independent draw. Batches are int64 CPU tensors
    ``[3, batch_size]``: a disk table deduplicates its ids on the CPU, so ids that start there
    cost no GPU synchronisation.
    """

    def __init__(self, num_items: int, batch_size: int, *, topics: int = 32,
                 exponent: float = 1.1, seed: int = 0):
        for name, value, low in (("num_items", num_items, 2), ("batch_size", batch_size, 1),
                                 ("topics", topics, 2)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if num_items > _MAX_ITEMS:
            raise ValueError(f"num_items={num_items:,} is more than the {_MAX_ITEMS:,} a stream "
                             "can map (ids are computed in int64)")
        if topics > num_items:
            raise ValueError(f"topics={topics} exceeds num_items={num_items}: every topic needs "
                             "an item")
        if not (isinstance(exponent, (int, float)) and exponent > 0 and exponent != 1):
            raise ValueError(f"exponent must be a positive number other than 1, got {exponent!r}")
        self.num_items, self.batch_size, self.topics = num_items, batch_size, topics
        self.exponent, self.seed = float(exponent), int(seed)
        self._mul = next(p for p in _PRIMES if math.gcd(p, num_items) == 1)
        self._inv = pow(self._mul, -1, num_items)

    def __repr__(self) -> str:
        return (f"ClickStream({self.num_items:,} items, {self.batch_size:,} triples per step, "
                f"{self.topics} topics, Zipf exponent {self.exponent}, seed {self.seed})")

    # --- ranks, ids, topics ---------------------------------------------------------------
    def ids_of(self, ranks: torch.Tensor) -> torch.Tensor:
        """Item ids of popularity ranks (0: the most popular)."""
        return ranks.long() * self._mul % self.num_items

    def rank_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Popularity ranks of item ids (the inverse of :meth:`ids_of`)."""
        return torch.as_tensor(ids).long() * self._inv % self.num_items

    def topic_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The planted topic of each id."""
        return self.rank_of(ids) % self.topics

    def hottest(self, k: int, start: int = 0) -> torch.Tensor:
        """Ids of the items of popularity ranks ``start .. start + k - 1``."""
        stop = min(start + k, self.num_items)
        return self.ids_of(torch.arange(start, stop))

    def click_share(self, k: int) -> float:
        """Share of the draws that fall on the ``k`` most popular items."""
        s, n = 1.0 - self.exponent, self.num_items
        return ((k + 1) ** s - 1) / ((n + 1) ** s - 1)

    def head(self, share: float) -> int:
        """The fewest most popular items that take at least ``share`` of the draws."""
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share!r}")
        s, n = 1.0 - self.exponent, self.num_items
        k = math.ceil((1.0 + share * ((n + 1) ** s - 1.0)) ** (1.0 / s) - 1.0 - 1e-9)
        return min(n, max(1, k))

    def shares(self, head: float = 1.0) -> torch.Tensor:
        """Each item's share of the popularity draws, in id order (float32 ``[num_items]``):
        what :meth:`nbtools.OffloadedEmbedding.warm_cache` takes to load the most clicked items
        first. ``head`` < 1: only the most popular items that take that share of the draws
        (:meth:`head`), the others 0 (not loaded). (Anchors and negatives are such draws; a
        positive keeps nearly its draw's popularity.)"""
        k = self.head(head)
        s, top = 1.0 - self.exponent, float(self.num_items + 1)
        r = torch.arange(k, dtype=torch.float64)
        p = ((r + 2.0) ** s - (r + 1.0) ** s) / (top ** s - 1.0)   # P(rank r), see _ranks
        if k == self.num_items:
            p[-1] += 1.0 - float(p.sum())   # (the clamp to the last rank)
        out = torch.zeros(self.num_items, dtype=torch.float32)
        out[self.ids_of(torch.arange(k))] = p.float()
        return out

    # --- batches --------------------------------------------------------------------------
    def _ranks(self, gen: torch.Generator, n: int) -> torch.Tensor:
        s, top = 1.0 - self.exponent, float(self.num_items + 1)
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        x = ((top ** s - 1.0) * u + 1.0) ** (1.0 / s)            # inverse CDF of x**-exponent
        return (x.long() - 1).clamp_(0, self.num_items - 1)

    def batch(self, step: int) -> torch.Tensor:
        """The triples of ``step``: ``[3, batch_size]`` ids (anchor, positive, negative)."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + int(step))
        b, k = self.batch_size, self.topics
        anchor, other, negative = self._ranks(gen, 3 * b).view(3, b)
        positive = other - other % k + anchor % k                 # the anchor's topic
        positive = torch.where(positive >= self.num_items, positive - k, positive)
        return self.ids_of(torch.stack((anchor, positive, negative)))

    def __iter__(self):
        step = 0
        while True:
            yield self.batch(step)
            step += 1


class Item2Vec(nn.Module):
    """One vector per item, trained so that items clicked together score high.

    ``loss(batch)`` for triples ``[3, B]`` is the mean of
    ``-log σ(s(a, p)) - log σ(-s(a, n))`` with ``s(x, y) = x·y / sqrt(dim)``: skip-gram with
    one negative, on a single table (item2vec). The scale keeps the first scores near N(0, 1)
    with the table's default N(0, 1) rows, so no initialisation pass over the table is needed
    (for a disk table that would rewrite the whole file).
    """

    def __init__(self, table: nn.Module):
        super().__init__()
        self.table = table

    def scores(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positive, negative) scores of each triple. One lookup of all ``3 * B`` ids."""
        rows = self.table(batch)                                     # [3, B, dim]
        anchor, positive, negative = rows.unbind(0)
        scale = rows.shape[-1] ** -0.5
        return (anchor * positive).sum(-1) * scale, (anchor * negative).sum(-1) * scale

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        return _loss(*self.scores(batch))


def _loss(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    return -(F.logsigmoid(pos) + F.logsigmoid(-neg)).mean()


# The share of the clicks whose items fit_stream loads before the first step: with Zipf(1.1) over
# 21M items, the 38K most popular (one item in 550; 90% would take 551K).
WARM_HEAD = 0.8


def fit_stream(model: Item2Vec, stream: ClickStream, optimizer, steps: int, *, dashboard=None,
               log_every: int | None = None, read_ahead: bool | int = True,
               warm: bool = True) -> dict:
    """Train ``model`` on ``steps`` batches of ``stream``, from the stream's step 0.

    Each step looks its triples up, starts the read-ahead of a coming step's rows
    (``table.prefetch``: a disk table reads its misses while this step computes), and steps
    the optimizer. ``read_ahead``: steps read ahead (True: :data:`nbtools.disk.readahead.AHEAD`,
    8, the fastest measured on the GPU machine's disk; False or 0: none; tables not on disk prefetch
    one step, the one lookup their prefetch holds). ``dashboard``: a
    :class:`~nbtools.Dashboard`, stepped from this loop. ``warm``: where the table keeps hot
    rows in a cache (a disk table's RAM and GPU levels, a ``cache_bytes`` GPU cache), the
    stream's most popular items, those that take WARM_HEAD of the clicks, are loaded into it
    before the first step (``table.warm_cache(stream.shares(WARM_HEAD))``), so the first steps
    already find most of their rows. Only the head: a RAM cache a tenth of the table's size
    would otherwise read about the whole file to fill.

    Returns the history: ``step``, ``loss`` (mean over each ``log_every`` steps),
    ``pair_accuracy`` (share of those steps' triples whose positive outscored the negative,
    measured before the step that trains on them: a held-out figure for the rows seen so far),
    ``ram_hit_rate`` (share of those steps' unique rows that a disk table found in its RAM
    cache without reading them from disk, by the step or by its read-ahead; None for other
    tables), ``time_s``; ``pairs_per_s`` over the whole run, and ``warm_s``, the seconds the
    warming took (before the first step; not in ``time_s``).
    """
    if steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    log_every = log_every or max(1, steps // 50)
    table = model.table
    disk = getattr(table, "disk", None)       # a disk table's file and RAM cache, else None
    history = {"step": [], "loss": [], "pair_accuracy": [], "ram_hit_rate": [], "time_s": []}
    pin = table.device.type == "cuda"         # host ids in pinned memory: copies need no sync
    depth = readahead.AHEAD if read_ahead is True else int(read_ahead or 0)
    if depth < 0:
        raise ValueError(f"read_ahead must be a bool or a number of steps >= 0, got "
                         f"{read_ahead!r}")
    if disk is None:          # a RAM or GPU table's prefetch holds one coming lookup
        depth = min(depth, 1)
    lead = max(1, depth)      # batches made ahead of the step (the next one at least)

    def batch(k):
        ids = stream.batch(k)
        return ids.pin_memory() if pin else ids
    loss_sum = right = None
    t0 = time.perf_counter()
    if warm and (table.rows.own_cache or table.rows.cache is not None):    # a cache to warm
        table.warm_cache(stream.shares(WARM_HEAD))
    warm_s = time.perf_counter() - t0
    seen = dict(disk.stats) if disk is not None else None   # (before any read-ahead counts)
    t0 = time.perf_counter()
    coming = collections.deque(batch(k) for k in range(min(steps, lead)))
    for ids in list(coming)[1:]:
        table.prefetch(ids)
    for step in range(steps):
        ids = coming.popleft()
        pos, neg = model.scores(ids)
        if step + lead < steps:
            coming.append(batch(step + lead))
            if depth:
                table.prefetch(coming[-1])
        loss = _loss(pos, neg)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            wins = (pos > neg).float().mean()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            right = wins if right is None else right + wins
        if dashboard is not None:
            dashboard.step(stream.batch_size)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            n = step + 1 - (history["step"][-1] if history["step"] else 0)
            history["step"].append(step + 1)
            history["loss"].append(float(loss_sum) / n)           # note: a CPU-GPU sync point
            history["pair_accuracy"].append(float(right) / n)
            history["ram_hit_rate"].append(_hit_rate(seen, disk))
            history["time_s"].append(time.perf_counter() - t0)
            loss_sum = right = None
            seen = dict(disk.stats) if disk is not None else None
    synchronize(table.device)
    history["pairs_per_s"] = steps * stream.batch_size / (time.perf_counter() - t0)
    history["warm_s"] = warm_s
    return history


def _hit_rate(before: dict | None, disk) -> float | None:
    """Share of the unique rows looked up since ``before`` (a disk table's ``stats``) that
    were neither missed nor brought in by a read-ahead (counted at their lookup, not at their
    read: a read-ahead reads rows of steps still to come)."""
    if disk is None:
        return None
    now = disk.stats
    looked = now["lookups"] - before["lookups"]
    read = now["misses"] - before["misses"] + now["ahead_hits"] - before["ahead_hits"]
    return max(0.0, 1.0 - read / looked) if looked else None


@dataclasses.dataclass
class TopicRecovery:
    """What :func:`topic_recovery` measured."""

    topic_match: float      # share of the items whose nearest neighbour shares their topic
    chance: float           # the share a neighbour drawn at random from the set would score
    items: int
    start_rank: int

    def __str__(self) -> str:
        return (f"popularity ranks {self.start_rank:,}-{self.start_rank + self.items - 1:,}: "
                f"{self.topic_match:.1%} of nearest neighbours share the item's topic "
                f"(chance {self.chance:.1%})")


@torch.no_grad()
def topic_recovery(table: nn.Module, stream: ClickStream, items: int = 2000,
                   start_rank: int = 0) -> TopicRecovery:
    """How much planted structure the vectors hold: among the items of popularity ranks
    ``start_rank .. start_rank + items - 1``, the share whose nearest neighbour (by cosine,
    among the others of the set) has the same topic, against chance."""
    ids = stream.hottest(items, start_rank)
    if len(ids) < 2:
        raise ValueError(f"topic_recovery needs at least 2 items; ranks {start_rank:,}.. of "
                         f"{stream.num_items:,} give {len(ids)}")
    rows = F.normalize(table(ids).float(), dim=-1)
    sim = rows @ rows.T
    sim.fill_diagonal_(-math.inf)
    topic = stream.topic_of(ids).to(sim.device)
    nearest = sim.argmax(1)
    counts = torch.bincount(topic, minlength=stream.topics).double()
    same = (counts[topic] - 1) / (len(ids) - 1)               # others of one's own topic
    return TopicRecovery(float((topic[nearest] == topic).double().mean()), float(same.mean()),
                         len(ids), start_rank)


__all__ = ["ClickStream", "Item2Vec", "fit_stream", "topic_recovery", "TopicRecovery"]
