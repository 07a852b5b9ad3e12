"""How fast can Python read random rows from this machine's local disk, and what does each way
leave in the page cache? The disk tier (nbtools.disk over nbtools.rowfile) reads a step's missed
rows as a batch of unique, sorted, uniformly random rows; this times that access with each engine.

  sequential      write then read a file of --gib GiB in 4 MiB requests (RowFile, O_DIRECT);
                  the write fills the file, which matters: preallocated blocks that were never
                  written read as zeros without touching the disk
  rowfile-direct  RowFile, O_DIRECT, at 1, 4, 16, 32 and 64 threads (Python threads in preadv);
                  at 512 B also a small batch of 1,024 rows (per-call overhead)
  rowfile-buf     RowFile, buffered (POSIX_FADV_RANDOM): as shipped (pages dropped after each
                  call) and with auto_drop=False, then drop_cache()
  kvikio          KvikIO's C++ thread pool, one CuFile.pread per row into host memory (all in
                  flight, then waited), at 16 and 64 threads, and with auto_direct_io_read
  torch-mmap      torch.from_file(shared=True) viewed as rows + index_select (torch threads):
                  the memory-map way, page faults and read-ahead included
  io_uring        the `liburing` PyPI binding (Python + Zig over liburing), one ring, one thread,
                  O_DIRECT reads, queue depths 64 and 256. On the CPU machine where this script
                  was written it installs cleanly but dies with SIGILL when a Ring is made (its
                  build needs a newer CPU), so it is probed in a subprocess first and skipped
                  with the reason when the probe fails.
  writes          random row writes, 512 B and 4 KiB: O_DIRECT against the buffered policies
                  (as shipped: DONTNEED after each call + fdatasync per 64 MiB; fdatasync after
                  every call; no dropping)

Batches: 65,536 rows of 512 B, 43,690 of 1,536 B, 16,384 of 4 KiB, 4,096 of 16 KiB (32-64 MiB, a
training step's misses at most; --quick: an eighth). Each cell repeats fresh batches for --seconds (timing only the
read calls) after one untimed batch. Page cache: bytes of the file resident afterwards (mincore),
and the change of /proc/meminfo Cached and of the cgroup's page-cache counter over the cell; the
file's pages are dropped before each cell.

    # on the GPU machine (no network): the KvikIO and liburing wheels travel in .whl/io/, a folder
    # of their own: their nvidia/ namespace (libcufile) on PYTHONPATH breaks torch's CUDA calls
    # (cudaHostRegister, graph capture), so the test suite never installs them
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site-io .whl/io/*.whl && export PYTHONPATH=/tmp/site-io
    python3 benchmarks/experiments/disk_io.py --dir /tmp/nbtools-disk --gib 8 --out disk_io.json
    python3 benchmarks/experiments/disk_io.py --dir /tmp/nbtools-disk --gib 1 --quick   # < 60 s

KvikIO loads libcufile through cuda-pathfinder, which looks in site-packages only, not in
PYTHONPATH folders: the script preloads ``nvidia/cu13/lib/libcufile.so.0`` from sys.path first.
KvikIO needs libcuda (a GPU driver) even for host buffers; without it that engine is skipped.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import rowfile  # noqa: E402
from nbtools.meters.memory import file_cache_bytes  # noqa: E402
from nbtools.rowfile import RowFile  # noqa: E402

SIZES = (512, 1536, 4096, 16384)
BATCH_BYTES = 64 << 20
MAX_BATCH = 65_536


# --- page cache readings ----------------------------------------------------------------------
def meminfo_cached() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_file_bytes() -> int | None:
    """Page cache charged to this process's cgroup (v2 memory.stat 'file', v1 'cache')."""
    for path, key in (("/sys/fs/cgroup/memory.stat", "file"),
                      ("/sys/fs/cgroup/memory/memory.stat", "cache")):
        try:
            with open(path) as f:
                for line in f:
                    k, v = line.split()
                    if k == key:
                        return int(v)
        except (OSError, ValueError):
            continue
    return None


def cgroup_current() -> int | None:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            with open(path) as f:
                return int(f.read())
        except (OSError, ValueError):
            continue
    return None


