"""Could a step's write-back leave the SMs' zero-copy stores for a copy engine? (issue 23: the
row-wise steps' 288-byte rows sit 1.2-1.3x above a floor that moves them one way, then the
other, because zero-copy reads and writes of small rows barely overlap on the link.)

A staged write-back would copy the step's updated rows, packed as the step holds them, to a
pinned staging buffer with a copy engine (one contiguous device-to-host copy, which the link
carries beside the next step's zero-copy gather, the other direction), and CPU threads would
then scatter them into the table. For each row size, 4,000,000 rows in pinned host memory and
the unique ids of 65,536 uniform draws (bench_step.py's case), loops time:

  floor        zero-copy gather then zero-copy write of the rows (what a step moves today)
  gather       kernels.gather_rows alone
  put          kernels.put_rows alone (the write-behind's zero-copy write)
  d2h          the packed rows copied to pinned staging by a copy engine
  gather+d2h   a gather and another batch's d2h at once, on two streams: wall per pair
  gather+put   the same with the zero-copy write (what write-behind overlaps today)
  cpu scatter  staging -> table rows on the CPU (index_copy_), with the machine's threads
               and with 2 (Colab's free tier has 2 cores): host time, not the GPU's

gather+d2h near max(gather, d2h) with the CPU scatter under it would put a step's traffic
under its serial floor. Without a GPU only the CPU scatter is timed (``--cpu-only``).

    python3 benchmarks/experiments/dma_writeback.py            # GPU machine, ~1 minute
    python3 benchmarks/experiments/dma_writeback.py --cpu-only --rows 1000000
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_step
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
from nbtools import hostmem  # noqa: E402


def cpu_ms(fn, repeats=7) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row-bytes", default="288,544,768")
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--cpu-only", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_only
    gen = torch.Generator().manual_seed(0)
    ids = [torch.unique(torch.randint(0, args.rows, (65536,), generator=gen)) for _ in range(2)]
    threads = torch.get_num_threads()
    print(f"# {torch.cuda.get_device_name() if cuda else 'CPU only'}; {args.rows:,} rows, "
          f"{ids[0].numel():,} unique ids of 65,536 uniform draws; {threads} CPU threads")
    out = []
    for row_bytes in (int(x) for x in args.row_bytes.split(",")):
        width = row_bytes // 4
        h = hostmem.HostTensor((args.rows, width), torch.float32, name="dma", pin=cuda)
        table = h.tensor
        staging = hostmem.HostTensor((ids[1].numel(), width), torch.float32, name="staging",
                                     pin=cuda)
        packed = torch.randn(ids[1].numel(), width)
        staging.tensor.copy_(packed)
        res = {}
        for n in sorted({threads, 2}):
            torch.set_num_threads(n)
            res[f"cpu scatter, {n} threads"] = cpu_ms(
                lambda: table.index_copy_(0, ids[1], staging.tensor))
        torch.set_num_threads(threads)
        if cuda:
            import bench_step as bs
            from nbtools import kernels
            dev = torch.device("cuda")
            view = h.view()
            gid = [i.to(dev) for i in ids]
            count = [torch.tensor([i.numel()], device=dev) for i in gid]
            bufs = [torch.randn(i.numel(), width, device=dev) for i in gid]

            def loop_ms(fn):
                return bs.loop_ms(lambda _: fn(), list(range(20)), dev)
            side = torch.cuda.Stream()
            main_s = torch.cuda.current_stream()

            def pair(other):
                def both():
                    side.wait_stream(main_s)
                    with torch.cuda.stream(side):
                        other()
                    kernels.gather_rows(view, gid[0], count[0], bufs[0])
                    main_s.wait_stream(side)
                return both
            gather = lambda: kernels.gather_rows(view, gid[0], count[0], bufs[0])  # noqa: E731
            put = lambda: kernels.put_rows(view, gid[1], count[1], bufs[1])  # noqa: E731
            d2h = lambda: staging.tensor.copy_(bufs[1], non_blocking=True)  # noqa: E731
            res["floor"] = loop_ms(lambda: (gather(), kernels.put_rows(view, gid[0], count[0],
                                                                      bufs[0])))
            res["gather"] = loop_ms(gather)
            res["put"] = loop_ms(put)
            res["d2h"] = loop_ms(d2h)
            res["gather+d2h"] = loop_ms(pair(d2h))
            res["gather+put"] = loop_ms(pair(put))
        staging.close()
        h.close()
        mb = ids[0].numel() * row_bytes / 1e6
        print(f"\n{row_bytes} B rows, {mb:.1f} MB a batch")
        for k, ms in res.items():
            print(f"  {k:24s} {ms:7.3f} ms  ({mb / ms:.1f} GB/s)", flush=True)
        out.append((row_bytes, res))
    keys = list(out[0][1])
    print("\n| row B | " + " | ".join(f"{k} ms" for k in keys) + " |")
    print("|---:|" + "---:|" * len(keys))
    for row_bytes, res in out:
        print(f"| {row_bytes} | " + " | ".join(f"{res[k]:.3f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
