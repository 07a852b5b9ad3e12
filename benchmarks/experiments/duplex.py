"""Do a step's reads and writes of host rows share the link or add up? (issue 23: the row-wise
steps' 288-byte rows sit 1.2-1.35x above a floor that moves them one way, then the other.)

For each row size, 4,000,000 rows in pinned host memory and the sorted unique ids of 65,536
uniform draws (bench_step.py's case), a loop times:

  floor            index_select then index_copy_ of the rows (bench_step.traffic_floor_ms)
  read P           kernels.gather_rows on a grid capped at P programs (the step's gather)
  write W          kernels.put_rows on a grid capped at W programs (the write-behind)
  both P/W         a read and a write of another batch's rows at once, on two streams
                   (a step's gather beside the last step's write-back): wall per pair

``both`` near ``max(read, write)`` means the link carries both directions at once (PCIe is
full duplex); near ``read + write``, they take turns, and no schedule beats the floor.

    python benchmarks/experiments/duplex.py            # GPU machine, ~1 minute
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_step
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
import bench_step as bs  # noqa: E402
from nbtools import hostmem, kernels  # noqa: E402

N = 4_000_000


def loop_ms(fn) -> float:
    """bench_step's median ms per call over loops of 20 calls of ``fn``."""
    return bs.loop_ms(lambda _: fn(), list(range(20)), torch.device("cuda"))


def ints(text):
    return [int(x) if x != "none" else None for x in text.split(",") if x]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row-bytes", default="288,768,1536")
    ap.add_argument("--reads", default="32,64,none", help="gather grid caps (none: uncapped)")
    ap.add_argument("--writes", default="16,32,64,none", help="write grid caps")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name(dev)}; {N:,} rows, unique ids of 65,536 uniform draws")
    gen = torch.Generator().manual_seed(0)
    ids = [torch.unique(torch.randint(0, N, (65536,), generator=gen)).to(dev) for _ in range(2)]
    count = [torch.tensor([i.numel()], device=dev) for i in ids]
    table = []
    for row_bytes in ints(args.row_bytes):
        width = row_bytes // 4
        h = hostmem.HostTensor((N, width), torch.float32, name="duplex")
        view = h.view()
        bufs = [torch.zeros(i.numel(), width, device=dev) for i in ids]
        mb = ids[0].numel() * row_bytes / 1e6
        floor = loop_ms(lambda: (view.index_copy_(0, ids[0], view.index_select(0, ids[0]))))
        print(f"\n{row_bytes} B rows, {mb:.1f} MB each way a step: floor {floor:.3f} ms "
              f"({2 * mb / floor:.1f} GB/s)", flush=True)
        reads = {}
        for p in ints(args.reads):
            reads[p] = loop_ms(lambda: kernels.gather_rows(view, ids[0], count[0], bufs[0],
                                                           programs=p))
            print(f"  read  P={p}: {reads[p]:.3f} ms ({mb / reads[p]:.1f} GB/s)", flush=True)
        writes = {}
        for w in ints(args.writes):
            writes[w] = loop_ms(lambda: kernels.put_rows(view, ids[1], count[1], bufs[1],
                                                         programs=w))
            print(f"  write W={w}: {writes[w]:.3f} ms ({mb / writes[w]:.1f} GB/s)", flush=True)
        side = torch.cuda.Stream()
        main_s = torch.cuda.current_stream()
        for p in reads:
            for w in writes:
                def both():
                    side.wait_stream(main_s)
                    with torch.cuda.stream(side):
                        kernels.put_rows(view, ids[1], count[1], bufs[1], programs=w)
                    kernels.gather_rows(view, ids[0], count[0], bufs[0], programs=p)
                    main_s.wait_stream(side)
                ms = loop_ms(both)
                serial = reads[p] + writes[w]
                print(f"  both  P={p} W={w}: {ms:.3f} ms = {ms / floor:.2f}x floor, "
                      f"{ms / serial:.2f}x read+write, {ms / max(reads[p], writes[w]):.2f}x the "
                      f"longer", flush=True)
                table.append((row_bytes, p, w, ms, floor, serial))
        h.close()
    print("\n| row B | P | W | both ms | x floor | x (read + write) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row_bytes, p, w, ms, floor, serial in table:
        print(f"| {row_bytes} | {p} | {w} | {ms:.3f} | {ms / floor:.2f} | {ms / serial:.2f} |")


if __name__ == "__main__":
    main()
