"""Does a zero-copy row's alignment, not only its bytes, set the link's time? (issue 23)

bench_step's traffic floor (gather + scatter of a step's unique rows on a pinned zero-copy
view, nbtools.hostmem) for rows of several widths at 4M rows and 65,536 uniform ids: 64 fp32
words (256 B, 16-byte aligned rows), 65 (260 B: bf16 weights + RowWiseAdagrad's accumulator, as
stored), 68 (272 B, padded to 16 bytes), 72 (288 B, 32 bytes), 96 (bf16 Adam rows), 384
(fp32 Adam rows). Prints ms per step and GB/s of rows each way.

    python3 benchmarks/experiments/row_width.py
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
from bench_step import traffic_floor_ms  # noqa: E402
from nbtools.devices import resolve_device  # noqa: E402


def main():
    device = resolve_device()
    rows, dim, steps = 4_000_000, 128, 20
    gen = torch.Generator(device="cpu").manual_seed(0)
    batches = [torch.randint(0, rows, (65536,), generator=gen).to(device) for _ in range(steps)]
    uniq = sum(torch.unique(b).numel() for b in batches) / steps
    print(f"{device}, {rows:,} rows, 65,536 uniform ids ({uniq:,.0f} unique a step)")
    print("| row words | bytes | ms/step | GB/s each way | ms / ms at 260 B |\n|---:|---:|---:|---:|---:|")
    res = {}
    for width in (64, 65, 68, 72, 96, 384):
        res[width] = ms = traffic_floor_ms(rows, dim, batches, device, width_factor=width / dim)
    for width, ms in res.items():
        print(f"| {width} | {4 * width} | {ms:.3f} | {uniq * 4 * width / ms / 1e6:.1f} | "
              f"{ms / res[65]:.2f} |")


if __name__ == "__main__":
    main()
