"""A stress of the disk tier's concurrency: randomised runs against a host table, bit for bit.

Each run trains a small table on Zipf ids twice, in host RAM and on disk (the log file, a RAM
cache of 20 to 200 rows, reading 1 to readahead.DEPTH (8) steps ahead), with the disk file's
reads and writes slowed by random sleeps, so that read-aheads, lookups, write-backs, rows taken
from queued write-backs and the cleaner interleave in ever new orders; the two tables must end
with the same weights and optimizer state (torch.equal). Runs until --seconds have passed;
exits 1 on the first difference, naming the run. Not a test (it runs for minutes): run it after a change to
nbtools/disk/readahead.py, nbtools/disk/__init__.py or nbtools/disk/log.py.

    python3 benchmarks/experiments/readahead_stress.py --seconds 300
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import OffloadedEmbedding
from nbtools.disk import readahead  # noqa: E402
from nbtools.testing import train_reading_ahead  # noqa: E402

N, D = 400, 8


def zipf(steps, batch, gen):
    p = torch.arange(1, N + 1, dtype=torch.float64) ** -1.1
    return [torch.multinomial(p / p.sum(), batch, replacement=True, generator=gen)
            for _ in range(steps)]


def train(placement, batches, depth, jitter=None, **extra):
    torch.manual_seed(0)
    init = torch.randn(N, D)
    t = OffloadedEmbedding(N, D, name=f"stress-{placement}", device="cpu", placement=placement,
                           **extra)
    with torch.no_grad():
        t.weight.copy_(init)
    if jitter is not None:                  # slowed, randomly, file reads and writes
        f, rng = t.disk.file, random.Random(jitter)
        read, write = f.read, f.write
        f.read = lambda *a, **k: (time.sleep(rng.random() * 0.004), read(*a, **k))[1]
        f.write = lambda *a, **k: (time.sleep(rng.random() * 0.006), write(*a, **k))[1]
    train_reading_ahead(t, batches, depth)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=120.0)
    args = ap.parse_args()
    end, k = time.time() + args.seconds, 0
    while time.time() < end:
        batches = zipf(25, 48, torch.Generator().manual_seed(k))
        depth, cache = 1 + k % readahead.DEPTH, [20, 50, 70, 200][k // readahead.DEPTH % 4]
        host = train("host", batches, depth)
        with tempfile.TemporaryDirectory() as folder:
            disk = train("disk", batches, depth, jitter=k, disk_dir=folder,
                         host_cache_bytes=cache * 3 * D * 4)
            same = torch.equal(host.weight, disk.weight) and all(
                torch.equal(host.state_columns(n), disk.state_columns(n))
                for n in host.state_names)
            disk.close()
        host.close()
        if not same:
            print(f"run {k} (depth {depth}, RAM cache {cache} rows): the disk table DIFFERS")
            sys.exit(1)
        k += 1
    print(f"{k} runs, every one bit-identical to host RAM")


if __name__ == "__main__":
    main()
