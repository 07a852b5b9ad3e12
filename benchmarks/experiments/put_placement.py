"""Where should a step's write-back go when rows are small? Raw kernels, no nbtools step.

Each step: the gather of its unique rows from pinned host memory into GPU memory, ~``--compute-ms``
of GPU work standing for the loss, backward and update, and the write-back of the rows to host
memory. 4,000,000 rows of ``--row-bytes`` (288: bf16 weights + RowWiseAdagrad, padded; 1,536:
fp32 Adam), 65,536 uniform ids a step, sorted and unique as a lookup leaves them.

  floor    gather then write-back, nothing else (bench_step.py's traffic floor)
  series   gather, compute, write-back, on one stream (the update writing through)
  beside   gather, compute on the main stream; the write-back of step t on a side stream as soon
           as step t's compute is done, beside step t+1's gather (nbtools' write-behind today)
  after    the same, but the write-back of step t starts once step t+1's gather is done, beside
           step t+1's compute (a deferred write-behind)

With 288-byte rows bench_step measured the link serving a gather and a write-back one after
the other (benchmarks/RESULTS.md, session 12): then "after" should beat "beside" by about the
compute's time; with 1,536-byte rows they overlap and "beside" should win. Writes nothing of a
table (the rows are scratch).

    python benchmarks/experiments/put_placement.py [--row-bytes 288,1536]   # GPU machine, ~1 min
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import hostmem, kernels  # noqa: E402

N, IDS = 4_000_000, 65_536


def timed(step, steps: int, rounds: int = 5) -> float:
    """ms per step over loops of ``steps`` (one synchronisation per loop), median of rounds."""
    out = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--row-bytes", default="288,1536")
    ap.add_argument("--compute-ms", type=float, default=0.3)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    ids = [torch.unique(torch.randint(0, N, (IDS,), generator=gen)).to(dev) for _ in range(8)]
    counts = [torch.tensor([len(i)], device=dev) for i in ids]
    # stand-in compute: elementwise passes over 32 MB, as many as take --compute-ms
    scratch = torch.randn(8 << 20, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        scratch.mul_(1.0001).add_(1e-6)
    torch.cuda.synchronize()
    per = (time.perf_counter() - t0) / 50 * 1e3
    passes = max(1, round(args.compute_ms / per))

    def compute():
        for _ in range(passes):
            scratch.mul_(1.0001).add_(1e-6)
    print(f"compute: {passes} passes of {per:.3f} ms", flush=True)
    side = torch.cuda.Stream(dev)
    for row_bytes in (int(b) for b in args.row_bytes.split(",")):
        width = row_bytes // 4
        host = hostmem.HostTensor((N, width), torch.float32, name="put-placement")
        view = host.view()
        bufs = [torch.zeros(IDS, width, device=dev) for _ in range(3)]
        gprog = kernels.zero_copy_programs(dev)
        wprog = kernels.WRITE_BEHIND_PROGRAMS

        def gather(i):
            kernels.gather_rows(view, ids[i % 8], counts[i % 8], bufs[i % 3], 0, None, None,
                                gprog)

        done = [None, None, None]         # per buffer: the event after its last write-back

        def put(i, programs=None):
            kernels.put_rows(view, ids[i % 8], counts[i % 8], bufs[i % 3], programs=programs)

        def put_side(i):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                put(i, wprog)
                done[i % 3] = torch.cuda.Event()
                done[i % 3].record(side)

        def buffer_free(i):                # step i's buffer: its write-back of step i - 3 done
            if done[i % 3] is not None:
                torch.cuda.current_stream().wait_event(done[i % 3])

        def floor(i):
            gather(i)
            put(i)

        def series(i):
            gather(i)
            compute()
            put(i)

        def beside(i):
            buffer_free(i)
            gather(i)
            compute()
            put_side(i)

        pending = []

        def after(i):
            buffer_free(i)
            gather(i)
            if pending:                    # step i - 1's write-back, once this gather is done
                put_side(pending.pop())
            compute()
            pending.append(i)

        res = {}
        for name, fn in (("floor", floor), ("series", series), ("beside", beside),
                         ("after", after)):
            for i in range(3):
                fn(i)
            res[name] = timed(fn, args.steps)
            if pending:                    # the last deferred write-back
                put_side(pending.pop())
            torch.cuda.synchronize()
            done[:] = [None, None, None]
        print(f"\n{row_bytes}-byte rows, {IDS:,} uniform ids: " + ", ".join(
            f"{k} {v:.3f} ms" for k, v in res.items()))
        print("  x floor: " + ", ".join(f"{k} {v / res['floor']:.2f}" for k, v in res.items()))
        host.close()


if __name__ == "__main__":
    main()
