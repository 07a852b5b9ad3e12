"""nbtools: train embeddings larger than GPU memory from Jupyter and Colab.

Tables and optimizer state live in pinned host RAM; each step moves only the rows a batch
touches. Heavy optional pieces (cupy, ipywidgets, matplotlib, NVML) load only when used.
"""
from __future__ import annotations

import importlib

__version__ = "0.2.0"


class NbtoolsError(Exception):
    """Base class of the errors nbtools raises itself."""


# name -> module that defines it; resolved on first access so `import nbtools` stays cheap.
_LAZY = {
    "describe": "nbtools.env",
    "resolve_device": "nbtools.devices",
    "HostTensor": "nbtools.hostmem",
    "host_empty": "nbtools.hostmem",
    "host_zeros": "nbtools.hostmem",
    "pin_tensor": "nbtools.hostmem",
    "pinned_bytes": "nbtools.hostmem",
    "transfer_counters": "nbtools.hostmem",
    "cache_counters": "nbtools.hostmem",
    "OffloadedEmbedding": "nbtools.tables",
    "OffloadedEmbeddingBag": "nbtools.tables",
    "ShardedEmbedding": "nbtools.distributed",
    "OffloadOptimizer": "nbtools.optim",
    "RowWiseAdagrad": "nbtools.rowwise",
    "PartialRowWiseAdam": "nbtools.rowwise",
    "plan": "nbtools.optim",
    "Plan": "nbtools.optim",
    "PinnedLoader": "nbtools.loader",
    "Dashboard": "nbtools.dashboard",
    "ThroughputMeter": "nbtools.meters",
    "CheckpointManager": "nbtools.checkpoint",
    # errors and configs that messages and the README tell users to reach for
    "OffloadConfig": "nbtools.optim",
    "TableConfig": "nbtools.tables",
    "LoaderConfig": "nbtools.loader",
    "DashboardConfig": "nbtools.dashboard",
    "MonitorConfig": "nbtools.meters",
    "CheckpointConfig": "nbtools.checkpoint",
    "FetchConfig": "nbtools.data",
    "MFConfig": "nbtools.models",
    "SkipGramConfig": "nbtools.models",
    "SyntheticConfig": "nbtools.models",
    "TrainConfig": "nbtools.models",
    "NonFiniteGradientError": "nbtools.optim",
    "UnsupportedOptimizerError": "nbtools.optim",
    "HostMemoryError": "nbtools.placement",
    "NoRoomError": "nbtools.placement",
    "DiskTableBrokenError": "nbtools.disk",
    "remove_stale_tables": "nbtools.disk",
    "HostBudgetError": "nbtools.devices",
    "set_host_budget": "nbtools.devices",
    "PinningError": "nbtools.hostmem",
    "UnsafeFileError": "nbtools.files",
    "UnconsumedGradientWarning": "nbtools.engine.lookups",
}

# Submodules reachable as attributes after a plain `import nbtools` (nbtools.colab.drive_dir).
_SUBMODULES = ("checkpoint", "colab", "dashboard", "data", "devices", "disk", "distributed", "env",
               "files", "hostmem", "loader", "meters", "models", "optim", "placement", "pretrained",
               "rowfile", "rowwise", "sizing", "tables", "testing", "units")

__all__ = ["NbtoolsError", "__version__", *_LAZY]


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"nbtools.{name}")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'nbtools' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
