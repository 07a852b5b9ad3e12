"""Embedding tables whose rows live in (pinned) host memory.

Each lookup deduplicates the ids on the compute device, gathers only those rows from host memory
(on CUDA: GPU kernels read the pinned rows over PCIe, zero-copy) and returns differentiable rows.
The gathered rows are the leaves autograd sees; :class:`nbtools.OffloadOptimizer` later takes
their gradients, sums them per id and writes updated rows (and optimizer state) back. Step cost
grows with the batch, never with the table.

The full table is ``table.weight``: an ordinary CPU tensor (not an ``nn.Parameter``), so
``model.to("cuda")`` leaves it where it is.

Layout: once an optimizer attaches its per-row state, each host row holds
``[weight | state_1 | ... | state_k]``. A training lookup gathers whole rows, so a step reads and
writes one long row per id instead of k + 1 short ones: on an H100, zero-copy gathers of
1,536-byte rows kept ~48 GB/s on a 23 GiB table where 512-byte rows fell to ~20 GB/s
(benchmarks/RESULTS.md). ``table.weight`` is then a strided view of the first columns.
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


def copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, skipped when ``src`` is the very same memory (a state dict of live
    host tensors handed back)."""
    if (src.device == dst.device and src.data_ptr() == dst.data_ptr()
            and src.stride() == dst.stride() and src.dtype == dst.dtype):
        return
    with torch.no_grad():
        dst.copy_(src)


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
        self._host = self._new_host((self.num_embeddings, self.embedding_dim), dtype,
                                    pin and self.device.type == "cuda", self.name)
        self._rows = RowStore(self._host, self.device)
        self._grad_scale = None      # RowStore over (num_embeddings, 1) per-row gradient weights
        self._state_names = []       # optimizer state interleaved after the weight, in order
        self._pending = []           # (unique ids, rows leaf, state rows) per lookup since last step
        self._warned_pending = False
        self.trainable = True
        with torch.no_grad():        # nn.Embedding's default initialisation: N(0, 1)
            # pinned: drawn on the GPU (its generator, as nn.Embedding(device="cuda") would) and
            # written over PCIe, ~50x faster than the single CPU thread of Tensor.normal_
            rows = self._host.view()
            rows.normal_()
            if padding_idx is not None:
                rows[padding_idx].zero_()
            if rows.is_cuda:
                torch.cuda.synchronize(rows.device)   # the host copy is read from now on

    def _new_host(self, shape, dtype, pin: bool, name: str) -> HostTensor:
        """Host memory for this table, its zero-copy view on the table's CUDA device."""
        return HostTensor(shape, dtype, pin=pin, name=name,
                          device=self.device if self.device.type == "cuda" else None)

    # --- the host table -------------------------------------------------------------------
    @property
    def weight(self) -> torch.Tensor:
        """All rows, as a CPU tensor aliasing the (pinned) host memory. Reading it waits for
        queued GPU writes first, so what you read is current. Write to it to initialise."""
        synchronize(self.device)
        return self._host.tensor[:, : self.embedding_dim]

    def state_columns(self, name: str) -> torch.Tensor:
        """Host view of one per-row optimizer state (e.g. ``"exp_avg"``), aligned with rows."""
        synchronize(self.device)
        i = self._state_names.index(name) + 1
        d = self.embedding_dim
        return self._host.tensor[:, i * d:(i + 1) * d]

    def attach_state(self, names, initial: dict) -> None:
        """Give every row room for per-row optimizer state, stored after its weight.

        Called once by :class:`nbtools.OffloadOptimizer`. The host table is reallocated as
        ``[weight | state...]`` per row (the old one is released); state columns start at
        ``initial[name]``. References to ``table.weight`` taken before this point to the old
        memory: create the optimizer first.
        """
        names = list(names)
        if self._state_names:
            raise ValueError(f"table {self.name!r} already carries optimizer state "
                             f"{self._state_names}; use one OffloadOptimizer per table")
        if not names:
            return
        old = self._host
        d, n = self.embedding_dim, self.num_embeddings
        width = d * (1 + len(names))
        check_fits(n * width * old.tensor.element_size(),
                   f"table {self.name!r} with optimizer state ({', '.join(names)})",
                   "Use nbtools.plan(...) to size it, or an optimizer with less state "
                   "(SGD, Adagrad).")
        synchronize(self.device)
        new = self._new_host((n, width), old.tensor.dtype, old.pinned, self.name)
        chunk = max(1, (64 << 20) // (d * old.tensor.element_size()))   # bounded temporaries
        for start in range(0, n, chunk):
            new.tensor[start:start + chunk, :d].copy_(old.tensor[start:start + chunk])
        for i, name in enumerate(names, start=1):
            if initial.get(name, 0.0):
                new.tensor[:, i * d:(i + 1) * d].fill_(initial[name])
        old.close()
        self._host, self._rows, self._state_names = new, RowStore(new, self.device), names
        self._pending.clear()

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
        host = self._new_host((self.num_embeddings, 1), self._host.tensor.dtype,
                              self._host.pinned, f"{self.name}.grad_scale")
        host.tensor.copy_(weights.reshape(-1, 1))
        self._grad_scale = RowStore(host, self.device)

    def close(self) -> None:
        """Release the pinned registration now (the CPU tensor stays valid as plain memory)."""
        synchronize(self.device)
        self._pending.clear()
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
        # int64 ids: index_copy_ (the write-back) takes no other index dtype
        uniq, inv = torch.unique(flat.long(), return_inverse=True)   # sorted: bounds at the ends
        lo, hi = torch.stack((uniq[0], uniq[-1])).tolist()      # note: a CPU-GPU sync point
        if lo < 0 or hi >= self.num_embeddings:
            bad = (flat < 0) | (flat >= self.num_embeddings)
            value = int(flat[bad.nonzero()[0, 0]])
            raise IndexError(
                f"table {self.name!r} has {self.num_embeddings:,} rows but ids contain {value:,} "
                f"(first at {_ids_error_position(bad, ids.shape)}); valid ids are 0 to "
                f"{self.num_embeddings - 1:,}")
        recording = torch.is_grad_enabled() and self.trainable
        d = self.embedding_dim
        with torch.no_grad():
            if recording and self._state_names:
                # Training: whole rows now, so the optimizer step needs no second gather.
                full = self._rows.gather(uniq)
                rows, state = full[:, :d].clone(), full[:, d:]
            else:
                rows, state = self._rows.gather(uniq, 0, d), None
        if recording:
            rows.requires_grad_(True)
            self._pending.append((uniq, rows, state))
            if len(self._pending) > _PENDING_WARN and not self._warned_pending:
                self._warned_pending = True
                warnings.warn(
                    f"table {self.name!r} holds {len(self._pending)} lookups waiting for an "
                    "optimizer step: run evaluation under torch.no_grad(), or call "
                    "optimizer.zero_grad()", RuntimeWarning, stacklevel=3)
        return rows, inv

    def take_grad(self):
        """What the optimizer needs for the rows looked up since the last call.

        Returns ``(ids, grad, rows, state)``: unique ids (padding row excluded), their gradients
        summed over every occurrence in every lookup (per-row scale applied), the weight rows
        and the state columns as gathered (``state`` is None when no state is attached or the
        lookups predate it). All None when no row has a gradient. Clears the pending lookups.
        Called by :class:`OffloadOptimizer`.
        """
        records = [rec for rec in self._pending if rec[1].grad is not None]
        self._pending.clear()
        if not records:
            return None, None, None, None
        if len(records) == 1:
            ids, leaf, state = records[0]
            grad, rows = leaf.grad, leaf.detach()
        else:                        # several lookups this step: one more dedup across them
            all_ids = torch.cat([r[0] for r in records])
            ids, inv = torch.unique(all_ids, return_inverse=True)
            grad = torch.zeros(ids.numel(), self.embedding_dim, dtype=records[0][1].grad.dtype,
                               device=self.device)
            grad.index_add_(0, inv, torch.cat([r[1].grad for r in records]))
            # Rows (and state) of one id are identical in every lookup: take any occurrence.
            pick = torch.empty(ids.numel(), dtype=torch.long, device=self.device)
            pick.scatter_(0, inv, torch.arange(all_ids.numel(), device=self.device))
            rows = torch.cat([r[1].detach() for r in records])[pick]
            states = [r[2] for r in records]
            state = None if any(s is None for s in states) else torch.cat(states)[pick]
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            if not bool(keep.all()):
                ids, grad, rows = ids[keep], grad[keep], rows[keep]
                state = None if state is None else state[keep]
                if ids.numel() == 0:
                    return None, None, None, None
        if self._grad_scale is not None:
            grad = grad * self._grad_scale.gather(ids).to(grad.dtype)
        return ids, grad, rows, state

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
        copy_unless_same(self.weight, src)     # .weight synchronises first

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
