"""Embedding tables whose rows live in (pinned) host memory.

Each lookup deduplicates the ids on the compute device, gathers only those rows from host memory
(on CUDA: GPU kernels read the pinned rows over PCIe, zero-copy) and returns differentiable rows.
The gathered rows are the leaves autograd sees; :class:`nbtools.OffloadOptimizer` later takes
their gradients, sums them per id and writes updated rows (and optimizer state) back. Step cost
grows with the batch, never with the table.

The full table is ``table.weight``: an ordinary CPU tensor (not an ``nn.Parameter``), so
``model.to("cuda")`` leaves it where it is.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import NbtoolsError
from .devices import host_memory_bytes, human_bytes, resolve_device, synchronize
from .hostmem import HostTensor, RowStore

# A table warns once when this many lookups wait for an optimizer step: a loop that runs the
# table with autograd on but never steps (evaluation without torch.no_grad) would grow forever.
_PENDING_WARN = 256


class HostMemoryError(NbtoolsError, MemoryError):
    """A table or its optimizer state would not fit in host memory; nothing was allocated."""


def check_fits(nbytes: int, what: str, hint: str = "") -> None:
    """Refuse, before allocating, ``nbytes`` of host memory that this machine does not have."""
    available = host_memory_bytes()["available"]
    if available is not None and nbytes > 0.9 * available:
        raise HostMemoryError(
            f"{what} needs {human_bytes(nbytes)} of host memory but only "
            f"{human_bytes(available)} is available (nbtools keeps 10% free). {hint}".rstrip())


def _ids_error_position(flat_bad: torch.Tensor, shape) -> str:
    pos = int(flat_bad.nonzero()[0, 0])
    if len(shape) <= 1:
        return f"position {pos}"
    return f"position {tuple(int(i) for i in np.unravel_index(pos, tuple(shape)))}"


class _OffloadedTable(nn.Module):
    """Shared machinery of :class:`OffloadedEmbedding` and :class:`OffloadedEmbeddingBag`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, padding_idx=None,
                 dtype=torch.float32, device="auto", name=None, pin: bool = True):
        super().__init__()
        for arg, value in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if not (dtype.is_floating_point if isinstance(dtype, torch.dtype) else False):
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        if padding_idx is not None:
            if not -self.num_embeddings <= padding_idx < self.num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} is out of range for "
                                 f"{self.num_embeddings:,} rows")
            padding_idx = int(padding_idx) % self.num_embeddings
        self.padding_idx = padding_idx
        self.name = name or type(self).__name__
        self.device = resolve_device(device)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = self.num_embeddings * self.embedding_dim * itemsize
        check_fits(nbytes, f"table {self.name!r} ({self.num_embeddings:,} x {self.embedding_dim} "
                           f"{str(dtype).replace('torch.', '')})",
                   "Use nbtools.plan(...) to size it; a smaller dim, fewer rows or "
                   "dtype=torch.bfloat16 halves it.")
        # Pinning only pays when a GPU reads the rows.
        self._host = HostTensor((self.num_embeddings, self.embedding_dim), dtype,
                                pin=pin and self.device.type == "cuda", name=self.name,
                                device=self.device if self.device.type == "cuda" else None)
        self._rows = RowStore(self._host, self.device)
        self._grad_scale = None      # RowStore over (num_embeddings, 1) per-row gradient weights
        self._pending = []           # (unique ids, gathered rows leaf) per lookup since last step
        self._warned_pending = False
        self.trainable = True
        with torch.no_grad():        # nn.Embedding's default initialisation: N(0, 1)
            self._host.tensor.normal_()
            if padding_idx is not None:
                self._host.tensor[padding_idx].zero_()

    # --- the host table -------------------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """All rows, as a CPU tensor aliasing the (pinned) host memory. Reading it waits for
        queued GPU writes first, so what you read is current. Write to it to initialise."""
        synchronize(self.device)
        return self._host.tensor

    @property
    def pinned(self) -> bool:
        return self._host.pinned

    @property
    def nbytes(self) -> int:
        return self._host.nbytes

    @property
    def transfer_mode(self) -> str:
        """'zero-copy', 'staged' (pageable memory, CUDA) or 'host' (CPU compute)."""
        return self._rows.mode

    def set_grad_scale(self, weights) -> None:
        """Multiply each row's summed gradient by ``weights[id]`` before the optimizer step.

        For rare words: e.g. inverse frequency. ``None`` turns it off. Like
        ``nn.Embedding(scale_grad_by_freq=True)``, but with your own per-id weights.
        """
        if weights is None:
            self._grad_scale = None
            return
        weights = torch.as_tensor(weights)
        if weights.shape != (self.num_embeddings,) or not weights.is_floating_point():
            raise ValueError(f"grad scale for table {self.name!r} must be a float tensor of shape "
                             f"({self.num_embeddings},), got {tuple(weights.shape)} {weights.dtype}")
        if not torch.isfinite(weights).all():
            raise ValueError(f"grad scale for table {self.name!r} contains non-finite values")
        host = HostTensor((self.num_embeddings, 1), self._host.tensor.dtype,
                          pin=self._host.pinned, name=f"{self.name}.grad_scale",
                          device=self.device if self.device.type == "cuda" else None)
        host.tensor.copy_(weights.reshape(-1, 1))
        self._grad_scale = RowStore(host, self.device)

    def close(self) -> None:
        """Release the pinned registration now (the CPU tensor stays valid as plain memory)."""
        synchronize(self.device)
        self._host.close()
        self._rows = RowStore(self._host, self.device)

    # --- lookups ----------------------------------------------------------------------------
    def _prepare_ids(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(f"table {self.name!r}: ids must be an integer tensor, "
                                f"got {type(ids).__name__}") from e
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"table {self.name!r}: ids must be integers, got dtype {ids.dtype}; "
                            "convert with ids.long() if they are whole numbers")
        return ids.to(self.device, non_blocking=True)

    def _lookup(self, ids: torch.Tensor):
        """Deduplicate ``ids`` (any shape), check the range, gather the unique rows.

        Returns (rows [U, dim], inverse [ids.numel()]).
        """
        flat = ids.reshape(-1)
        if flat.numel() == 0:
            rows = torch.zeros(0, self.embedding_dim, dtype=self._host.tensor.dtype,
                               device=self.device)
            return rows, flat.long()
        uniq, inv = torch.unique(flat, return_inverse=True)   # sorted: bounds are at the ends
        lo, hi = torch.stack((uniq[0], uniq[-1])).tolist()      # note: a CPU-GPU sync point
        if lo < 0 or hi >= self.num_embeddings:
            bad = (flat < 0) | (flat >= self.num_embeddings)
            value = int(flat[bad.nonzero()[0, 0]])
            raise IndexError(
                f"table {self.name!r} has {self.num_embeddings:,} rows but ids contain {value:,} "
                f"(first at {_ids_error_position(bad, ids.shape)}); valid ids are 0 to "
                f"{self.num_embeddings - 1:,}")
        with torch.no_grad():
            rows = self._rows.gather(uniq)
        if torch.is_grad_enabled() and self.trainable:
            rows.requires_grad_(True)
            self._pending.append((uniq, rows))
            if len(self._pending) > _PENDING_WARN and not self._warned_pending:
                self._warned_pending = True
                warnings.warn(
                    f"table {self.name!r} holds {len(self._pending)} lookups waiting for an "
                    "optimizer step: run evaluation under torch.no_grad(), or call "
                    "optimizer.zero_grad()", RuntimeWarning, stacklevel=3)
        return rows, inv

    def take_grad(self):
        """Gradients of the rows looked up since the last call, summed per id.

        Returns ``(ids, grad)`` with unique ids (padding row excluded, per-row scale applied),
        or ``(None, None)`` when no row has a gradient. Clears the pending lookups. Called by
        :class:`OffloadOptimizer`.
        """
        records = [(u, r.grad) for u, r in self._pending if r.grad is not None]
        self._pending.clear()
        if not records:
            return None, None
        if len(records) == 1:
            ids, grad = records[0]
        else:                        # several lookups this step: one more dedup across them
            ids, inv = torch.unique(torch.cat([u for u, _ in records]), return_inverse=True)
            grad = torch.zeros(ids.numel(), self.embedding_dim, dtype=records[0][1].dtype,
                               device=self.device)
            grad.index_add_(0, inv, torch.cat([g for _, g in records]))
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, grad = ids[keep], grad[keep]
            if ids.numel() == 0:
                return None, None
        if self._grad_scale is not None:
            grad = grad * self._grad_scale.gather(ids).to(grad.dtype)
        return ids, grad

    def clear_pending(self) -> None:
        self._pending.clear()

    # --- state dict: 'weight' is the live host tensor (no copy) -----------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            missing_keys.append(key)
            return
        src = state_dict[key]
        if tuple(src.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: checkpoint has {tuple(src.shape)}, table "
                              f"{self.name!r} is ({self.num_embeddings}, {self.embedding_dim})")
            return
        dst = self.weight                      # synchronises first
        if src is not dst:
            with torch.no_grad():
                dst.copy_(src)

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings:,}, {self.embedding_dim}, name={self.name!r}, "
             f"dtype={self._host.tensor.dtype}, device={self.device}, {self.transfer_mode}, "
             f"host={human_bytes(self.nbytes)}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        return s


class OffloadedEmbedding(_OffloadedTable):
    """``nn.Embedding`` whose table lives in (pinned) host memory.

    Args:
        num_embeddings: rows in the table.
        embedding_dim: values per row.
        padding_idx: this row reads as zeros (it starts at zero) and never gets a gradient.
        dtype: floating dtype of the table (and of its optimizer state).
        device: compute device, ``"auto"`` = CUDA when available, else CPU.
        name: used in messages and in optimizer/checkpoint state.
        pin: register the host memory with CUDA (zero-copy). ``False`` uses pageable memory
            and copies rows through the CPU (slower, for when pinning is refused).

    ``table(ids)`` takes integer ids of any shape, on the compute device or the CPU, and
    returns ``ids.shape + (embedding_dim,)`` rows on the compute device.

    >>> table = OffloadedEmbedding(1000, 8, device="cpu", name="words")
    >>> table(torch.tensor([[1, 2], [2, 999]])).shape
    torch.Size([2, 2, 8])
    >>> table.weight.shape
    torch.Size([1000, 8])
    """

    def forward(self, ids) -> torch.Tensor:
        ids = self._prepare_ids(ids)
        rows, inv = self._lookup(ids)
        return F.embedding(inv, rows).view(*ids.shape, self.embedding_dim)


class OffloadedEmbeddingBag(_OffloadedTable):
    """``nn.EmbeddingBag`` over a host-memory table: sums, means or maxima of rows per bag.

    Input is either padded 2-D ids ``[bags, length]`` or 1-D ids with ``offsets`` (start of
    each bag). With ``padding_idx`` set, padding entries are left out of the bag, so ``mean``
    divides by each bag's real length, not the padded one (as ``nn.EmbeddingBag`` does).

    Args:
        num_embeddings, embedding_dim, padding_idx, dtype, device, name, pin: as for
            :class:`OffloadedEmbedding`.
        mode: ``"sum"``, ``"mean"`` (default) or ``"max"``.

    >>> bag = OffloadedEmbeddingBag(100, 4, mode="mean", padding_idx=0, device="cpu")
    >>> bag(torch.tensor([[5, 6, 0], [7, 0, 0]])).shape
    torch.Size([2, 4])
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean", **kwargs):
        if mode not in ("sum", "mean", "max"):
            raise ValueError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.mode = mode

    def forward(self, ids, offsets=None, per_sample_weights=None) -> torch.Tensor:
        ids = self._prepare_ids(ids)
        if offsets is None:
            if ids.dim() != 2:
                raise ValueError(f"table {self.name!r}: without offsets, ids must be 2-D "
                                 f"[bags, length]; got shape {tuple(ids.shape)}")
            bags, length = ids.shape
            offsets = torch.arange(0, bags * length, length, device=self.device) if length else \
                torch.zeros(bags, dtype=torch.long, device=self.device)
        else:
            if ids.dim() != 1:
                raise ValueError(f"table {self.name!r}: with offsets, ids must be 1-D; got shape "
                                 f"{tuple(ids.shape)}")
            offsets = self._prepare_ids(offsets).long()
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(self.device).reshape(-1)
        flat = ids.reshape(-1)
        rows, inv = self._lookup(flat)
        padding = None
        if self.padding_idx is not None:
            # Padding maps to one extra all-zero row that embedding_bag leaves out of each bag.
            padding = rows.shape[0]
            rows = torch.cat((rows, rows.new_zeros(1, self.embedding_dim)))
            inv = torch.where(flat == self.padding_idx, padding, inv)
        return F.embedding_bag(inv, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights, padding_idx=padding)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
