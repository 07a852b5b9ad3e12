"""Host memory that the GPU reads and writes directly.

``torch.empty(..., pin_memory=True)`` rounds every allocation up to a power of two (a 5.1 GB
table pins 8 GiB) and is slow to allocate. nbtools instead allocates plainly, touches every page
(zero fill), and registers the pages in place with ``cudaHostRegister``: exact in size, and
undone with ``cudaHostUnregister`` when the memory is closed or collected.

A registered buffer has a *zero-copy CUDA view*: a CUDA tensor aliasing the same host bytes, so
``index_select`` / ``index_copy_`` on it are GPU kernels that read and write host RAM over PCIe.
Without CUDA the same objects hold ordinary memory and report ``pinned=False``; the "CUDA view"
is then the host tensor itself, so every caller runs unchanged on the CPU.

Every pinned byte nbtools holds is counted (:func:`pinned_bytes`), as are the bytes its tables
move between host and GPU (:func:`transfer_counters`), and what their GPU caches of hot rows spare
the link (:func:`cache_counters`): neither NVML nor /proc can see them.

One mechanism pins: :func:`page_aligned` allocates (pages of its own, so two registrations never
share a page), and a registry keyed by address range registers each range once, shares it among
its holders (:class:`HostTensor`, :class:`pin_tensor`, the loader) and unregisters it when the
last one lets go.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from . import NbtoolsError
from .devices import cuda_ok, hold_host, memlock_limit, release_host
from .units import human_bytes

_CUDA_HOST_REGISTER_PORTABLE = 1   # usable from every CUDA context
_CUDA_HOST_REGISTER_MAPPED = 2     # map into the device address space (zero-copy)

_PAGE = mmap.PAGESIZE
_deferred = []             # ranges let go inside a CUDA graph capture, unregistered later
_lock = threading.RLock()   # re-entrant: a finalizer (release) may run in a GC pass while held
# (address, bytes) -> its registration, for every range nbtools has registered and still holds:
# the one place pinned memory is counted
_regions: dict[tuple[int, int], "_Registration"] = {}
_counters = {"h2d_bytes": 0, "d2h_bytes": 0}
_cache_counters = {"lookup_rows": 0, "hit_rows": 0, "saved_bytes": 0}


class PinningError(NbtoolsError, RuntimeError):
    """cudaHostRegister refused memory (container limits, memlock, driver)."""


def pinned_bytes() -> int:
    """Bytes of host memory that nbtools has registered with CUDA right now.

    >>> pinned_bytes() >= 0
    True
    """
    with _lock:
        return sum(r.nbytes for r in _regions.values())


def pinned_regions() -> list[tuple[str, int]]:
    """``(name, bytes)`` for each registered region, largest first."""
    with _lock:
        return sorted(((r.name, r.nbytes) for r in _regions.values()), key=lambda r: -r[1])


def transfer_counters() -> dict:
    """Cumulative bytes nbtools itself moved host->GPU and GPU->host (a copy of the counters).

    >>> sorted(transfer_counters())
    ['d2h_bytes', 'h2d_bytes']
    """
    return dict(_counters)


def count_transfer(h2d: int = 0, d2h: int = 0) -> None:
    """Add to the transfer counters (called by tables, loaders and checkpoints)."""
    _counters["h2d_bytes"] += int(h2d)
    _counters["d2h_bytes"] += int(d2h)


def cache_counters() -> dict:
    """Cumulative counts of every table's GPU cache of hot rows (a copy): unique rows looked up
    in training, how many of them were cache hits, and the PCIe bytes the cache saved (a hit
    is neither read nor written over PCIe; admissions and write-backs cost their rows). All
    zero while no table has a cache.

    >>> sorted(cache_counters())
    ['hit_rows', 'lookup_rows', 'saved_bytes']
    """
    return dict(_cache_counters)


def count_cache(lookups: int = 0, hits: int = 0, saved_bytes: int = 0) -> None:
    """Add one table's cache readings since its last call (called by tables at each optimizer
    step; ``saved_bytes`` may be negative while a cache fills)."""
    _cache_counters["lookup_rows"] += int(lookups)
    _cache_counters["hit_rows"] += int(hits)
    _cache_counters["saved_bytes"] += int(saved_bytes)


def _clear_cuda_error() -> None:
    """Reset CUDA's last-error slot after a refused registration, so that the next kernel launch
    torch checks does not report it. torch's cudart binding has no ``cudaGetLastError``; the
    runtime library torch loaded is found in this process's maps and called through ctypes."""
    fn = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if fn is not None:
        fn()
        return
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
        for path in sorted(paths):
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError):
        pass                                        # not Linux, or no runtime found: nothing to clear


