"""One place that decides which device nbtools computes on and what this machine can do.

Nothing else in nbtools asks ``torch.cuda.is_available()``: it asks :func:`cuda_ok`, which is
resolved once per process.
"""
from __future__ import annotations

import functools
import os  # noqa: F401  (the doctest of describe() uses os.devnull)
import platform
import resource

import torch


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


def _human(n) -> str:
    if n is None:
        return "N/A"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def describe(file=None) -> dict:
    """Print (and return) torch, CUDA, GPU and pinning capability at a glance.

    >>> info = describe(file=open(os.devnull, "w"))
    >>> sorted(info)[:3]
    ['cuda', 'device', 'gpu']
    """
    from . import hostmem  # local: hostmem imports this module

    mem = host_memory_bytes()
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda_ok() else None,
        "device": str(resolve_device()),
        "gpu": None,
        "gpu_memory_bytes": None,
        "host_total_bytes": mem["total"],
        "host_available_bytes": mem["available"],
        "memlock_limit_bytes": memlock_limit(),
        "pinning": "unavailable (no CUDA): tables use ordinary host memory",
        "pinned_bytes": hostmem.pinned_bytes(),
    }
    if cuda_ok():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["pinning"] = hostmem.probe_pinning()
    lines = [
        f"nbtools  python {info['python']}  torch {info['torch']}  CUDA {info['cuda'] or 'N/A'}",
        f"device   {info['device']}  GPU {info['gpu'] or 'none'}  GPU memory {_human(info['gpu_memory_bytes'])}",
        f"host RAM {_human(info['host_available_bytes'])} available of {_human(info['host_total_bytes'])}"
        f"  memlock limit {_human(info['memlock_limit_bytes']) if info['memlock_limit_bytes'] else 'unlimited'}",
        f"pinning  {info['pinning']}  (nbtools holds {_human(info['pinned_bytes'])} pinned)",
    ]
    print("\n".join(lines), file=file)
    return info


human_bytes = _human


def synchronize(device) -> None:
    """Wait for queued GPU work on ``device`` (no-op on the CPU).

    nbtools calls this before the host reads memory that GPU kernels may still be writing
    (``table.weight``, ``state_dict()``).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
