"""How a table's row ``[weight | state_1 | ... | state_k]`` sits in memory
(:class:`RowLayout`), and the padding that rounds a row to whole 32-byte sectors
(:func:`row_padding`). :mod:`nbtools.store.rows` re-exports both."""
from __future__ import annotations

import dataclasses

import torch

from .precision import round_to


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How one row ``[weight | state_1 | ... | state_k]`` sits in memory.

    The row is stored in ``unit`` (the state's dtype once an optimizer attached, else the
    weight's). A weight of a narrower dtype (bf16 or fp16 weights with fp32 state) is packed
    into the first ``weight_cols`` columns: two bf16 values per fp32 column. Every value is
    computed in float32 (:meth:`weight` / :meth:`state` upcast, the fused kernels likewise)
    and rounded to its storage dtype when written.

    Each state is ``dim`` columns wide unless ``state_dims`` says otherwise: a row-wise
    optimizer's per-row state is narrower (:class:`nbtools.rowwise.PartialRowWiseAdam`'s
    ``exp_avg_sq`` is one column: ``state_dims=(dim, 1)``).

    >>> lay = RowLayout(3, torch.bfloat16, torch.float32, states=2)
    >>> lay.weight_cols, lay.width, lay.state_col(1)
    (2, 8, 5)
    >>> lay = RowLayout(4, torch.float32, torch.float32, states=2, state_dims=(4, 1))
    >>> lay.width, lay.state_col(1), lay.state_widths
    (9, 8, (4, 1))
    """

    dim: int
    weight_dtype: torch.dtype
    unit: torch.dtype
    states: int = 0
    state_dims: tuple | None = None    # columns of each state (None: ``dim`` each)
    pad: int = 0                       # unused columns at the end (:func:`row_padding`)
    names: tuple = ()                  # each state's name (an optimizer's), in order

    def __post_init__(self):
        if self.state_dims is not None:
            dims = tuple(int(k) for k in self.state_dims)
            if len(dims) != self.states or any(k <= 0 for k in dims):
                raise ValueError(f"state_dims must give a positive width for each of the "
                                 f"{self.states} states, got {self.state_dims!r}")
            object.__setattr__(self, "state_dims", dims)

    @property
    def packed(self) -> bool:
        return self.weight_dtype != self.unit

    @property
    def weight_cols(self) -> int:
        return -(-self.dim * self.weight_dtype.itemsize // self.unit.itemsize)

    @property
    def state_widths(self) -> tuple:
        """Columns of each state, in order."""
        return self.state_dims if self.state_dims is not None else (self.dim,) * self.states

    @property
    def used(self) -> int:
        """Columns that hold values (``width`` less the padding)."""
        return self.weight_cols + sum(self.state_widths)

    @property
    def width(self) -> int:
        return self.used + self.pad

    def state_col(self, i: int) -> int:
        """First column of state ``i`` (0-based)."""
        return self.weight_cols + sum(self.state_widths[:i])

    def weight(self, rows: torch.Tensor) -> torch.Tensor:
        """The weights of ``rows`` [m, width] as stored (a view)."""
        if not self.packed:
            return rows[:, : self.dim]
        return rows[:, : self.weight_cols].view(self.weight_dtype)[:, : self.dim]

    def state(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        c = self.state_col(i)
        return rows[:, c:c + self.state_widths[i]]

    def pack(self, weight: torch.Tensor, states: list, rounding: str = "nearest",
             generator=None) -> torch.Tensor:
        """Rows [m, width] of ``unit`` from float32 ``weight`` [m, d] and ``states`` (each
        [m, its width]), each rounded to its storage dtype (:func:`nbtools.store.precision.round_to`)."""
        out = weight.new_zeros(weight.shape[0], self.width, dtype=self.unit)
        self.weight(out).copy_(round_to(weight, self.weight_dtype, rounding, generator))
        for i, st in enumerate(states):
            self.state(out, i).copy_(round_to(st, self.unit, rounding, generator))
        return out


ALIGN_BYTES = 32          # rows padded to a multiple of this (see row_padding)


def row_padding(layout: RowLayout) -> int:
    """Columns that round a row of ``layout`` up to a multiple of :data:`ALIGN_BYTES`, where
    that adds at most an eighth to it (rows of 256 bytes or more).

    Why: the GPU reads and writes pinned rows in 32-byte sectors. A row whose bytes are not a
    multiple of 32 starts at a different offset in its sectors every row, and a step's rows
    cross the link at a lower rate: 260-byte rows (bf16 weights + RowWiseAdagrad's
    accumulator) padded to 288 bytes move in less time than unpadded, although they are 11%
    more bytes (benchmarks/RESULTS.md, "The link by row width").
    Padding columns hold zeros and are never computed with.

    >>> row_padding(RowLayout(128, torch.bfloat16, torch.float32, 1, (1,)))   # 260 -> 288 B
    7
    >>> row_padding(RowLayout(128, torch.float32, torch.float32, 2))          # 1,536 B: aligned
    0
    >>> row_padding(RowLayout(8, torch.float32, torch.float32, 1, (1,)))      # 36 B: small rows
    0
    """
    unit = layout.unit.itemsize
    nbytes = layout.used * unit
    pad_bytes = -nbytes % ALIGN_BYTES
    if nbytes < 256 or pad_bytes % unit or pad_bytes * 8 > nbytes:
        return 0
    return pad_bytes // unit
