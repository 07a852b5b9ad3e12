"""A checkpoint base of a log-structured disk table whose rows have moved: records in file
order (what nbtools saves) against the rows in id order read through the map (what a base
in id order would read: every moved row at random), and against a table written in place.

The table (``--rows`` x 128 bf16 with RowWiseAdagrad: 260-byte rows, 512 in the file) is
churned without training: its rows are read sequentially and written back (appended) in
shuffled batches until ``--moved`` of them have left their home slots, as in a long run.
Writes the checkpoints under ``--dir``.

    python benchmarks/experiments/disk_base.py --dir /tmp/nbb     # GPU machine, ~2 min
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nbtools  # noqa: E402
from nbtools.checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402


def table(args, layout):
    os.environ["NBTOOLS_DISK_LAYOUT"] = layout
    t = nbtools.OffloadedEmbedding(args.rows, 128, dtype=torch.bfloat16, placement="disk",
                                   disk_dir=os.path.join(args.dir, f"t-{layout}"),
                                   host_cache_bytes=64 << 20, name=f"t_{layout}")
    opt = nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, t, lr=0.1)
    t.disk.flush()                     # the initial rows written
    return t, opt


def churn(t, share: float, gen) -> int:
    """Move ``share`` of the rows out of their home slots: read sequentially, a random
    ``share`` of each stretch appended back in shuffled order (their values unchanged)."""
    log = t.disk.file
    n, rb = t.num_embeddings, t.disk.row_bytes
    step = 1 << 18
    rows = np.empty((step, rb), dtype=np.uint8)
    for a in range(0, n, step):
        m = min(step, n - a)
        log.read_range(a, rows[:m])
        pick = np.flatnonzero(gen.random(m) < share)
        order = gen.permutation(len(pick))
        log.write(a + pick[order], rows[pick[order]])
    return log.away


def save(t, opt, path, records: bool) -> float:
    """Seconds of one checkpoint save (a base): ``records`` as nbtools saves a log file whose
    rows moved, else a base in id order read through the map."""
    shutil.rmtree(path, ignore_errors=True)
    t.disk.flush()                    # no dirty row: nothing moves during the save
    log = t.disk.file
    away = getattr(log, "away", 0)
    if not records:
        log.away = 0                  # (the base's choice reads it: id order)
    try:
        ck = CheckpointManager(path, config=CheckpointConfig(verbose=False, progress=False))
        t0 = time.perf_counter()
        ck.save(1, model=t, opt=opt, rng=False)
        return time.perf_counter() - t0
    finally:
        if not records:
            log.away = away


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--moved", type=float, default=0.5)
    ap.add_argument("--dir", default="/tmp/nbb")
    args = ap.parse_args()
    gen = np.random.default_rng(0)
    os.makedirs(args.dir, exist_ok=True)
    gb = args.rows * 260 / 1e9
    t, opt = table(args, "inplace")
    s_in = save(t, opt, os.path.join(args.dir, "ck-inplace"), True)
    t.close()
    t, opt = table(args, "log")
    away = churn(t, args.moved, gen)
    s_rec = save(t, opt, os.path.join(args.dir, "ck-records"), True)
    s_id = save(t, opt, os.path.join(args.dir, "ck-idorder"), False)
    t.close()
    print(f"{args.rows:,} rows ({gb:.2f} GB of rows), {away:,} moved ({args.moved:.0%})")
    print("| base | s | GB/s | x in place |\n|---|---:|---:|---:|")
    for name, s in (("in place (id order, sequential)", s_in),
                    ("log, records in file order (nbtools)", s_rec),
                    ("log, id order through the map", s_id)):
        print(f"| {name} | {s:.2f} | {gb / s:.2f} | {s / s_in:.2f} |")


if __name__ == "__main__":
    main()
