"""Data-parallel training: dense layers in DistributedDataParallel, sharded tables averaging.

Each rank trains on its own slice of the data; :func:`data_parallel` makes a step over the ranks'
batches a step over their concatenation with a mean loss.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..tables import OffloadedEmbedding
from .sharded import ShardedEmbedding


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
