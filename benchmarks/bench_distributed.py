"""Weak scaling of a ShardedEmbedding: the same ids per rank, one machine, 1, 2, 4 ranks.

Each rank looks up its own batch of ids (uniform over the whole table), takes a small loss, runs
backward and its OffloadOptimizer(Adam) step. World 1 is a plain OffloadedEmbedding (the same
class without a process group), in this process. Reported per world size: the step time of the
slowest rank (a loop of steps, one synchronisation at its end), the median time of the lookup
alone (synchronised steps), the bytes one rank sends per step by the formula of
docs/distributed.md with the unique ids counted, the rows all ranks look up per second and
their ratio to world 1 (weak scaling targets: 1.8x on 2 GPUs, 3.4x on 4).

--backend nccl: one rank a GPU (rank r on cuda:r), NVLink multicast off (NCCL_NVLS_ENABLE=0);
gloo: every rank on --device, rows exchanged through the CPU. auto: nccl where there are GPUs
for the largest world, else gloo.

    python benchmarks/bench_distributed.py --backend nccl --worlds 1,2,4 --out DIR   # 4 GPUs
    python benchmarks/bench_distributed.py --quick       # 1 and 2 ranks, small, on a CPU
"""
from __future__ import annotations

import os
import statistics
import time

import harness
import torch
import torch.distributed as dist

import nbtools
from nbtools.devices import resolve_device, synchronize


def job(rank, world, rows, dim, batch, steps, device, placement):
    device = resolve_device(device.replace("rank", str(rank)))
    table = nbtools.ShardedEmbedding(rows, dim, name="items", device=device, placement=placement)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, table, lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, rows, (batch,), generator=g).to(device) for _ in range(steps + 3)]

    def step(ids):
        table(ids).float().pow(2).sum().mul(1e-3).backward()
        opt.step()
        opt.zero_grad()

    lookup_s, unique = [], []
    for i, ids in enumerate(batches):               # synchronised steps: the lookup alone
        synchronize(device)
        t0 = time.perf_counter()
        out = table(ids)
        synchronize(device)
        if i >= 3:                                   # warm-up
            lookup_s.append(time.perf_counter() - t0)
            unique.append(int(torch.unique(ids).numel()))
        out.float().pow(2).sum().mul(1e-3).backward()
        opt.step()
        opt.zero_grad()
    if world > 1:
        dist.barrier()
    synchronize(device)
    t0 = time.perf_counter()
    for ids in batches[3:]:                          # the loop as training runs it
        step(ids)
    synchronize(device)
    u = statistics.mean(unique)
    itemsize = torch.empty((), dtype=torch.float32).element_size()
    return {"step_ms": (time.perf_counter() - t0) / steps * 1e3,
            "lookup_ms": statistics.median(lookup_s) * 1e3, "placement": table.shard.placement,
            "sent_MB": (16 * world + u * (8 + 2 * dim * itemsize)) / 1e6 if world > 1 else 0.0}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=65_536, help="ids per rank per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    ap.add_argument("--placement", default="host", help="of each rank's shard (host, gpu)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.dim, args.batch, args.steps, args.worlds = 20_000, 16, 1024, 3, "1,2"
        args.backend = "gloo"
    worlds = [int(w) for w in args.worlds.split(",")]
    device = str(harness.setup(args))
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.device_count() >= max(worlds) else "gloo"
    if args.backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # NVLink multicast off
        device = "cuda:rank"                               # rank r on cuda:r
    result = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "backend": args.backend,
              "device": harness.device_name(resolve_device(device.replace("rank", "0"))),
              "worlds": {}}
    run = (args.rows, args.dim, args.batch, args.steps, device, args.placement)
    for world in worlds:
        if args.backend == "nccl" and world > torch.cuda.device_count():
            print(f"world {world}: skipped, {torch.cuda.device_count()} GPU(s)")
            continue
        per_rank = [job(0, 1, *run)] if world == 1 else nbtools.distributed.spawn(
            job, world, args=run, timeout=400, backend=args.backend)
        r = max(per_rank, key=lambda r: r["step_ms"])
        r["rows_per_s"] = world * args.batch / r["step_ms"] * 1e3
        result["worlds"][world] = r
    base = result["worlds"].get(1, {}).get("rows_per_s")
    for r in result["worlds"].values():
        r["vs_world_1"] = r["rows_per_s"] / base if base else None
    harness.print_table(
        ["ranks", "step ms (slowest)", "lookup ms", "MB sent/rank", "M rows/s (all)", "x 1 rank"],
        [[w, f"{r['step_ms']:.2f}", f"{r['lookup_ms']:.2f}", f"{r['sent_MB']:.2f}",
          f"{r['rows_per_s'] / 1e6:.2f}", f"{r['vs_world_1']:.2f}" if r["vs_world_1"] else None]
         for w, r in result["worlds"].items()],
        f"{args.rows:,} x {args.dim} Adam ({args.placement}), {args.batch:,} uniform ids per rank "
        f"per step, {result['device']}, {args.backend} (targets: 1.8x on 2, 3.4x on 4)")
    harness.save(args, "distributed.json", result)


if __name__ == "__main__":
    main()
