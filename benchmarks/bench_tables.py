"""Step time of OffloadOptimizer(Adam) against the usual alternatives, and its flatness in table size.

One step = lookup of a batch of ids, a small loss, backward, optimizer step. Compared, in one run:
  gpu_sparse_adam   nn.Embedding(sparse=True) on the GPU + torch.optim.SparseAdam (needs the
                    table on the GPU: the speed to approach)
  offload_adam      nbtools.OffloadedEmbedding + OffloadOptimizer(Adam), zero-copy
  manual_offload    CPU index_select into pinned buffers, copy to the GPU, Adam on the rows,
                    copy back, CPU index_copy_ (what people write by hand)
  cpu_sparse_adam   the table on the CPU with SparseAdam, rows copied to the GPU for the model
                    (the common workaround)
  gpu_dense_adam    nn.Embedding on the GPU + dense Adam
then offload_adam at several table sizes with the same batch (it should stay flat), plus raw
gather rates of zero-copy index_select.

    python benchmarks/bench_tables.py              # GPU machine: 4M x 128, 65,536 ids/step
    python benchmarks/bench_tables.py --quick      # small, runs on a CPU in seconds
"""
from __future__ import annotations

import gc
import time

import harness
import torch
from harness import loss_of, step_ms, synchronize
from torch import nn

import nbtools
from nbtools import hostmem


def bench_offload(n, dim, batches, device):
    t0 = time.perf_counter()
    table = nbtools.OffloadedEmbedding(n, dim, device=device, name=f"t{n}")
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, [table], lr=1e-3)
    alloc_s = time.perf_counter() - t0

    def step(ids):
        opt.zero_grad()
        loss_of(table(ids)).backward()
        opt.step()

    ms = step_ms(step, batches, device)
    table.close()
    del opt, table
    gc.collect()
    return ms, alloc_s


def bench_torch_embedding(n, dim, batches, device, opt_cls, sparse, table_device):
    emb = nn.Embedding(n, dim, sparse=sparse).to(table_device)
    opt = opt_cls(emb.parameters(), lr=1e-3)

    def step(ids):
        opt.zero_grad()
        rows = emb(ids.to(table_device)).to(device)
        loss_of(rows).backward()
        opt.step()

    ms = step_ms(step, batches, device)
    del opt, emb
    gc.collect()
    return ms


def bench_manual(n, dim, batches, device):
    """Hand-written offload: CPU gathers into pinned buffers, async copies, Adam on the GPU."""
    weight = torch.randn(n, dim)
    state = [torch.zeros(n, dim), torch.zeros(n, dim)]
    cap = max(b.numel() for b in batches)
    pin = device.type == "cuda"
    bufs = [torch.empty(cap, dim, pin_memory=pin) for _ in range(3)]
    adam = None
    step_count = [torch.tensor(0.0)]

    def step(ids):
        nonlocal adam
        uniq, inv = torch.unique(ids.cpu(), return_inverse=True)
        u = uniq.numel()
        host = [weight] + state
        gpu = []
        for src, buf in zip(host, bufs):
            torch.index_select(src, 0, uniq, out=buf[:u])
            gpu.append(buf[:u].to(device, non_blocking=True))
        p = nn.Parameter(gpu[0])
        rows = p[inv.to(device, non_blocking=True)]
        loss_of(rows).backward()
        if adam is None:
            adam = torch.optim.Adam([p], lr=1e-3)
        adam.param_groups[0]["params"] = [p]
        adam.state = {p: {"exp_avg": gpu[1], "exp_avg_sq": gpu[2], "step": step_count[0]}}
        adam.step()
        for dst, t, buf in zip(host, (p.detach(), gpu[1], gpu[2]), bufs):
            buf[:u].copy_(t, non_blocking=True)
        synchronize(device)
        for dst, buf in zip(host, bufs):
            dst.index_copy_(0, uniq, buf[:u])

    ms = step_ms(step, batches, device)
    del weight, state, bufs
    gc.collect()
    return ms


