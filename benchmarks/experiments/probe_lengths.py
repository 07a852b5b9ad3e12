"""How long a probe of the disk's random-read rate must run: short probes against long ones.

bench_disk divides a step's misses by the disk's random-read rate, probed in the same run. A
cloud disk may serve a short burst faster than it sustains: this writes a row file of
``--rows`` rows of ``--row-bytes`` (O_DIRECT, every row written), then probes random unique
rows in single calls of several lengths and depths (reads in flight), interleaved, for
``--rounds`` rounds, and prints rows/s per (length, depth): median and spread. With
``--batches``, each probe also runs with glibc's AIO handed that many requests per
``lio_listio`` call (RequestPool.batch, default nbtools.rowfile.fileio.AIO_BATCH), and with
``--concurrent N`` as N calls at once from N threads sharing the file (a disk table's
read-aheads). With ``--stream S`` every thread reads call after call for S seconds (a
loop's read-aheads, which follow each other without a pause), and ``--append ROWS`` adds a
thread writing ROWS consecutive rows every ``--append-ms`` (a log table's write-backs) through
the same request pool: the rate a disk table's loop can expect, against the lone probe's.
``--paced-ms`` makes the streams a loop's pipeline: step k waits for its call, runs that many
ms of Python, then issues the call ``--concurrent`` steps ahead (no table code at all).

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
from nbtools.rowfile import fileio  # noqa: E402
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
    ap.add_argument("--stream", type=float, default=0.0,
                    help="seconds of calls back to back per thread (0: one call each)")
    ap.add_argument("--append", type=int, default=0,
                    help="rows written at a moving head every --append-ms meanwhile")
    ap.add_argument("--append-ms", type=float, default=27.0)
    ap.add_argument("--busy", type=int, default=0,
                    help="threads running Python meanwhile (holding the GIL, as a training "
                         "loop's main thread does)")
    ap.add_argument("--paced-ms", type=float, default=None,
                    help="a loop's pipeline instead of free streams (with --stream): step k "
                         "waits for its call, runs Python for this many ms (holding the GIL, "
                         "as a step's own work does), then issues step k + --concurrent's call")
    ap.add_argument("--engine", default=None,
                    help="the file's I/O engine (nbtools.rowfile.fileio.ENGINES; default: nbtools')")
    ap.add_argument("--switch-ms", type=float, default=None,
                    help="sys.setswitchinterval (Python's default: 5 ms)")
    args = ap.parse_args()
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
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
    if args.engine:
        f.engine = args.engine
    cases = [(n, d, b) for n in lengths for d in depths for b in batches]
    rates = {c: [] for c in cases}
    outs = [np.empty((max(lengths), args.row_bytes), dtype=np.uint8)
            for _ in range(args.concurrent)]

    head = [0]

    def paced(n):
        """Rows/s of a loop reading --concurrent steps ahead (see --paced-ms)."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        def call(i):
            ids = np.unique(gen.integers(0, args.rows, n))
            f.read(ids, outs[i][: len(ids)])
            return len(ids)
        with ThreadPoolExecutor(args.concurrent) as ex:
            k = args.concurrent
            flight = deque(ex.submit(call, i) for i in range(k))
            rows, t = 0, time.perf_counter()
            step = 0
            while time.perf_counter() - t < args.stream:
                rows += flight.popleft().result()
                end = time.perf_counter() + args.paced_ms / 1e3
                x = 0
                while time.perf_counter() < end:       # the step's own Python
                    for j in range(200):
                        x += j
                flight.append(ex.submit(call, (step + k) % k))
                step += 1
            elapsed = time.perf_counter() - t
            for fut in flight:
                fut.result()
        return rows / elapsed

    def one(n, d, b):
        f._pool.batch = b
        f._pool.threads = d
        if args.paced_ms is not None and args.stream:
            return paced(n)
        done = threading.Event()
        count = [0] * args.concurrent
        src = np.zeros((max(1, args.append), args.row_bytes), dtype=np.uint8)

        def reader(i):
            while True:
                ids = np.unique(gen.integers(0, args.rows, n))
                f.read(ids, outs[i][: len(ids)])
                count[i] += len(ids)
                if not args.stream or done.is_set():
                    return

        def appender():
            while not done.is_set():
                t1 = time.perf_counter()
                if head[0] + args.append > args.rows:
                    head[0] = 0
                f.write_range(head[0], src)
                head[0] += args.append
                time.sleep(max(0.0, args.append_ms / 1e3 - (time.perf_counter() - t1)))

        def busy():
            x = 0
            while not done.is_set():
                for k in range(1000):
                    x += k
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(args.concurrent)]
        extra = [threading.Thread(target=appender)] if args.append else []
        extra += [threading.Thread(target=busy) for _ in range(args.busy)]
        if args.concurrent == 1 and not args.stream and not extra:
            # one call: in this thread (a thread made per call would time its start, and the
            # native AIO engine's context made and destroyed with it)
            t = time.perf_counter()
            reader(0)
            return count[0] / (time.perf_counter() - t)
        t = time.perf_counter()
        for th in threads + extra:
            th.start()
        if args.stream:
            time.sleep(args.stream)
            done.set()
        for th in threads:
            th.join()
        rate = sum(count) / (time.perf_counter() - t)
        done.set()
        for th in extra:
            th.join()
        return rate
    for r in range(args.rounds):
        for c in cases:
            rates[c].append(one(*c))
        print(f"round {r}: " + ", ".join(f"{n}@{d}/{b} {rates[(n, d, b)][-1]:,.0f}"
                                        for n, d, b in cases), flush=True)
    print(f"\n{args.concurrent} call(s) at once, engine {f.engine}"
          + (f", back to back for {args.stream:g} s" if args.stream else "")
          + (f", {args.append:,} rows appended every {args.append_ms:g} ms" if args.append
             else "") + (f", {args.busy} thread(s) running Python" if args.busy else "")
          + (f", switch interval {args.switch_ms:g} ms" if args.switch_ms is not None else "")
          + (f", paced: a step waits for its call and runs {args.paced_ms:g} ms of Python"
             if args.paced_ms is not None and args.stream else "")
          + "\n| rows a call | in flight | requests a "
          "lio_listio | rows/s median (min..max) |\n|---:|---:|---:|---|")
    for (n, d, b), xs in rates.items():
        print(f"| {n:,} | {d} | {b:,} | {np.median(xs):,.0f} ({min(xs):,.0f}..{max(xs):,.0f}) |")
    f.close()
    if not args.keep:
        os.remove(path)


if __name__ == "__main__":
    main()
