"""Where a disk table's Zipf step spends its time: a timeline of its threads.

A disk-bound loop should keep the disk busy all the time: one load (the reads of a coming
step's misses) always in flight, two where reads ahead overlap. This records, for a loop of
Zipf steps on an aged log-structured table (bench_disk's setting, smaller by default), when
each of these runs:

  find     the read-ahead thread's work for a coming step (its misses, slots, the load's start)
  load     a read-ahead's reads (nbtools.disk.readahead), on a loader thread
  write    a write-back of evicted rows (and the log cleaner inside it), on the writer thread
  lookup   the training loop's lookup of a step's rows (waits for its load)
  sync     a lookup's own reads of misses that no read-ahead brought in

and prints the share of the loop's time with 0, 1, 2+ loads in flight, the mean duration of
each kind, the misses a lookup read itself, the disk's rate during the loop against a probe,
and per thread the time spent waiting for the table's lock and holding it.

    python3 benchmarks/experiments/disk_timeline.py --rows 4000000 --cache-gib 0.28 --dir /tmp/nbt
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import bench_disk as bd  # noqa: E402
from nbtools import disk as disk_mod
from nbtools.disk import readahead  # noqa: E402
from nbtools.devices import resolve_device  # noqa: E402

EVENTS: list = []


def traced(kind, fn, rows=None):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            n = rows(*a, **k) if rows else 0
            EVENTS.append((kind, t0, time.perf_counter(), n, threading.get_ident()))
    return wrapper


# a coming step's milestones, by its ids tensor: prefetch handed over, misses found (the
# find's start), its load's start and end, its lookup (take_prepared)
STEPS: dict = collections.defaultdict(dict)


def milestone(name, fn, key, when="start"):
    def wrapper(*a, **k):
        if when == "start":
            STEPS[key(*a, **k)].setdefault(name, time.perf_counter())
        try:
            return fn(*a, **k)
        finally:
            if when == "end":
                STEPS[key(*a, **k)].setdefault(name, time.perf_counter())
    return wrapper


# seconds inside each of the table's inner calls, per (call, thread): where a find, a lookup
# and the lock's holders spend their time (outermost calls of each name only)
CALLS: collections.Counter = collections.Counter()
COUNTS: collections.Counter = collections.Counter()
_inside = threading.local()


def timed_call(name, fn):
    def wrapper(*a, **k):
        seen = getattr(_inside, "names", None)
        if seen is None:
            seen = _inside.names = set()
        if name in seen:
            return fn(*a, **k)
        seen.add(name)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seen.discard(name)
            key = (name, threading.current_thread().name.split("_")[0])
            CALLS[key] += time.perf_counter() - t0
            COUNTS[key] += 1
    return wrapper


INNER = {readahead.ReadAhead: ("settle_for", "settle_done", "_settle", "start", "fill",
                               "pending_for", "_written", "take"),
         disk_mod.DiskRows: ("_take", "_sweep", "_evict", "_advance", "_close_step",
                             "mark_used", "sync_mapped", "ensure_slab", "_load_beside",
                             "_placed", "_count_ahead")}


def install():
    for cls, names in INNER.items():
        for n in names:
            setattr(cls, n, timed_call(f"{cls.__name__}.{n}", getattr(cls, n)))
    readahead.prepare = timed_call("prepare", readahead.prepare)
    disk_mod.prepare = timed_call("prepare", disk_mod.prepare)
    R, D = readahead.ReadAhead, disk_mod.DiskRows
    R.submit = milestone("submit", R.submit, lambda self, ids, *a: id(ids))
    R._find = milestone("find", R._find, lambda self, item, *a: id(item.ids))
    R._load = milestone("load0", R._load, lambda self, item: id(item.ids))
    R._load = milestone("load1", R._load, lambda self, item: id(item.ids), when="end")
    D.take_prepared = milestone("take", D.take_prepared, lambda self, ids: id(ids))
    R._find = traced("find", R._find)
    R._load = traced("load", R._load, rows=lambda self, item: len(item.rows))
    D._drain = traced("write", D._drain, rows=lambda self, stash: sum(len(i) for i, _ in stash))
    D.resolve = traced("lookup", D.resolve, rows=lambda self, ids, training: len(ids))
    D._load = traced("sync", D._load, rows=lambda self, ids, slots: len(ids))


class TimedLock:
    """The table's lock, timed: per thread name, seconds waited to take it and seconds held
    (outermost holds of the re-entrant lock only)."""

    def __init__(self, lock):
        self.lock = lock
        self.depth = threading.local()
        self.waited = collections.Counter()
        self.held = collections.Counter()

    def acquire(self, *a, **k):
        t0 = time.perf_counter()
        got = self.lock.acquire(*a, **k)
        if got:
            d = getattr(self.depth, "n", 0)
            if d == 0:
                name = threading.current_thread().name.split("_")[0]
                self.waited[name] += time.perf_counter() - t0
                self.depth.since = time.perf_counter()
            self.depth.n = d + 1
        return got

    def release(self):
        self.depth.n -= 1
        if self.depth.n == 0:
            name = threading.current_thread().name.split("_")[0]
            self.held[name] += time.perf_counter() - self.depth.since
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def coverage(spans, t0, t1):
    """Seconds of [t0, t1] with 0, 1, 2, 3+ of ``spans`` in progress."""
    edges = sorted([(max(a, t0), 1) for a, b in spans if b > t0 and a < t1] +
                   [(min(b, t1), -1) for a, b in spans if b > t0 and a < t1])
    out = collections.Counter()
    level, last = 0, t0
    for t, d in edges:
        out[min(level, 3)] += t - last
        level, last = level + d, t
    out[min(level, 3)] += t1 - last
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cache-gib", type=float, default=0.28)
    ap.add_argument("--ahead", type=int, default=2)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--age-steps", type=int, default=0, help="uniform steps first (0: until "
                    "the log's cleaner has cleaned 8 segments)")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    device = resolve_device()
    gen = np.random.default_rng(0)
    table, opt = bd.make_table(args, device, "disk", disk_dir=args.dir,
                               host_cache_bytes=int(args.cache_gib * (1 << 30)))
    table.disk.flush()
    pin = device.type == "cuda"
    log = getattr(table.disk.file, "stats", None)
    aged = 0
    while (aged < args.age_steps if args.age_steps else
           log is not None and log["cleaned_segments"] < 8 and aged < 2000):
        uni = [torch.randint(0, args.rows, (args.ids,)) for _ in range(4)]
        bd.run_steps(table, opt, [b.pin_memory() if pin else b for b in uni], device,
                     prefetch=args.ahead)
        aged += 4
    table.disk.flush(drop=True)
    table.disk.warm(bd.hottest(args.rows, table.disk.capacity_rows))
    cached = bd.hottest(args.rows, table.disk.capacity_rows)
    bd.run_steps(table, opt, [torch.from_numpy(cached[i:i + args.ids])
                              for i in range(0, len(cached), args.ids)], device, prefetch=0)

    def zipf(k):
        out = [torch.from_numpy(bd.zipf_ids(gen, args.rows, args.ids)) for _ in range(k)]
        return [b.pin_memory() if pin else b for b in out]
    bd.run_steps(table, opt, zipf(6), device, prefetch=args.ahead)
    probe = max(bd.probe(table, 8192, 32, gen), bd.probe(table, 8192, 64, gen))
    install()
    lock = table.disk._lock = TimedLock(table.disk._lock)
    batches = zipf(bd.SETTLE + args.steps + bd.TAIL)
    CALLS.clear()
    COUNTS.clear()
    before = dict(log) if log else {}
    marks = []
    ms = bd.run_steps(table, opt, batches, device, prefetch=args.ahead,
                      window=(bd.SETTLE, bd.SETTLE + args.steps),
                      marks=lambda: marks.append(time.perf_counter()))
    t0, t_end = marks
    ev = [e for e in EVENTS if e[2] > t0 and e[1] < t_end]
    by = collections.defaultdict(list)
    for kind, a, b, n, _ in ev:
        by[kind].append((a, b, n))
    total = t_end - t0
    cov = coverage([(a, b) for a, b, _ in by["load"] + by["sync"]], t0, t_end)
    reads = sum(n for _, _, n in by["load"] + by["sync"])
    print(f"{args.rows:,} rows, {args.steps} Zipf steps, {args.ahead} ahead: "
          f"{ms:.1f} ms/step; probe {probe:,.0f} rows/s; rows read {reads / args.steps:,.0f} a "
          f"step = {reads / total:,.0f} rows/s in the loop ({reads / total / probe:.2f}x probe)")
    print("reads in flight (loads + a lookup's own): " + ", ".join(
        f"{k}{'+' if k == 3 else ''}: {cov[k] / total:.0%}" for k in range(4)))
    for kind in ("find", "load", "write", "lookup", "sync"):
        xs = by[kind]
        if xs:
            d = np.array([b - a for a, b, _ in xs]) * 1e3
            n = np.array([n for _, _, n in xs])
            print(f"{kind:7s} {len(xs):4d} calls, ms mean {d.mean():6.2f} p90 "
                  f"{np.percentile(d, 90):6.2f} max {d.max():6.2f}, rows mean {n.mean():8.0f}, "
                  f"busy {d.sum() / 1e3 / total:.0%} of the loop")
    # how early each timed step's rows were asked for and read, against its lookup
    per = [STEPS[id(b)] for b in batches[bd.SETTLE:bd.SETTLE + args.steps]]
    step_s = ms / 1e3

    def lag(a, b):
        xs = [p[b] - p[a] for p in per if a in p and b in p]
        return (f"{np.median(xs) / step_s:5.2f} steps (p10 {np.percentile(xs, 10) / step_s:.2f},"
                f" p90 {np.percentile(xs, 90) / step_s:.2f}), {len(xs)} of {len(per)}"
                if xs else "n/a")
    print("per timed step, in steps of the loop's mean step time:")
    print("  prefetch -> its misses found :", lag("submit", "find"))
    print("  prefetch -> its load starts  :", lag("submit", "load0"))
    print("  load start -> load end       :", lag("load0", "load1"))
    print("  load start -> its lookup     :", lag("load0", "take"))
    print("  load end -> its lookup       :", lag("load1", "take"),
          "(negative: the lookup waited)")
    n_all = len(batches)
    print(f"inner calls, ms a step (all {n_all} steps of the loop), by thread:")
    for (name, thread), sec in sorted(CALLS.items(), key=lambda kv: -kv[1]):
        if sec / n_all * 1e3 >= 0.05:
            print(f"  {thread:18s} {name:28s} {sec / n_all * 1e3:7.2f}  "
                  f"({COUNTS[(name, thread)] / n_all:.1f} calls a step)")
    for name in sorted(set(lock.waited) | set(lock.held)):
        print(f"table lock, thread {name}: waited {lock.waited[name] / args.steps * 1e3:.2f}"
              f" ms a step, held {lock.held[name] / args.steps * 1e3:.2f} ms a step "
              "(the whole run's, the untimed first steps too)")
    if log:
        print("log during the loop:", {k: log[k] - before.get(k, 0) for k in log})
    table.close()


if __name__ == "__main__":
    main()
