"""Tile shapes of the zero-copy kernels, timed on the 65,536-uniform-id step of bench_step.py.

4,000,000 x 384 fp32 rows ([weight | m | v] of a 128-wide Adam table) in pinned host RAM; the
sorted unique ids of 65,536 uniform draws. Times, in ms (median of 5 loops of 20 calls):
  torch index_select / index_copy_   the traffic floor's two halves (bench_step.py "floor")
  gather R x C / W                   kernels.gather_rows with BLOCK_R=R, BLOCK_C=C, W warps
  adam R x C / W                     the fused Adam update writing the rows back (same tiles)
  read || write                      a gather and a scatter of different rows on two streams
                                     at once, against the two in series (do they overlap?)

    python benchmarks/experiments/zero_copy_tiles.py          # GPU machine, ~1 minute
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import hostmem, kernels  # noqa: E402

GATHER = [(8, 512, 4), (4, 512, 4), (16, 512, 8), (2, 512, 4), (32, 128, 4), (16, 128, 4),
          (64, 128, 8), (8, 128, 4), (8, 128, 2), (4, 128, 1), (64, 128, 4), (16, 256, 4)]
UPDATE = [(32, 128, 4), (16, 128, 4), (8, 128, 4), (64, 128, 8), (32, 128, 8), (128, 128, 8),
          (8, 128, 2), (4, 128, 1), (16, 128, 2)]


def timed(fn, reps=20, loops=5):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(loops):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def main():
    dev = torch.device("cuda")
    n, d, width = 4_000_000, 128, 384
    host = hostmem.HostTensor((n, width), torch.float32, name="tiles")
    view = host.view()
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.unique(torch.randint(0, n, (65_536,), generator=gen)).to(dev)
    other = torch.unique(torch.randint(0, n, (65_536,), generator=gen)).to(dev)
    cap = ids.numel() + 1
    kid = torch.cat([ids, torch.tensor([n], device=dev)])
    count = torch.tensor([ids.numel()], device=dev, dtype=torch.int32)
    guard = torch.zeros(1, device=dev, dtype=torch.int32)
    rows = torch.zeros(cap, width, device=dev)
    grad = torch.randn(cap, d, device=dev) * 1e-3
    target = kernels.Target(view=view, view_w=view[:, :d], state_col=d)
    group = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    adam = kernels.fused_update_for(torch.optim.Adam, group, ["exp_avg", "exp_avg_sq"],
                                    torch.float32)
    values, consts = adam.scalars(group, 5, 0)
    hyper = torch.tensor(values, dtype=torch.float64, device=dev)
    res = {}
    res["torch index_select"] = timed(lambda: view.index_select(0, ids))
    src = torch.zeros(ids.numel(), width, device=dev)
    res["torch index_copy_"] = timed(lambda: view.index_copy_(0, ids, src))
    res["floor (sum)"] = res["torch index_select"] + res["torch index_copy_"]
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    src2 = torch.zeros(other.numel(), width, device=dev)

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            view.index_select(0, ids)
        with torch.cuda.stream(s2):
            view.index_copy_(0, other, src2)
        cur.wait_stream(s1)
        cur.wait_stream(s2)
    res["read || write (two streams)"] = timed(both)
    for tile in GATHER:
        kernels.TILES["gather"] = tile
        res["gather %d x %d / %d" % tile] = timed(
            lambda: kernels.gather_rows(view, kid, count, rows))
    kernels.TILES.pop("gather")
    for tile in UPDATE:
        kernels.TILES["update"] = tile
        res["adam %d x %d / %d" % tile] = timed(
            lambda: adam(rows, rows[:, :d], grad, target, kid, count, guard, hyper, consts))
    kernels.TILES.pop("update")
    host.close()
    print(f"\n{torch.cuda.get_device_name(dev)}: 4,000,000 x 384 fp32, {ids.numel():,} unique ids")
    for k, v in res.items():
        print(f"{k:<34}{v:8.3f} ms")


if __name__ == "__main__":
    main()
