"""Sizing a table and its optimizer state before anything is allocated: :func:`nbtools.plan`."""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from ..devices import host_memory_bytes, resolve_device
from ..placement import NoRoomError, TableConfig, auto_placement, disk_bytes
from ..rowwise import PartialRowWiseAdam, RowWiseAdagrad
from ..store.layout import RowLayout, row_padding
from ..units import human_bytes
from .probe import NOT_PER_ROW, probe_row_state

# plan()'s names of the row-wise optimizers (besides the torch.optim class names)
_ROWWISE_NAMES = {"rowwise_adagrad": RowWiseAdagrad, "rowwiseadagrad": RowWiseAdagrad,
                  "partial_rowwise_adam": PartialRowWiseAdam,
                  "partialrowwiseadam": PartialRowWiseAdam}


def optimizer_names() -> dict:
    """The optimizer names :func:`plan` takes (lower case, ``-`` read as ``_``) -> their class:
    every ``torch.optim`` optimizer whose update can be per row, and the row-wise ones.

    >>> names = optimizer_names()
    >>> names["adam"] is torch.optim.Adam, "optimizer" in names, "lbfgs" in names
    (True, False, False)
    """
    names = {n.lower(): c for n, c in ((n, getattr(torch.optim, n)) for n in dir(torch.optim))
             if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
             and c is not torch.optim.Optimizer and not issubclass(c, NOT_PER_ROW)}
    names.update(_ROWWISE_NAMES)
    return names


@dataclasses.dataclass
class Plan:
    """What a table and its optimizer state need, computed before anything is allocated."""

    num_rows: int
    dim: int
    dtype: str
    optimizer: str
    row_state: list
    table_bytes: int
    state_bytes: int
    host_bytes: int            # table + state, all in (pinned) host memory
    gpu_bytes_per_step: int    # rows, grads and state of one batch of unique ids on the GPU
    host_available_bytes: int | None
    fits: bool                 # in host RAM
    placement: str = "host"    # where OffloadedEmbedding(placement="auto") would put it now:
    placement_reason: str = ""  # "gpu", "host", "disk", or "none" (it fits on no tier)
    disk_free_bytes: int | None = None   # free on the disk placement="disk" would use
    disk_row_bytes: int | None = None    # a row as a disk table holds it (RAM rows are padded
                                         # to 32-byte sectors: nbtools.store.layout.row_padding)
    pad_bytes: int = 0         # of host_bytes: that padding (in state_bytes' place before)
    # a disk table's levels under placement="auto": rows its RAM cache holds by default
    # (host_cache_bytes), and rows its GPU cache holds (gpu_fraction of the free GPU memory;
    # None without CUDA). The levels hold different rows.
    ram_cache_rows: int | None = None
    gpu_cache_rows: int | None = None
    state_dtype: str = ""      # what the per-row state is stored in ("" without state)

    def _disk_file(self) -> str:
        """The file a disk table of this plan makes: a log of packed rows with its spare slots
        where the disk has room for them, else its rows in place in 512-byte sectors
        (nbtools.disk.log)."""
        from ..disk import log as disklog
        row = self.disk_row_bytes or self.host_bytes // max(1, self.num_rows)
        rows = disklog.file_rows(self.num_rows, disklog.log_stride(row), self.disk_free_bytes)
        stride = disklog.log_stride(row) if rows != self.num_rows else disk_bytes(row, 1)
        what = (f"log-structured, {rows / self.num_rows - 1:.0%} spare"
                if rows != self.num_rows else "rows in place")
        return f"a file of {human_bytes(rows * stride)} ({what})"

    def __str__(self) -> str:
        avail = human_bytes(self.host_available_bytes)
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{self.num_rows:,} x {self.dim} {self.dtype} with {self.optimizer} "
                f"(per-row state: {', '.join(self.row_state) or 'none'}"
                + (f" in {self.state_dtype}" if self.row_state else "") + ")\n"
                f"  table {human_bytes(self.table_bytes)} + state {human_bytes(self.state_bytes)}"
                + (f" + sector padding {human_bytes(self.pad_bytes)}" if self.pad_bytes else "") +
                f" = {human_bytes(self.host_bytes)} host (pinned); available {avail}: {verdict}\n"
                f"  GPU per step (batch of unique ids): {human_bytes(self.gpu_bytes_per_step)}\n"
                f"  disk: {self._disk_file()}, {human_bytes(self.disk_free_bytes)} free for "
                "placement='disk'\n"
                f"  placement='auto' -> {self.placement} ({self.placement_reason})"
                + self._levels())

    def _levels(self) -> str:
        """A disk table's levels, hottest first (only where placement='auto' picks disk)."""
        if self.placement != "disk" or self.ram_cache_rows is None:
            return ""
        row = self.host_bytes // max(1, self.num_rows)
        gpu = ("no GPU cache (no CUDA)" if not self.gpu_cache_rows else
               f"GPU cache {self.gpu_cache_rows:,} rows ({human_bytes(self.gpu_cache_rows * row)})")
        held = (self.gpu_cache_rows or 0) + self.ram_cache_rows
        return (f"\n  levels: {gpu}, then RAM cache {self.ram_cache_rows:,} rows "
                f"({human_bytes(self.ram_cache_rows * row)}, host_cache_bytes), then the file: "
                f"{min(1.0, held / max(1, self.num_rows)):.0%} of the rows off the disk")


