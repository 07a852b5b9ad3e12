"""The whole-table face of rows in memory (host RAM or the GPU): what reads or writes a table's
rows from outside a step (checkpoints above all) asks of them.

A tier answers :meth:`nbtools.store.RowTier.whole` with a face once every row held above the
memory (a cache of hot rows, write-backs in flight) is back in it. The face reads and writes
ranges of rows, or rows by id, *as stored*: uint8 ``[rows, row_bytes]``, where ``row_bytes``
counts the columns a row uses (``[weight | state...]``, not the padding that rounds a row in
memory up to whole 32-byte sectors), so the same bytes go to and come from a disk table's face
(:class:`nbtools.disk.access.WholeTable`, which answers for rows in a file).

It also keeps which rows changed since a checkpoint took them all, for incremental
checkpoints: one flag a row on the compute device, set where a step's update is queued
(:meth:`WholeRows.written`, the ids of the step's batch: no host synchronisation), where whole
rows are written through the face, and for every row where the rows are handed out writable
(``table.weight``: what is written through it is not tracked).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch


class WholeRows:
    """Rows ``tensor`` (``[num_rows, width]``, host or GPU memory) as a whole, the first
    ``used`` columns of each stored (see the module docs). ``device``: where the step's ids
    are, and so the change flags."""

    moved = False         # rows are stored in id order (a log-structured file's may not be)

    def __init__(self, tensor: torch.Tensor, used: int, name: str, device: torch.device):
        self.tensor, self.name = tensor, name
        self.num_rows = int(tensor.shape[0])
        self.dtype = tensor.dtype
        item = tensor.element_size()
        self.width = int(used)
        self.row_bytes = self.width * item          # bytes of a row as stored
        self.stride = int(tensor.shape[1]) * item if tensor.dim() > 1 else item
        # a flag a row, and one for the sentinel (num_rows) a batch pads its ids with
        self.changed = torch.ones(self.num_rows + 1, dtype=torch.bool, device=device)
        self.checkpoint = None      # the checkpoint the flags count from (a token)

    def _raw(self) -> torch.Tensor:
        return self.tensor.view(self.num_rows, -1).view(torch.uint8)[:, : self.row_bytes]

    # --- what changed ---------------------------------------------------------------------
    def written(self, ids: torch.Tensor) -> None:
        """Rows ``ids`` (a step's unique ids on the compute device, padded with the sentinel)
        are about to be written. Until a checkpoint has taken every row there is nothing to
        count from (the first save copies them all), so a table never saved pays nothing."""
        if self.checkpoint is not None:
            self.changed.index_fill_(0, ids, True)

    def all_changed(self) -> None:
        """Every row may change (the rows were handed out writable)."""
        self.changed.fill_(True)

    def changed_since(self, token) -> int | None:
        """Rows written since the checkpoint ``token`` took every row (:meth:`mark_checkpointed`);
        None when changes are not counted from that checkpoint: the next save copies every row."""
        if token is None or self.checkpoint != token:
            return None
        return int(self.changed[: self.num_rows].sum())

    def changed_ids(self, start: int, stop: int) -> np.ndarray:
        """Sorted ids in ``start:stop`` of the rows written since the last checkpoint."""
        got = torch.nonzero(self.changed[start:stop]).reshape(-1)
        return got.cpu().numpy().astype(np.int64) + start

    def mark_checkpointed(self, token) -> None:
        """The checkpoint ``token`` now holds every row as it is: count changes from here."""
        self.changed.fill_(False)
        self.checkpoint = token

    # --- rows as stored -------------------------------------------------------------------
    def read_bytes(self, start: int, out: np.ndarray) -> None:
        """Rows ``start:start + len(out)`` into ``out`` (uint8 ``[m, row_bytes]``)."""
        torch.from_numpy(out).copy_(self._raw()[start:start + len(out)])

    def write_bytes(self, start: int, src: np.ndarray) -> None:
        """Rows ``start:start + len(src)`` from ``src`` (uint8 ``[m, row_bytes]``)."""
        self._raw()[start:start + len(src)].copy_(torch.from_numpy(src))
        self.changed[start:start + len(src)] = True

    def copy_rows(self, ids: np.ndarray, out: np.ndarray) -> None:
        """Rows ``ids`` into ``out`` (uint8 ``[len(ids), row_bytes]``)."""
        idx = torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(self.tensor.device)
        torch.from_numpy(out).copy_(self._raw().index_select(0, idx))

    def write_records(self, ids: np.ndarray, src: np.ndarray) -> None:
        """Rows ``ids`` (any order, each once) from ``src`` (uint8 ``[len(ids), row_bytes]``)."""
        idx = torch.from_numpy(np.asarray(ids, dtype=np.int64)).to(self.tensor.device)
        self._raw()[idx] = torch.from_numpy(src).to(self.tensor.device)
        self.changed[idx.to(self.changed.device)] = True

    @contextlib.contextmanager
    def hold_mapping(self, writable: bool = False):
        """The rows' tensor itself, which every view a state dict hands out is a view of."""
        yield self.tensor

    def discard_cache(self) -> None:
        """Every row is rewritten next: nothing is held above the memory (the tier emptied its
        cache when it handed out this face for writing)."""
