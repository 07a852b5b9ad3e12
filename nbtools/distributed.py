"""Row-sharded offloaded tables over ``torch.distributed``: one table split across processes.

Each rank keeps the rows ``r`` with ``r % world == rank`` in its own
:class:`~nbtools.OffloadedEmbedding` (its own host memory and per-row optimizer state). Rows go
round-robin rather than in contiguous ranges because ids are usually numbered by frequency (a
vocabulary sorted by count): contiguous ranges would put every hot row, and most of the traffic,
on rank 0; round-robin spreads them evenly.

A lookup exchanges ids and rows with ``all_to_all``; gradients travel back to the owners the same
way, and each rank's :class:`~nbtools.OffloadOptimizer` steps only its own shard, with the
table's lazy semantics. See docs/distributed.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.distributed as dist
from torch import nn

from .devices import on_tables
from .store.cache import warm_counts
from .tables import OffloadedEmbedding


def _world_of(process_group) -> tuple[int, int]:
    """``(rank, world)`` in ``process_group``; None = the default group when
    torch.distributed is initialised, else ``(0, 1)`` (a single process)."""
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
        self.rank, self.world = _world_of(process_group)
        if isinstance(num_embeddings, bool) or not isinstance(num_embeddings, int) \
                or num_embeddings < self.world:
            raise ValueError(f"num_embeddings must be an int of at least the world size "
                             f"{self.world}, got {num_embeddings!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.name = name or type(self).__name__
        padding_idx = options.pop("padding_idx", None)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} is out of range for "
                                 f"{num_embeddings:,} rows")
            padding_idx = int(padding_idx) % num_embeddings
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
        ids = self.shard.prepare_ids(ids)
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


# --- data-parallel training -------------------------------------------------------------------
def _has_table(module: nn.Module) -> bool:
    return any(isinstance(m, (OffloadedEmbedding, ShardedEmbedding)) for m in module.modules())


def data_parallel(model: nn.Module, **ddp_options) -> nn.Module:
    """Make ``model`` (built the same on every rank, its tables :class:`ShardedEmbedding`)
    train data-parallel over the default process group, each rank on its own slice of the data
    (``PinnedLoader(..., rank=rank, world=world)``); returns ``model``, changed in place.

    Every submodule with trainable dense parameters and no table is wrapped in torch's
    :class:`~torch.nn.parallel.DistributedDataParallel` (its parameters copied from rank 0 and
    their gradients averaged over the ranks in backward), and every ShardedEmbedding averages
    its rows' gradients the same way, so a step over the ranks' batches is a step over their
    concatenation with a mean loss. ``ddp_options`` go to DistributedDataParallel (GPU
    modules get ``device_ids=[their device]``). One process (no process group): ``model`` as
    it is. Parameters held directly by a module that also holds a table cannot be wrapped:
    move them into a submodule (a ValueError names them)."""
    from torch.nn.parallel import DistributedDataParallel

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return model
    for m in model.modules():
        if isinstance(m, ShardedEmbedding):
            m.average_grads = True

    def wrap(module: nn.Module, path: str) -> None:
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        if own:
            raise ValueError(f"data_parallel: {path or 'the model'} holds parameters {own} "
                             "beside its tables; move them into a submodule (e.g. an "
                             "nn.Linear) so that it can be wrapped in DistributedDataParallel")
        for name, child in module.named_children():
            if isinstance(child, (DistributedDataParallel, OffloadedEmbedding, ShardedEmbedding)):
                continue
            if _has_table(child):
                wrap(child, f"{path}.{name}" if path else name)
            elif any(p.requires_grad for p in child.parameters()):
                device = next(child.parameters()).device
                opts = dict(ddp_options)
                if device.type == "cuda":
                    opts.setdefault("device_ids", [device])
                setattr(module, name, DistributedDataParallel(child, **opts))
    wrap(model, "")
    return model


# --- launching a small job from a notebook or a test --------------------------------------
def init(backend: str | None = None) -> tuple[int, int]:
    """Join the process group a launcher set up, from its environment (``torchrun
    --nproc_per_node=N train.py`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``); returns ``(rank, world)``. ``backend``: default ``"nccl"`` where CUDA is
    available (rank r on ``cuda:LOCAL_RANK``, made current), else ``"gloo"``. Without a
    launcher's environment (one process): ``(0, 1)`` and no process group. Already joined
    (:func:`spawn`'s workers): the group's rank and size."""
    import os

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    extra = {}
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (docs/distributed.md)
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        extra["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, **extra)
    return dist.get_rank(), dist.get_world_size()



def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world, port, args, results, timeout_s, backend="gloo"):
    import datetime
    import os
    import sys

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    extra = {}
    if backend == "nccl":           # one GPU a rank: cuda:rank, current in this process
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (docs/distributed.md)
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            **extra)
    value = fn(rank, world, *args)
    results.put((rank, value))      # SimpleQueue: written before put returns
    dist.barrier()                  # every rank past its last collective
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter finalisation: gloo's threads now and then abort a process there
    # ("terminate called without an active exception") after its work is done
    os._exit(0)


def spawn(fn, nprocs: int, args=(), timeout: float = 600.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` processes on this machine, each in a
    process group (the default group, so ``ShardedEmbedding(...)`` shards over it), and return
    their return values in rank order.

    ``backend``: ``"gloo"`` (CPU ranks, or GPU ranks exchanging through host memory) or
    ``"nccl"`` (one GPU a rank: rank r computes on ``cuda:r``, made current in its process;
    ``nprocs`` at most the GPUs visible).

    ``fn`` must be importable by the new processes: define it in a ``.py`` file (in a
    notebook, ``%%writefile job.py`` and ``from job import train``), not in a cell. A rank that
    raises fails the whole job with its traceback; after ``timeout`` seconds the processes are
    killed and ``TimeoutError`` is raised. Collectives give up after the same timeout.
    """
    import time

    import torch.multiprocessing as mp

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and nprocs > torch.cuda.device_count():
        raise ValueError(f"backend='nccl' runs one rank a GPU: {nprocs} ranks asked for, "
                         f"{torch.cuda.device_count()} GPU(s) visible")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    job = mp.start_processes(_worker, args=(fn, nprocs, free_port(), tuple(args), results,
                                            timeout, backend), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not job.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {nprocs} processes did not "
                                   f"finish in {timeout:g} s; its processes were killed")
    finally:
        for p in job.processes:
            if p.is_alive():
                p.kill()
    values = dict(results.get() for _ in range(nprocs))
    return [values[r] for r in range(nprocs)]


# --- checkpoints: one CheckpointManager per rank, a manifest that ties them together --------
SHARDS = "SHARDS.json"


def _rank_dir(rank: int, world: int) -> str:
    return f"rank{rank}-of-{world}"


def _barrier(table: ShardedEmbedding) -> None:
    if table.world > 1:
        dist.barrier(group=table.group)


def save_sharded(directory, step: int, table: ShardedEmbedding, opt, *, keep: int = 3,
                 config=None) -> dict:
    """Save a sharded table and its optimizer (on every rank at once: a collective).

    Each rank writes its shard and its optimizer's state with the atomic
    :class:`~nbtools.CheckpointManager` format into ``directory/rank{r}-of-{world}/``; once all
    have finished, rank 0 writes ``directory/SHARDS.json`` (world size, shape, layout, step,
    optimizer), which :func:`restore_sharded` reads. ``opt`` must step only this table
    (``OffloadOptimizer(cls, table, ...)``): ordinary parameters are checkpointed apart.
    Returns this rank's ``CheckpointManager.save`` figures.
    """
    import json
    import os
    from pathlib import Path

    from .checkpoint import CheckpointManager

    if opt.state_dict()["dense"] is not None or opt.tables != {table.shard.name: table.shard}:
        raise ValueError(f"save_sharded: the optimizer must step only table {table.name!r} "
                         f"(it steps tables {list(opt.tables)} and ordinary parameters: "
                         f"{opt.state_dict()['dense'] is not None}); give the rest of the model "
                         "its own optimizer and checkpoint")
    root = Path(directory).expanduser()
    manager = CheckpointManager(root / _rank_dir(table.rank, table.world), keep=keep,
                                config=config)
    info = manager.save(step, table=table.shard, opt=opt, rng=False)
    _barrier(table)                        # every shard complete before the manifest names it
    if table.rank == 0:
        body = {"format": "nbtools.ShardedEmbedding/1", "step": int(step), "world": table.world,
                "layout": "round-robin: rank k holds rows k, k + world, ...",
                "name": table.name, "num_embeddings": table.num_embeddings,
                "embedding_dim": table.embedding_dim,
                "optimizer": opt.optimizer_class.__name__}
        tmp = root / (SHARDS + ".tmp")
        with open(tmp, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / SHARDS)
    _barrier(table)
    return info


def _constructor_kwargs(cls, group: dict) -> dict:
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in group.items() if k in accepted and k != "params"}


def restore_sharded(directory, table: ShardedEmbedding, opt, *, config=None):
    """Load what :func:`save_sharded` wrote into ``table`` and ``opt``, on any number of ranks
    (a collective); returns the saved step, or None when ``directory`` holds no sharded
    checkpoint.

    On the world size it was saved with, each rank restores its own shard. On another (one
    process included) each rank reads every saved shard in turn, one at a time, into a
    temporary CPU table and keeps the rows it now owns (weight and per-row state); the scalar
    state (Adam's step) and hyper-parameters come from saved rank 0. Each shard's newest
    checkpoint must be the manifest's step.
    """
    import json
    from pathlib import Path

    from .checkpoint import CheckpointError, CheckpointManager

    root = Path(directory).expanduser()
    try:
        with open(root / SHARDS) as f:
            m = json.load(f)
    except FileNotFoundError:
        return None
    if (m["num_embeddings"], m["embedding_dim"]) != (table.num_embeddings, table.embedding_dim):
        raise ValueError(f"checkpoint {root} holds a {m['num_embeddings']:,} x "
                         f"{m['embedding_dim']} table, table {table.name!r} is "
                         f"{table.num_embeddings:,} x {table.embedding_dim}")
    if m["optimizer"] != opt.optimizer_class.__name__:
        raise ValueError(f"checkpoint {root} was saved with {m['optimizer']}, this optimizer is "
                         f"{opt.optimizer_class.__name__}")
    saved_world, name = m["world"], table.shard.name

    def restore_one(rank, shard, shard_opt):
        got = CheckpointManager(root / _rank_dir(rank, saved_world), config=config).restore(
            table=shard, opt=shard_opt, rng=False)
        if got != m["step"]:
            raise CheckpointError(
                f"rank {rank}'s newest readable checkpoint in {root} is step {got}, the manifest "
                f"{root / SHARDS} names step {m['step']}: a save was interrupted or a shard is "
                "damaged. Restore an intact copy of the whole directory.")

    if saved_world == table.world:
        restore_one(table.rank, table.shard, opt)
        _barrier(table)
        return m["step"]
    mine = opt.state_dict()
    kwargs = _constructor_kwargs(opt.optimizer_class, mine["tables"][name]["group"])
    scalar = None
    for k in range(saved_world):
        old = OffloadedEmbedding(len(range(k, table.num_embeddings, saved_world)),
                                 table.embedding_dim, device="cpu", name=name,
                                 dtype=table.shard.rows.host.tensor.dtype)
        old_opt = type(opt)(opt.optimizer_class, old, **kwargs)
        restore_one(k, old, old_opt)
        if k == 0:
            scalar = old_opt.state_dict()["tables"][name]
        ids = torch.arange(k, table.num_embeddings, saved_world)
        keep = ids % table.world == table.rank
        rows = old.rows.host.tensor[keep]          # [weight | state...] of the rows now mine
        device = table.shard.device
        table.shard.rows.scatter((ids[keep] // table.world).to(device), rows.to(device))
        old.close()
    mine["tables"][name] = {**mine["tables"][name], "group": scalar["group"],
                            "scalar_state": scalar["scalar_state"]}
    opt.load_state_dict(mine)                      # row state: the live tensors, kept as is
    _barrier(table)
    return m["step"]
