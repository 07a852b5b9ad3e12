"""The sharded table: one table's rows split across the ranks of a process group.

Each rank keeps the rows ``r`` with ``r % world == rank`` in its own
:class:`~nbtools.OffloadedEmbedding` (its own host memory and per-row optimizer state). Rows go
round-robin rather than in contiguous ranges because ids are usually numbered by frequency (a
vocabulary sorted by count): contiguous ranges would put every hot row, and most of the traffic,
on rank 0; round-robin spreads them evenly.

A lookup exchanges ids and rows with ``all_to_all``; gradients travel back to the owners the same
way (the autograd exchange, :class:`_RowsToRequesters`), and each rank's
:class:`~nbtools.OffloadOptimizer` steps only its own shard, with the table's lazy semantics.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn

from ..devices import on_tables
from ..store.cache import warm_counts
from ..tables import OffloadedEmbedding, padding_row


def world_of(process_group) -> tuple[int, int]:
    """``(rank, world)`` in ``process_group``; None = the default group when
    torch.distributed is initialised, else ``(0, 1)`` (a single process).

    >>> world_of(None)                    # no process group
    (0, 1)
    """
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _exchange(tensor: torch.Tensor, out_rows: int, out_splits, in_splits, group, comm_device):
    """``all_to_all``: send rows ``in_splits[j]`` of ``tensor`` to rank j, receive
    ``out_splits[j]`` rows from rank j; the result is on ``tensor``'s device."""
    send = tensor.to(comm_device).contiguous()
    recv = send.new_empty((out_rows,) + tuple(send.shape[1:]))
    dist.all_to_all_single(recv, send, output_split_sizes=out_splits,
                           input_split_sizes=in_splits, group=group)
    return recv.to(tensor.device)


class _RowsToRequesters(torch.autograd.Function):
    """Forward: the owners' looked-up rows go back to the ranks that asked for them.
    Backward: the requesters' gradients go to the owners (the reverse ``all_to_all``), where
    the shard's lookup sums them per row."""

    @staticmethod
    def forward(ctx, rows, asked, served, group, comm_device, scale):
        ctx.asked, ctx.served, ctx.group, ctx.comm_device = asked, served, group, comm_device
        ctx.scale = scale
        return _exchange(rows, sum(asked), asked, served, group, comm_device)

    @staticmethod
    def backward(ctx, grad):
        if ctx.scale != 1.0:           # data-parallel: the ranks' gradients averaged
            grad = grad * ctx.scale
        back = _exchange(grad, sum(ctx.served), ctx.served, ctx.asked, ctx.group,
                         ctx.comm_device)
        return back, None, None, None, None, None