def _check_hyperparameters(optimizer, kwargs: dict) -> None:
    """Refuse, naming plan(), keywords that ``optimizer`` does not take (else its __init__
    would be blamed for a slip in the call to plan())."""
    if not isinstance(optimizer, type) or optimizer is torch.optim.Optimizer:
        raise TypeError(f"optimizer must be an optimizer class (torch.optim.Adam, "
                        f"nbtools.RowWiseAdagrad, ...) or its name, got {optimizer!r}"
                        + (" (the base class, which has no update of its own)"
                           if optimizer is torch.optim.Optimizer else ""))
    try:
        params = inspect.signature(optimizer.__init__).parameters
    except (TypeError, ValueError):          # no signature to read: the optimizer judges
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        takes = [n for n, p in params.items() if n not in ("self", "params") and
                 p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise TypeError(f"plan() got keyword(s) {unknown} that are neither its own (device, "
                        f"gpu_fraction, disk_dir, dtype, state_dtype, unique_ids_per_step) nor "
                        f"hyper-parameters of {optimizer.__name__}, which takes {takes}")


def plan(num_rows: int, dim: int, optimizer=torch.optim.Adam, dtype=torch.float32,
         unique_ids_per_step: int = 65536, *, state_dtype=None, device="auto",
         gpu_fraction: float = 0.5, disk_dir=None, **optimizer_kwargs) -> Plan:
    """Size a table and its optimizer state before allocating anything.

    Args:
        num_rows, dim: table shape.
        optimizer: optimizer class (or its name, e.g. ``"adam"``, ``"rowwise_adagrad"``,
            ``"partial_rowwise_adam"``: :func:`optimizer_names`).
        dtype: table dtype.
        state_dtype: what the optimizer state is stored in, as the table's ``state_dtype``
            (None: float32 for bf16/fp16 weights, else the weights' dtype).
        unique_ids_per_step: expected distinct ids per step, for the GPU estimate.
        device, gpu_fraction, disk_dir: for what ``placement="auto"`` would choose now
            (:func:`~nbtools.placement.auto_placement`: the GPU when rows + state take at most
            ``gpu_fraction`` of its free memory, else host RAM, else a file in ``disk_dir``).
        **optimizer_kwargs: hyper-parameters that change the state (``amsgrad=True``, ...).

    >>> p = plan(10_000_000, 128, "adam")
    >>> p.row_state, p.host_bytes == 3 * 10_000_000 * 128 * 4
    (['exp_avg', 'exp_avg_sq'], True)
    >>> p = plan(10_000_000, 128, "rowwise_adagrad", dtype=torch.bfloat16)
    >>> p.row_state, p.host_bytes // 10_000_000      # 256 weight + 4 state, padded to 288
    (['sum'], 288)
    """
    # (checked as the table checks them: shape, dtype, state_dtype, gpu_fraction, disk_dir)
    config = TableConfig(dtype=dtype, state_dtype=state_dtype, gpu_fraction=gpu_fraction,
                         disk_dir=disk_dir)
    num_rows, dim, unique_ids_per_step = config.check("auto", {
        "num_rows": num_rows, "dim": dim, "unique_ids_per_step": unique_ids_per_step})
    table_options = {"placement", "name", "device_ids", "padding_idx", "pin", "cache_bytes",
                     "cache_fraction", "cache_rows", "host_cache_bytes",
                     "rounding", "write_behind", "cuda_graphs"} & set(optimizer_kwargs)
    if table_options:
        raise TypeError(f"plan() got table option(s) {sorted(table_options)}: plan() sizes "
                        "the table and says where placement='auto' would put it "
                        "(Plan.placement); pass placement and the other table options to "
                        "OffloadedEmbedding. plan()'s other keywords are the optimizer's "
                        "hyper-parameters (amsgrad=True, ...)")
    if isinstance(optimizer, str):
        names = optimizer_names()
        key = optimizer.lower().replace("-", "_")
        # torch.optim's names that are not offered are still known: the probe below refuses
        # them, saying why they cannot train a table
        known = {**{c.__name__.lower(): c for c in NOT_PER_ROW}, **names}
        if key not in known:
            raise ValueError(f"unknown optimizer {optimizer!r}: plan() takes one of "
                             f"{sorted(names)}, or an optimizer class whose update is per row "
                             "(torch.optim.Adam, nbtools.RowWiseAdagrad, ...)")
        optimizer = known[key]
    _check_hyperparameters(optimizer, optimizer_kwargs)
    optimizer_kwargs.setdefault("lr", 1e-3)
    low = dtype in (torch.bfloat16, torch.float16)
    row_state, _, _, _, shapes = probe_row_state(optimizer, optimizer_kwargs, dim,
                                                 torch.device("cpu"),
                                                 torch.float32 if low else dtype,
                                                 check_separable=False)
    # Rows as a table stores them (nbtools.store.layout.RowLayout): state in the table's state
    # dtype (default float32 for bf16/fp16 weights), the weights packed into its columns.
    stored = config.storage_state_dtype if row_state else dtype
    layout = RowLayout(dim, dtype, stored, len(row_state),
                       tuple(math.prod(s) for s in shapes.values()))
    disk_row = layout.used * layout.unit.itemsize
    if row_state:                          # rows with state are padded in RAM (not on disk)
        layout = dataclasses.replace(layout, pad=row_padding(layout))
    unit = layout.unit.itemsize
    table_bytes = num_rows * layout.weight_cols * unit
    state_bytes = num_rows * (layout.used - layout.weight_cols) * unit
    pad_bytes = num_rows * layout.pad * unit
    host = table_bytes + state_bytes + pad_bytes
    unique = min(unique_ids_per_step, num_rows)
    # gathered rows, the lookup's output and its gradient, and the optimizer's temporaries
    rows = unique * dim * torch.empty((), dtype=dtype).element_size()
    gpu_per_step = 3 * rows + 2 * unique * (layout.width - layout.weight_cols) * unit
    available = host_memory_bytes()["available"]

    def place(nbytes):
        try:
            return auto_placement(nbytes, resolve_device(device), gpu_fraction, disk_dir,
                                  num_rows)
        except NoRoomError as e:
            return "none", str(e)
    placement, why = place(host)
    if pad_bytes and placement in ("disk", "none"):
        # the padding never sends rows that fit in RAM to disk (placement.regrow_for_state)
        where, reason = place(host - pad_bytes)
        if where not in ("disk", "none"):
            placement, pad_bytes, host = where, 0, host - pad_bytes
            why = f"{reason}; rows not padded to 32-byte sectors (padded, they would not fit)"
    from .. import disk
    levels = {}
    if placement == "disk":
        row = host // max(1, num_rows)
        target = resolve_device(device)
        levels["ram_cache_rows"] = min(num_rows, disk.DEFAULT_HOST_CACHE_BYTES // row)
        if target.type == "cuda":
            from ..devices import gpu_free_bytes
            levels["gpu_cache_rows"] = min(num_rows, int(gpu_fraction * gpu_free_bytes(target))
                                           // row)
    return Plan(num_rows, dim, str(dtype).replace("torch.", ""), optimizer.__name__,
                list(row_state), table_bytes, state_bytes, host,
                gpu_bytes_per_step=gpu_per_step,
                host_available_bytes=available,
                fits=available is None or host <= 0.9 * available,
                placement=placement, placement_reason=why,
                disk_free_bytes=disk.free_bytes(disk_dir or disk.default_dir()),
                disk_row_bytes=disk_row, pad_bytes=pad_bytes,
                state_dtype=str(stored).replace("torch.", "") if row_state else "", **levels)
