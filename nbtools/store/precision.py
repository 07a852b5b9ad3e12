"""Low-precision storage with float32 math: how values are rounded when written.

A table may store its weights (and, optionally, its optimizer state) in bfloat16 or float16:
half the bytes per row, so half the PCIe traffic per step. Rows are upcast to float32 when
gathered, the update is computed in float32, and the result is rounded once, when written:

* ``"nearest"``: round to nearest, ties to even (what ``Tensor.to`` does).
* ``"stochastic"`` (bfloat16 only): round up with probability equal to the fraction dropped,
  so an update smaller than bfloat16's resolution (about 0.4% of the value) still moves the
  weight on average, where round-to-nearest would lose it every time.

The fused kernels (:mod:`nbtools.kernels`) round the same way on the GPU; this module is the
torch reference and the generic path's rounding.
"""
from __future__ import annotations

import torch

ROUNDINGS = ("nearest", "stochastic")
LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_rounding(rounding: str, dtype: torch.dtype) -> None:
    """Refuse a rounding mode that does not exist or does not apply to ``dtype``."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if rounding == "stochastic" and dtype == torch.float16:
        raise ValueError("stochastic rounding is offered for bfloat16 storage; float16 rounds "
                         "to nearest (its 10-bit mantissa loses far less)")


def stochastic_round_bf16(x: torch.Tensor,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 ``x`` to bfloat16, rounding up (in magnitude) with probability equal to the
    dropped fraction: ``E[result] == x`` for every finite ``x`` below bfloat16's maximum.

    >>> x = torch.full((100_000,), 1.0 + 2 ** -10)      # 1/8 of the way to the next bf16
    >>> y = stochastic_round_bf16(x, torch.Generator().manual_seed(0)).float()
    >>> sorted(set(y.tolist())), round((y.mean().item() - 1) * 2 ** 10, 1)
    ([1.0, 1.0078125], 1.0)
    """
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device,
                          generator=generator)
    # adding below the kept 16 bits carries into them with probability = the dropped fraction;
    # the shifts clear the dropped bits (the sign bit rides along: bf16 is fp32's top half)
    rounded = ((bits + noise) >> 16) << 16
    return rounded.view(torch.float32).to(torch.bfloat16)


def round_to(x: torch.Tensor, dtype: torch.dtype, rounding: str = "nearest",
             generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (computed in float32) as ``dtype`` storage, rounded as ``rounding`` says."""
    if rounding == "stochastic" and dtype == torch.bfloat16:
        return stochastic_round_bf16(x, generator)
    return x.to(dtype)
