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
SHARDS_FORMAT = "nbtools.ShardedEmbedding/1"
SHARDS_MAX_BYTES = 1 << 20      # SHARDS.json is a few hundred bytes: one past this is not ours


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
    from pathlib import Path

    from ..checkpoint import CheckpointManager
    from ..files import make_folder, write_private

    if opt.state_dict()["dense"] is not None or opt.tables != {table.shard.name: table.shard}:
        raise ValueError(f"save_sharded: the optimizer must step only table {table.name!r} "
                         f"(it steps tables {list(opt.tables)} and ordinary parameters: "
                         f"{opt.state_dict()['dense'] is not None}); give the rest of the model "
                         "its own optimizer and checkpoint")
    root = Path(directory).expanduser()
    make_folder(str(root))                 # the user's alone (0700), like the shards' folders
    manager = CheckpointManager(root / _rank_dir(table.rank, table.world), keep=keep,
                                config=config)
    info = manager.save(step, table=table.shard, opt=opt, rng=False)
    _barrier(table)                        # every shard complete before the manifest names it
    if table.rank == 0:
        body = {"format": SHARDS_FORMAT, "step": int(step), "world": table.world,
                "layout": "round-robin: rank k holds rows k, k + world, ...",
                "name": table.name, "num_embeddings": table.num_embeddings,
                "embedding_dim": table.embedding_dim,
                "optimizer": opt.optimizer_class.__name__}
        # a new 0600 file renamed over SHARDS.json: never written through a link planted there
        write_private(root / SHARDS, json.dumps(body, indent=1).encode(), fsync=True)
    _barrier(table)
    return info


def _constructor_kwargs(cls, group: dict) -> dict:
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in group.items() if k in accepted and k != "params"}


def read_shards(root) -> dict | None:
    """``root/SHARDS.json``, checked (:func:`check_shards`), or None where there is none. It is
    data from a folder someone else may have filled: a link, FIFO or device there, a file over
    ``SHARDS_MAX_BYTES``, or anything but the JSON :func:`save_sharded` writes raises
    :class:`~nbtools.checkpoint.CheckpointError`, without blocking and before anything changes."""
    import json
    import os
    from pathlib import Path

    from ..checkpoint import CheckpointError
    from ..files import open_regular

    path = Path(root) / SHARDS
    try:
        fd = open_regular(path, what="sharded checkpoint manifest", error=CheckpointError)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(SHARDS_MAX_BYTES + 1)
    if len(raw) > SHARDS_MAX_BYTES:
        _damaged(path, f"is over {SHARDS_MAX_BYTES:,} bytes")
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:
        _damaged(path, f"is not valid JSON ({e})")
    check_shards(m, path)
    return m


def _damaged(path, what: str):
    from ..checkpoint import CheckpointError

    raise CheckpointError(f"{path} {what}: damaged, or not written by save_sharded. Nothing was "
                          "restored; restore an intact copy of the whole directory.")


def check_shards(m, path=SHARDS) -> None:
    """Raise :class:`~nbtools.checkpoint.CheckpointError` (naming the field) unless ``m`` has
    the fields :func:`save_sharded` writes, of their types and ranges: the format, ``step``
    >= 0, ``world`` >= 1, ``num_embeddings`` >= 0 and ``embedding_dim`` >= 1 (ints, not
    bools), ``name`` and ``optimizer`` (strings)."""
    if not isinstance(m, dict):
        _damaged(path, f"holds a JSON {type(m).__name__}, expected an object")
    if m.get("format") != SHARDS_FORMAT:
        _damaged(path, f"has format {m.get('format')!r}, expected {SHARDS_FORMAT!r}")
    for key, lo in (("step", 0), ("world", 1), ("num_embeddings", 0), ("embedding_dim", 1)):
        value = m.get(key)
        if type(value) is not int or value < lo:
            _damaged(path, f"has {key} {value!r}, expected an int >= {lo}")
    for key in ("name", "optimizer"):
        if not isinstance(m.get(key), str):
            _damaged(path, f"has {key} {m.get(key)!r}, expected a string")


