"""A checkpoint with a slow mirror, as on Colab with Google Drive: training steps while the
mirror copies the last checkpoint in the background, against the same steps with no copy.

A ``--rows`` x ``--dim`` float32 host table with Adam state (the optimizer's rows in pinned RAM)
is trained on Zipf(1.1) ids (``--ids`` a step). CheckpointManager saves it (local disk), and its
DriveSync copies the checkpoint into a second folder at ``--mirror-mbps`` MB/s (the copy's
reads and writes are paced to that rate, as a Drive upload is), while the loop goes on. The
figures are the local save's seconds, how long the copy took, and the median step time with and
without a copy running beside it (the steps a copy spans against as many steps after it
finished, at most 500).

    python benchmarks/bench_mirror.py --out DIR       # GPU machine
    python benchmarks/bench_mirror.py --quick         # any machine
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import types

import harness
import numpy as np
import torch
from harness import synchronize, zipf_ids

import nbtools
from nbtools.checkpoint import CheckpointConfig, CheckpointManager, mirror


def paced_copy(mbps: float):
    """shutil.copyfileobj at no more than ``mbps`` MB/s (it sleeps between chunks)."""
    def copy(fsrc, fdst, length=16 << 20):
        start, done = time.perf_counter(), 0
        while True:
            buf = fsrc.read(min(length, 4 << 20))
            if not buf:
                return
            fdst.write(buf)
            done += len(buf)
            ahead = done / (mbps * 1e6) - (time.perf_counter() - start)
            if ahead > 0:
                time.sleep(ahead)
    return copy


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--mirror-mbps", type=float, default=100.0,
                    help="the mirror's rate in MB/s (Drive from Colab: tens to ~100)")
    ap.add_argument("--dir", default=None, help="the checkpoints' folder (default: a temporary one)")
    args = ap.parse_args()
    device = harness.setup(args)
    if args.quick:
        args.rows, args.ids, args.mirror_mbps = 50_000, 1024, 20.0
    root = args.dir or tempfile.mkdtemp(prefix="nbtools-mirror-")
    table = nbtools.OffloadedEmbedding(args.rows, args.dim, device=device, name="t",
                                       placement="host")
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, table, lr=0.01)
    gen = np.random.default_rng(0)
    head = torch.linspace(-1, 1, args.dim, device=device)

    def step():
        ids = torch.from_numpy(zipf_ids(gen, args.rows, args.ids)).to(device)
        opt.zero_grad()
        (table(ids) * head).sum().backward()
        opt.step()
        synchronize(device)

    for _ in range(5):
        step()
    manager = CheckpointManager(f"{root}/local", keep=2, mirror=f"{root}/mirror",
                                config=CheckpointConfig(verbose=False))
    # the mirror's own view of shutil, its copies paced (the shutil module itself unchanged)
    mirror.shutil = types.SimpleNamespace(**vars(shutil))
    mirror.shutil.copyfileobj = paced_copy(args.mirror_mbps)
    try:
        saved = manager.save(1, table=table, opt=opt)
        t0 = time.perf_counter()
        during = []
        while manager.sync.pending():
            t = time.perf_counter()
            step()
            during.append(time.perf_counter() - t)
        copy_s = time.perf_counter() - t0
        manager.sync.wait()
        after = []
        for _ in range(max(5, min(len(during), 500))):
            t = time.perf_counter()
            step()
            after.append(time.perf_counter() - t)
    finally:
        mirror.shutil = shutil
        manager.sync.finalize(unmount=False)
        table.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    ms_during = statistics.median(during) * 1e3 if during else float("nan")
    ms_after = statistics.median(after) * 1e3
    result = {"args": vars(args), "device": harness.device_name(device),
              "checkpoint_bytes": saved["bytes"], "save_s": saved["seconds"],
              "copy_s": copy_s, "steps_during_copy": len(during),
              "ms_per_step_during_copy": ms_during, "ms_per_step_after": ms_after,
              "during_over_after_x": ms_during / ms_after}
    print(f"{args.rows:,} x {args.dim} float32 + Adam (host), {args.ids:,} ids a step, "
          f"{harness.device_name(device)}; mirror at {args.mirror_mbps:g} MB/s")
    harness.print_table(["measure", "value"], [
        ["checkpoint", f"{saved['bytes'] / 1e9:.2f} GB, saved locally in {saved['seconds']:.2f} s"],
        ["the mirror's copy", f"{copy_s:.1f} s beside {len(during)} steps"],
        ["step while it copies", f"{ms_during:.2f} ms (median)"],
        ["step after it", f"{ms_after:.2f} ms (median)"],
        ["during / after", f"{result['during_over_after_x']:.2f}x"]])
    harness.save(args, "bench_mirror.json", result)


if __name__ == "__main__":
    main()
