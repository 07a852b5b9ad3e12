"""The row protocol between tables and the optimizer: unique ids, the rows they name, and where
those rows live.

A lookup hands the optimizer a :class:`RowBatch`: the batch's unique ids, sorted, in a buffer
of fixed capacity (the number of ids, at most the number of rows + 1), their count as a
one-element tensor on the compute device, and the inverse map from each id to its unique slot.
Nothing in it needs the host to know how many ids are unique, so a lookup never waits for the
GPU. Ids that must not be read or written (out of range, or the padding row) are replaced by the
*sentinel* ``num_rows``: it sorts last, reads as a zero row and is never written.

A :class:`RowStore` is where rows live (placement):

* ``zero-copy``: pinned host memory; GPU kernels read and write host RAM over PCIe.
* ``gpu``: a CUDA tensor (the table fits the GPU): same protocol, no PCIe.
* ``staged``: pageable host memory with CUDA compute (``pin=False``): the CPU gathers, then copies.
* ``host``: CPU compute.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from . import kernels
from .hostmem import count_transfer, gather_rows, scatter_rows


@dataclasses.dataclass
class RowBatch:
    """Unique ids of one lookup (or of every lookup of a step, merged).

    Attributes:
        ids: [cap] int64, sorted unique ids, then the sentinel ``num_rows`` (slots at and past
            ``count`` hold the sentinel too).
        count: [1] int64 on the compute device: how many slots are in use (the sentinel, when
            some id was replaced by it, is the last of them).
        inverse: [n] int64: slot of each id of the lookup, in the lookup's order.
        bad: [1] bool on the compute device: an id was out of range.
        num_rows: the table's row count (= the sentinel value).
    """

    ids: torch.Tensor
    count: torch.Tensor
    inverse: torch.Tensor
    bad: torch.Tensor
    num_rows: int

    @property
    def capacity(self) -> int:
        return self.ids.numel()

    def live(self, count: int, has_sentinel: bool) -> torch.Tensor:
        """The real ids (sentinel excluded), once the host knows ``count``."""
        return self.ids[: count - int(has_sentinel)]

    def sentinel_flag(self) -> torch.Tensor:
        """[1] bool on the device: the last used slot holds the sentinel."""
        if self.capacity == 0:
            return torch.zeros(1, dtype=torch.bool, device=self.count.device)
        last = (self.count - 1).clamp_min(0)
        return self.ids.gather(0, last).eq(self.num_rows) & (self.count > 0)


def unique_ids(flat: torch.Tensor, num_rows: int, padding_idx=None) -> RowBatch:
    """Deduplicate 1-D int64 ``flat`` on its device, without a host synchronisation.

    Out-of-range ids (flagged in ``bad``) and ``padding_idx`` become the sentinel ``num_rows``.

    >>> b = unique_ids(torch.tensor([5, 2, 5, 9, 2]), num_rows=8)
    >>> b.ids.tolist(), b.count.tolist(), b.inverse.tolist(), b.bad.tolist()
    ([2, 5, 8, 8, 8], [3], [1, 0, 1, 2, 0], [True])
    """
    n = flat.numel()
    device = flat.device
    valid = (flat >= 0) & (flat < num_rows)
    bad = (~valid).any().reshape(1)
    if padding_idx is not None:
        valid &= flat != padding_idx
    safe = torch.where(valid, flat, num_rows)
    cap = min(n, num_rows + 1)
    if n == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return RowBatch(empty, torch.zeros(1, dtype=torch.long, device=device), empty,
                        torch.zeros(1, dtype=torch.bool, device=device), num_rows)
    ordered, order = torch.sort(safe)
    new = torch.ones(n, dtype=torch.bool, device=device)
    torch.ne(ordered[1:], ordered[:-1], out=new[1:])
    slot = torch.cumsum(new, 0) - 1                 # slot of each sorted id
    inverse = torch.empty_like(slot).scatter_(0, order, slot)
    ids = torch.full((cap,), num_rows, dtype=torch.long, device=device)
    ids.scatter_(0, slot, ordered)                 # equal values to a slot: any writer wins
    return RowBatch(ids, slot[-1:] + 1, inverse, bad, num_rows)


def merge(batches: list, grads: list):
    """One RowBatch for several lookups of the same table, and their gradients summed per id.

    Returns ``(batch, grad, pick)``: ``pick[j]`` is a position in the concatenated slots of the
    lookups where unique id ``j`` came from (to take its gathered row and state).
    """
    num_rows = batches[0].num_rows
    all_ids = torch.cat([b.ids for b in batches])
    merged = unique_ids(all_ids, num_rows)          # sentinel slots merge into one sentinel
    merged.bad = torch.stack([b.bad for b in batches]).any().reshape(1)
    grad = torch.zeros(merged.capacity, grads[0].shape[1], dtype=grads[0].dtype,
                       device=grads[0].device)
    grad.index_add_(0, merged.inverse, torch.cat(grads))
    pick = torch.zeros(merged.capacity, dtype=torch.long, device=all_ids.device)
    pick.scatter_(0, merged.inverse, torch.arange(all_ids.numel(), device=all_ids.device))
    return merged, grad, pick


class DeviceRows:
    """A table's rows held on the GPU (``placement="gpu"``): what :class:`HostTensor` is for
    host rows, with the same attributes, so a RowStore treats both alike."""

    pinned = False

    def __init__(self, shape, dtype, device, name: str = "tensor"):
        self.name = name
        self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.nbytes = self.tensor.numel() * self.tensor.element_size()

    def view(self) -> torch.Tensor:
        return self.tensor

    def close(self) -> None:
        pass

    def __repr__(self):
        return (f"DeviceRows(name={self.name!r}, shape={tuple(self.tensor.shape)}, "
                f"dtype={self.tensor.dtype}, device={self.tensor.device})")


class RowStore:
    """The rows of a 2-D table as the compute device reaches them (see the module docs).

    ``idx`` arguments are on the compute device. Bytes that cross PCIe are counted.

    >>> from nbtools.hostmem import HostTensor
    >>> store = RowStore(HostTensor((5, 2), name="demo"), torch.device("cpu"))
    >>> store.scatter(torch.tensor([1, 3]), torch.ones(2, 2))
    >>> store.gather(torch.tensor([3])).tolist()
    [[1.0, 1.0]]
    """

    def __init__(self, host, device: torch.device):
        self.host = host
        self.device = torch.device(device)
        if isinstance(host, DeviceRows):
            self.mode = "gpu"
        elif self.device.type == "cuda":
            self.mode = "zero-copy" if host.pinned else "staged"
        else:
            self.mode = "host"
        shape = host.tensor.shape
        self.width = int(shape[1]) if len(shape) > 1 else 1
        self.row_bytes = (int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1) \
            * host.tensor.element_size()

    @property
    def num_rows(self) -> int:
        return self.host.tensor.shape[0]

    @property
    def direct(self) -> bool:
        """The compute device indexes the rows itself (zero-copy or GPU-placed)."""
        return self.mode in ("zero-copy", "gpu")

    def _cols(self, tensor: torch.Tensor, start: int, stop):
        if start == 0 and stop is None:
            return tensor
        return tensor[:, start:stop]

    def _count(self, nbytes: int, h2d: bool) -> None:
        if self.mode != "gpu":
            count_transfer(h2d=nbytes) if h2d else count_transfer(d2h=nbytes)

    def gather(self, idx: torch.Tensor, start: int = 0, stop=None) -> torch.Tensor:
        """Rows ``idx`` (columns ``start:stop``) on the compute device; every id in range."""
        if self.mode == "host":
            return self._cols(self.host.tensor, start, stop).index_select(0, idx)
        width = (stop if stop is not None else self.width) - start
        self._count(idx.numel() * width * self.host.tensor.element_size(), h2d=True)
        if self.direct:
            return gather_rows(self._cols(self.host.view(), start, stop), idx)
        return self._cols(self.host.tensor, start, stop).index_select(0, idx.cpu()).to(self.device)

    def gather_batch(self, batch: RowBatch, start: int = 0, stop=None) -> torch.Tensor:
        """Rows of a :class:`RowBatch`: [capacity, width]; rows of unused slots and of the
        sentinel are zeros. No host synchronisation where the kernels run (CUDA + Triton)."""
        stop = self.width if stop is None else stop
        if self.direct and kernels.usable_on(self.device):
            out = torch.empty(batch.capacity, stop - start, dtype=self.host.tensor.dtype,
                              device=self.device)
            # bytes estimated from capacity: the exact count is on the GPU (a sync to read)
            self._count(batch.capacity * (stop - start) * self.host.tensor.element_size(), True)
            return kernels.gather_rows(self.host.view(), batch.ids, batch.count, out, start)
        # torch path: the sentinel reads row 0 and is zeroed after (it is at most one slot per
        # unique value, and ids past count repeat it)
        safe = batch.ids.clamp(max=self.num_rows - 1)
        rows = self.gather(safe, start, stop)
        return rows.masked_fill_((batch.ids == self.num_rows).unsqueeze(1), 0)

    def scatter(self, idx: torch.Tensor, rows: torch.Tensor) -> None:
        """Write whole rows ``idx`` (every id in range)."""
        if self.mode == "host":
            self.host.tensor.index_copy_(0, idx, rows)
            return
        self._count(idx.numel() * self.row_bytes, h2d=False)
        if self.direct:
            scatter_rows(self.host.view(), idx, rows)
        else:
            self.host.tensor.index_copy_(0, idx.cpu(), rows.cpu())