def drop_file_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd) if os.access(path, os.W_OK) else None
        rowfile.fadvise(fd, "POSIX_FADV_DONTNEED")
    finally:
        os.close(fd)


class CacheProbe:
    """Page-cache readings before and after a cell."""

    def __init__(self, path):
        self.path = path
        drop_file_cache(path)
        self.meminfo, self.cgroup = meminfo_cached(), cgroup_file_bytes()

    def result(self) -> dict:
        def delta(now, then):
            return None if now is None or then is None else now - then
        return {"file_resident (MiB)": _mib(file_cache_bytes(self.path)),
                "meminfo_cached_delta (MiB)": _mib(delta(meminfo_cached(), self.meminfo)),
                "cgroup_file_delta (MiB)": _mib(delta(cgroup_file_bytes(), self.cgroup))}


def _mib(n):
    return None if n is None else round(n / 2**20, 1)


# --- engines: each returns a callable reading rows `ids` (sorted, unique) of `size` bytes -----
def rowfile_view(path: str, size: int, threads: int, direct) -> RowFile:
    """The data file seen as rows of ``size`` bytes (a RowFile over the same bytes)."""
    total = os.path.getsize(path) - rowfile.HEADER
    meta = {"num_rows": total // size, "row_bytes": size, "stride": size,
            "data_offset": rowfile.HEADER}
    fd, block = rowfile._open(path, os.O_RDWR, direct, stride=size)
    if direct is True and not block:
        raise OSError("O_DIRECT refused")
    return RowFile(path, fd, meta, block, threads, True)


def time_reads(read, num_rows: int, size: int, batch: int, seconds: float, rng) -> dict:
    out = np.empty((batch, size), dtype=np.uint8)
    t0 = time.perf_counter()
    read(np.sort(rng.choice(num_rows, batch, replace=False)), out)      # warm-up, untimed
    first = time.perf_counter() - t0
    spent, rows, calls = 0.0, 0, 0
    while spent < seconds or calls < 2:
        ids = np.sort(rng.choice(num_rows, batch, replace=False))
        t0 = time.perf_counter()
        read(ids, out)
        spent += time.perf_counter() - t0
        rows += batch
        calls += 1
    return {"IOPS": round(rows / spent), "GB/s": round(rows * size / spent / 1e9, 3),
            "ms/batch": round(spent / calls * 1e3, 2), "first batch ms": round(first * 1e3, 1),
            "batch": batch, "batches": calls}


def check_reads(read, ref_read, num_rows, size, rng) -> None:
    """An engine must return what RowFile returns."""
    ids = np.sort(rng.choice(num_rows, 64, replace=False))
    a, b = np.zeros((64, size), np.uint8), np.ones((64, size), np.uint8)
    read(ids, a)
    ref_read(ids, b)
    if not np.array_equal(a, b):
        raise RuntimeError("returned different bytes than RowFile")


def load_kvikio():
    """Import kvikio, preloading libcufile from any sys.path folder (see the module notes)."""
    for folder in sys.path:
        for lib in glob.glob(os.path.join(folder or ".", "nvidia", "cu*", "lib", "libcufile.so.0")):
            try:
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
    import kvikio
    import kvikio.defaults
    return kvikio


def kvikio_reader(kvikio, path, size, threads, direct_read: bool):
    kvikio.defaults.set("num_threads", threads)
    kvikio.defaults.set("compat_mode", True)
    try:
        kvikio.defaults.set("auto_direct_io_read", direct_read)
    except Exception:
        if direct_read:
            raise
    f = kvikio.CuFile(path, "r")

    def read(ids, out):
        offs = (rowfile.HEADER + ids * size).tolist()
        futures = [f.pread(out[i], size, o) for i, o in enumerate(offs)]
        for fu in futures:
            fu.get()
    return read, f.close


def torch_reader(path, size):
    import torch
    total = os.path.getsize(path)
    raw = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    n = (total - rowfile.HEADER) // size
    rows = raw[rowfile.HEADER: rowfile.HEADER + n * size].view(n, size)

    def read(ids, out):
        torch.index_select(rows, 0, torch.from_numpy(ids), out=torch.from_numpy(out))

    def close():
        nonlocal raw, rows
        del raw, rows
        gc.collect()
    return read, close


