"""Row-sharded offloaded tables over ``torch.distributed``: one table split across processes.

:mod:`~nbtools.distributed.sharded` (:class:`ShardedEmbedding`, its rows round-robin over the
ranks, and the autograd exchange of rows and gradients), :mod:`~nbtools.distributed.parallel`
(:func:`data_parallel`), :mod:`~nbtools.distributed.launch` (:func:`init`, :func:`spawn`) and
:mod:`~nbtools.distributed.checkpoints` (:func:`save_sharded`, :func:`restore_sharded`). See
docs/distributed.md.
"""
from __future__ import annotations

from .checkpoints import SHARDS, restore_sharded, save_sharded
from .launch import free_port, init, spawn
from .parallel import data_parallel
from .sharded import ShardedEmbedding, world_of

__all__ = ["ShardedEmbedding", "world_of", "data_parallel", "init", "spawn", "free_port",
           "save_sharded", "restore_sharded", "SHARDS"]