def gather_rates(device, n_ids=65536):
    """GB/s of zero-copy row gathers and scatters from pinned host memory, by row length and
    table size (sorted unique ids, as a table step issues them), and the bulk-copy ceiling."""
    out = {}
    for row_bytes, sizes_gib in ((512, (0.5, 2, 8, 20)), (1536, (1.5, 6, 24))):
        dim = row_bytes // 4
        for gib in sizes_gib:
            rows = int(gib * 2**30 / row_bytes)
            h = hostmem.HostTensor((rows, dim), torch.float32, name="gather-bench")
            view = h.view()
            idx = torch.unique(torch.randint(0, rows, (n_ids,), device=device))
            vals = torch.randn(idx.numel(), dim, device=device)
            for name, fn in (("gather", lambda: hostmem.gather_rows(view, idx)),
                             ("scatter", lambda: hostmem.scatter_rows(view, idx, vals))):
                for _ in range(3):
                    fn()
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                synchronize(device)
                rate = 20 * idx.numel() * row_bytes / (time.perf_counter() - t0) / 1e9
                out[f"{name} {row_bytes}B rows, {gib:g} GiB table (GB/s)"] = rate
            h.close()
            del h, view
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src, non_blocking=True)
    synchronize(device)
    out["pinned bulk memcpy host->GPU (GB/s)"] = src.numel() * 10 / (time.perf_counter() - t0) / 1e9
    return out


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sizes", default="1000000,10000000,50000000", help="rows for the flatness sweep")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.ids, args.steps, args.sizes = 100_000, 4096, 6, "10000,100000,400000"
    device = harness.setup(args)
    gen = torch.Generator(device="cpu").manual_seed(0)
    def make_batches(n):
        return [torch.randint(0, n, (args.ids,), generator=gen).to(device) for _ in range(args.steps + 3)]
    batches = make_batches(args.rows)

    res = {"device": harness.device_name(device),
           "torch": torch.__version__, "rows": args.rows, "dim": args.dim, "ids_per_step": args.ids,
           "step_ms": {}, "sweep_ms": {}, "sweep_alloc_s": {}}
    sm = res["step_ms"]
    print(f"# {res['device']}  table {args.rows:,} x {args.dim} fp32, {args.ids:,} ids/step", flush=True)
    sm["offload_adam"], _ = bench_offload(args.rows, args.dim, batches, device)
    print("offload_adam", sm["offload_adam"], flush=True)
    if device.type == "cuda":
        sm["gpu_sparse_adam"] = bench_torch_embedding(args.rows, args.dim, batches, device,
                                                      torch.optim.SparseAdam, True, device)
        sm["gpu_dense_adam"] = bench_torch_embedding(args.rows, args.dim, batches, device,
                                                     torch.optim.Adam, False, device)
    sm["manual_offload"] = bench_manual(args.rows, args.dim, batches, device)
    sm["cpu_sparse_adam"] = bench_torch_embedding(args.rows, args.dim, batches[: 3 + max(3, args.steps // 3)],
                                                  device, torch.optim.SparseAdam, True, torch.device("cpu"))
    for n in (int(s) for s in args.sizes.split(",")):
        b = make_batches(n)
        try:
            res["sweep_ms"][n], res["sweep_alloc_s"][n] = bench_offload(n, args.dim, b, device)
        except nbtools.NbtoolsError as e:          # too big for this machine: say so, go on
            res["sweep_ms"][n] = None
            print(f"skip {n:,} rows: {e}", flush=True)
        print("sweep", n, res["sweep_ms"][n], flush=True)
    if device.type == "cuda":
        res["gather"] = gather_rates(device)

    base = sm["offload_adam"]
    print(f"\n## step time, {args.rows:,} x {args.dim}, {args.ids:,} ids/step ({res['device']})")
    print(f"{'method':<22}{'ms/step':>10}{'vs offload_adam':>18}")
    for k, v in sm.items():
        print(f"{k:<22}{v:>10.2f}{v / base:>17.2f}x")
    print("\n## offload_adam vs table size (same batch)")
    for n, v in res["sweep_ms"].items():
        alloc = res["sweep_alloc_s"].get(n)
        print(f"{n:>12,} rows  {'-' if v is None else f'{v:.2f} ms/step'}  "
              f"(allocate+init {'-' if alloc is None else f'{alloc:.1f} s'})")
    for k, v in res.get("gather", {}).items():
        print(f"{k:<44}{v:8.1f}")
    harness.save(args, "tables.json", res)


if __name__ == "__main__":
    main()
