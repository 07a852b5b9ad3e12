"""Does a prefetching step gain when its update runs beside the prefetch's gather?

With ``Prefetcher.UPDATE_WAITS`` (the default) a step's update waits for the pending prefetch's
gather; off (tables without a cache), the update and its write-back run beside it. Each system
of bench_step.py (its 65,536-uniform-id step on 4M x 128, the next batch prefetched) is built
once and timed in alternating loops, waits on and off, ``--rounds`` times: single loops of
these steps move by 10-20% between calls, so only a same-table alternation tells the two apart.
Each system against the traffic floor of its own rows (bench_step.traffic_floor_ms).

    python benchmarks/experiments/prefetch_overlap.py           # GPU machine, ~1-2 minutes
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_step
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
import bench_step as bs  # noqa: E402
from nbtools.prefetch import Prefetcher  # noqa: E402

SYSTEMS = ("nbtools host bf16 rowwise,nbtools host bf16 rowwise prefetch,"
           "nbtools host bf16 rowwise+bf16 state prefetch,nbtools host rowwise prefetch,"
           "nbtools host bf16+bf16 state prefetch,nbtools host prefetch")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bs.add_systems_arg(ap, SYSTEMS)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    dev = bs.resolve_device()
    batches = bs.uniform_batches(65536, dev, n=args.rows)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# {gpu}; {args.rows:,} x {args.dim}, 65,536 uniform ids; {args.rounds} rounds of "
          "alternating loops (update waits / beside)", flush=True)
    rows_out = []
    for name in args.systems.split(","):
        step, keep = bs.system_step(name, dev, n=args.rows, dim=args.dim)
        step.next.update({id(b): batches[(i + 1) % len(batches)]
                          for i, b in enumerate(batches)})
        times = {True: [], False: []}
        try:
            for _ in range(args.rounds):
                for waits in (True, False):
                    Prefetcher.UPDATE_WAITS = waits
                    times[waits].append(bs.loop_ms(step, batches, dev, repeats=3, warmup=2))
        finally:
            Prefetcher.UPDATE_WAITS = True
        row_bytes = bs.stored_row_bytes(keep[0])
        del step, keep
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        floor = bs.traffic_floor_ms(args.rows, args.dim, batches, dev,
                                    width_factor=row_bytes / 4 / args.dim)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        wins = sum(b < a for a, b in zip(times[True], times[False]))
        print(f"{name}: {row_bytes} B rows, floor {floor:.3f} ms; waits "
              f"{' '.join(f'{t:.3f}' for t in times[True])}; beside "
              f"{' '.join(f'{t:.3f}' for t in times[False])}", flush=True)
        rows_out.append((name, row_bytes, floor, on, off, wins))
    print("\n| system | row B | floor ms | update waits ms (x floor) | update beside ms (x floor) "
          "| beside / waits | rounds beside won |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rb, floor, on, off, wins in rows_out:
        print(f"| {name} | {rb} | {floor:.3f} | {on:.3f} ({on / floor:.2f}) | {off:.3f} "
              f"({off / floor:.2f}) | {off / on:.2f} | {wins} of {args.rounds} |")


if __name__ == "__main__":
    main()
