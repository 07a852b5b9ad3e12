"""Sharded checkpoints: one CheckpointManager per rank, a manifest that ties them together.

:func:`save_sharded` writes each rank's shard and optimizer state into ``rank{r}-of-{world}/``
and then ``SHARDS.json``; :func:`restore_sharded` reads them back on any number of ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..tables import OffloadedEmbedding
from .sharded import ShardedEmbedding


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

    from ..checkpoint import CheckpointManager

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

    from ..checkpoint import CheckpointError, CheckpointManager

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
