"""Where a table's rows live: the row store, the tiers around it, the row layout.

Every tier gives a table the same :class:`RowTier`: :class:`~nbtools.store.rows.RowStore` for
rows in GPU memory, pinned or pageable host memory and CPU tables, and
:class:`nbtools.disk.store.DiskStore` (a RowStore over a disk table's RAM slots) for rows in a
file; around any of them, :class:`~nbtools.store.tiers.Cached` (a GPU cache of hot rows above
it) and :class:`~nbtools.store.tiers.WriteBehind` (its rows written back behind the next step).
:func:`nbtools.placement.make_store` turns a placement into a stack of them; the table and its
lookups use only what the protocol names, never which tiers it is.
"""
from __future__ import annotations

from typing import Protocol

import torch


class RowTier(Protocol):
    """What a table and its lookups ask of the rows, wherever they live."""

    mode: str              # how kernels reach the rows: "gpu", "zero-copy", "staged", "host"
    width: int             # columns of a row [weight | state...]
    row_bytes: int
    cache: object          # the GPU cache of hot rows in front of them, or None
    keeps_host_ids: bool   # lookups deduplicate ids on the CPU (batch_of), not on the device
    layout: object         # how a row [weight | state...] is stored (a RowLayout, its state names)
    host: object           # the memory the rows live in (a table's storage)
    disk: object           # a disk table's file and RAM slots (nbtools.disk.DiskRows), or None

    @property
    def kind(self) -> str: ...                     # the table's transfer_mode

    def view(self) -> torch.Tensor: ...            # the rows as fused kernels index them
    def gather_batch(self, batch, start: int = 0, stop=None, admit: bool = False,
                     programs=None, into=None, written: str = "patch",
                     cached=None) -> torch.Tensor: ...
    def gather(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor: ...
    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None: ...
    def target(self, ids: torch.Tensor, layout, rounding: str = "nearest",
               num_rows=None): ...                 # where a fused update writes
    # writing behind (nbtools.store.tiers.WriteBehind; a tier that does not answers no/nothing)
    def can_write_behind(self, rows: torch.Tensor, forced: bool = False) -> bool: ...
    def settle(self) -> None: ...                  # order the stream after writes in flight
    def before_gather(self, overwrites=(), after=None) -> bool: ...
    def patch(self, batch, out: torch.Tensor, start: int = 0, capture=None,
              aside: bool = False) -> None: ...
    def writing(self, ids: torch.Tensor) -> bool: ...
    def patches_from(self, cap, stream) -> bool: ...
    def flush(self, drop: bool = True) -> None: ...
    def step_queued(self) -> None: ...             # the optimizer took the pending lookups
    def read_ahead(self, ids, padding_idx=None) -> bool: ...
    def attach_cache(self, capacity: int) -> bool: ...  # its own (a disk table's GPU level)
    def rows_now(self, keep_cache: bool) -> torch.Tensor: ...   # every row, current
    # what the table and its cache ask instead of which tier this is
    @property
    def in_memory(self) -> bool: ...               # every row in one tensor (not a file's)
    @property
    def own_cache(self) -> bool: ...               # a cache of its own (a disk table's levels)
    def cache_cost(self, num_rows: int) -> tuple[int, int]: ...  # a GPU cache's bytes
    def warm_rows(self, counts: torch.Tensor) -> bool: ...       # into its own cache, now
    def own_cache_stats(self) -> dict: ...      # its own cache's table.cache_stats()
    # the table as a whole (nbtools.store.whole.WholeRows; a disk table's
    # nbtools.disk.access.WholeTable): ranges and rows as stored, the rows changed since a
    # checkpoint; ``written(ids)``: a step's update of those rows is queued next
    def whole(self, writes: bool = False): ...
    def written(self, ids: torch.Tensor) -> None: ...
    def current_for(self, disk, cache=None) -> bool: ...
    def close(self) -> None: ...
