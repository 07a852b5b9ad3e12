"""Step time of a ShardedEmbedding against the number of ranks (gloo, one machine).

Each rank looks up its own batch of ids (uniform over the table), takes a small loss, runs
backward and its OffloadOptimizer(Adam) step. World 1 is a plain OffloadedEmbedding (the same
class without a process group). Reported per world size: the median step time of the slowest
rank, the median time of the lookup alone, and the bytes one rank sends per step by the formula
of docs/distributed.md with the unique ids counted.

    python benchmarks/bench_distributed.py --out DIR     # GPU machine: CUDA compute, gloo
    python benchmarks/bench_distributed.py --quick       # 1 and 2 ranks, small, on a CPU
"""
from __future__ import annotations

import statistics
import time

import harness
import torch

import nbtools
from nbtools.devices import resolve_device, synchronize


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
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="1,2,4")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.dim, args.batch, args.steps, args.worlds = 20_000, 16, 1024, 3, "1,2"
    device = str(harness.setup(args))
    result = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "device": device,
              "worlds": {}}
    for world in (int(w) for w in args.worlds.split(",")):
        per_rank = nbtools.distributed.spawn(
            job, world, args=(args.rows, args.dim, args.batch, args.steps, device), timeout=400)
        result["worlds"][world] = max(per_rank, key=lambda r: r["step_ms"])
    harness.print_table(
        ["ranks", "step ms (slowest)", "lookup ms", "MB sent/rank"],
        [[w, f"{r['step_ms']:.2f}", f"{r['lookup_ms']:.2f}", f"{r['sent_MB']:.2f}"]
         for w, r in result["worlds"].items()],
        f"{args.rows:,} x {args.dim} Adam, {args.batch:,} ids per rank per step, {device}, gloo")
    harness.save(args, "distributed.json", result)


if __name__ == "__main__":
    main()
