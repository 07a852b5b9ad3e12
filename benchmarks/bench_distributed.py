"""Step time of a ShardedEmbedding against the number of ranks (gloo, one machine).

Each rank looks up its own batch of ids (uniform over the table), takes a small loss, runs
backward and its OffloadOptimizer(Adam) step. World 1 is a plain OffloadedEmbedding (the same
class without a process group). Reported per world size: the median step time of the slowest
rank, the median time of the lookup alone, and the bytes one rank sends per step by the formula
of docs/distributed.md with the unique ids counted.

    python benchmarks/bench_distributed.py --out DIR     # GPU machine: CUDA compute, gloo
    python benchmarks/bench_distributed.py --quick       # small, on a CPU in seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import nbtools  # noqa: E402
from nbtools.devices import resolve_device, synchronize  # noqa: E402


def job(rank, world, rows, dim, batch, steps, device):
    device = resolve_device(device)
    table = nbtools.ShardedEmbedding(rows, dim, name="items", device=device)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, table, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, rows, (batch,), generator=g) for _ in range(steps + 3)]
    step_s, lookup_s, unique = [], [], []
    for i, ids in enumerate(batches):
        synchronize(device)
        t0 = time.perf_counter()
        out = table(ids)
        synchronize(device)
        t1 = time.perf_counter()
        out.float().pow(2).sum().mul(1e-3).backward()
        opt.step()
        opt.zero_grad()
        synchronize(device)
        if i >= 3:                                   # warm-up
            step_s.append(time.perf_counter() - t0)
            lookup_s.append(t1 - t0)
            unique.append(int(torch.unique(ids).numel()))
    u = statistics.mean(unique)
    itemsize = torch.empty((), dtype=torch.float32).element_size()
    return {"step_ms": statistics.median(step_s) * 1e3,
            "lookup_ms": statistics.median(lookup_s) * 1e3,
            "sent_MB": (16 * world + u * (8 + 2 * dim * itemsize)) / 1e6 if world > 1 else 0.0}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, CPU-friendly")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--device", default="auto", help="compute device of every rank")
    ap.add_argument("--out", default=None, help="write DIR/distributed.json")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.dim, args.batch, args.steps, args.worlds = 100_000, 32, 4096, 5, "1,2"
    device = str(resolve_device(args.device))
    result = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "device": device,
              "worlds": {}}
    print(f"{args.rows:,} x {args.dim} Adam, {args.batch:,} ids per rank per step, {device}, gloo")
    print(f"{'ranks':>6}{'step ms (slowest)':>20}{'lookup ms':>12}{'MB sent/rank':>14}")
    for world in (int(w) for w in args.worlds.split(",")):
        per_rank = nbtools.distributed.spawn(
            job, world, args=(args.rows, args.dim, args.batch, args.steps, device), timeout=400)
        worst = max(per_rank, key=lambda r: r["step_ms"])
        result["worlds"][world] = worst
        print(f"{world:>6}{worst['step_ms']:>20.2f}{worst['lookup_ms']:>12.2f}"
              f"{worst['sent_MB']:>14.2f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "distributed.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
