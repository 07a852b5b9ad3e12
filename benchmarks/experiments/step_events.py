"""Where a looped step's GPU waits for the host, without a profiler (which slows the host and
changes the answer where the step is bound by it).

Each step of bench_step.py's 4,000,000 x 128 table, 65,536 uniform ids, records a CUDA event
on the training stream at four points (before the lookup, after it, after the loss's backward,
after the optimizer step) and reads the host clock at the same points. After the loop the
events give the GPU's times; aligned with the host clock at the first event (the GPU idle
then), ``lag = GPU time - host time`` at each point: near its minimum the GPU reached that
point as soon as the host queued it (it had been waiting for the host); large, the GPU was
still busy with earlier work. Per phase: GPU time, host time, and the share of steps whose
phase began with the GPU waiting.

    python benchmarks/experiments/step_events.py --systems "nbtools host bf16 rowwise"   # GPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import bench_step as bs  # noqa: E402

POINTS = ("start", "looked up", "backward done", "stepped")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    bs.add_systems_arg(ap, "nbtools host,nbtools host bf16 rowwise")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ids", type=int, default=65_536)
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = bs.uniform_batches(args.ids, device)
    for name in args.systems.split(","):
        table, opt = bs.system_step(name, device)[1]
        head = torch.linspace(-1, 1, table.embedding_dim, device=device)
        ahead = bool((bs.SYSTEMS.get(name) or {}).get("prefetch"))   # table.prefetch(next ids)
        for i, ids in enumerate(batches[:10]):
            rows = table(ids)
            if ahead:
                table.prefetch(batches[(i + 1) % len(batches)])
            bs.loss_of(rows * head).backward()
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        marks = []           # per step: [(event, host seconds)] at POINTS

        def mark(row):
            e = torch.cuda.Event(enable_timing=True)
            e.record(stream)
            row.append((e, time.perf_counter()))
        t0 = time.perf_counter()
        for i in range(args.steps):
            row = []
            mark(row)
            rows = table(batches[i % len(batches)])
            if ahead:
                table.prefetch(batches[(i + 1) % len(batches)])
            mark(row)
            bs.loss_of(rows * head).backward()
            mark(row)
            opt.step()
            opt.zero_grad()
            mark(row)
            marks.append(row)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps * 1e3
        first_e, first_h = marks[0][0]
        lag = [[first_e.elapsed_time(e) - (h - first_h) * 1e3 for e, h in row] for row in marks]
        floor = min(min(r) for r in lag)
        print(f"\n=== {name}: {wall:.3f} ms/step (loop, events included)")
        print(f"{'phase':<34}{'GPU ms':>8}{'host ms':>9}{'GPU waited':>12}")
        for p in range(len(POINTS)):
            nxt = (p + 1) % len(POINTS)
            gpu, host, waited = [], [], 0
            for i, row in enumerate(marks):
                if nxt == 0:
                    if i + 1 == len(marks):
                        continue
                    end_e, end_h = marks[i + 1][0]
                else:
                    end_e, end_h = row[nxt]
                gpu.append(row[p][0].elapsed_time(end_e))
                host.append((end_h - row[p][1]) * 1e3)
                waited += lag[i][p] - floor < 0.03      # within 30 us of the host's clock
            label = f"{POINTS[p]} -> {POINTS[nxt]}"
            print(f"{label:<34}{statistics.median(gpu):8.3f}{statistics.median(host):9.3f}"
                  f"{waited / len(gpu):11.0%}")
        med = [statistics.median(lag[i][p] for i in range(len(marks))) - floor
               for p in range(len(POINTS))]
        print("GPU behind the host at each point, median ms: " +
              ", ".join(f"{POINTS[p]} {med[p]:.3f}" for p in range(len(POINTS))))
        del table, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
