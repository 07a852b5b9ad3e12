"""Checkpoints that survive a Colab disconnect: chunked, atomic, verified, Drive-aware.

A checkpoint is a directory ``step-000000100`` holding raw tensor bytes in a few data files,
a small side file for the odd non-JSON value, and a ``MANIFEST`` written last: it lists every
tensor (dtype, shape, where its bytes are, CRC-32 of each run) and every file's size, and
carries its own checksum in its first line. The directory is built under a temporary name,
every file is fsync'ed, and only then is it renamed into place, so a checkpoint is either
complete or invisible. A process killed at any point leaves the earlier checkpoints intact.

Tensors are streamed in chunks (64 MiB by default), never copied whole: a 10 GB pinned table
is written straight from its host memory, and read back straight into it. CUDA tensors pass
through one reusable staging buffer.

Disk tables (``placement="disk"``) are saved file to file, never through RAM: a full copy of
their rows (a base) now and then, and otherwise only the rows changed since the previous save
(a delta); each manifest names the base and deltas it needs (:mod:`~nbtools.checkpoint.rows`).

Everything needed to continue exactly is saved: each object's ``state_dict()`` (modules with
offloaded tables, optimizers incl. :class:`~nbtools.OffloadOptimizer`, LR schedulers,
:class:`~nbtools.PinnedLoader`, metric histories), plain dicts, the step, and the RNG states of
python, numpy, torch CPU and CUDA.

The package, one file per part: :mod:`~nbtools.checkpoint.format` (data files, reader,
writer, manifest), :mod:`~nbtools.checkpoint.tree` (state trees <-> JSON),
:mod:`~nbtools.checkpoint.layout` (checkpoint directories: scan, prune, clean up),
:mod:`~nbtools.checkpoint.mirror` (copies to a second folder such as Google Drive),
:mod:`~nbtools.checkpoint.rows` (disk tables: bases, deltas and their chains),
:mod:`~nbtools.checkpoint.rng` (the random generators' states),
:mod:`~nbtools.checkpoint.save` (writing one checkpoint), :mod:`~nbtools.checkpoint.restore`
(reading one back) and :mod:`~nbtools.checkpoint.manager` (:class:`CheckpointManager`: where,
which, how many, the mirror).

>>> import tempfile
>>> import torch
>>> model = torch.nn.Linear(3, 2)
>>> ckpt = CheckpointManager(tempfile.mkdtemp(), keep=2, config=CheckpointConfig(verbose=False))
>>> info = ckpt.save(10, model=model, extra={"epoch": 1})
>>> before = model.weight.detach().clone()
>>> with torch.no_grad():
...     _ = model.weight.zero_()
>>> ckpt.restore(model=model)
10
>>> torch.equal(model.weight, before)
True
"""
from __future__ import annotations

from .format import (EXTRAS, FORMAT, FORMAT_VERSION, MANIFEST, CheckpointConfig, CheckpointError,
                     CheckpointSpaceError, CheckpointWarning)
from .layout import prune
from .manager import CheckpointManager
from .mirror import DriveSync, copy_checkpoint

__all__ = ["CheckpointManager", "CheckpointConfig", "CheckpointError", "CheckpointSpaceError",
           "CheckpointWarning", "DriveSync", "copy_checkpoint", "prune", "FORMAT",
           "FORMAT_VERSION", "MANIFEST", "EXTRAS"]
