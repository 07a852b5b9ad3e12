"""The machine check: host<->GPU copy and zero-copy gather rates against the link's maximum."""
from __future__ import annotations

from .backends import LINK_KEYS, SystemBackend, safe_reading


def measure_bandwidth(nbytes: int = 256 << 20, *, row_bytes: int = 512, device="auto",
                      repeat: int = 5, progress=None) -> dict:
    """Host<->GPU bandwidth of this machine: pinned and pageable copies both ways, and the
    zero-copy gather rate of random ``row_bytes`` rows from pinned memory (what an offloaded
    table does every step), in bytes/s, with the link's theoretical maximum.

    Without CUDA every rate is N/A. ``progress(name, results_so_far)`` is called before each
    measurement.

    >>> r = measure_bandwidth(1 << 20, device="cpu")
    >>> r["pinned_h2d_bytes_per_s"] is None, r["note"]
    (True, 'no CUDA device: host<->GPU bandwidth is N/A')
    """
    import torch

    from ..devices import resolve_device
    from ..hostmem import HostTensor, gather_rows

    names = ("pinned_h2d", "pinned_d2h", "pageable_h2d", "pageable_d2h", "zero_copy_gather")
    out = {f"{n}_bytes_per_s": None for n in names}
    out.update(nbytes=int(nbytes), row_bytes=int(row_bytes), link_bytes_per_s=None, note="")
    dev = resolve_device(device)
    if dev.type != "cuda":
        out["note"] = "no CUDA device: host<->GPU bandwidth is N/A"
        return out
    backend = SystemBackend(dev)
    out["link_bytes_per_s"] = safe_reading(backend.link, LINK_KEYS)["link_bytes_per_s"]
    backend.close()
    dim = max(1, row_bytes // 4)
    rows = max(1, nbytes // (dim * 4))
    host = None
    try:
        host = HostTensor((rows, dim), torch.float32, name="bandwidth-check", device=dev)
        flat = host.tensor.view(-1).view(torch.uint8)
        pageable = torch.zeros_like(flat)     # touched, so page faults are not timed
        gpu = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)

        def timed(fn, moved):
            fn()                                    # warm-up
            torch.cuda.synchronize(dev)             # note: a sync point, fine in a one-off check
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            return moved * repeat / (start.elapsed_time(end) / 1e3)

        nb = flat.numel()
        tests = {
            "pinned_h2d": (lambda: gpu.copy_(flat, non_blocking=True), nb),
            "pinned_d2h": (lambda: flat.copy_(gpu, non_blocking=True), nb),
            "pageable_h2d": (lambda: gpu.copy_(pageable), nb),
            "pageable_d2h": (lambda: pageable.copy_(gpu), nb),
        }
        if host.pinned:
            view = host.view()
            idx = torch.randint(0, rows, (max(1, rows // 4),), device=dev)
            tests["zero_copy_gather"] = (lambda: gather_rows(view, idx), idx.numel() * dim * 4)
        for name, (fn, moved) in tests.items():
            if progress is not None:
                progress(name, dict(out))
            out[f"{name}_bytes_per_s"] = timed(fn, moved)
        if not host.pinned:
            out["note"] = "memory could not be pinned here: pinned and zero-copy rates are N/A"
            out["pinned_h2d_bytes_per_s"] = out["pinned_d2h_bytes_per_s"] = None
    except Exception as e:   # out of memory, pinning refused: report, never crash
        out["note"] = f"measurement failed: {type(e).__name__}: {e}"
    finally:
        if host is not None:
            host.close()
    return out
