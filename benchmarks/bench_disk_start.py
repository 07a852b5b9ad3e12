"""A fresh disk table's start, as notebooks/disk.ipynb meets it: the seconds to make the table,
to attach the optimizer (the one write of every row with its state), to warm the RAM cache with
the stream's hottest items, and each of the first ``--steps`` steps of ``fit_stream`` (reading
8 steps ahead). Beside each step: the Triton kernels compiled during it (new entries in the
kernel families' caches), and, over the whole loop, the functions that took the most of the
host's own time (cProfile).

On the H100 the notebook's first three steps took ~40 s, with the GPU idle and the disk reading
~1 MB/s, and later steps 58-78 ms: this script says where those seconds go.

    python benchmarks/bench_disk_start.py --out DIR       # GPU machine: the notebook's table
    python benchmarks/bench_disk_start.py --quick         # any machine
"""
from __future__ import annotations

import cProfile
import io
import pstats
import shutil
import tempfile
import time

import harness
import torch
from harness import synchronize

import nbtools
from nbtools.kernels.common import compiled, compiled_by_kernel
from nbtools.models.clickstream import ClickStream, Item2Vec, fit_stream


def unwritten_mib() -> float:
    """The page cache's bytes not yet on disk (Dirty + Writeback in /proc/meminfo), MiB: a
    fresh table's file is written through it, and reads queue behind its flush (nan where there
    is no /proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
        return (kib["Dirty"] + kib["Writeback"]) / 1024
    except (OSError, KeyError, ValueError):
        return float("nan")


class StepTimer:
    """What fit_stream's ``dashboard`` argument is stepped with: each step's seconds (from the
    last call) and the kernels compiled during it."""

    def __init__(self, device):
        self.device = device
        self.seconds, self.compiles, self.unwritten = [], [], []
        self.t = time.perf_counter()
        self.seen = compiled()

    def step(self, n):
        synchronize(self.device)
        now, seen = time.perf_counter(), compiled()
        self.seconds.append(now - self.t)
        self.compiles.append(seen - self.seen)
        self.unwritten.append(unwritten_mib())
        self.t, self.seen = now, seen


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=21_136_650)
    ap.add_argument("--dim", type=int, default=252)
    ap.add_argument("--batch", type=int, default=32_768, help="triples a step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--dir", default=None, help="the table's folder (default: a temporary one)")
    args = ap.parse_args()
    device = harness.setup(args)
    if args.quick:
        args.rows, args.batch, args.budget_gib, args.steps = 200_000, 1_024, 0.0625, 6
    budget = int(args.budget_gib * 2**30)
    folder = args.dir or tempfile.mkdtemp(prefix="nbtools-disk-start-")
    nbtools.set_host_budget(budget)
    times = {}
    t = time.perf_counter()
    table = nbtools.OffloadedEmbedding(args.rows, args.dim, name="items", dtype=torch.bfloat16,
                                       placement="disk", disk_dir=folder, device=device,
                                       host_cache_bytes=budget // 2)
    times["make_s"] = time.perf_counter() - t
    t = time.perf_counter()
    opt = nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.3)
    times["optimizer_s"] = time.perf_counter() - t
    times["unwritten_mib_after_optimizer"] = unwritten_mib()
    stream = ClickStream(args.rows, args.batch, topics=64, seed=0)
    timer = StepTimer(device)
    profile = cProfile.Profile()
    profile.enable()
    history = fit_stream(Item2Vec(table), stream, opt, args.steps, dashboard=timer,
                         log_every=args.steps)
    profile.disable()
    times["warm_s"] = history["warm_s"]
    timer.seconds[0] -= history["warm_s"]        # (the warming ran before the first step)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
    top = [line for line in text.getvalue().splitlines() if line.strip()][-16:]
    table.close()
    if args.dir is None:
        shutil.rmtree(folder, ignore_errors=True)

    print(f"{args.rows:,} x {args.dim} bf16 rows with RowWiseAdagrad on disk, "
          f"{args.batch:,} triples a step, {harness.device_name(device)}")
    print(f"  make the table {times['make_s']:.2f} s; attach the optimizer (every row written "
          f"once) {times['optimizer_s']:.2f} s, leaving "
          f"{times['unwritten_mib_after_optimizer']:,.0f} MiB not yet on disk; warm the RAM "
          f"cache {times['warm_s']:.2f} s")
    harness.print_table(["step", "seconds", "Triton kernels compiled", "MiB not yet on disk"],
                        [[i, f"{s:.3f}", c, f"{u:,.0f}"] for i, (s, c, u) in
                         enumerate(zip(timer.seconds, timer.compiles, timer.unwritten))])
    kinds = compiled_by_kernel()
    print("specialisations compiled, per kernel: " +
          (", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"))
    print("host time by function, the whole loop (cProfile, own time):")
    print("\n".join(top))
    harness.save(args, "bench_disk_start.json", {
        "args": vars(args), "device": harness.device_name(device), **times,
        "step_s": timer.seconds, "compiled": timer.compiles, "compiled_by_kernel": kinds,
        "unwritten_mib": timer.unwritten, "profile": top,
        "ram_hit_rate": history["ram_hit_rate"]})


if __name__ == "__main__":
    main()
