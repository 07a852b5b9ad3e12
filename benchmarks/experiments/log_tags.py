"""A log file's RAM and append cost with each slot's id in the row's padding, against in RAM.

A new disk table's log file (nbtools.disk.log.create: rows of ``--row-bytes`` packed 32 bytes
apart, the default 100% spare) takes ``--steps`` appends of about ``--batch`` rows, half of
them Zipf(1.1) ids and half uniform, so that the spare fills and the cleaner copies rows;
then :meth:`~nbtools.disk.log.LogFile.identity` moves every row home. Run twice: with the ids
in the rows' padding (tags, the default where a row has room), and with them in RAM (the
``owner`` map; RowFile.tagged forced off for the run). Prints the maps' RAM per row, the time
per append with its cleaning, the cleaner's copies per row appended, and identity's time.

    python benchmarks/experiments/log_tags.py --rows 2000000 --steps 5000 --dir DIR
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from nbtools import rowfile
from nbtools.disk import log as disklog  # noqa: E402


def run(rows: int, row_bytes: int, batch: int, steps: int, folder: str, tags: bool) -> str:
    saved = rowfile.RowFile.tagged
    if not tags:
        rowfile.RowFile.tagged = property(lambda self: False)
    path = os.path.join(folder, "log_tags.nbrows")
    try:
        log, _ = disklog.create(path, rows, row_bytes, {}, threads=16, free=1 << 50)
        assert log.tagged == tags
        gen = np.random.default_rng(0)
        src = gen.integers(0, 256, (batch, row_bytes), dtype=np.uint8)
        t0 = time.perf_counter()
        for _ in range(steps):
            hot = np.minimum(gen.zipf(1.1, batch // 2), rows) - 1
            ids = np.unique(np.concatenate([hot, gen.integers(0, rows, batch // 2)]))
            log.write(ids, src[:len(ids)])
        per = (time.perf_counter() - t0) / steps * 1e3
        t0 = time.perf_counter()
        moved = log.identity()
        home = time.perf_counter() - t0
        st = log.stats
        out = (f"ids {'in the padding' if tags else 'in RAM'}: maps {log.map_bytes / rows:.2f} "
               f"B/row ({log.map_bytes / 1e6:.1f} MB); {per:.2f} ms an append; the cleaner "
               f"copied {st['cleaned'] / max(1, st['appended']):.2f} rows a row appended "
               f"({st['cleaned_segments']} segments); identity: {moved:,} rows home in "
               f"{home:.1f} s")
        log.close()
        return out
    finally:
        rowfile.RowFile.tagged = saved
        if os.path.exists(path):
            os.remove(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--row-bytes", type=int, default=260)
    ap.add_argument("--batch", type=int, default=1600)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--dir", default=None, help="folder for the file (default: a temp folder)")
    args = ap.parse_args()
    folder = args.dir or tempfile.mkdtemp()
    os.makedirs(folder, exist_ok=True)
    print(f"# {args.rows:,} rows of {args.row_bytes} B, appends of ~{args.batch} rows x "
          f"{args.steps}, in {folder}", flush=True)
    for tags in (True, False):
        print(run(args.rows, args.row_bytes, args.batch, args.steps, folder, tags), flush=True)


if __name__ == "__main__":
    main()
