"""How long a probe of the disk's random-read rate must run: short probes against long ones.

bench_disk divides a step's misses by the disk's random-read rate, probed in the same run. A
cloud disk may serve a short burst faster than it sustains: this writes a row file of
``--rows`` rows of ``--row-bytes`` (O_DIRECT, every row written), then probes random unique
rows in single calls of several lengths and depths (reads in flight), interleaved, for
``--rounds`` rounds, and prints rows/s per (length, depth): median and spread. With
``--batches``, each probe also runs with glibc's AIO handed that many requests per
``lio_listio`` call (RequestPool.batch, default nbtools.fileio.AIO_BATCH), and with
``--concurrent N`` as N calls at once from N threads sharing the file (a disk table's
read-aheads).

    python3 benchmarks/experiments/probe_lengths.py --dir /tmp/nbp --rows 20000000
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import fileio  # noqa: E402
from nbtools.rowfile import RowFile  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--rows", type=int, default=20_000_000)
    ap.add_argument("--row-bytes", type=int, default=260)
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--depths", default="64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default=str(fileio.AIO_BATCH),
                    help="requests per lio_listio call, comma-separated")
    ap.add_argument("--concurrent", type=int, default=1, help="calls at once (threads)")
    ap.add_argument("--keep", action="store_true", help="reuse the file if it is there")
    args = ap.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [int(x) for x in args.depths.split(",")]
    path = os.path.join(args.dir, "probe.rows")
    gen = np.random.default_rng(0)
    if args.keep and os.path.exists(path):
        f = RowFile.open(path, threads=64)
    else:
        f = RowFile.create(path, args.rows, args.row_bytes, threads=64, overwrite=True)
        t0 = time.perf_counter()
        chunk = max(1, (64 << 20) // args.row_bytes)
        block = gen.integers(0, 256, (chunk, args.row_bytes), dtype=np.uint8)
        for a in range(0, args.rows, chunk):
            f.write_range(a, block[: min(chunk, args.rows - a)])
        f.flush()
        print(f"wrote {args.rows:,} rows ({f.stride} B each on disk, direct={f.direct}) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    cases = [(n, d, b) for n in lengths for d in depths for b in batches]
    rates = {c: [] for c in cases}
    outs = [np.empty((max(lengths), args.row_bytes), dtype=np.uint8)
            for _ in range(args.concurrent)]

    def one(n, d, b):
        f._pool.batch = b
        f._pool.threads = d
        sets = [np.unique(gen.integers(0, args.rows, n)) for _ in range(args.concurrent)]
        threads = [threading.Thread(target=f.read, args=(ids, out[: len(ids)]))
                   for ids, out in zip(sets, outs)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return sum(len(s) for s in sets) / (time.perf_counter() - t)
    for r in range(args.rounds):
        for c in cases:
            rates[c].append(one(*c))
        print(f"round {r}: " + ", ".join(f"{n}@{d}/{b} {rates[(n, d, b)][-1]:,.0f}"
                                        for n, d, b in cases), flush=True)
    print(f"\n{args.concurrent} call(s) at once\n| rows a call | in flight | requests a "
          "lio_listio | rows/s median (min..max) |\n|---:|---:|---:|---|")
    for (n, d, b), xs in rates.items():
        print(f"| {n:,} | {d} | {b:,} | {np.median(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f}) |")
    f.close()
    if not args.keep:
        os.remove(path)


if __name__ == "__main__":
    main()
