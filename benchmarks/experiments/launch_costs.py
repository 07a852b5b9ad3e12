"""Experiment (GPU machine): CPU cost per batch of PinnedLoader (enqueue time, cProfile) and the
launch cost of each torch call it makes. Figures in benchmarks/RESULTS.md.

    python3 benchmarks/experiments/launch_costs.py
"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools.loader import PinnedLoader
from nbtools import hostmem
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
pairs = torch.randint(0, 1_000_000, (100_000_000, 2), generator=g)
ld = PinnedLoader(pairs, batch_size=32768, device=dev, seed=0)
it = iter(ld)
for _ in range(50): next(it)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(500): next(it)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"loader alone: {(t1 - t0) / 500 * 1e6:.1f} us/batch CPU (enqueue), {(time.perf_counter() - t0) / 500 * 1e6:.1f} us/batch wall")
pr = cProfile.Profile(); pr.enable()
for _ in range(500): next(it)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])

# raw op launch costs
view = hostmem.cuda_alias(pairs, dev)
idx = torch.randperm(100_000_000, device=dev)[:32768].to(torch.int32)
side = torch.cuda.Stream()
main = torch.cuda.current_stream()
def cost(name, fn, n=2000):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    print(f"{name:40s} {dt:7.2f} us")
cost("torch.sort(idx32)", lambda: torch.sort(idx), 500)
s_idx, order = torch.sort(idx)
cost("view.index_select(0, sidx)", lambda: view.index_select(0, s_idx), 500)
rows = view.index_select(0, s_idx)
cost("empty_like+index_copy_", lambda: torch.empty_like(rows).index_copy_(0, order, rows), 500)
cost("idx slice perm[a:b]", lambda: idx[100:200])
cost("torch.cuda.current_stream(dev)", lambda: torch.cuda.current_stream(dev))
cost("torch.cuda.current_stream()", lambda: torch.cuda.current_stream())
cost("side.wait_stream(main)", lambda: side.wait_stream(main))
cost("side.record_event()", lambda: side.record_event())
ev = side.record_event()
cost("main.wait_event(ev)", lambda: main.wait_event(ev))
def ctx():
    with torch.cuda.stream(side):
        pass
cost("with torch.cuda.stream(side)", ctx)
cost("rows.record_stream(main)", lambda: rows.record_stream(main))
cost("rows.view(n, 2)", lambda: rows.view(32768, 2))
cost("rows[0:100] slice", lambda: rows[0:100])
on = pairs[:1_000_000].to(dev)
cost("ceiling t[idx]", lambda: on[idx[:32768] % 1_000_000], 500)
