"""Two ways to order a step's work, timed in alternating loops on the same table.

``--toggle update_waits``: with ``Prefetcher.UPDATE_WAITS`` a prefetching step's update waits
for the pending prefetch's gather; off (tables without a cache), the update and its write-back
run beside it. ``--toggle fast_streams``: the current stream, side streams and events through
torch's Python helpers, or through nbtools.engine.streams (torch's C calls). (Session 22 also timed
``RowStore.DEFER_WRITE_BACK`` this way, a write-back started once the next lookup's gather was
queued: it lost in every round, benchmarks/RESULTS.md, and is not in the tree; session 19's
commit 8ff65de has it, and a ``TOGGLES`` entry for it times it again.)

Each system of bench_step.py (its 65,536-uniform-id step on 4M x 128; "prefetch" systems
prefetch the next batch) is built once and timed in alternating loops, the switch off and on,
``--rounds`` times: single loops of these steps move by 10-20% between calls, so only a
same-table alternation tells two orders apart. Each system against the traffic floor of its
own rows (bench_step.traffic_floor_ms).

    python benchmarks/experiments/prefetch_overlap.py           # GPU machine, ~1-2 minutes
    python benchmarks/experiments/prefetch_overlap.py --toggle fast_streams --systems S
    python benchmarks/experiments/prefetch_overlap.py --toggle vector_views --systems S

``--toggle vector_views``: row copies (gather, write-back, patch) on rows seen as their own
dtype, or as 4- or 2-byte integers whose row stride is a multiple of 16 of them
(nbtools.kernels._as_vectors); ``vector_puts``: every copy so, or every copy but the
write-back. ``--toggle id_order``: a training lookup's rows in id order made from its unique
rows upcast, or reordered in their storage dtype and then upcast (TableLookups.ID_ORDER);
``take_rows``: reordered and upcast by index_select and a copy, or by one kernel
(TableLookups.FUSED_TAKE); ``sums_check``: the step's inf/nan check as a pass of its own, or
made by the gradient's fixed-order sum (OffloadOptimizer.SUMS_CHECK); ``step_wrapper``:
torch's wrapper around an optimizer's step or nbtools' (its profiler scope only while
profiling); ``session24``: those three together. CUDA graphs bake the kernels in: each value gets a table of its own, built and
timed with it.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_step
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
import bench_step as bs  # noqa: E402
from nbtools.engine.lookups import TableLookups  # noqa: E402
from nbtools.engine.prefetch import Prefetcher  # noqa: E402
from nbtools import kernels
from nbtools.engine import streams  # noqa: E402
from nbtools.optim import OffloadOptimizer  # noqa: E402

# the step as torch.optim.Optimizer wraps every optimizer's (before session 24)
TORCH_STEP = torch.optim.Optimizer.profile_hook_step(
    torch.no_grad()(OffloadOptimizer.step.__wrapped__))
TORCH_STEP.hooked = True


class _Session24:
    """Session 24's host and GPU changes to the step, all off or all on: the take kernel,
    the inf/nan check made by the gradient's sum, nbtools' step wrapper."""

    @property
    def on(self):
        return OffloadOptimizer.SUMS_CHECK

    @on.setter
    def on(self, value):
        TableLookups.FUSED_TAKE = OffloadOptimizer.SUMS_CHECK = value
        OffloadOptimizer.step = NBTOOLS_STEP if value else TORCH_STEP


NBTOOLS_STEP = OffloadOptimizer.step
SESSION24 = _Session24()

# --toggle: (owner, attribute, (the value timed first, the second), label of each value)
ALL_COPIES, VECTORS = kernels.ROW_COPIES, kernels.VECTOR_VIEWS     # (VECTORS: the default)
TOGGLES = {"update_waits": (Prefetcher, "UPDATE_WAITS", (True, False),
                            ("update waits", "update beside")),
           "fast_streams": (streams, "FAST", (False, True), ("torch's stream helpers",
                                                             "nbtools.engine.streams")),
           "vector_views": (kernels, "VECTOR_VIEWS", (frozenset(), VECTORS),
                            ("rows as their dtype", "rows as 16-value vectors")),
           "vector_puts": (kernels, "VECTOR_VIEWS", (ALL_COPIES, ALL_COPIES - {"put"}),
                           ("every copy as vectors", "write-backs as their dtype")),
           "id_order": (TableLookups, "ID_ORDER", (False, True),
                        ("unique rows upcast, then reordered", "rows reordered, then upcast")),
           "take_rows": (TableLookups, "FUSED_TAKE", (False, True),
                         ("index_select, then upcast", "one take kernel")),
           "sums_check": (OffloadOptimizer, "SUMS_CHECK", (False, True),
                          ("an inf/nan pass of its own", "checked by the sum")),
           "step_wrapper": (OffloadOptimizer, "step", (TORCH_STEP, OffloadOptimizer.step),
                            ("torch's step wrapper", "nbtools' step wrapper")),
           "session24": (SESSION24, "on", (False, True), ("before session 24", "session 24"))}
# toggles of what a step's CUDA graphs bake in: one table per value, each built, captured
# and timed with its own value
BAKED = {"vector_views", "vector_puts", "sums_check", "session24"}

SYSTEMS = ("nbtools host bf16 rowwise,nbtools host bf16 rowwise prefetch,"
           "nbtools host bf16 rowwise+bf16 state prefetch,nbtools host rowwise prefetch,"
           "nbtools host bf16+bf16 state prefetch,nbtools host prefetch")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    bs.add_systems_arg(ap, SYSTEMS)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--toggle", choices=sorted(TOGGLES), default="update_waits")
    args = ap.parse_args()
    owner, attr, values, labels = TOGGLES[args.toggle]
    kept = getattr(owner, attr)
    dev = bs.resolve_device()
    batches = bs.uniform_batches(65536, dev, n=args.rows)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# {gpu}; {args.rows:,} x {args.dim}, 65,536 uniform ids; {args.rounds} rounds of "
          f"alternating loops ({labels[0]} / {labels[1]})", flush=True)
    rows_out = []
    for name in args.systems.split(","):
        built = {}
        try:
            for value in (values if args.toggle in BAKED else values[:1]):
                setattr(owner, attr, value)
                step, keep = bs.system_step(name, dev, n=args.rows, dim=args.dim)
                bs.follow(step, batches)
                built[value] = (step, keep)
            times = {value: [] for value in values}
            for _ in range(args.rounds):
                for value in values:
                    setattr(owner, attr, value)
                    step = built.get(value, built[values[0]])[0]
                    times[value].append(bs.loop_ms(step, batches, dev, repeats=3, warmup=2))
        finally:
            setattr(owner, attr, kept)
        row_bytes = bs.stored_row_bytes(built[values[0]][1][0])
        del step, built
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        floor = bs.traffic_floor_ms(args.rows, args.dim, batches, dev,
                                    width_factor=row_bytes / 4 / args.dim)
        first, second = times[values[0]], times[values[1]]
        on, off = statistics.median(first), statistics.median(second)
        wins = sum(b < a for a, b in zip(first, second))
        print(f"{name}: {row_bytes} B rows, floor {floor:.3f} ms; {labels[0]} "
              f"{' '.join(f'{t:.3f}' for t in first)}; {labels[1]} "
              f"{' '.join(f'{t:.3f}' for t in second)}", flush=True)
        rows_out.append((name, row_bytes, floor, on, off, wins))
    print(f"\n| system | row B | floor ms | {labels[0]} ms (x floor) | {labels[1]} ms (x floor) "
          "| second / first | rounds the second won |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rb, floor, on, off, wins in rows_out:
        print(f"| {name} | {rb} | {floor:.3f} | {on:.3f} ({on / floor:.2f}) | {off:.3f} "
              f"({off / floor:.2f}) | {off / on:.2f} | {wins} of {args.rounds} |")


if __name__ == "__main__":
    main()
