"""One place that decides which device nbtools computes on and what this machine can do.

Nothing else in nbtools asks ``torch.cuda.is_available()``: it asks :func:`cuda_ok`, which is
resolved once per process. The printout of all of it, :func:`nbtools.describe`, is in
:mod:`nbtools.env`.
"""
from __future__ import annotations

import functools
import resource

import torch

from .units import human_bytes  # noqa: F401  (nbtools.devices.human_bytes: older imports)


@functools.lru_cache(maxsize=None)
def cuda_ok() -> bool:
    """True when a CUDA device can be used (resolved once)."""
    return torch.cuda.is_available()


def resolve_device(device="auto") -> torch.device:
    """Turn ``"auto"``, a string or a ``torch.device`` into the compute device.

    ``"auto"`` means the current CUDA device when there is one, else the CPU.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if device is None or device == "auto":
        if cuda_ok():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not cuda_ok():
            raise RuntimeError(f"device={device!r} was asked for, but torch sees no CUDA device "
                               f"(torch {torch.__version__}); pass device='cpu' or 'auto'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r}: nbtools computes on 'cuda' or 'cpu'")
    return dev


def host_memory_bytes() -> dict:
    """Total and available host RAM in bytes, from /proc/meminfo (N/A elsewhere -> None)."""
    info = {"total": None, "available": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemTotal":
                    info["total"] = int(rest.split()[0]) * 1024
                elif key == "MemAvailable":
                    info["available"] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return info


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK soft limit in bytes; None when unlimited or unknown.

    cudaHostRegister is not bound by it on most drivers, but containers sometimes are.
    """
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def synchronize(device) -> None:
    """Wait for queued GPU work on ``device`` (no-op on the CPU).

    nbtools calls this before the host reads memory that GPU kernels may still be writing
    (``table.weight``, ``state_dict()``).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_free_bytes(device) -> int:
    """GPU memory this process may still take: the device's free memory, and no more than a
    cap set with ``torch.cuda.set_per_process_memory_fraction`` leaves (what placement="auto"
    and a cache's share of free memory are measured against)."""
    device = torch.device(device)
    free, total = torch.cuda.mem_get_info(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        cap = int(fraction(device) * total) - torch.cuda.memory_reserved(device)
        free = min(free, max(cap, 0))
    return free