def _check_shards_there(root, m: dict, config) -> None:
    """Every saved rank's folder is there, a folder, and its newest checkpoint is the
    manifest's step and complete (files present with their sizes): checked on every rank for
    every saved rank, so that all ranks refuse alike, before anything changes."""
    import os
    import re

    from ..checkpoint import CheckpointError, CheckpointManager

    world, step = m["world"], m["step"]
    present = set()
    with os.scandir(root) as entries:          # bounded by what is there, whatever world says
        for e in entries:
            found = re.fullmatch(rf"rank(0|[1-9][0-9]*)-of-{world}", e.name)
            if found and int(found.group(1)) < world and e.is_dir(follow_symlinks=False):
                present.add(int(found.group(1)))
    if len(present) < world:
        missing = []
        for k in range(world):                 # stops within len(present) + 5 ranks
            if k not in present:
                missing.append(_rank_dir(k, world))
                if len(missing) == 5:
                    break
        raise CheckpointError(
            f"{root / SHARDS} names {world} ranks, but {world - len(present):,} of their folders "
            f"are missing or not folders ({', '.join(missing)}{', ...' if len(missing) == 5 else ''})"
            ": the copy is incomplete. Nothing was restored; restore an intact copy of the whole "
            "directory.")
    for k in range(world):
        rows = CheckpointManager(root / _rank_dir(k, world), config=config).checkpoints()
        if not rows or rows[0]["step"] != step or rows[0]["status"] != "ok":
            newest = (f"step {rows[0]['step']} ({rows[0]['status']})" if rows
                      else "no checkpoint")
            raise CheckpointError(
                f"rank {k}'s newest checkpoint in {root} is {newest}, the manifest "
                f"{root / SHARDS} names step {step}: a save was interrupted or a shard is "
                "damaged. Nothing was restored; restore an intact copy of the whole directory.")


def restore_sharded(directory, table: ShardedEmbedding, opt, *, config=None):
    """Load what :func:`save_sharded` wrote into ``table`` and ``opt``, on any number of ranks
    (a collective); returns the saved step, or None when ``directory`` holds no sharded
    checkpoint (no ``SHARDS.json``).

    On the world size it was saved with, each rank restores its own shard. On another (one
    process included) each rank reads every saved shard in turn, one at a time, into a
    temporary CPU table and keeps the rows it now owns (weight and per-row state); the scalar
    state (Adam's step) and hyper-parameters come from saved rank 0. Each shard's newest
    checkpoint must be the manifest's step. A damaged ``SHARDS.json`` (a link, FIFO or device,
    oversized, not the JSON save_sharded writes), a missing shard or a shard whose newest
    checkpoint is not that step raises :class:`~nbtools.checkpoint.CheckpointError` before
    anything changes.
    """
    from pathlib import Path

    from ..checkpoint import CheckpointError, CheckpointManager

    root = Path(directory).expanduser()
    m = read_shards(root)
    if m is None:
        return None
    if (m["num_embeddings"], m["embedding_dim"]) != (table.num_embeddings, table.embedding_dim):
        raise ValueError(f"checkpoint {root} holds a {m['num_embeddings']:,} x "
                         f"{m['embedding_dim']} table, table {table.name!r} is "
                         f"{table.num_embeddings:,} x {table.embedding_dim}")
    if m["optimizer"] != opt.optimizer_class.__name__:
        raise ValueError(f"checkpoint {root} was saved with {m['optimizer']}, this optimizer is "
                         f"{opt.optimizer_class.__name__}")
    _check_shards_there(root, m, config)
    saved_world, name = m["world"], table.shard.name

    def restore_one(rank, shard, shard_opt):
        # the newest checkpoint only (checked above): all of it or, if damaged, nothing
        got = CheckpointManager(root / _rank_dir(rank, saved_world), config=config).restore(
            table=shard, opt=shard_opt, rng=False, fall_back=False)
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
        try:
            restore_one(k, old, old_opt)
            if k == 0:
                scalar = old_opt.state_dict()["tables"][name]
            ids = torch.arange(k, table.num_embeddings, saved_world)
            keep = ids % table.world == table.rank
            rows = old.rows.host.tensor[keep]      # [weight | state...] of the rows now mine
            device = table.shard.device
            table.shard.rows.scatter((ids[keep] // table.world).to(device), rows.to(device))
        except CheckpointError as e:
            if k == 0:
                raise
            raise CheckpointError(f"{e}\nRows of saved ranks 0..{k - 1} were already copied into "
                                  f"table {table.name!r}: it is partly restored, do not train "
                                  "on it.") from None
        finally:
            old.close()
    mine["tables"][name] = {**mine["tables"][name], "group": scalar["group"],
                            "scalar_state": scalar["scalar_state"]}
    opt.load_state_dict(mine)                      # row state: the live tensors, kept as is
    _barrier(table)
    return m["step"]
