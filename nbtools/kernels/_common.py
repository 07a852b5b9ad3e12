"""What the Triton kernel modules share: whether Triton runs for a device, and the grid
arithmetic of their launchers.

The kernels themselves are in :mod:`nbtools.kernels` (a lookup's rows and the fused optimizer
updates), :mod:`nbtools.kernels._admission` (the GPU cache's admission) and :mod:`nbtools.kernels._segsum` (the
fixed-order gradient sum); this module is below all three, so that each can use these helpers
and :mod:`nbtools.kernels` can re-export the others' names without an import cycle. It imports
no Triton: :func:`triton_ok` tries on first call.
"""
from __future__ import annotations

import functools
import math
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_ok() -> bool:
    """True when Triton can be imported (kernels then run on CUDA, or on the CPU when
    ``TRITON_INTERPRET=1`` is set)."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except Exception:          # missing, or a broken install: the torch path still works
        return False
    return True


def usable_on(device: torch.device) -> bool:
    """Whether the kernels run for tensors on ``device``."""
    if not triton_ok():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``least``)."""
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
