"""Where a small step's host (CPU) time goes: bench_step.py's 4,000,000 x 128 Adam step with
4,096 uniform ids (``--ids``), nbtools GPU-placed and offloaded (writing behind the next step,
and writing through) against nn.Embedding(sparse=True) + SparseAdam, or the systems named by
``--systems`` (bench_step.SYSTEMS); ``--cprofile`` adds cProfile's tables.

At this size the GPU finishes each step long before the host has queued the next, so the
step's wall time is the host's time. Every piece of the step is wrapped with a timer (a few
hundred nanoseconds each) and timed over ``--steps`` steps; the table gives microseconds of
CPU per step per piece (indented pieces are inside the one above: _queue holds the graph
replay, or, for a step not seen before, the checks and launches queued op by op).

    python benchmarks/experiments/host_costs.py [--steps 300]     # GPU machine, ~20 s
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import bench_step as bs  # noqa: E402
from nbtools import optim, tables
from nbtools.engine import prefetch
from nbtools.store import rows
from nbtools.engine import steps  # noqa: E402

SPENT = collections.Counter()


def timed(owner, name, label=None):
    """Wrap ``owner.name`` so each call adds its wall time to SPENT[label]."""
    fn = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT[label] += time.perf_counter() - t0
    setattr(owner, name, wrapper)
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ids", type=int, default=4096)
    bs.add_systems_arg(ap, "torch sparse,nbtools gpu,nbtools host,nbtools host write-through")
    ap.add_argument("--cprofile", action="store_true",
                    help="also profile each system's loop with cProfile (the functions with "
                    "the most own time, and the most time inside them)")
    ap.add_argument("--cprofile-rows", type=int, default=28,
                    help="rows of each cProfile table")
    ap.add_argument("--cprofile-only", default="",
                    help="list only functions whose file or name matches this regex "
                    "(e.g. nbtools)")
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = bs.uniform_batches(args.ids, device)
    wraps = [(optim.OffloadOptimizer, "step", "opt.step"),
             (optim.OffloadOptimizer, "_queue", "  _queue (checks + updates)"),
             (optim.OffloadOptimizer, "_settle", "  _settle"),
             (optim.TableSlot, "plan_fused", "    plan_fused"),
             (steps.StepGraphs, "run", "    StepGraphs.run (replay)"),
             (steps, "queue_checks", "    queue_checks (eager)"),
             (optim.TableSlot, "queue_fused", "    queue_fused (eager)"),
             (tables.OffloadedEmbedding, "collect", "  collect"),
             (tables.OffloadedEmbedding, "forward", "table(ids)"),
             (rows.LookupGraphs, "run", "  LookupGraphs.run"),
             (rows.RowStore, "patch", "    RowStore.patch"),
             (rows.RowStore, "write_behind", "  RowStore.write_behind"),
             (prefetch.Prefetcher, "start", "table.prefetch"),
             (prefetch.Prefetcher, "take", "  Prefetcher.take")]
    for owner, name, label in wraps:
        timed(owner, name, label)
    results = []          # (system, wall, parts): a system may be named twice
    for system in args.systems.split(","):
        step, keep = bs.system_step(system, device)
        bs.follow(step, batches)           # a prefetching step needs each batch's successor
        if system == "torch sparse":
            emb, opt = keep
            timed(opt, "step", "opt.step")
            timed(emb, "forward", "table(ids)")
        orig_backward = torch.Tensor.backward
        timed(torch.Tensor, "backward", "loss.backward")
        for i in range(3 * len(batches)):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        SPENT.clear()
        rounds = args.steps // len(batches) * len(batches)   # whole passes: prefetch's order
        t0 = time.perf_counter()
        for i in range(rounds):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / rounds * 1e6
        spent = dict(SPENT)
        if args.cprofile:
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            for i in range(rounds):
                step(batches[i % len(batches)])
            torch.cuda.synchronize()
            prof.disable()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(
                    *([args.cprofile_only] if args.cprofile_only else []), args.cprofile_rows)
                print(f"\n--- {system}: cProfile by {key}, {args.steps} steps")
                print("\n".join(buf.getvalue().splitlines()[6:]))
        torch.Tensor.backward = orig_backward
        parts = {k: v / rounds * 1e6 for k, v in spent.items()}
        if system.startswith("nbtools"):      # steps replayed as graphs, of those timed
            graphs = keep[1]._graphs
            parts["(step graphs: replays, captures)"] = (graphs.replays, len(graphs._graphs))
        results.append((system, wall, parts))
        del step, keep
        torch.cuda.empty_cache()
    for system, wall, parts in results:
        print(f"\n=== {system}: {wall:.1f} us/step wall (timers included)")
        for k, us in sorted(parts.items(), key=lambda kv: -kv[1] if isinstance(kv[1], float)
                            else 0):
            print(f"  {us:8.1f} us  {k}" if isinstance(us, float) else f"  {us}  {k}")


if __name__ == "__main__":
    main()
