"""A plain training loop over a PinnedLoader on a disk table, which reads the coming batches'
rows ahead by itself (nbtools.engine.ahead), against the same loop calling ``table.prefetch``
8 steps ahead, and the loop whose ids are not the loader's own tensors (no read-ahead).

A ``--rows`` x ``--dim`` table (bf16 weights, row-wise Adagrad) on disk with a ``--cache-gib``
RAM cache warmed with the hottest rows of a Zipf(1.1) stream, every cached row marked changed
before each loop (a long run's steady state: each miss evicts a row that is written back).
Each loop gets its own ids (``--ids`` a step), so no loop finds another's rows in RAM; rounds
alternate the loops. ms/step over all but the first SETTLE steps of a loop.

    python benchmarks/bench_ahead.py --out DIR          # GPU machine
    python benchmarks/bench_ahead.py --quick            # any machine
"""
from __future__ import annotations

import statistics
import time

import harness
import numpy as np
import torch
from harness import hottest, synchronize, zipf_ids

import nbtools

SETTLE = 10


def loop(table, opt, loader, device, kind: str, coming: list) -> float:
    """ms/step of one loop over ``loader``: "plain" (the loader's tensors), "prefetch" (the
    same ids from the host, ``table.prefetch`` 8 steps ahead), "copied" (``ids + 0``)."""
    head = torch.linspace(-1, 1, table.embedding_dim, device=device)
    table.disk.ram.dirty[table.disk.ram.id_of >= 0] = True
    if kind == "prefetch":
        for ids in coming[1:8]:
            table.prefetch(ids)
        batches = [(ids,) for ids in coming]
    else:
        batches = loader
    t0 = None
    for i, (ids,) in enumerate(batches):
        if i == SETTLE:
            synchronize(device)
            t0 = time.perf_counter()
        rows = table(ids + 0 if kind == "copied" else ids)
        if kind == "prefetch" and i + 8 < len(coming):
            table.prefetch(coming[i + 8])
        (rows * head).sum().backward()
        opt.step()
        opt.zero_grad()
    synchronize(device)
    return (time.perf_counter() - t0) / (len(coming) - SETTLE) * 1e3


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--cache-gib", type=float, default=1.4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--gpu-cache-gib", type=float, default=0.0,
                    help="a GPU level of this size above the RAM cache, warmed from the "
                         "stream's shares (as a model warms it)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.dim, args.ids, args.steps, args.cache_gib, args.rounds = \
            50_000, 16, 1024, 6, 0.0005, 1
        args.gpu_cache_gib = min(args.gpu_cache_gib, 0.001)
    device = harness.setup(args)
    table = nbtools.OffloadedEmbedding(args.rows, args.dim, device=device, placement="disk",
                                       dtype=torch.bfloat16, disk_dir=args.dir,
                                       host_cache_bytes=int(args.cache_gib * (1 << 30)))
    opt = nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.01)
    t0 = time.perf_counter()
    table.disk.warm(hottest(args.rows, table.disk.ram.capacity_rows))
    if args.gpu_cache_gib:
        from nbtools.disk.gpu import attach
        attach(table.disk, int(args.gpu_cache_gib * (1 << 30)) // table.disk.row_bytes, device)
        table.warm_cache(harness.zipf_shares(args.rows))
    print(f"{table!r}\nwarmed in {time.perf_counter() - t0:.0f} s", flush=True)
    gen = np.random.default_rng(0)
    kinds = ("plain", "prefetch", "copied")
    times = {k: [] for k in kinds}
    n = SETTLE + args.steps
    for r in range(args.rounds + 1):                  # round 0: warm-up, not counted
        for kind in kinds:
            flat = torch.from_numpy(zipf_ids(gen, args.rows, n * args.ids))
            loader = nbtools.PinnedLoader(flat, batch_size=args.ids, device=device,
                                          shuffle=False)
            coming = [b.pin_memory() if device.type == "cuda" else b
                      for b in flat.split(args.ids)]
            ms = loop(table, opt, loader, device, kind, coming)
            if r:
                times[kind].append(ms)
            print(f"round {r} {kind}: {ms:.1f} ms/step", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    res = {"args": vars(args), "device": str(device), "gpu": harness.device_name(device),
           "ms_per_step": times, "median_ms": med,
           "plain_x_prefetch": med["plain"] / med["prefetch"],
           "copied_x_prefetch": med["copied"] / med["prefetch"]}
    harness.print_table(
        ["loop", "ms/step (rounds)", "median", "x prefetch 8 ahead"],
        [[k, ", ".join(f"{x:.1f}" for x in times[k]), f"{med[k]:.1f}",
          f"{med[k] / med['prefetch']:.2f}"] for k in kinds],
        f"{args.rows:,} x {args.dim} bf16 on disk, {args.cache_gib} GiB RAM cache, "
        + (f"{args.gpu_cache_gib} GiB GPU level, " if args.gpu_cache_gib else "") +
        f"{args.ids:,} Zipf ids a step")
    table.close()
    harness.save(args, "bench_ahead.json", res)


if __name__ == "__main__":
    main()