def _check(err, what: str, nbytes: int) -> None:
    code = int(err)
    if code == 0:
        return
    _clear_cuda_error()
    limit = memlock_limit()
    raise PinningError(
        f"{what} failed for {human_bytes(nbytes)} (cudaError {code}). The container or driver "
        f"refused to lock this memory (memlock limit: {human_bytes(limit) if limit else 'unlimited'}). "
        "Pass pin=False to use ordinary pageable memory (slower transfers, same results), or free "
        "other pinned memory first.")


def cuda_register(ptr: int, nbytes: int) -> None:
    """cudaHostRegister of ``[ptr, ptr + nbytes)`` (portable, mapped); PinningError when CUDA
    refuses. The one call that locks pages (tests replace it, with :func:`cuda_unregister`,
    to record what would be registered)."""
    err = torch.cuda.cudart().cudaHostRegister(
        ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED)
    _check(err, "cudaHostRegister", nbytes)


class _Registration:
    """One range registered with CUDA, shared by its holders; unregistered when the last one lets
    go (each holder's ``weakref.finalize`` calls :meth:`release` once)."""

    def __init__(self, ptr: int, nbytes: int, name: str):
        self.ptr, self.nbytes, self.name = ptr, nbytes, name
        self.holders = 0

    def release(self) -> None:
        with _lock:
            self.holders -= 1
            if self.holders > 0:
                return
            _regions.pop((self.ptr, self.nbytes), None)
            if capturing():
                # a garbage collection inside a CUDA graph capture: synchronising or
                # unregistering now would invalidate the capture and, failing, leave the range
                # registered after its memory is freed (the next registration of those
                # addresses then fails). Done before the next registration instead.
                _deferred.append(self.ptr)
                return
        _unregister_quietly(self.ptr)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (then a let-go range is unregistered
    later, before the next registration); False without CUDA."""
    try:
        return cuda_ok() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def _unregister_quietly(ptr: int) -> None:
    try:
        cuda_unregister(ptr)
    except Exception:     # interpreter shutdown: the CUDA context may already be gone
        pass


def _flush_deferred() -> None:
    """Unregister the ranges let go during a capture (called with ``_lock`` held)."""
    while _deferred:
        _unregister_quietly(_deferred.pop())


def cuda_unregister(ptr: int) -> None:
    """cudaHostUnregister of the range registered at ``ptr``, after a device sync (no kernel may
    still use its pages)."""
    torch.cuda.synchronize()     # no kernel may still read or write these pages
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _hold(owner, ptr: int, nbytes: int, name: str) -> weakref.finalize:
    """Keep ``[ptr, ptr + nbytes)`` registered with CUDA while ``owner`` lives: register it, or
    share the registration nbtools already holds for exactly this range (a second
    cudaHostRegister of it would fail). Returns the finalizer that lets go early (idempotent)."""
    with _lock:   # held while registering: two holders of one range must not both register it
        if _deferred and not capturing():
            _flush_deferred()
        reg = _regions.get((ptr, nbytes))
        if reg is None:
            cuda_register(ptr, nbytes)
            reg = _regions[(ptr, nbytes)] = _Registration(ptr, nbytes, name)
        reg.holders += 1
    return weakref.finalize(owner, reg.release)


def _held(ptr: int, nbytes: int) -> bool:
    with _lock:
        return (ptr, nbytes) in _regions


def page_aligned(nbytes: int) -> np.ndarray:
    """Uninitialised uint8 host memory: ``nbytes`` rounded up to whole pages of its own.

    cudaHostRegister locks whole pages, so memory that will be registered starts on a page and
    gets its pages to itself: two registrations then never share one. numpy owns the bytes so
    that their release can be hooked (``weakref.finalize`` on the array fires before numpy frees
    them).

    >>> a = page_aligned(100)
    >>> a.ctypes.data % mmap.PAGESIZE, a.nbytes == mmap.PAGESIZE
    (0, True)
    """
    padded = -(-max(nbytes, 1) // _PAGE) * _PAGE
    whole = np.empty(padded + _PAGE, dtype=np.uint8)
    start = -whole.ctypes.data % _PAGE
    return whole[start:start + padded]      # a view: keeps `whole` alive


def whole_range_pinned(t: torch.Tensor) -> bool:
    """Whether the first and the last byte of ``t`` are in page-locked memory.

    ``Tensor.is_pinned()`` only looks at the first byte of the storage, which may sit on a page
    locked for a neighbouring allocation, or outside the view ``t``.
    """
    first = t.data_ptr()
    last = first + t.numel() * t.element_size() - 1
    return all(torch.frombuffer((ctypes.c_uint8 * 1).from_address(a), dtype=torch.uint8).is_pinned()
               for a in (first, last))


class _CudaArrayView:
    """Exposes a registered host range through ``__cuda_array_interface__`` (as bytes).

    Holding ``owner`` keeps the host memory alive for as long as a CUDA view of it exists.
    """

    def __init__(self, ptr: int, nbytes: int, owner):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None}


def cuda_alias(host: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """A CUDA tensor aliasing the registered, contiguous host tensor ``host`` (zero-copy)."""
    if not host.is_contiguous():
        raise ValueError("cuda_alias needs a contiguous host tensor")
    device = device or torch.device("cuda", torch.cuda.current_device())
    nbytes = host.numel() * host.element_size()
    with torch.cuda.device(device):   # the view must be made with its device current
        raw = torch.as_tensor(_CudaArrayView(host.data_ptr(), nbytes, host), device=device)
    return raw.view(host.dtype).view(host.shape)


class HostTensor:
    """A host tensor, registered with CUDA when it can be, plus its zero-copy CUDA view.

    Args:
        shape: tensor shape.
        dtype: torch dtype.
        pin: register with CUDA (ignored without CUDA, where ``pinned`` is False).
        name: label for :func:`pinned_regions` and error messages.
        device: CUDA device the zero-copy view lives on (default: current).

    The memory is zero-filled (which also touches every page before registering it).

    >>> h = HostTensor((4, 3), torch.float32, name="demo")
    >>> h.tensor.shape, h.tensor.sum().item()
    (torch.Size([4, 3]), 0.0)
    >>> h.view().device.type in ("cpu", "cuda")
    True
    >>> h.close()
    """

    def __init__(self, shape, dtype=torch.float32, *, pin: bool = True, name: str = "tensor",
                 device=None):
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"HostTensor shape must be non-negative, got {shape}")
        self.name = name
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        # pages of its own; unregistered exactly when numpy frees them (the tensor keeps the
        # array alive), or earlier by close()
        hold_host(self.nbytes, f"{name!r} ({human_bytes(self.nbytes)})")
        try:
            self._raw = page_aligned(self.nbytes)
        except BaseException:
            release_host(self.nbytes)
            raise
        weakref.finalize(self._raw, release_host, self.nbytes)
        self.tensor = torch.from_numpy(self._raw)[: self.nbytes].view(dtype).view(shape)
        self.tensor.zero_()   # touch every page (multi-threaded memset) before pinning
        self.pinned = False
        self._view = None
        self._device = device
        if pin and cuda_ok() and self.nbytes > 0:
            self._finalizer = _hold(self._raw, self._raw.ctypes.data, self._raw.nbytes, name)
            self.pinned = True

    def view(self) -> torch.Tensor:
        """The tensor the compute device indexes: the zero-copy CUDA alias when pinned, else
        the host tensor itself."""
        if not self.pinned:
            return self.tensor
        if self._view is None:
            self._view = cuda_alias(self.tensor, self._device)
        return self._view

    def close(self) -> None:
        """Unregister now. The host tensor stays valid as ordinary memory; CUDA views made
        earlier must not be used after this."""
        self._view = None
        if self.pinned:
            self._finalizer()
            self.pinned = False

    def __reduce__(self):
        # A copy (deepcopy, pickle) gets memory of its own, registered as this one is: the
        # registration itself cannot be copied.
        return _rebuild_host_tensor, (tuple(self.tensor.shape), self.tensor.dtype, self.pinned,
                                      self.name, self._device, self.tensor)

    def __repr__(self):
        return (f"HostTensor(name={self.name!r}, shape={tuple(self.tensor.shape)}, "
                f"dtype={self.tensor.dtype}, bytes={self.nbytes}, pinned={self.pinned})")


def _rebuild_host_tensor(shape, dtype, pin, name, device, data) -> HostTensor:
    host = HostTensor(shape, dtype, pin=pin, name=name, device=device)
    host.tensor.copy_(data)
    return host


def host_zeros(shape, dtype=torch.float32, *, pin: bool = True, name: str = "tensor") -> HostTensor:
    """Allocate a zero-filled :class:`HostTensor` (pinned when CUDA is there)."""
    return HostTensor(shape, dtype, pin=pin, name=name)


host_empty = host_zeros   # pages must be touched before pinning anyway, so "empty" is zeros


class pin_tensor:
    """Register an existing contiguous CPU tensor in place, without copying it.

    Keeps ``tensor`` alive; :meth:`close` (or collection of this object) lets go of the
    registration, which is undone once no other holder of the same range (another
    :class:`pin_tensor`, a second loader over the same tensor) remains. Memory pinned by torch
    (``pin_memory()``) or by the caller is used as it is. Without CUDA this does nothing and
    ``pinned`` is False.

    >>> t = torch.arange(6.0)
    >>> p = pin_tensor(t, name="data")
    >>> p.tensor is t
    True
    >>> p.close()
    """

    def __init__(self, tensor: torch.Tensor, *, name: str = "tensor"):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pin_tensor takes a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"pin_tensor needs a contiguous CPU tensor, got device={tensor.device}, "
                             f"contiguous={tensor.is_contiguous()}; call .contiguous().cpu() first")
        self.tensor = tensor
        self.name = name
        self.nbytes = tensor.numel() * tensor.element_size()
        self.pinned = False
        self._view = None
        if cuda_ok() and self.nbytes > 0:
            ptr = tensor.data_ptr()
            if not _held(ptr, self.nbytes) and whole_range_pinned(tensor):
                self._finalizer = lambda: None   # pinned by torch (pin_memory()) or the caller
            else:
                self._finalizer = _hold(self, ptr, self.nbytes, name)
            self.pinned = True

    def view(self) -> torch.Tensor:
        """Zero-copy CUDA alias (or the CPU tensor itself without pinning)."""
        if not self.pinned:
            return self.tensor
        if self._view is None:
            self._view = cuda_alias(self.tensor)
        return self._view

    def close(self) -> None:
        self._view = None
        if self.pinned:
            self._finalizer()
            self.pinned = False

    def __reduce__(self):
        # A copy registers its own copy of the memory (the registration cannot be copied).
        return _repin, (self.tensor, self.pinned, self.name)


def _repin(tensor, pinned: bool, name: str):
    held = pin_tensor(tensor.clone() if pinned else tensor, name=name)
    return held


def probe_pinning() -> str:
    """Try to register a small buffer; say whether zero-copy pinning works here."""
    try:
        h = HostTensor((1024,), torch.float32, name="probe")
        ok = h.pinned
        if ok:
            v = h.view()
            v.fill_(1.0)
            torch.cuda.synchronize()
            ok = bool(h.tensor.sum().item() == 1024)
        h.close()
        return "zero-copy ok (cudaHostRegister + mapped view)" if ok else "registration refused"
    except Exception as e:   # report, never crash describe()
        return f"failed: {e}"


# --- row gather / scatter ---------------------------------------------------------------------
# Measured (benchmarks/RESULTS.md): zero-copy gathers are bound by the number of row
# requests and page translations, not by bytes; 16-byte loads bought nothing over index_select.
# What helps is fewer, longer rows: tables keep [weight | optimizer state] interleaved per row.

def gather_rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, idx)``; ``src`` may be a zero-copy view (rows then cross PCIe)."""
    return src.index_select(0, idx)


def scatter_rows(dst: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst.index_copy_(0, idx, rows)``; ``dst`` may be a zero-copy view."""
    dst.index_copy_(0, idx, rows)


_MALLOC_TUNED = False


def keep_freed_memory_small() -> None:
    """Have glibc's malloc give every block of 1 MiB or more its own mapping, handed back to the
    OS when freed (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``). Its default raises that threshold up
    to 32 MiB as blocks are freed, and then keeps the freed memory of a disk table's step-sized
    arrays (evicted rows' copies, read buffers) in each thread's pool: 0.2-0.6 GiB more RSS
    after a few hundred steps, measured. Once per process, by the first disk table; not where
    ``MALLOC_MMAP_THRESHOLD_`` is set (the user's own choice), nor with
    ``NBTOOLS_MALLOC_TUNE=0``, nor off glibc."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or os.environ.get("NBTOOLS_MALLOC_TUNE") == "0":
        return
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt if hasattr(libc, "gnu_get_libc_version") else None   # glibc only
    except OSError:
        return
    if mallopt is None:
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt(-3, 1 << 20)                                           # M_MMAP_THRESHOLD
