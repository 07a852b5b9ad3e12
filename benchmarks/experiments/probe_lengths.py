"""How long a probe of the disk's random-read rate must run: short probes against long ones.

bench_disk divides a step's misses by the disk's random-read rate, probed in the same run. A
cloud disk may serve a short burst faster than it sustains: this writes a row file of
``--rows`` rows of ``--row-bytes`` (O_DIRECT, every row written), then probes random unique
rows in single calls of several lengths and depths (reads in flight), interleaved, for
``--rounds`` rounds, and prints rows/s per (length, depth): median and spread.

    python3 benchmarks/experiments/probe_lengths.py --dir /tmp/nbp --rows 20000000
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools.rowfile import RowFile  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--row-bytes", type=int, default=260)
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--depths", default="64,128")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    path = os.path.join(args.dir, "probe.rows")
    f = RowFile.create(path, args.rows, args.row_bytes, threads=64, overwrite=True)
    t0 = time.perf_counter()
    chunk = max(1, (64 << 20) // args.row_bytes)
    gen = np.random.default_rng(0)
    block = gen.integers(0, 256, (chunk, args.row_bytes), dtype=np.uint8)
    for a in range(0, args.rows, chunk):
        f.write_range(a, block[: min(chunk, args.rows - a)])
    f.flush()
    print(f"wrote {args.rows:,} rows ({f.stride} B each on disk, direct={f.direct}) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    rates = {(n, d): [] for n in lengths for d in depths}
    out = np.empty((max(lengths), args.row_bytes), dtype=np.uint8)
    for r in range(args.rounds):
        for n in lengths:
            for d in depths:
                ids = np.unique(gen.integers(0, args.rows, n))
                f.threads = d
                f._pool.threads = d
                t = time.perf_counter()
                f.read(ids, out[: len(ids)])
                rates[(n, d)].append(len(ids) / (time.perf_counter() - t))
        print(f"round {r}: " + ", ".join(f"{n}@{d} {rates[(n, d)][-1]:,.0f}"
                                        for n in lengths for d in depths), flush=True)
    print("\n| rows a call | in flight | rows/s median (min..max) |\n|---:|---:|---|")
    for (n, d), xs in rates.items():
        print(f"| {n:,} | {d} | {np.median(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f}) |")
    f.close()
    os.remove(path)


if __name__ == "__main__":
    main()
