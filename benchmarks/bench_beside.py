"""What a disk table's read-ahead costs the step's thread beside it, on the CPU alone.

The read-ahead deduplicates each coming step's ids on a thread of its own
(:func:`nbtools.disk.readahead.prepare`, a ``torch.unique`` of 65,536 ids) while the step's thread
does its own host work: it fills the lookup's buffer with the step's 65,536 inverse ids and
marks the GPU level's slots (numpy scatters into arrays of a slot each). On a machine of few
cores the two share the cores. This script runs the step thread's work in a loop with a
read-ahead thread beside it in three ways, and times the step thread's work:

  none     no read-ahead beside it
  team     the read-ahead's dedup with torch's thread count (a team of threads)
  alone    the read-ahead's thread held to itself (:func:`nbtools.devices.torch_on_this_thread_alone`,
           what the read-ahead does on a machine of at most ``nbtools.devices.FEW_CORES`` cores)

and, under each, two ways of filling the buffer: a torch copy (which torch may split over its
thread pool) and a numpy copy (the calling thread alone). The read-ahead's thread dedups a batch,
then sleeps ``--gap-ms`` (the rest of a step), and reports its wall time per dedup and the CPU
time per dedup of every thread but the step's (the read-ahead's, and any team of torch threads
it starts).

    taskset -c 0,1 python benchmarks/bench_beside.py --out DIR    # a Colab-sized CPU share
    python benchmarks/bench_beside.py --quick
"""
from __future__ import annotations

import threading
import time

import harness
import numpy as np
import torch

from nbtools import devices
from nbtools.disk import readahead


def zipf_batches(gen, rows: int, ids: int, count: int) -> list:
    return [torch.from_numpy(harness.zipf_ids(gen, rows, ids)) for _ in range(count)]


class Beside:
    """The read-ahead's thread: dedups batches in turn, a gap after each, until stopped."""

    def __init__(self, batches, rows: int, mode: str, gap_s: float):
        self.batches, self.rows, self.mode, self.gap_s = batches, rows, mode, gap_s
        self.stop = threading.Event()
        self.wall = self.cpu = 0.0
        self.count = 0
        self.thread = threading.Thread(target=self.run, name="bench-readahead", daemon=True)

    def run(self):
        if self.mode == "alone":
            devices.torch_on_this_thread_alone()
        i = 0
        while not self.stop.is_set():
            w, c = time.perf_counter(), time.thread_time()
            readahead.prepare(self.batches[i % len(self.batches)], self.rows)
            self.wall += time.perf_counter() - w
            self.cpu += time.thread_time() - c
            self.count += 1
            i += 1
            time.sleep(self.gap_s)

    def __enter__(self):
        if self.mode != "none":
            self.thread.start()
            time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def step_work(args, gen):
    """The step thread's host work: each a function of no arguments, timed in turn."""
    inv = torch.unique(zipf_batches(gen, args.rows, args.ids, 1)[0], return_inverse=True)[1]
    buf = torch.empty(inv.numel() + 64, dtype=torch.long)
    flags = [np.zeros(args.slots, dtype=bool) for _ in range(3)]
    marks = [gen.integers(0, args.slots, args.marked) for _ in range(8)]

    def torch_copy():
        buf[64:] = inv

    def numpy_copy():
        buf.numpy()[64:] = inv.numpy()

    def scatters():
        for s in marks:
            for f in flags:
                f[s] = True
            flags[0][s] = False
    return {"buffer, torch copy": torch_copy, "buffer, numpy copy": numpy_copy,
            "slot marks, numpy": scatters}


def timed(fn, reps: int) -> dict:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts = np.sort(np.array(ts)) * 1e3
    return {"median_ms": float(np.median(ts)), "mean_ms": float(ts.mean()),
            "p90_ms": float(ts[int(0.9 * (len(ts) - 1))])}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--ids", type=int, default=65_536)
    ap.add_argument("--slots", type=int, default=8_000_000, help="the GPU level's slots")
    ap.add_argument("--marked", type=int, default=20_000, help="slots marked per scatter")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=4.0)
    args = ap.parse_args()
    if args.quick:
        args.rows, args.ids, args.slots, args.marked, args.reps = 100_000, 4096, 100_000, 500, 20
    harness.setup(args)
    gen = np.random.default_rng(0)
    batches = zipf_batches(gen, args.rows, args.ids, 16)
    work = step_work(args, gen)
    res = {"args": vars(args), "cores": devices.usable_cores(),
           "torch_threads": torch.get_num_threads(), "modes": {}}
    rows = []
    for mode in ("none", "team", "alone"):
        with Beside(batches, args.rows, mode, args.gap_ms / 1e3) as beside:
            count, wall = beside.count, beside.wall
            cpu, own = time.process_time(), time.thread_time()
            got = {name: timed(fn, args.reps) for name, fn in work.items()}
            # the CPU of every thread but this one: the read-ahead's and any team it starts
            others = (time.process_time() - cpu) - (time.thread_time() - own)
            count, wall = beside.count - count, beside.wall - wall
        per = count or 1
        got["readahead"] = {"dedups": count, "wall_ms": wall / per * 1e3,
                            "cpu_ms": others / per * 1e3}
        res["modes"][mode] = got
        for name in work:
            rows.append([f"{mode}: {name}", f"{got[name]['median_ms']:.3f}",
                         f"{got[name]['mean_ms']:.3f}", f"{got[name]['p90_ms']:.3f}"])
        if count:
            rows.append([f"{mode}: a dedup's wall ms / CPU ms of all other threads",
                         f"{got['readahead']['wall_ms']:.3f}", f"{got['readahead']['cpu_ms']:.3f}",
                         ""])
    harness.print_table(["beside the step's thread", "median ms", "mean ms", "p90 ms"], rows,
                        f"{res['cores']} cores, torch threads {res['torch_threads']}")
    harness.save(args, "bench_beside.json", res)


if __name__ == "__main__":
    main()