def uring_probe(path) -> str | None:
    """None when liburing works here, else why not (run in a subprocess: it may die)."""
    try:
        import importlib.util
        if importlib.util.find_spec("liburing") is None:
            return "liburing is not installed (pip install liburing)"
    except Exception as e:
        return f"liburing: {e}"
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--uring-selftest", path],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0 or "ok" not in p.stdout:
        sig = f" (signal {-p.returncode})" if p.returncode < 0 else ""
        return f"liburing probe failed, exit {p.returncode}{sig}: {p.stderr.strip()[-300:]}"
    return None


def uring_reader(path, size, depth):
    import liburing as L
    ring = L.Ring()
    L.io_uring_queue_init(depth, ring)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    cqe = L.Cqe()
    bounce = rowfile._aligned(MAX_BATCH * size if size <= 1024 else BATCH_BYTES)
    mv = memoryview(bounce)

    def read(ids, out):
        k = len(ids)
        offs = (rowfile.HEADER + ids * size).tolist()
        nxt = done = inflight = 0
        while done < k:
            while inflight < depth and nxt < k:
                sqe = L.io_uring_get_sqe(ring)
                if sqe is None:
                    break
                L.io_uring_prep_read(sqe, fd, mv[nxt * size:(nxt + 1) * size], offs[nxt])
                sqe.user_data = nxt
                nxt += 1
                inflight += 1
            L.io_uring_submit(ring)
            L.io_uring_wait_cqe(ring, cqe)
            ready = L.io_uring_cq_ready(ring)
            for i in range(ready):
                c = cqe[i]
                if c.res != size:
                    raise OSError(f"io_uring read returned {c.res}")
            L.io_uring_cq_advance(ring, ready)
            done += ready
            inflight -= ready
        out[:] = bounce[: k * size].reshape(k, size)

    def close():
        L.io_uring_queue_exit(ring)
        os.close(fd)
    return read, close


def uring_selftest(path) -> None:
    """The io_uring engine on a few hundred rows, against RowFile (run in a subprocess)."""
    rng = np.random.default_rng(0)
    for size in (512, 4096):
        read, close = uring_reader(path, size, 64)
        with rowfile_view(path, size, 4, "auto") as ref:
            ids = np.sort(rng.choice(ref.num_rows, 300, replace=False))
            a, b = np.zeros((300, size), np.uint8), np.ones((300, size), np.uint8)
            read(ids, a)
            ref.read(ids, b)
        close()
        assert np.array_equal(a, b), "io_uring rows differ from RowFile's"
    print("ok")


