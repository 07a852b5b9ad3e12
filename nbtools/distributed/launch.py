"""Launching a small job from a notebook or a test: join a launcher's group, or spawn the ranks.

:func:`init` joins the process group torchrun describes; :func:`spawn` starts ``nprocs`` ranks on
this machine, each in the default group, and returns their values in rank order.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def init(backend: str | None = None) -> tuple[int, int]:
    """Join the process group a launcher set up, from its environment (``torchrun
    --nproc_per_node=N train.py`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``); returns ``(rank, world)``. ``backend``: default ``"nccl"`` where CUDA is
    available (rank r on ``cuda:LOCAL_RANK``, made current), else ``"gloo"``. Without a
    launcher's environment (one process): ``(0, 1)`` and no process group. Already joined
    (:func:`spawn`'s workers): the group's rank and size."""
    import os

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    extra = {}
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (docs/distributed.md)
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        extra["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, **extra)
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world, port, args, results, timeout_s, backend="gloo"):
    import datetime
    import os
    import sys

    from ..devices import usable_cores     # (this process's share of the cores)
    torch.set_num_threads(max(1, usable_cores() // world))
    extra = {}
    if backend == "nccl":           # one GPU a rank: cuda:rank, current in this process
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast off (docs/distributed.md)
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            **extra)
    value = fn(rank, world, *args)
    results.put((rank, value))      # SimpleQueue: written before put returns
    dist.barrier()                  # every rank past its last collective
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter finalisation: gloo's threads now and then abort a process there
    # ("terminate called without an active exception") after its work is done
    os._exit(0)


def spawn(fn, nprocs: int, args=(), timeout: float = 600.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` processes on this machine, each in a
    process group (the default group, so ``ShardedEmbedding(...)`` shards over it), and return
    their return values in rank order.

    ``backend``: ``"gloo"`` (CPU ranks, or GPU ranks exchanging through host memory) or
    ``"nccl"`` (one GPU a rank: rank r computes on ``cuda:r``, made current in its process;
    ``nprocs`` at most the GPUs visible).

    ``fn`` must be importable by the new processes: define it in a ``.py`` file (in a
    notebook, ``%%writefile job.py`` and ``from job import train``), not in a cell. A rank that
    raises fails the whole job with its traceback; after ``timeout`` seconds the processes are
    killed and ``TimeoutError`` is raised. Collectives give up after the same timeout.
    """
    import time

    import torch.multiprocessing as mp

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and nprocs > torch.cuda.device_count():
        raise ValueError(f"backend='nccl' runs one rank a GPU: {nprocs} ranks asked for, "
                         f"{torch.cuda.device_count()} GPU(s) visible")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    job = mp.start_processes(_worker, args=(fn, nprocs, free_port(), tuple(args), results,
                                            timeout, backend), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not job.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {nprocs} processes did not "
                                   f"finish in {timeout:g} s; its processes were killed")
    finally:
        for p in job.processes:
            if p.is_alive():
                p.kill()
    values = dict(results.get() for _ in range(nprocs))
    return [values[r] for r in range(nprocs)]
