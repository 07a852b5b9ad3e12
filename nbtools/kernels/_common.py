"""What the kernel families share on the host: whether Triton runs for a device, the grid
arithmetic of their launchers, and :func:`jit`, which imports a family's ``@triton.jit``
functions on their first launch.

It imports no Triton: :func:`triton_ok` tries on first call, and the modules that define the
kernels (``_rows``, ``_update``, ``_admission``, ``_segsum``) import it when :func:`jit` first
loads them, so ``import nbtools.kernels`` works on a machine without Triton (a table on the
CPU takes the torch path) and Triton reads ``TRITON_INTERPRET`` only once a kernel runs.
"""
from __future__ import annotations

import functools
import importlib
import math
import os
import types

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


@functools.lru_cache(maxsize=None)
def jit(family: str) -> types.ModuleType:
    """The module of one family's ``@triton.jit`` functions: ``"rows"`` (a lookup's row
    copies), ``"update"`` (the fused optimizer updates), ``"admission"`` (the GPU cache's)
    or ``"segsum"`` (the fixed-order gradient sum), imported with Triton on first use."""
    return importlib.import_module(f"{__package__}._{family}")


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``least``)."""
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