# --- the measurements -------------------------------------------------------------------------
def sequential(path, gib: float, quick: bool) -> dict:
    chunk = 64 << 20
    n = max(1, int(gib * 2**30) // 4096)
    res = {}
    f = RowFile.create(path, n, 4096, {"what": "disk_io.py data"}, threads=8, overwrite=True)
    res["direct"] = f.direct
    src = np.random.default_rng(0).integers(0, 256, (chunk // 4096, 4096), dtype=np.uint8)
    rows = chunk // 4096
    t0 = time.perf_counter()
    for a in range(0, n, rows):
        f.write_range(a, src[: min(rows, n - a)])
    f.flush()
    res["write GB/s"] = round(n * 4096 / (time.perf_counter() - t0) / 1e9, 3)
    dst = np.empty_like(src)
    read_n = n if not quick else min(n, 4 * rows)
    t0 = time.perf_counter()
    for a in range(0, read_n, rows):
        f.read_range(a, dst[: min(rows, read_n - a)])
    res["read GB/s"] = round(read_n * 4096 / (time.perf_counter() - t0) / 1e9, 3)
    res["block"] = f.block
    f.close()
    return res


def random_reads(path, args, rng) -> tuple[list, list]:
    cells, notes = [], []
    threads_list = (1, 4, 16, 32, 64) if not args.quick else (1, 16, 64)
    kv, kv_why = None, None
    try:
        kv = load_kvikio()
    except Exception as e:
        kv_why = f"kvikio not usable: {type(e).__name__}: {str(e)[:200]}"
        notes.append(kv_why)
    uring_why = uring_probe(path)
    if uring_why:
        notes.append(f"io_uring skipped: {uring_why}")

    for size in SIZES:
        batch = min(MAX_BATCH, BATCH_BYTES // size) // (8 if args.quick else 1)
        ref = rowfile_view(path, size, 16, "auto")
        num_rows = ref.num_rows

        def cell(engine, make, batch=batch, check=True):
            probe = CacheProbe(path)
            try:
                read, close = make()
            except Exception as e:
                notes.append(f"{engine} {size} B: not run: {type(e).__name__}: {e}")
                return None
            try:
                if check:
                    check_reads(read, ref.read, num_rows, size, rng)
                r = time_reads(read, num_rows, size, batch, args.seconds, rng)
            except Exception as e:
                notes.append(f"{engine} {size} B: failed: {type(e).__name__}: {str(e)[:200]}")
                return None
            finally:
                close()
            r = {"engine": engine, "size": size, **r, **probe.result()}
            cells.append(r)
            print(f"  {engine:<32} {size:>6} B  {r['IOPS']:>9,} IOPS  {r['GB/s']:6.3f} GB/s  "
                  f"cache {r['file_resident (MiB)']} MiB", flush=True)
            return r

        for t in threads_list:
            def make(t=t):
                f = rowfile_view(path, size, t, True)
                return f.read, f.close
            cell(f"rowfile-direct t{t}", make)
        if size == 512:
            for t in (16,) if args.quick else (16, 32):
                def make(t=t):
                    f = rowfile_view(path, size, t, True)
                    return f.read, f.close
                cell(f"rowfile-direct t{t} k1024", make, batch=1024)

        def make_buf(auto_drop):
            f = rowfile_view(path, size, 16, False)
            f.auto_drop = auto_drop
            return f.read, (lambda: None) if not auto_drop else f.close, f
        holder = {}

        def make_buf_shipped():
            read, close, _ = make_buf(True)
            return read, close
        cell("rowfile-buf t16", make_buf_shipped)

        def make_buf_nodrop():
            read, close, f = make_buf(False)
            holder["f"] = f
            return read, close
        r = cell("rowfile-buf t16 auto_drop=False", make_buf_nodrop)
        if r is not None and "f" in holder:
            f = holder.pop("f")
            f.drop_cache()
            r["file_resident after drop_cache (MiB)"] = _mib(file_cache_bytes(path))
            f.close()

        if kv is not None:
            for t, direct_read in ((16, False), (64, False), (64, True)):
                r = cell(f"kvikio t{t}" + (" auto_direct_io_read" if direct_read else ""),
                         lambda t=t, d=direct_read: kvikio_reader(kv, path, size, t, d))
                if r is None and t == 16:
                    kv = None                # the same failure would repeat for every cell
                    notes.append("kvikio: given up after its first failure")
                    break
        try:
            import torch
            cell(f"torch-mmap index_select t{torch.get_num_threads()}",
                 lambda: torch_reader(path, size))
        except ImportError:
            notes.append("torch not installed: torch-mmap skipped")
        if not uring_why:
            for depth in (64, 256):
                cell(f"io_uring qd{depth} (1 thread)", lambda d=depth: uring_reader(path, size, d))
        ref.close()
    return cells, notes


def random_writes(path, args, rng) -> list:
    cells = []
    for size in (512, 4096):
        batch = min(MAX_BATCH, BATCH_BYTES // size) // (16 if args.quick else 1)
        variants = [("rowfile-direct t32", True, "shipped"),
                    ("rowfile-buf t32 (DONTNEED each call, fdatasync/64 MiB)", False, "shipped"),
                    ("rowfile-buf t32 fdatasync each call", False, "sync"),
                    ("rowfile-buf t32 no dropping", False, "none")]
        for name, direct, policy in variants:
            probe = CacheProbe(path)
            f = rowfile_view(path, size, 32, direct)
            if direct and not f.direct:
                f.close()
                continue
            if policy == "none":
                f.auto_drop = False
            src = np.random.default_rng(1).integers(0, 256, (batch, size), dtype=np.uint8)

            def write(ids, _out, f=f, policy=policy, src=src):
                f.write(ids, src)
                if policy == "sync":
                    os.fdatasync(f._fd)
                    f._unsynced = 0
            r = time_reads(write, f.num_rows, size, batch, args.seconds, rng)
            r.update(probe.result())
            t0 = time.perf_counter()
            f.drop_cache() if not direct else f.flush()
            r["final sync ms"] = round((time.perf_counter() - t0) * 1e3, 1)
            if policy == "none":
                r["file_resident after drop_cache (MiB)"] = _mib(file_cache_bytes(path))
            f.close()
            r = {"engine": "write " + name, "size": size, **r}
            cells.append(r)
            print(f"  {r['engine']:<60} {size:>5} B  {r['IOPS']:>8,} IOPS  "
                  f"cache {r.get('file_resident (MiB)')} MiB", flush=True)
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/nbtools-disk", help="folder on the disk to measure")
    ap.add_argument("--gib", type=float, default=8.0, help="data file size, GiB")
    ap.add_argument("--seconds", type=float, default=None,
                    help="timed seconds per cell (default 2, --quick 0.25)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer cells, short")
    ap.add_argument("--no-writes", action="store_true", help="skip the random-write cells")
    ap.add_argument("--keep", action="store_true", help="keep the data file afterwards")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--uring-selftest", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.uring_selftest:
        return uring_selftest(args.uring_selftest)
    args.seconds = args.seconds or (0.2 if args.quick else 2.0)
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "disk_io.rows")
    rng = np.random.default_rng(0)
    env = {"python": platform.python_version(), "numpy": np.__version__,
           "cpus": os.cpu_count(), "kernel": platform.release(), "dir": args.dir,
           "gib": args.gib, "free_bytes": __import__("shutil").disk_usage(args.dir).free}
    try:
        import torch
        env["torch"], env["torch_threads"] = torch.__version__, torch.get_num_threads()
    except ImportError:
        pass
    print(f"disk_io: {env}", flush=True)
    t_all = time.perf_counter()
    try:
        print("sequential (RowFile, 4 MiB requests) ...", flush=True)
        seq = sequential(path, args.gib, args.quick)
        print(f"  {seq}", flush=True)
        print("random reads (unique sorted rows, fresh batches) ...", flush=True)
        cells, notes = random_reads(path, args, rng)
        wcells = []
        if not args.no_writes:
            print("random writes ...", flush=True)
            wcells = random_writes(path, args, rng)
    finally:
        if not args.keep and os.path.exists(path):
            os.remove(path)
    res = {"env": env, "sequential": seq, "reads": cells, "writes": wcells, "notes": notes,
           "seconds": round(time.perf_counter() - t_all, 1)}
    print(f"\n## disk_io: {args.gib:g} GiB file in {args.dir}, {env['cpus']} CPUs, "
          f"{res['seconds']} s")
    print(f"sequential: write {seq['write GB/s']} GB/s, read {seq['read GB/s']} GB/s "
          f"(O_DIRECT={seq['direct']}, block {seq['block']} B)\n")
    print("| engine | row B | batch | IOPS | GB/s | first batch ms | file cached MiB "
          "| Cached delta MiB | cgroup file delta MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in cells + wcells:
        extra = r.get("file_resident after drop_cache (MiB)")
        cached = r.get("file_resident (MiB)")
        cached = f"{cached} -> {extra} (drop_cache)" if extra is not None else cached
        print(f"| {r['engine']} | {r['size']} | {r['batch']:,} | {r['IOPS']:,} | {r['GB/s']} | "
              f"{r['first batch ms']} | {cached} | {r.get('meminfo_cached_delta (MiB)')} | "
              f"{r.get('cgroup_file_delta (MiB)')} |")
    for n in notes:
        print(f"- {n}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"results: {args.out}")


if __name__ == "__main__":
    main()