class ShardedEmbedding(nn.Module):
    """An embedding table whose rows are split across the ranks of a process group.

    Args:
        num_embeddings: rows of the whole table.
        embedding_dim: values per row.
        process_group: the ``torch.distributed`` group to shard over; None = the default group
            when ``torch.distributed`` is initialised, else no sharding (one process: the table
            behaves exactly like an :class:`~nbtools.OffloadedEmbedding`).
        name: used in messages and optimizer/checkpoint state (the shard carries it).
        **options: :class:`~nbtools.OffloadedEmbedding` options (``padding_idx``, ``device``,
            ``placement``, ``config``, ``dtype``, ...), applied to the local shard.

    Every rank must call each lookup with its own ids (any shape, any count, zero included) and
    backpropagate through every training lookup: a lookup and its backward are collectives.
    ``OffloadOptimizer(torch.optim.X, model)`` on each rank finds the local shard (an
    OffloadedEmbedding submodule) and steps only it.

    >>> table = ShardedEmbedding(100, 4, device="cpu", name="items")   # no process group
    >>> table(torch.tensor([[1, 2], [2, 99]])).shape, table.world, table.shard.num_embeddings
    (torch.Size([2, 2, 4]), 1, 100)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, process_group=None,
                 name=None, **options):
        super().__init__()
        # None stays None (collectives then use the default group): holding the default
        # group's object would keep it alive after destroy_process_group()
        self.group = process_group
        self.rank, self.world = world_of(process_group)
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) \
                or num_embeddings < self.world:
            raise ValueError(f"num_embeddings must be an int of at least the world size "
                             f"{self.world}, got {num_embeddings!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.name = name or type(self).__name__
        padding_idx = padding_row(options.pop("padding_idx", None), num_embeddings)
        self.padding_idx = padding_idx
        local_padding = None
        if padding_idx is not None and padding_idx % self.world == self.rank:
            local_padding = padding_idx // self.world
        # rows rank, rank + world, ...: local row i is global row i * world + rank
        rows = (num_embeddings - self.rank + self.world - 1) // self.world
        self.shard = OffloadedEmbedding(rows, embedding_dim, padding_idx=local_padding,
                                        name=self.name, **options)
        self.device = self.shard.device
        # False: a row's gradient is the sum of every rank's (each rank's loss its own);
        # True (data_parallel): their mean, as DistributedDataParallel averages dense ones
        self.average_grads = False
        backend = dist.get_backend(self.group) if self.world > 1 else None
        # gloo exchanges CPU tensors; NCCL those on the GPU (tests/test_distributed.py runs both)
        self._comm_device = torch.device("cpu") if backend == "gloo" else self.device

    # --- the rows of this rank --------------------------------------------------------------
    def local_ids(self) -> torch.Tensor:
        """[shard rows] int64: the global id of each row this rank holds, in shard order."""
        return torch.arange(self.rank, self.num_embeddings, self.world)

    def warm_cache(self, counts) -> None:
        """Known frequencies of the whole table's rows (``num_embeddings`` counts or shares,
        as :meth:`nbtools.OffloadedEmbedding.warm_cache` takes them): this rank's go to its
        shard.

        >>> table = ShardedEmbedding(100, 4, device="cpu")     # no process group
        >>> table.warm_cache(torch.arange(100))
        """
        counts = warm_counts(counts, self.num_embeddings, self.name)
        self.shard.warm_cache(counts[self.rank::self.world])

    @property
    def weight(self) -> torch.Tensor:
        """The whole table (a single process) or this rank's rows (``local_ids()`` order)."""
        return self.shard.weight

    def read_weight(self) -> torch.Tensor:
        """:attr:`weight` for reading only (:meth:`nbtools.OffloadedEmbedding.read_weight`)."""
        return self.shard.read_weight()

    @on_tables
    def load_full_weight(self, weight: torch.Tensor) -> None:
        """Copy this rank's rows out of a full ``[num_embeddings, dim]`` table (e.g. to start
        every world size from the same initial table)."""
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"table {self.name!r}: expected a full table of shape "
                             f"({self.num_embeddings}, {self.embedding_dim}), got "
                             f"{tuple(weight.shape)}")
        with torch.no_grad():
            self.shard.weight.copy_(weight[self.rank::self.world])

    @on_tables
    def gather_full(self, state: str | None = None) -> torch.Tensor:
        """The whole table (``state=None``) or one per-row optimizer state (e.g.
        ``"exp_avg"``) as a CPU tensor ``[num_embeddings, dim]`` (``[num_embeddings, 1]`` for a
        row-wise state) on every rank: an ``all_gather`` of every shard (the whole table crosses
        the network; for tests and small tables)."""
        local = self.shard.weight if state is None else self.shard.state_columns(state)
        local = local.detach().to("cpu")
        if self.world == 1:
            return local.clone()
        most = (self.num_embeddings + self.world - 1) // self.world
        padded = local.new_zeros(most, local.shape[1])    # (a row-wise state: 1 column)
        padded[: local.shape[0]] = local
        send = padded.to(self._comm_device)
        # the receive buffers where the send is: NCCL writes GPU memory (CPU buffers here
        # were an illegal memory access)
        parts = [torch.empty_like(send) for _ in range(self.world)]
        dist.all_gather(parts, send, group=self.group)
        full = local.new_empty(self.num_embeddings, local.shape[1])
        for r, part in enumerate(parts):
            n = (self.num_embeddings - r + self.world - 1) // self.world
            full[r::self.world] = part[:n].cpu()
        return full

    # --- lookups ----------------------------------------------------------------------------
    def _raise_bad_ids(self, flat: torch.Tensor, shape, bad_ranks: list) -> None:
        """Raise IndexError (on every rank) where ranks ``bad_ranks`` had ids out of range:
        this rank's names its first bad id, the others name those ranks."""
        if self.rank in bad_ranks:
            bad = (flat < 0) | (flat >= self.num_embeddings)
            pos = int(bad.nonzero()[0, 0])
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(pos), tuple(shape))) \
                if len(shape) > 1 else pos
            raise IndexError(
                f"table {self.name!r} has {self.num_embeddings:,} rows but rank {self.rank}'s "
                f"ids contain {int(flat[pos]):,} (first at position {where}); valid ids are 0 "
                f"to {self.num_embeddings - 1:,}. No rank looked up or changed anything.")
        raise IndexError(
            f"table {self.name!r}: ids out of range on rank(s) {bad_ranks} (see their error; "
            f"valid ids are 0 to {self.num_embeddings - 1:,}). No rank looked up or changed "
            "anything.")

    @on_tables
    def forward(self, ids) -> torch.Tensor:
        if self.world == 1:
            return self.shard(ids)
        ids = self.shard.lookups.prepare_ids(ids)
        flat = ids.reshape(-1).long()
        # each unique id is asked for once; owners get them grouped by rank
        uniq, inverse = torch.unique(flat, return_inverse=True)
        owner = uniq % self.world
        order = torch.argsort(owner, stable=True)
        asked = torch.bincount(owner, minlength=self.world)
        # One exchange tells every rank how many ids each rank asks of it and whether any
        # rank's ids are out of range: a bad id on any rank raises on every rank before ids or
        # rows move (no table changes, no rank waits for a peer that raised)
        bad = ((flat < 0) | (flat >= self.num_embeddings)).any().long()
        told = _exchange(torch.stack([asked, bad.expand(self.world)], 1), self.world,
                         [1] * self.world, [1] * self.world, self.group, self._comm_device)
        told = told.tolist()                   # note: the step's one sync point here
        bad_ranks = [r for r, (_, b) in enumerate(told) if b]
        if bad_ranks:
            self._raise_bad_ids(flat, ids.shape, bad_ranks)
        asked, served = asked.tolist(), [n for n, _ in told]
        wanted = _exchange(uniq[order] // self.world, sum(served), served, asked, self.group,
                           self._comm_device)
        rows = self.shard(wanted)              # one lookup: duplicates across ranks merge here
        got = _RowsToRequesters.apply(rows, asked, served, self.group, self._comm_device,
                                      1.0 / self.world if self.average_grads else 1.0)
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)
        # F.embedding, not index_select: its backward sums each id's rows in a fixed order
        # (sort-based) where index_select's adds with atomics on CUDA (docs/reproducibility.md)
        return F.embedding(slot[inverse], got).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings:,}, {self.embedding_dim}, name={self.name!r}, "
                f"rank={self.rank}, world={self.world}")
