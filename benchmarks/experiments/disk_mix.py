"""What slows a disk table's step reads down: the write-backs beside them, or the GIL?

A disk table's Zipf step reads ~2,000 missed rows and writes back about as many evicted dirty
ones, on two threads at once (nbtools.disk). This times RowFile random reads of a step's size
alone and beside each of the things that run with them in a training loop:

  read            batches of --batch unique random rows, sorted (RowFile, O_DIRECT, --threads)
  write           the same, written (a second RowFile on the same file)
  read+write      both at once, each on its own thread and pool: the loop's disk traffic
  read+append     reads beside writes of as many rows as were read, to *consecutive* slots at
                  a moving head (what a log-structured layout would write instead)
  read+clean      read+append plus a log cleaner's work: per row appended, the rows of the
                  emptiest segments read and their live ones written again at the head, both
                  sequential; at --utilization u (live share of a cleaned segment) each appended
                  row costs 1 / (1 - u) rows read and u / (1 - u) more rows written
  read+fresh      read+append, the appends into never-written space (``--fresh``: that share
                  of the file is reserved, not written, as a new log file's spare segments
                  are): ext4 must convert each written extent, a journalled metadata change
  read+python     reads beside a thread running pure Python (holds the GIL between switches)
  read+numpy      reads beside a thread doing numpy work on ~2 MB arrays (sort, unique, take)

Each cell runs with RowFile's two I/O engines (nbtools.rowfile.fileio.RequestPool): "threads" (Python
threads in os.preadv) and "aio" (glibc's lio_listio: one GIL-free call per batch).

Rows/s of the reads in each cell (and of the writes where there are some), cells interleaved
over --rounds so that a cloud disk's drift shows as spread, not as a difference.

    python3 benchmarks/experiments/disk_mix.py --dir /tmp/nbtools-mix --gib 8 --out mix.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools.rowfile import RowFile  # noqa: E402

ROW = 512


def batches_of(rng, n_rows: int, batch: int):
    while True:
        yield np.unique(rng.integers(0, n_rows, batch))


FRESH = {"head": None, "end": 0}      # read+fresh: the next never-written row, the file's end


def reader(f: RowFile, rng, n_rows, batch, stop, out_counts):
    buf = np.empty((batch, ROW), dtype=np.uint8)
    gen = batches_of(rng, n_rows, batch)
    while not stop.is_set():
        ids = next(gen)
        f.read(ids, buf[: len(ids)])
        out_counts[0] += len(ids)


def writer(f: RowFile, rng, n_rows, batch, stop, out_counts, append: bool, pace=None,
           clean: float = 0.0):
    """Random row writes, or (``append``) consecutive ones at a moving head; with ``pace``
    (the reader's count), no more rows written than read: a loop writes back what it reads.
    ``clean``: the cleaned segments' live share u: each appended batch also reads
    batch / (1 - u) rows at a second head and writes batch * u / (1 - u) more at the first."""
    buf = np.zeros((batch, ROW), dtype=np.uint8)
    gen = batches_of(rng, n_rows, batch)
    head, tail = 0, n_rows // 2
    fresh = append == "fresh"
    if fresh:
        head = FRESH["head"]
    seg = np.zeros((int(batch / (1 - clean)) if clean else 0, ROW), dtype=np.uint8)
    while not stop.is_set():
        if pace is not None and out_counts[0] > pace[0]:
            time.sleep(0.0005)
            continue
        if append:
            if clean:            # the cleaner: a segment read, its live rows written again
                if tail + len(seg) > n_rows:
                    tail = 0
                f.read_range(tail, seg)
                tail += len(seg)
                live = seg[: len(seg) - batch]
                if head + len(live) > n_rows:
                    head = 0
                f.write_range(head, live)
                head += len(live)
            if fresh:
                if head + batch > FRESH["end"]:
                    break                        # (no never-written space left)
            elif head + batch > n_rows:
                head = 0
            f.write_range(head, buf)
            head += batch
            out_counts[0] += batch
            if fresh:
                FRESH["head"] = head
        else:
            ids = next(gen)
            f.write(ids, buf[: len(ids)])
            out_counts[0] += len(ids)


def python_busy(stop, counts):
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i % 7
        counts[0] += 1000


def numpy_busy(stop, counts):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 1 << 40, 262_144)
    while not stop.is_set():
        u = np.unique(a)
        np.take(u, np.argsort(a[: len(u)], kind="stable"))
        counts[0] += 1


def cell(kind: str, rf: RowFile, wf: RowFile, n_rows: int, args, seed: int) -> dict:
    kind, engine = kind.split(" ")
    rf._pool.engine = wf._pool.engine = engine
    stop = threading.Event()
    reads, other = [0], [0]
    rng_r, rng_w = np.random.default_rng(seed), np.random.default_rng(seed + 1000)
    threads = []
    if kind != "write":
        threads.append(threading.Thread(target=reader,
                                        args=(rf, rng_r, n_rows, args.batch, stop, reads)))
    if kind in ("write", "read+write", "read+append", "read+clean", "read+fresh"):
        log = kind in ("read+append", "read+clean", "read+fresh")
        threads.append(threading.Thread(target=writer, args=(
            wf, rng_w, n_rows, args.batch, stop, other,
            "fresh" if kind == "read+fresh" else log, reads if log else None,
            args.utilization if kind == "read+clean" else 0.0)))
    elif kind == "read+python":
        threads.append(threading.Thread(target=python_busy, args=(stop, other)))
    elif kind == "read+numpy":
        threads.append(threading.Thread(target=numpy_busy, args=(stop, other)))
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    out = {"read_rows_per_s": reads[0] / dt}
    if kind in ("write", "read+write", "read+append", "read+clean", "read+fresh"):
        out["write_rows_per_s"] = other[0] / dt
    elif kind != "read":
        out["other_per_s"] = other[0] / dt
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/nbtools-mix")
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--utilization", type=float, default=2 / 3,
                    help="read+clean: the live share of the segments a cleaner empties")
    ap.add_argument("--fresh", type=float, default=0.0,
                    help="share of the file at its end reserved but never written (read+fresh "
                    "appends there; every other cell uses the written part)")
    ap.add_argument("--shared", action="store_true",
                    help="reads and writes through one RowFile (one request pool: its AIO "
                    "descriptors shared, as a disk table's are) instead of two")
    ap.add_argument("--kinds", default=None,
                    help="comma-separated cells to run (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    path = os.path.join(args.dir, "mix.rows")
    total = int(args.gib * (1 << 30)) // ROW
    n_rows = total - int(total * args.fresh)       # the written rows; the rest reserved only
    FRESH["head"], FRESH["end"] = n_rows, total
    f = RowFile.create(path, total, ROW, {"what": "disk_mix"}, threads=args.threads,
                       overwrite=True)
    t0 = time.perf_counter()
    chunk = np.full((1 << 17, ROW), 7, dtype=np.uint8)      # 64 MiB: fill (written blocks)
    for start in range(0, n_rows, len(chunk)):
        f.write_range(start, chunk[: min(len(chunk), n_rows - start)])
    f.flush()
    fill = time.perf_counter() - t0
    print(f"file {n_rows:,} rows of {ROW} B written in {fill:.1f} s "
          f"({n_rows * ROW / fill / 1e9:.2f} GB/s), direct={f.direct}", flush=True)
    wf = f
    rf = f if args.shared else RowFile.open(path, threads=args.threads, writable=False, unclean_ok=True) \
        if "unclean_ok" in RowFile.open.__code__.co_varnames else \
        RowFile.open(path, threads=args.threads, writable=False)
    from nbtools.rowfile.fileio import _aio
    engines = ["threads"] + (["aio"] if _aio.ready() else [])
    if not _aio.ready():
        print(f"aio engine unavailable: {_aio.why}")
    names = args.kinds.split(",") if args.kinds else (
        "read", "write", "read+write", "read+append", "read+clean", "read+python", "read+numpy")
    kinds = [f"{k} {e}" for k in names for e in engines]
    res = {"args": vars(args), "fill_gb_s": n_rows * ROW / fill / 1e9, "cells": {k: [] for k in kinds}}
    for r in range(args.rounds):
        for i, kind in enumerate(kinds):
            c = cell(kind, rf, wf, n_rows, args, seed=100 * r + i)
            res["cells"][kind].append(c)
            print(f"round {r} {kind:20s} " + ", ".join(f"{k} {v:,.0f}" for k, v in c.items()),
                  flush=True)
    if rf is not f:
        rf.close()
    f.close()
    os.remove(path)
    first = kinds[0]           # "read threads" unless --kinds says otherwise
    print(f"\n| cell, engine | read rows/s (median of {args.rounds}) | x {first} | "
          "write rows/s | other |\n|---|---:|---:|---:|---:|")
    base = float(np.median([c["read_rows_per_s"] for c in res["cells"][first]]))
    for kind in kinds:
        cs = res["cells"][kind]
        med = lambda key: float(np.median([c[key] for c in cs])) if key in cs[0] else None  # noqa
        rd, wr, ot = med("read_rows_per_s"), med("write_rows_per_s"), med("other_per_s")
        print(f"| {kind} | {rd:,.0f} | {rd / base:.2f} | "
              f"{'' if wr is None else f'{wr:,.0f}'} | {'' if ot is None else f'{ot:,.0f}'} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
