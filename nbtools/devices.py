"""One place that decides which device nbtools computes on and what this machine can do, and
the CUDA stream calls of a step (:func:`current`, :func:`entered`, :func:`record`).

Nothing else in nbtools asks ``torch.cuda.is_available()``: it asks :func:`cuda_ok`, which is
resolved once per process. The printout of all of it, :func:`nbtools.describe`, is in
:mod:`nbtools.env`.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import resource
import signal
import threading

import torch

from . import NbtoolsError
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


_NO_GUARD = contextlib.nullcontext()


def on(device: torch.device):
    """A context in which ``device`` is the current CUDA device, where it is a CUDA device other
    than the current one; nothing (no cost) otherwise. Triton launches, CUDA graphs, streams
    made without a device and zero-copy views use the *current* device: every entry point of
    a table or an optimizer enters its table's device, so a table on ``cuda:1`` works while
    ``cuda:0`` is current.

    >>> with on(torch.device("cpu")):
    ...     pass
    """
    if device.type != "cuda" or device.index is None or \
            device.index == torch.cuda.current_device():
        return _NO_GUARD
    return torch.cuda.device(device)


def on_tables(fn):
    """Decorator of a method of an object with a ``device`` (a table) or a ``guard_device``
    (an optimizer: its first table's): the method runs with that device current (:func:`on`)."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        dev = getattr(self, "device", None)
        if not isinstance(dev, torch.device):
            dev = getattr(self, "guard_device", None)
        if dev is None:
            return fn(self, *args, **kwargs)
        with on(dev):
            return fn(self, *args, **kwargs)
    return run


class HostBudgetError(NbtoolsError, MemoryError):
    """An allocation would take nbtools past its host-memory budget (set_host_budget)."""


# The host-RAM budget (set_host_budget / NBTOOLS_HOST_BUDGET) and what nbtools holds now: every
# HostTensor (pinned or not: tables, RAM caches, loader slabs) and a disk table's row maps.
_host = {"budget": None, "held": 0, "env_read": False}


def parse_bytes(text) -> int:
    """``12GiB``, ``512M``, ``3e9`` or an int -> bytes.

    >>> parse_bytes("1.5GiB"), parse_bytes("512M"), parse_bytes(1000)
    (1610612736, 536870912, 1000)
    """
    if isinstance(text, (int, float)):
        return int(text)
    t = str(text).strip().upper().replace("IB", "").replace("B", "")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(float(t))


def set_host_budget(nbytes) -> None:
    """Bound the host RAM nbtools takes: pinned and plain table rows, disk tables' RAM caches
    and row maps, loader slabs (``nbytes``: bytes or a string such as ``"12GiB"``; None: no
    bound). The environment variable ``NBTOOLS_HOST_BUDGET`` sets it too. Placement
    ("auto" picks disk over RAM), nbtools.plan and every allocation respect it; an allocation
    past it raises :class:`HostBudgetError` before anything is taken. Disk tables read with
    ``O_DIRECT``, so the page cache does not grow outside it."""
    _host["budget"] = None if nbytes is None else parse_bytes(nbytes)
    _host["env_read"] = True


def host_budget() -> int | None:
    """The host-memory budget in bytes, or None (see :func:`set_host_budget`)."""
    if not _host["env_read"]:
        _host["env_read"] = True
        env = os.environ.get("NBTOOLS_HOST_BUDGET")
        if env:
            _host["budget"] = parse_bytes(env)
    return _host["budget"]


def hold_host(nbytes: int, what: str = "host memory") -> None:
    """Count ``nbytes`` that nbtools is about to take; refuse past the budget."""
    budget = host_budget()
    if budget is not None and _host["held"] + nbytes > budget:
        raise HostBudgetError(
            f"{what} needs {human_bytes(nbytes)} but nbtools already holds "
            f"{human_bytes(_host['held'])} of its {human_bytes(budget)} host budget "
            "(nbtools.set_host_budget / NBTOOLS_HOST_BUDGET); nothing was allocated. Use "
            "placement='disk' with a smaller host_cache_bytes, or raise the budget.")
    _host["held"] += nbytes


def release_host(nbytes: int) -> None:
    _host["held"] = max(0, _host["held"] - nbytes)


def held_host_bytes() -> int:
    """Host bytes nbtools holds now (what the budget counts)."""
    return _host["held"]


def _cgroup_available() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return int(limit) - int(f.read())
    except (OSError, ValueError):
        return None


def host_memory_bytes() -> dict:
    """Total and available host RAM in bytes, from /proc/meminfo (N/A elsewhere -> None),
    within the container's memory limit and nbtools' host budget, where either is set."""
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
    limits = [v for v in (_cgroup_available(),) if v is not None]
    budget = host_budget()
    if budget is not None:
        limits.append(budget - _host["held"])
    if limits:
        least = max(0, min(limits))
        info["available"] = least if info["available"] is None else min(info["available"], least)
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


# At most this many cores, nbtools' background threads keep torch's CPU ops to themselves
# (:func:`torch_on_this_thread_alone`): the step's thread needs a core of its own.
FEW_CORES = 4


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """The cores a container's CPU quota allows (cgroup v2 ``cpu.max``; v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), or None where none is set."""
    for quota_file, period_file in (("cpu.max", None),
                                    ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us"),
                                    ("cpu,cpuacct/cpu.cfs_quota_us",
                                     "cpu,cpuacct/cpu.cfs_period_us")):
        try:
            with open(os.path.join(root, quota_file)) as f:
                words = f.read().split()
            if period_file is None:                 # v2: "<quota> <period>" or "max <period>"
                if words[0] == "max":
                    return None
                quota, period = int(words[0]), int(words[1])
            else:
                quota = int(words[0])
                if quota < 0:                       # v1: -1, no quota
                    return None
                with open(os.path.join(root, period_file)) as f:
                    period = int(f.read())
        except (OSError, ValueError, IndexError):
            continue
        return quota / period if quota > 0 and period > 0 else None
    return None


def usable_cores() -> int:
    """The CPU cores this process may run on: its share (``taskset``, a container's CPU set
    and its CPU quota, rounded up), not the host's count."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:              # (not Linux)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return min(cores, max(1, math.ceil(quota))) if quota else cores


@functools.lru_cache(maxsize=None)
def _openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def torch_on_this_thread_alone() -> bool:
    """From now on, torch's CPU ops called on this thread run on it alone, not split over a
    team of threads; every other thread's count, and the count a new thread starts from, stay
    as they were. For a background thread on a machine of few cores: its ops (a read-ahead's
    deduplication of 65,536 ids) would otherwise take every core for a moment, the step's
    thread's too. Only where torch runs its CPU ops on OpenMP, whose thread count belongs to
    each thread; elsewhere nothing changes and it returns False."""
    if not _openmp():
        return False
    before = torch.get_num_threads()    # (a new thread's count: the one new threads start from)
    if before == 1:
        return True
    torch.set_num_threads(1)            # this thread's count, and the one new threads start from
    # ...which a thread of its own puts back (its own count ends with it)
    restore = threading.Thread(target=torch.set_num_threads, args=(before,),
                               name="nbtools-threads")
    restore.start()
    restore.join()
    return True


def few_cores_thread() -> None:
    """The initializer of nbtools' background threads that run torch's CPU ops beside the
    step: on a machine of at most :data:`FEW_CORES` cores, they run those ops alone. Never
    raises (an executor whose initializer raised refuses all work): the count is a tuning."""
    try:
        if usable_cores() <= FEW_CORES:
            torch_on_this_thread_alone()
    except Exception:                   # noqa: BLE001 (a tuning: the thread works either way)
        pass


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


def after_failed_capture(device=None) -> None:
    """Call when a CUDA graph capture has failed: torch marks the device's default random
    generator as capturing at ``capture_begin`` and unmarks it only when ``capture_end``
    succeeds, so after a failed one every random op raises "Offset increment outside graph
    capture encountered unexpectedly". The generator gets a fresh copy of its own state (same
    seed and offset, not capturing)."""
    if not cuda_ok():
        return
    index = torch.cuda.current_device() if device is None or torch.device(device).index is None \
        else torch.device(device).index
    gen = torch.cuda.default_generators[index]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except (AttributeError, RuntimeError):      # an older torch: nothing to reset
        pass


@contextlib.contextmanager
def deferred_interrupts():
    """Hold a Ctrl-C / "interrupt kernel" (SIGINT) back until the block ends, then raise it.

    An optimizer step queues its updates before it records them (the scalar state, the
    counts): interrupted in between, its rows would move on while its step count did not.
    Inside this block SIGINT only is noted; at the end the handler that was installed before
    runs (Python's default: KeyboardInterrupt). A second SIGINT inside the block raises
    KeyboardInterrupt at once (a step that hangs can still be stopped). Outside the main
    thread nothing changes (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or previous == signal.SIG_IGN:   # installed outside Python, or
        yield                                            # ignored: left as it is
        return

    def note(signum, frame):
        caught.append(frame)
        if len(caught) > 1:           # pressed again: stop now
            raise KeyboardInterrupt
    try:
        signal.signal(signal.SIGINT, note)
    except (ValueError, OSError, TypeError):      # not this interpreter's main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if len(caught) == 1:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            else:                     # SIG_DFL (the process would end): as Python's default
                raise KeyboardInterrupt


# --- the current CUDA stream, a side stream entered and events recorded -----------------------
# A training step of an offloaded table asks for the current stream, enters a side stream for its
# write-back and records events several times a step. torch's Python helpers resolve their
# arguments in Python on every call, several times the cost of the C call underneath
# (benchmarks/RESULTS.md, "the step's stream calls at a tenth of their host cost"). A small
# step is bound by the host, so these add up to a few percent of it.
#
# `current` and `entered` go to torch's C functions directly where they exist and the stream is
# on the current device; anywhere else (an older torch, another device) they fall back to
# torch's own helpers, which do the same thing more slowly. `FAST = False` (or
# NBTOOLS_FAST_STREAMS=0 in the environment) turns the shortcut off, so the two can be timed
# against each other.
FAST = os.environ.get("NBTOOLS_FAST_STREAMS", "1") != "0"
_C = torch._C
_get_stream = getattr(_C, "_cuda_getCurrentStream", None)
c_set_stream = getattr(_C, "_cuda_setStream", None)
_get_device = getattr(_C, "_cuda_getDevice", None)
fast_ready = None         # None: not asked yet; True: the C calls answered as torch's own did


def fast_ok(index: int) -> bool:
    """Once: initialise CUDA through torch's helper and confirm the C calls take the
    arguments they are given here and agree with it (torch versions differ)."""
    global fast_ready
    if fast_ready is not None:
        return fast_ready
    if None in (_get_stream, c_set_stream, _get_device):
        fast_ready = False
        return False
    try:
        ours = torch.cuda.current_stream(index)
        sid, dev, kind = _get_stream(index)
        fast_ready = (sid, dev, kind) == (ours.stream_id, ours.device_index, ours.device_type)
        if fast_ready and _get_device() == index:     # (sets the stream it is already on)
            c_set_stream(stream_id=sid, device_index=dev, device_type=kind)
    except (RuntimeError, TypeError, AttributeError, ValueError):
        fast_ready = False
    return fast_ready


def current(device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for a ``torch.device`` with an index (what
    :func:`nbtools.devices.resolve_device` gives) or a device index."""
    index = device.index if isinstance(device, torch.device) else device
    if FAST and index is not None and fast_ok(index):
        sid, dev, kind = _get_stream(index)
        return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)
    return torch.cuda.current_stream(device)


@contextlib.contextmanager
def entered(stream: torch.cuda.Stream):
    """``with torch.cuda.stream(stream)``: work queued inside goes to ``stream``; the current
    stream is the one before again afterwards."""
    index = stream.device_index
    if not (FAST and fast_ok(index) and _get_device() == index):
        with torch.cuda.stream(stream):
            yield
        return
    sid, dev, kind = _get_stream(index)
    c_set_stream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        yield
    finally:
        c_set_stream(stream_id=sid, device_index=dev, device_type=kind)


def record(event: torch.cuda.Event, device) -> None:
    """``event.record()`` on ``device``'s current stream."""
    event.record(current(device))
