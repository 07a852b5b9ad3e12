"""Can a step's compute run beside a zero-copy gather, and on how few SMs can that gather keep
the link busy? bench_step.py's 65,536-uniform-id step: 4,000,000 x 384 fp32 rows ([weight | m |
v] of a 128-wide Adam table) in pinned host RAM, the sorted unique ids of 65,536 draws.

  gather P          kernels.gather_rows of the 256 state columns on a grid capped at P programs
                    (None: one program per row block), alone
  compute           a stand-in for the step's own kernels (index_select, pow, sum, index_add_,
                    an int32 sort of the ids) on the GPU, alone
  both P            the two at once on two streams: wall, and the compute stream's own span
  step serial       gather 384 columns, compute, write 384 columns back (what a step does now)
  step split P      gather the 128 weight columns; then the 256 state columns on a side stream
                    (grid capped at P) while the compute runs; then the write-back
  floor             gather + write back of 384 columns (bench_step.py's traffic floor)

    python benchmarks/experiments/overlap.py        # GPU machine, ~1 minute
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import hostmem, kernels  # noqa: E402

N, D = 4_000_000, 128


def timed(fn, reps=10, loops=5):
    """Median ms per call of ``fn`` (returns its own inner span in ms if it gives one)."""
    fn()
    torch.cuda.synchronize()
    walls, inner = [], []
    for _ in range(loops):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        spans = []
        a.record()
        for _ in range(reps):
            spans.append(fn())
        b.record()
        b.synchronize()
        walls.append(a.elapsed_time(b) / reps)
        if spans[0] is not None:
            inner.append(sum(x.elapsed_time(y) for x, y in spans) / reps)
    return statistics.median(walls), (statistics.median(inner) if inner else None)


def main():
    dev = torch.device("cuda")
    h = hostmem.HostTensor((N, 3 * D), torch.float32, name="overlap")
    view = h.view()
    gen = torch.Generator().manual_seed(0)
    draws = torch.randint(0, N, (65_536,), generator=gen).to(dev)
    ids = torch.unique(draws)
    cap = ids.numel()
    count = torch.tensor([cap], device=dev)
    inv = torch.searchsorted(ids, draws)
    out_w = torch.empty(cap, D, device=dev)
    out_s = torch.empty(cap, 2 * D, device=dev)
    out_all = torch.empty(cap, 3 * D, device=dev)
    x = torch.randn(cap, D, device=dev)
    ids32 = draws.int()
    side = torch.cuda.Stream()
    main_s = torch.cuda.current_stream()

    def compute():
        y = x.index_select(0, inv)
        y.pow(2).sum()
        g = torch.zeros_like(x)
        g.index_add_(0, inv, y)
        torch.sort(ids32)
        return None

    def gather_state(p):
        kernels.gather_rows(view, ids, count, out_s, col0=D, programs=p)

    rows = []
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    caps = [None, 4 * sms, 2 * sms, sms, sms // 2, sms // 4, 16, 8]
    rows.append(("compute", *timed(compute)))
    for p in caps:
        rows.append((f"gather P={p}", *timed(lambda: gather_state(p))))
    for p in caps:
        def both():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            side.wait_stream(main_s)
            with torch.cuda.stream(side):
                gather_state(p)
            a.record()
            compute()
            b.record()
            main_s.wait_stream(side)
            return a, b
        rows.append((f"both P={p} (inner: compute span)", *timed(both)))

    def serial():
        kernels.gather_rows(view, ids, count, out_all)
        compute()
        view.index_copy_(0, ids, out_all)
    rows.append(("step serial", *timed(serial)))
    for p in caps:
        def split():
            kernels.gather_rows(view, ids, count, out_w)
            side.wait_stream(main_s)
            with torch.cuda.stream(side):
                gather_state(p)
            compute()
            main_s.wait_stream(side)
            view.index_copy_(0, ids, out_all)
        rows.append((f"step split P={p}", *timed(split)))

    def floor():
        kernels.gather_rows(view, ids, count, out_all)
        view.index_copy_(0, ids, out_all)
    rows.append(("floor", *timed(floor)))
    print(f"{cap:,} unique rows of {N:,} x {3 * D} fp32, {sms} SMs")
    for name, ms, inner in rows:
        extra = f"   inner {inner:.3f} ms" if inner is not None else ""
        print(f"  {name:40s} {ms:7.3f} ms{extra}")
    h.close()


if __name__ == "__main__":
    main()
