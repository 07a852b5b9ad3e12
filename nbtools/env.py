"""What this machine offers nbtools, at a glance: :func:`describe` (``nbtools.describe()``).

It sits above :mod:`nbtools.devices` and :mod:`nbtools.hostmem` (it asks both), so neither has to
import the other backwards.
"""
from __future__ import annotations

import os
import platform

import torch

from . import colab, disk, hostmem
from .rowfile import fileio
from .devices import (FEW_CORES, cuda_ok, gpu_free_bytes, host_budget, host_memory_bytes,
                      memlock_limit, resolve_device, usable_cores)
from .units import human_bytes as _human


_ENGINE_NAMES = {"kaio": "Linux's native AIO", "aio": "glibc's POSIX AIO",
                 "threads": "Python threads"}


def describe(file=None) -> dict:
    """Print (and return) which nbtools this is (version and commit), and torch, CUDA, GPU and
    pinning capability at a glance.

    >>> info = describe(file=open(os.devnull, "w"))
    >>> sorted(info)[:3]
    ['auto_gpu_budget_bytes', 'cores', 'cuda']
    """
    mem = host_memory_bytes()
    info = {
        "nbtools": colab.installed(),                # version, and where from: ref and commit
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda_ok() else None,
        "device": str(resolve_device()),
        "gpu": None,
        "gpu_memory_bytes": None,
        "cores": usable_cores(),                     # this process's share (taskset, container)
        "torch_threads": torch.get_num_threads(),
        "host_total_bytes": mem["total"],
        "host_available_bytes": mem["available"],
        "memlock_limit_bytes": memlock_limit(),
        "pinning": "unavailable (no CUDA): tables use ordinary host memory",
        "pinned_bytes": hostmem.pinned_bytes(),
        # what OffloadedEmbedding(placement="auto") puts on the GPU now (rows + state)
        "auto_gpu_budget_bytes": None,
        "host_budget_bytes": host_budget(),          # nbtools.set_host_budget, or None
        "disk_dir": disk.default_dir(),              # where placement="disk" files go
        "disk_free_bytes": disk.free_bytes(disk.default_dir()),
        # how a disk table's O_DIRECT file reads and writes rows (nbtools.rowfile.fileio.default_engine)
        "disk_engine": fileio.default_engine(direct=True),
        # which kernel families run as Triton kernels here, and which on the exact torch path
        "kernels": None,
    }
    if cuda_ok():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["gpu"] = props.name
        info["gpu_memory_bytes"] = props.total_memory
        info["pinning"] = hostmem.probe_pinning()
        from .tables import TableConfig
        free = gpu_free_bytes(torch.cuda.current_device())
        info["auto_gpu_budget_bytes"] = int(TableConfig.gpu_fraction * free)
    from .kernels import common as kernel_choice
    info["kernels"] = kernel_choice.describe_line(resolve_device())
    lines = [
        info["nbtools"],
        f"python   {info['python']}  torch {info['torch']}  CUDA {info['cuda'] or 'N/A'}",
        f"device   {info['device']}  GPU {info['gpu'] or 'none'}  GPU memory {_human(info['gpu_memory_bytes'])}",
        f"CPU      {info['cores']} cores for this process, torch {info['torch_threads']} threads"
        + ("; few: a disk table's read-ahead dedups on one thread" if info["cores"] <= FEW_CORES
           else ""),
        f"host RAM {_human(info['host_available_bytes'])} available of {_human(info['host_total_bytes'])}"
        f"  memlock limit {_human(info['memlock_limit_bytes']) if info['memlock_limit_bytes'] else 'unlimited'}",
        f"pinning  {info['pinning']}  (nbtools holds {_human(info['pinned_bytes'])} pinned)",
        "placement='auto': " + (f"a table whose rows + optimizer state fit "
                                f"{_human(info['auto_gpu_budget_bytes'])} (half the free GPU "
                                "memory) lives on the GPU, a larger one in pinned host RAM"
                                if info["auto_gpu_budget_bytes"] is not None else
                                "CPU compute: tables live in host memory")
        + (f"; past 90% of available RAM, in a file under {info['disk_dir']} "
           f"({_human(info['disk_free_bytes'])} free)"),
        f"host budget {_human(info['host_budget_bytes']) if info['host_budget_bytes'] else 'none'}"
        " (nbtools.set_host_budget: bounds pinned rows, RAM caches and staging)",
        f"disk I/O {_ENGINE_NAMES.get(info['disk_engine'], info['disk_engine'])} for a disk "
        "table's O_DIRECT file"
        + (" (NBTOOLS_DISK_ENGINE)" if os.environ.get("NBTOOLS_DISK_ENGINE") else
           "" if info["disk_engine"] == "kaio" else
           f" (Linux's native AIO unavailable: {fileio.native_aio_why()})"),
        f"kernels  {info['kernels']}",
    ]
    print("\n".join(lines), file=file)
    return info
