"""from_pretrained of a memory-mapped .npy file into a host and a disk table: GB/s against the
disk's own sequential read, and peak RSS growth against the table's bytes + 64 MiB.

The target: a 20 GB .npy into a host or a disk table with peak RSS growth <= the table's own RAM
+ 64 MiB, and a throughput figure against the disk's sequential read.

Each load is preceded by its own `dd` read of the source (O_DIRECT, 64 MiB blocks): the disk's
rate drifts from minute to minute on a shared VM, so each ratio uses the probe taken just before
it. The source's pages are dropped from the page cache before each load and each probe, so
every read meets the disk. Rows printed at the end (GB = 1e9 bytes):
  dd read           the source file, O_DIRECT: the disk's sequential read rate
  dd write          2 GB (at most) with O_DIRECT: its sequential write rate
  host / disk load  OffloadedEmbedding.from_pretrained(path, placement=...): source bytes / s,
                    and without the time an empty table of that shape takes to build
                    (allocation, pinning, its N(0, 1) draw), measured after the load
  RSS growth        peak resident memory during the load minus before it (VmHWM, reset with
                    /proc/self/clear_refs; else a 5 ms sampler), against table.ram_bytes.
                    On a GPU the process's CUDA context (and the pinned allocator) is made
                    first, and its own RSS reported apart ("CUDA context"): a training process
                    has it anyway, and the first pinned table of a process would otherwise be
                    charged with the driver's ~100 MiB
  page cache        the largest growth of the page cache (Cached in /proc/meminfo) during it

    python benchmarks/bench_pretrained.py --size-gb 20 --dir /data/tmp    # the target
    python benchmarks/bench_pretrained.py --quick                         # 50 MB
    python benchmarks/bench_pretrained.py --out artifacts/gpu             # suite: 8 GB, ~1 min
"""
from __future__ import annotations

import gc
import os
import re
import shutil
import sys
import tempfile
import threading
import time

import harness
import numpy as np
import torch
from harness import dd

import nbtools
from nbtools.pretrained import EXTRA_BYTES

GB = 1e9


def status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) << 10


def cached_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(re.search(r"^Cached:\s+(\d+)", f.read(), re.M).group(1)) << 10


