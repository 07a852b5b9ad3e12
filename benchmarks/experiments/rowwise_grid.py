"""Do small rows want other grid caps? (issue 23: the row-wise steps sit 1.13-1.32x above their
traffic floors where Adam's 1,536-byte rows reach theirs.)

The caps of the kernels that move rows over PCIe (``kernels.ZERO_COPY_PROGRAMS`` for the
gather, ``kernels.WRITE_BEHIND_PROGRAMS`` for the write-back behind the next step) were chosen
on fp32 Adam's 1,536-byte rows (benchmarks/experiments/write_behind.py --real). This times
bench_step.py's 65,536-uniform-id step of each storage combination named in ``--systems`` over
a grid of both caps, each system against the traffic floor of its own rows over the same ids
(bench_step.traffic_floor_ms), a fresh table per point (the caps are read when a lookup is
captured), the defaults first.

    python benchmarks/experiments/rowwise_grid.py            # GPU machine, ~2-3 min
    python benchmarks/experiments/rowwise_grid.py --writes 16,32 --gathers 32,64
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_step
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
import bench_step as bs  # noqa: E402
from nbtools import kernels  # noqa: E402

SYSTEMS = ("nbtools host bf16 rowwise,nbtools host rowwise,"
           "nbtools host bf16 rowwise+bf16 state,nbtools host bf16+bf16 state")


def ints(text: str) -> list:
    return [int(x) for x in text.split(",") if x]


def point_ms(name, batches, dev, writes, gathers, rows, dim):
    """ms per step of system ``name`` with the two caps set while its table is made and run."""
    saved = kernels.WRITE_BEHIND_PROGRAMS, kernels.ZERO_COPY_PROGRAMS
    kernels.WRITE_BEHIND_PROGRAMS, kernels.ZERO_COPY_PROGRAMS = writes, gathers
    try:
        step, keep = bs.system_step(name, dev, n=rows, dim=dim)
        bs.follow(step, batches)                                        # for a prefetching step
        ms = bs.loop_ms(step, batches, dev)
        row_bytes = bs.stored_row_bytes(keep[0])
        del step, keep
    finally:
        kernels.WRITE_BEHIND_PROGRAMS, kernels.ZERO_COPY_PROGRAMS = saved
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return ms, row_bytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--systems", default=SYSTEMS)
    ap.add_argument("--writes", default="8,16,32,64", help="write-back caps (programs)")
    ap.add_argument("--gathers", default="32,64,132", help="gather caps (programs)")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    dev = bs.resolve_device()     # (a CPU runs the plumbing only: the caps are CUDA's)
    batches = bs.uniform_batches(65536, dev, n=args.rows)
    default = (kernels.WRITE_BEHIND_PROGRAMS, kernels.ZERO_COPY_PROGRAMS)
    grid = [default] + [(w, p) for p in ints(args.gathers) for w in ints(args.writes)
                        if (w, p) != default]
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# {gpu}; {args.rows:,} x {args.dim}, 65,536 uniform ids; "
          f"defaults W={default[0]}, P={default[1]}", flush=True)
    summary = []
    for name in args.systems.split(","):
        floor = None
        times = []
        for w, p in grid:
            ms, row_bytes = point_ms(name, batches, dev, w, p, args.rows, args.dim)
            if floor is None:
                floor = bs.traffic_floor_ms(args.rows, args.dim, batches, dev,
                                            width_factor=row_bytes / 4 / args.dim)
                print(f"{name}: {row_bytes} B rows, floor {floor:.3f} ms", flush=True)
            times.append((ms, w, p))
            print(f"  W={w:<4} P={p:<4} {ms:7.3f} ms  {ms / floor:5.2f}x floor", flush=True)
        best = min(times)
        summary.append((name, row_bytes, floor, times[0][0], best))
    print("\n| system | row B | floor ms | default ms (x floor) | best ms (x floor) | best W, P |")
    print("|---|---:|---:|---:|---:|---|")
    for name, row_bytes, floor, base, (ms, w, p) in summary:
        print(f"| {name} | {row_bytes} | {floor:.3f} | {base:.3f} ({base / floor:.2f}) | "
              f"{ms:.3f} ({ms / floor:.2f}) | {w}, {p} |")


if __name__ == "__main__":
    main()
