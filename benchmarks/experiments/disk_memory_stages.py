"""Memory profile of bench_disk.py's stages, on any machine (benchmarks/RESULTS.md "Session 15").

    python benchmarks/experiments/disk_memory_stages.py --rows 30000000 --cache-gib 2.07 [--trace]

RSS (VmRSS, RssAnon) after each stage and its peak (50 ms sampler); glibc mallinfo2 (heap in
use / free-but-kept / mmapped); every numpy/torch array owned by the table's DiskRows / LogFile /
RowFile / ReadAhead; with --trace, tracemalloc (numpy domain) per-line peak temporaries of the
warm / flush / aging / dirty stages.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc

T_IMPORT0 = time.perf_counter()
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_disk as bd  # noqa: E402

GiB = float(1 << 30)
MiB = float(1 << 20)
ZIPF_PRIME = 1_000_000_007


# --- RSS sampling --------------------------------------------------------------------------
def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def mallinfo():
    m = _libc.mallinfo2()
    # arena: bytes of (all) arenas' heaps; uordblks in use; fordblks free but kept; hblkhd mmapped
    return {"heap": m.arena, "heap_used": m.uordblks, "heap_free": m.fordblks,
            "mmapped": m.hblkhd, "mmapped_n": m.hblks}


class Sampler(threading.Thread):
    """RSS and its anonymous part every ``period`` seconds, with their peaks since reset()."""

    def __init__(self, period=0.05):
        super().__init__(daemon=True)
        self.period, self.peak, self.peak_anon, self.timeline = period, 0, 0, []
        self.t0, self._halt, self._lock = time.perf_counter(), threading.Event(), threading.Lock()
        self.start()

    def run(self):
        while True:
            s = status()
            with self._lock:
                self.peak = max(self.peak, s["VmRSS"])
                self.peak_anon = max(self.peak_anon, s["RssAnon"])
            self.timeline.append((round(time.perf_counter() - self.t0, 2), s["VmRSS"],
                                  s["RssAnon"]))
            if self._halt.wait(self.period):
                return

    def reset(self):
        s = status()
        with self._lock:
            self.peak, self.peak_anon = s["VmRSS"], s["RssAnon"]

    def stop(self):
        self._halt.set()
        self.join()


STAGES = []


class stage:
    def __init__(self, name, sampler):
        self.name, self.s = name, sampler

    def __enter__(self):
        self.s.reset()
        self.t0 = time.perf_counter()
        self.before = status()
        return self

    def __exit__(self, *exc):
        after = status()
        self.s.peak = max(self.s.peak, after["VmRSS"])
        self.s.peak_anon = max(self.s.peak_anon, after["RssAnon"])
        rec = {"stage": self.name, "s": round(time.perf_counter() - self.t0, 1),
               "rss": after["VmRSS"], "anon": after["RssAnon"], "file": after["RssFile"],
               "peak_rss": self.s.peak, "peak_anon": self.s.peak_anon,
               "d_rss": after["VmRSS"] - self.before["VmRSS"], **mallinfo()}
        STAGES.append(rec)
        print(f"[{rec['stage']:<28}] {rec['s']:7.1f}s  RSS {rec['rss'] / GiB:6.3f} GiB "
              f"(anon {rec['anon'] / GiB:6.3f}, file {rec['file'] / MiB:6.0f} MiB)  "
              f"peak {rec['peak_rss'] / GiB:6.3f}  d {rec['d_rss'] / MiB:+8.1f} MiB | malloc heap "
              f"{rec['heap'] / MiB:.0f} (used {rec['heap_used'] / MiB:.0f}, free "
              f"{rec['heap_free'] / MiB:.0f}) mmapped {rec['mmapped'] / MiB:.0f} MiB "
              f"({rec['mmapped_n']})", flush=True)


# --- the bench's helpers (copied from benchmarks/bench_disk.py) -----------------------------
def zipf_ids(gen, n_rows, size, a=1.1):
    ranks = gen.zipf(a, size)
    while (ranks > n_rows).any():
        bad = ranks > n_rows
        ranks[bad] = gen.zipf(a, int(bad.sum()))
    return ((ranks - 1) * ZIPF_PRIME) % n_rows


hottest = bd.hottest


def run_steps(table, opt, batches, prefetch):
    bd.run_steps(table, opt, batches, torch.device("cpu"), prefetch)


# --- what the table owns ---------------------------------------------------------------------
def _base(a):
    while isinstance(a, np.ndarray) and a.base is not None and isinstance(a.base, np.ndarray):
        a = a.base
    return a


def inventory(table):
    """(path, kind, dtype, shape, nbytes of the array, nbytes of the buffer it keeps alive)."""
    from nbtools.disk import DiskRows
    from nbtools.disk.log import LogFile
    from nbtools.disk.readahead import ReadAhead, Ahead
    from nbtools.rowfile import RowFile
    from nbtools.rowfile.fileio import RequestPool
    walk_types = (DiskRows, LogFile, ReadAhead, Ahead, RowFile, RequestPool)
    rows, seen, seen_buf = [], set(), {}

    def visit(obj, path, depth):
        if depth > 6:
            return
        if isinstance(obj, np.ndarray):
            b = _base(obj)
            key = b.__array_interface__["data"][0] if isinstance(b, np.ndarray) else id(b)
            keep = b.nbytes if isinstance(b, np.ndarray) else obj.nbytes
            dup = key in seen_buf
            seen_buf.setdefault(key, path)
            rows.append((path, "ndarray" + (" view" if obj.base is not None else ""),
                         str(obj.dtype), tuple(obj.shape), obj.nbytes, 0 if dup else keep,
                         seen_buf[key] if dup else ""))
            return
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            key = st.data_ptr()
            dup = key in seen_buf
            seen_buf.setdefault(key, path)
            rows.append((path, "tensor", str(obj.dtype), tuple(obj.shape),
                         obj.numel() * obj.element_size(), 0 if dup else st.nbytes(),
                         seen_buf[key] if dup else ""))
            return
        if id(obj) in seen:
            return
        if isinstance(obj, walk_types) or type(obj).__name__ == "HostTensor":
            seen.add(id(obj))
            d = dict(getattr(obj, "__dict__", {}))
            for s in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, s):
                    d[s] = getattr(obj, s)
            for k, v in d.items():
                visit(v, f"{path}.{k}", depth + 1)
        elif isinstance(obj, (list, tuple, collections.deque)):
            seen.add(id(obj))
            for i, v in enumerate(obj):
                visit(v, f"{path}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            seen.add(id(obj))
            for k, v in obj.items():
                visit(v, f"{path}[{k!r}]", depth + 1)

    visit(table._disk, "disk", 0)
    return rows


def print_inventory(table, label):
    rows = inventory(table)
    total = sum(r[5] for r in rows)
    print(f"--- arrays owned by the table ({label}): {total / MiB:,.1f} MiB kept alive", flush=True)
    for r in sorted(rows, key=lambda r: -r[5]):
        if r[5] >= (1 << 20) or r[4] >= (1 << 20):
            print(f"    {r[0]:<40} {r[1]:<13} {r[2]:<14} {str(r[3]):<22} "
                  f"{r[4] / MiB:10.1f} MiB  keeps {r[5] / MiB:10.1f} MiB {r[6]}", flush=True)
    return rows


# --- per-line peaks of traced allocations (tracemalloc: numpy reports its buffers) -------------
class LinePeaks:
    """For lines of the given functions: the most traced bytes allocated above what was
    traced when the line started, until the next traced line (sys.settrace, all threads)."""

    def __init__(self, funcs):
        self.codes = {f.__code__: f"{f.__module__.split('.')[-1]}.{f.__qualname__}" for f in funcs}
        self.peaks = collections.defaultdict(int)
        self.local = threading.local()

    def _tracer(self, frame, event, arg):
        if frame.f_code not in self.codes:
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event in ("line", "return"):
            cur, peak = tracemalloc.get_traced_memory()
            prev = getattr(self.local, "prev", None)
            if prev is not None:
                key, start = prev
                self.peaks[key] = max(self.peaks[key], peak - start)
            tracemalloc.reset_peak()
            cur, _ = tracemalloc.get_traced_memory()
            self.local.prev = ((self.codes[frame.f_code], frame.f_lineno), cur) \
                if event == "line" else None
        return self._line

    def __enter__(self):
        sys.settrace(self._tracer)      # (the main thread only: clean attribution)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)

    def report(self, label, top=15):
        import linecache
        mods = {}
        for code, name in self.codes.items():
            mods[name] = code.co_filename
        print(f"--- top temporaries by line ({label}): peak traced bytes above the line's start")
        out = []
        for (name, line), b in sorted(self.peaks.items(), key=lambda kv: -kv[1])[:top]:
            src = linecache.getline(mods[name], line).strip()
            out.append((name, line, b, src))
            print(f"    {b / MiB:10.1f} MiB  {name}:{line}  {src[:110]}")
        return out


def tm_top(snapshot, label, top=12, base=None):
    dom = np.lib.tracemalloc_domain
    filt = [tracemalloc.DomainFilter(True, dom)]
    snap = snapshot.filter_traces(filt)
    stats = snap.compare_to(base.filter_traces(filt), "traceback") if base else \
        snap.statistics("traceback")
    print(f"--- live numpy buffers by allocation site ({label})")
    out = []
    for st in stats[:top]:
        size = st.size_diff if base else st.size
        fr = [f"{os.path.basename(f.filename)}:{f.lineno}" for f in st.traceback]
        print(f"    {size / MiB:10.1f} MiB  n={st.count:<5} " + " <- ".join(fr[:4]))
        out.append((size, st.count, fr))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=30_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--cache-gib", type=float, default=2.0)
    ap.add_argument("--dir", default="/tmp/memprof")
    ap.add_argument("--age-steps", type=int, default=400, help="uniform steps at most")
    ap.add_argument("--age-s", type=float, default=300)
    ap.add_argument("--ahead", type=int, default=4)
    ap.add_argument("--zipf-steps", type=int, default=12)
    ap.add_argument("--dirty-steps", type=int, default=0, help="0: every cached row once")
    ap.add_argument("--trace", action="store_true", help="tracemalloc + per-line peaks")
    ap.add_argument("--out", default="disk_memory_stages.json")
    args = ap.parse_args()

    global np, torch
    sampler = Sampler()
    with stage("import torch+nbtools", sampler):
        import numpy as np
        import torch
        import nbtools
        from nbtools import disk as nbdisk, rowfile
        from nbtools.disk import access as diskaccess
        from nbtools.disk import log as disklog
    torch.manual_seed(0)
    gen = np.random.default_rng(0)
    os.makedirs(args.dir, exist_ok=True)
    res = {"args": vars(args)}
    if args.trace:
        tracemalloc.start(6)
    snap0 = tracemalloc.take_snapshot() if args.trace else None
    trace_funcs = [diskaccess.WholeTable.warm, diskaccess.WholeTable.flush,
                   nbdisk.DiskRows._write_slots, nbdisk.DiskRows._write, nbdisk.DiskRows._evict,
                   nbdisk.DiskRows._load, nbdisk.DiskRows._take, nbdisk.DiskRows._sweep,
                   nbdisk.DiskRows._take_free, nbdisk.DiskRows.resolve, nbdisk.DiskRows._placed,
                   disklog.LogFile.write, disklog.LogFile._point, disklog.LogFile._allocate,
                   disklog.LogFile._clean, disklog.LogFile.read, disklog.LogFile.read_range,
                   disklog.LogFile._start_read,
                   rowfile.RowFile._io, rowfile.RowFile._check, hottest,
                   nbdisk.lookup, nbtools.disk.readahead.ReadAhead._find,
                   nbtools.disk.readahead.ReadAhead.start, nbtools.disk.readahead.ReadAhead.fill,
                   nbtools.disk.readahead.prepare]
    line_reports = {}

    def traced(label):
        if not args.trace:
            import contextlib
            return contextlib.nullcontext()
        lp = LinePeaks(trace_funcs)
        line_reports[label] = lp
        return lp

    with stage("create table", sampler):
        table = nbtools.OffloadedEmbedding(args.rows, args.dim, name="bench-disk", device="cpu",
                                           placement="disk", dtype=torch.bfloat16,
                                           disk_dir=args.dir,
                                           host_cache_bytes=int(args.cache_gib * GiB))
    with stage("attach optimizer", sampler):
        opt = nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.05)
    d = table._disk
    log = getattr(d.file, "stats", None)
    print(f"{d!r}; file {d.file!r}; cache rows {d.capacity_rows:,}; row_bytes {d.row_bytes}; "
          f"log {log is not None}", flush=True)
    res["cache_rows"], res["row_bytes"] = d.capacity_rows, d.row_bytes
    res["file_slots"] = getattr(d.file, "slots", args.rows)
    # leftovers of the weights-only table made first (its DiskRows / LogFile still alive?)
    gc.collect()
    res["live_diskrows"] = sum(isinstance(o, nbdisk.DiskRows) for o in gc.get_objects())
    res["live_logfiles"] = sum(isinstance(o, disklog.LogFile) for o in gc.get_objects())
    print(f"live DiskRows {res['live_diskrows']}, LogFile {res['live_logfiles']}", flush=True)

    with stage("flush (initial rows written)", sampler):
        d.flush()
    with stage("slab pinned (ensure_slab)", sampler):
        d.ensure_slab()         # (the bench's first aging step does it)
    with stage("probe (RowFile reads)", sampler):
        ids = np.unique(gen.integers(0, args.rows, 131072))
        out = np.empty((len(ids), d.file.row_bytes), dtype=np.uint8)
        rf = rowfile.RowFile.open(d.file.path, threads=64, writable=False)
        t0 = time.perf_counter()
        rf.read(ids, out)
        res["probe_rows_per_s"] = len(ids) / (time.perf_counter() - t0)
        rf.close()
        del out, rf
    print(f"probe {res['probe_rows_per_s']:,.0f} rows/s", flush=True)
    inv_before = print_inventory(table, "before aging")
    snap_before_age = tracemalloc.take_snapshot() if args.trace else None

    # --- aging: uniform steps, 4 per run_steps call, prefetch=ahead (as the bench) -----------
    aged, t0 = 0, time.perf_counter()
    age_marks = []
    cache_full_at = None
    with stage("aging (uniform steps)", sampler):
        while aged < args.age_steps and time.perf_counter() - t0 < args.age_s and \
                (log is None or log["cleaned_segments"] < 8):
            uni = [torch.randint(0, args.rows, (args.ids,)) for _ in range(4)]
            trace_now = args.trace and aged in (0, 4) or (
                args.trace and log is not None and log["cleaned_segments"] > 0
                and "aging, cleaner on" not in line_reports)
            if cache_full_at is None and d.stats["evicted"]:
                cache_full_at = aged
            if trace_now:
                lab = "aging, cleaner on" if log["cleaned_segments"] > 0 else \
                    ("aging, free slots" if not d.stats["evicted"] else "aging, evicting")
                if lab in line_reports:
                    lab += f" @{aged}"
                with traced(lab):
                    run_steps(table, opt, uni, args.ahead)
            else:
                run_steps(table, opt, uni, args.ahead)
            aged += 4
            s = status()
            age_marks.append((aged, round(time.perf_counter() - t0, 1), s["VmRSS"], s["RssAnon"],
                              d.stats["evicted"], dict(log) if log else None))
            if aged % 20 == 0:
                print(f"   aged {aged} steps {time.perf_counter() - t0:6.1f}s RSS "
                      f"{s['VmRSS'] / GiB:.3f} anon {s['RssAnon'] / GiB:.3f} evicted "
                      f"{d.stats['evicted']:,} log {log} | heap {mallinfo()['heap'] / MiB:.0f} "
                      f"free {mallinfo()['heap_free'] / MiB:.0f} MiB", flush=True)
    res["aged_steps"], res["aging_marks"], res["cache_full_at"] = aged, age_marks, cache_full_at
    inv_aged = print_inventory(table, "after aging, before flush(drop)")
    with stage("flush(drop=True)", sampler), traced("flush(drop=True)"):
        d.flush(drop=True)
    print(f"free list after flush(drop): {[len(f) for f in d._free]}", flush=True)
    with stage("hottest(rows, capacity)", sampler), traced("hottest"):
        hot = hottest(args.rows, d.capacity_rows)
    with stage("warm(hottest)", sampler), traced("warm"):
        res["warm_rows"] = d.warm(hot)
    del hot
    with stage("after warm, del ids, gc", sampler):
        gc.collect()
    inv_warm = print_inventory(table, "after warm")
    snap_after_warm = tracemalloc.take_snapshot() if args.trace else None

    # --- every cached row trained once (bench's --dirty default) ---------------------------
    with stage("dirty: each cached row once", sampler):
        cached = hottest(args.rows, d.capacity_rows)
        chunks = [torch.from_numpy(cached[i:i + args.ids]) for i in range(0, len(cached), args.ids)]
        if args.dirty_steps:
            chunks = chunks[: args.dirty_steps]
        if args.trace:
            with traced("dirty (first 4 steps)"):
                run_steps(table, opt, chunks[:4], 0)
            run_steps(table, opt, chunks[4:], 0)
        else:
            run_steps(table, opt, chunks, 0)
        res["dirty_steps"] = len(chunks)
        del cached, chunks
    with stage("zipf steps (no read-ahead)", sampler):
        zb = [torch.from_numpy(zipf_ids(gen, args.rows, args.ids)) for _ in range(args.zipf_steps)]
        run_steps(table, opt, zb, 0)
    with stage("zipf steps (read-ahead 4)", sampler), traced("zipf read-ahead"):
        zb = [torch.from_numpy(zipf_ids(gen, args.rows, args.ids)) for _ in range(args.zipf_steps)]
        run_steps(table, opt, zb, args.ahead)
    d.wait_read_ahead()
    inv_end = print_inventory(table, "end")
    with stage("malloc_trim(0)", sampler):
        _libc.malloc_trim(0)
    res["log"] = dict(log) if log else None
    res["stats"] = dict(d.stats)
    print(f"log {log}; stats {d.stats}", flush=True)

    if args.trace:
        snap_end = tracemalloc.take_snapshot()
        res["tm_after_warm_vs_before_age"] = tm_top(snap_after_warm, "after warm vs before aging",
                                                    base=snap_before_age)
        res["tm_end_vs_before_age"] = tm_top(snap_end, "end vs before aging", base=snap_before_age)
        res["tm_end_all"] = tm_top(snap_end, "end, all since start", base=snap0)
        res["lines"] = {k: v.report(k) for k, v in line_reports.items()}
    res["stages"] = STAGES
    res["inventory"] = {"before_aging": inv_before, "after_aging": inv_aged,
                        "after_warm": inv_warm, "end": inv_end}
    sampler.stop()
    res["timeline"] = sampler.timeline[::4]
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("\n| stage | s | RSS GiB | RssAnon GiB | peak RSS GiB | malloc heap used/free MiB | "
          "mmapped MiB |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in STAGES:
        print(f"| {r['stage']} | {r['s']} | {r['rss'] / GiB:.3f} | {r['anon'] / GiB:.3f} | "
              f"{r['peak_rss'] / GiB:.3f} | {r['heap_used'] / MiB:.0f}/{r['heap_free'] / MiB:.0f} "
              f"| {r['mmapped'] / MiB:.0f} |")
    table.close()


if __name__ == "__main__":
    main()
