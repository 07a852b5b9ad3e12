"""Where a table's rows live: the row store, its GPU cache of hot rows, the row layout.

Every tier gives a table the same :class:`RowTier`: :class:`~nbtools.store.rows.RowStore` for
rows in GPU memory, pinned or pageable host memory and CPU tables, and
:class:`nbtools.disk.store.DiskStore` (a RowStore over a disk table's RAM slots) for rows in a file.
:func:`nbtools.placement.make_store` turns a placement into one; the table and its lookups use
only what the protocol names, never which tier it is.
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

    @property
    def kind(self) -> str: ...                     # the table's transfer_mode

    def view(self) -> torch.Tensor: ...            # the rows as fused kernels index them
    def gather_batch(self, batch, start: int = 0, stop=None, admit: bool = False,
                     programs=None, into=None, written: str = "patch") -> torch.Tensor: ...
    def gather(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor: ...
    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None: ...
    def target(self, ids: torch.Tensor, layout, rounding: str = "nearest",
               num_rows=None): ...                 # where a fused update writes
    def settle(self) -> None: ...                  # order the stream after writes in flight
    def flush(self, drop: bool = True) -> None: ...
    def step_queued(self) -> None: ...             # the optimizer took the pending lookups
    def read_ahead(self, ids, padding_idx=None) -> bool: ...
    def rows_now(self, keep_cache: bool) -> torch.Tensor: ...   # every row, current
    def current_for(self, disk) -> bool: ...
    def close(self) -> None: ...