def drop_file_cache(path: str) -> None:
    """The file's clean pages leave the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Peak:
    """Peak RSS and page-cache growth while a block runs: VmHWM reset through clear_refs where
    the kernel allows it, and a sampler thread every 5 ms either way."""

    def __enter__(self):
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.rss0, self.cache0 = status("VmRSS"), cached_bytes()
        self.rss, self.cache = self.rss0, self.cache0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.rss = max(self.rss, status("VmRSS"))
            self.cache = max(self.cache, cached_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self.hwm:
            self.rss = max(self.rss, status("VmHWM"))
        self.rss_growth = self.rss - self.rss0
        self.cache_growth = self.cache - self.cache0


def write_source(path: str, rows: int, dim: int) -> None:
    """A float32 .npy of ``rows x dim``, written with plain writes (never mapped), fsynced and
    dropped from the page cache."""
    np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))._mmap.close()
    offset = np.load(path, mmap_mode="r").offset
    block = np.random.default_rng(0).standard_normal((max(1, (64 << 20) // (dim * 4)), dim),
                                                     dtype=np.float32)
    fd = os.open(path, os.O_WRONLY)
    try:
        for i, a in enumerate(range(0, rows, len(block))):
            part = block[: min(len(block), rows - a)] + np.float32(i)   # every chunk differs
            os.pwrite(fd, memoryview(part).cast("B"), offset + a * dim * 4)
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_file_cache(path)


def cuda_context_rss(device) -> int | None:
    """RSS taken by creating the CUDA context and pinning a first page (None on CPU)."""
    if device.type != "cuda":
        return None
    gc.collect()
    before = status("VmRSS")
    torch.zeros(1, device=device)
    torch.empty(1, pin_memory=True)
    torch.cuda.synchronize(device)
    return status("VmRSS") - before


def create_seconds(rows: int, dim: int, placement: str, device, folder: str) -> float:
    """Seconds to build an empty table of that shape there (allocation, pinning, N(0, 1)
    rows): the part of a load that is not the copy."""
    t0 = time.perf_counter()
    table = nbtools.OffloadedEmbedding(rows, dim, device=device, placement=placement,
                                       disk_dir=folder)
    seconds = time.perf_counter() - t0
    table.close()
    del table
    gc.collect()
    return seconds


def load(path: str, placement: str, device, folder: str) -> dict:
    drop_file_cache(path)
    with Peak() as peak:
        t0 = time.perf_counter()
        table = nbtools.OffloadedEmbedding.from_pretrained(
            path, device=device, placement=placement, disk_dir=folder, progress=False)
        seconds = time.perf_counter() - t0
    src = np.load(path, mmap_mode="r")
    picks = np.random.default_rng(1).integers(0, src.shape[0], 64)
    exact = bool(torch.equal(table.weight[torch.from_numpy(picks)].cpu().float(),
                             torch.from_numpy(np.array(src[picks]))))
    out = {"seconds": seconds, "bytes_per_s": src.nbytes / seconds, "exact": exact,
           "rss_growth_bytes": peak.rss_growth, "table_ram_bytes": table.ram_bytes,
           "table_bytes": table.nbytes, "page_cache_growth_bytes": peak.cache_growth,
           "peak_from": "VmHWM" if peak.hwm else "sampler", "repr": repr(table)}
    out["within_target"] = peak.rss_growth <= table.ram_bytes + EXTRA_BYTES
    table.close()
    del table
    gc.collect()
    return out


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--size-gb", type=float, default=8.0, help="source size in GB (default 8; "
                    "the target is 20: it needs 2x that on disk, 1x in RAM)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--placements", default="host,disk")
    ap.add_argument("--dir", default=None, help="where the source and the disk table go "
                    "(default: a temp dir under the system's temporary folder)")
    args = ap.parse_args()
    size = (0.05 if args.quick else args.size_gb) * GB
    rows = max(1, int(size) // (args.dim * 4))
    device = harness.setup(args)
    placements = args.placements.split(",")
    root = args.dir or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="nbtools-pretrained-", dir=root)
    need = rows * args.dim * 4 * (1 + ("disk" in placements))
    free = shutil.disk_usage(work).free
    if need > 0.95 * free:
        shutil.rmtree(work, ignore_errors=True)
        sys.exit(f"bench_pretrained: {need / GB:.1f} GB needed in {root}, {free / GB:.1f} GB "
                 "free: pass a smaller --size-gb or another --dir")
    path = os.path.join(work, "source.npy")
    res = {"device": str(device), "rows": rows, "dim": args.dim, "dir": root,
           "torch": torch.__version__, "command": " ".join(sys.argv)}
    try:
        res["cuda_context_rss_bytes"] = ctx = cuda_context_rss(device)
        if ctx is not None:
            print(f"CUDA context: RSS +{ctx / 2**20:,.0f} MiB (before any load)", flush=True)
        t0 = time.perf_counter()
        write_source(path, rows, args.dim)
        res["source_bytes"] = os.path.getsize(path)
        print(f"source {rows:,} x {args.dim} float32 = {res['source_bytes'] / GB:.2f} GB written "
              f"in {time.perf_counter() - t0:.1f} s; device {device}", flush=True)
        ddw = os.path.join(work, "dd-write.tmp")
        res["dd_write_bytes_per_s"] = dd(["if=/dev/zero", f"of={ddw}", "bs=64M",
                                          f"count={max(1, min(int(2 * GB), int(size)) >> 26)}",
                                          "oflag=direct"])
        os.remove(ddw)
        for placement in placements:
            drop_file_cache(path)
            rate = dd([f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"])
            r = load(path, placement, device, os.path.join(work, "tables"))
            r["dd_read_bytes_per_s"] = rate
            r["x_dd_read"] = r["bytes_per_s"] / rate
            r["create_s"] = create_seconds(rows, args.dim, placement, device,
                                           os.path.join(work, "tables"))
            copy_s = r["seconds"] - r["create_s"]       # (None: building took the whole load)
            r["copy_bytes_per_s"] = res["source_bytes"] / copy_s if copy_s > 0.1 * r["seconds"] \
                else None
            res[placement] = r
            print(f"{placement}: {r['bytes_per_s'] / GB:.2f} GB/s = {r['x_dd_read']:.2f}x dd read "
                  f"({rate / GB:.2f} GB/s); RSS +{r['rss_growth_bytes'] / 2**20:,.0f} MiB for "
                  f"{r['table_ram_bytes'] / 2**20:,.0f} MiB of table RAM; page cache "
                  f"+{r['page_cache_growth_bytes'] / 2**20:,.0f} MiB; exact={r['exact']}",
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'what':<34}{'value':>16}   (GB = 1e9 B; {res['source_bytes'] / GB:.1f} GB source)")
    print(f"{'dd write (O_DIRECT)':<34}{res['dd_write_bytes_per_s'] / GB:>11.2f} GB/s")
    if res["cuda_context_rss_bytes"] is not None:
        print(f"{'CUDA context (made first), RSS':<34}"
              f"{res['cuda_context_rss_bytes'] / 2**20:>11.0f} MiB   (not charged to the loads)")
    for placement in placements:
        r = res[placement]
        print(f"{'dd read before ' + placement:<34}{r['dd_read_bytes_per_s'] / GB:>11.2f} GB/s")
        print(f"{placement + ' load':<34}{r['bytes_per_s'] / GB:>11.2f} GB/s"
              f"   {r['x_dd_read']:.2f}x dd read, {r['seconds']:.1f} s")
        alone = r["copy_bytes_per_s"]
        print(f"{'  of which creating the table':<34}{r['create_s']:>13.1f} s"
              + (f"   (the copy alone: {alone / GB:.2f} GB/s, "
                 f"{alone / r['dd_read_bytes_per_s']:.2f}x dd read)" if alone else
                 "   (built in another process it takes as long as this load: not separable)"))
        print(f"{'  RSS growth - table RAM':<34}"
              f"{(r['rss_growth_bytes'] - r['table_ram_bytes']) / 2**20:>11.0f} MiB"
              f"   (limit {EXTRA_BYTES >> 20} MiB: {'met' if r['within_target'] else 'NOT met'}; "
              f"peak from {r['peak_from']})")
        print(f"{'  page cache growth':<34}{r['page_cache_growth_bytes'] / 2**20:>11.0f} MiB")
    line = "; ".join(f"{p} {res[p]['bytes_per_s'] / GB:.2f} GB/s ({res[p]['x_dd_read']:.2f}x dd "
                     f"read), RSS - table {(res[p]['rss_growth_bytes'] - res[p]['table_ram_bytes']) / 2**20:.0f} MiB"
                     f" {'ok' if res[p]['within_target'] and res[p]['exact'] else 'FAIL'}"
                     for p in placements)
    print(f"summary pretrained ({res['source_bytes'] / GB:.1f} GB .npy, {device}): {line}")
    harness.save(args, "pretrained.json", res)


if __name__ == "__main__":
    main()
