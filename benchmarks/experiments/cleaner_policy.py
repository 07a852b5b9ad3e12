"""How many rows the log file's cleaner copies per row written back, by victim policy
(``NBTOOLS_DISK_CLEANER``: "greedy", the fewest live rows; "cost-benefit", LFS's free space
per row copied times the segment's age). A count, not a time: no disk is touched (the file
under :class:`nbtools.disk.log.LogFile` is a stand-in that stores nothing), so it runs anywhere.

The workload is a disk table's steady state: Zipf(1.1) ids over ``--rows`` rows, an LRU RAM
cache of ``--cache`` rows, every evicted row dirty and appended. Hot ids either lie together
at the start of the id space (as bench_disk.py draws them) or are scattered (``--scatter``).
Counts are taken over the second half of the steps.

    python benchmarks/experiments/cleaner_policy.py [--scatter]      # any machine, ~30 s
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nbtools.disk.log as dl  # noqa: E402


class _NoFile:
    """A RowFile stand-in that stores nothing (the cleaner's choices need no bytes)."""

    def __init__(self, slots: int):
        self.num_rows, self.row_bytes, self.stride, self.path = slots, 4, 512, "(none)"

    def read(self, ids, out, at=None):
        pass

    def write(self, ids, src, at=None, fresh=False):
        pass

    def read_range(self, start, out):
        pass


def run(policy: str, args) -> tuple[int, int]:
    seg = args.segment
    log = dl.LogFile(_NoFile(dl.slots_for(args.rows, seg, args.spare)), args.rows,
                     segment_rows=seg)
    log.policy = policy
    rng = np.random.default_rng(args.seed)
    p = np.arange(1, args.rows + 1, dtype=np.float64) ** -1.1
    p /= p.sum()
    ids_of = rng.permutation(args.rows) if args.scatter else np.arange(args.rows)
    lru = collections.OrderedDict()
    half = None
    for step in range(args.steps):
        evicted = []
        for i in np.unique(ids_of[rng.choice(args.rows, args.ids, p=p)]).tolist():
            if i in lru:
                lru.move_to_end(i)
            else:
                lru[i] = True
                if len(lru) > args.cache:
                    evicted.append(lru.popitem(last=False)[0])
        if evicted:
            log.write(np.sort(np.array(evicted)), np.zeros((len(evicted), 4), np.uint8))
        if step == args.steps // 2:
            half = (log.stats["appended"], log.stats["cleaned"])
    return log.stats["appended"] - half[0], log.stats["cleaned"] - half[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=400_000)
    ap.add_argument("--cache", type=int, default=40_000)
    ap.add_argument("--ids", type=int, default=65_536)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--segment", type=int, default=2048)
    ap.add_argument("--spare", type=float, default=dl.SPARE)
    ap.add_argument("--scatter", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{args.rows:,} rows, RAM cache {args.cache:,}, {args.ids:,} Zipf ids a step, "
          f"segments of {args.segment}, spare {args.spare:.0%}, hot ids "
          f"{'scattered' if args.scatter else 'together'}")
    print("| policy | rows appended | rows the cleaner copied | copied per appended |")
    print("|---|---:|---:|---:|")
    for policy in ("greedy", "cost-benefit"):
        appended, cleaned = run(policy, args)
        print(f"| {policy} | {appended:,} | {cleaned:,} | {cleaned / max(1, appended):.2f} |")


if __name__ == "__main__":
    main()
