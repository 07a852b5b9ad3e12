"""Checkpoints of a disk table (placement="disk"): a base save, delta saves and a restore of the
chain, in seconds and bytes per second.

A table of --rows x --dim float32 rows with Adagrad's per-row state lives in a file under --dir.
Each round touches --touch of its rows (one optimizer step on random ids) and saves: the first
save is a base (every row), the next --deltas are deltas (the rows changed since the previous
save). Then the table's rows are overwritten and the newest checkpoint restored (the base and
every delta merged, each checksum read first). Medians over --repeat rounds; a restore is
checked against a sample of rows taken before it.

    python benchmarks/bench_checkpoint_disk.py --rows 2000000 --dim 64 --dir /tmp/ckd
    python benchmarks/bench_checkpoint_disk.py --quick

It uses only the public API, so a copy of it in another tree's benchmarks/ (whose harness puts
that tree's nbtools first) times that version: two trees compared in one call.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import harness
import torch

import nbtools
from nbtools.checkpoint import CheckpointConfig, CheckpointManager


def one_round(root: str, rows: int, dim: int, deltas: int, touch: float, seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.emb = nbtools.OffloadedEmbedding(rows, dim, placement="disk",
                                           disk_dir=os.path.join(root, "table"), name="emb")
    opt = nbtools.OffloadOptimizer(torch.optim.Adagrad, model, lr=0.1)
    ck = CheckpointManager(os.path.join(root, "ckpt"), keep=deltas + 2,
                           config=CheckpointConfig(progress=False, verbose=False))
    n = max(1, int(rows * touch))

    def train_and_save(step):
        ids = torch.randint(0, rows, (n,))
        model.emb(ids).sum().backward()
        opt.step()
        opt.zero_grad()
        return ck.save(step, model=model, opt=opt)

    base = train_and_save(0)
    saves = [train_and_save(step) for step in range(1, deltas + 1)]
    sample = torch.randint(0, rows, (4096,))
    reference = model.emb.weight[sample].clone()
    with torch.no_grad():
        model.emb.weight[sample] = 0.0
    t0 = time.perf_counter()
    ck.restore(model=model, opt=opt)
    restore_s = time.perf_counter() - t0
    exact = bool(torch.equal(model.emb.weight[sample], reference))
    del model, opt
    shutil.rmtree(root, ignore_errors=True)
    return {"base_s": base["seconds"], "base_bytes_per_s": base["bytes_per_s"],
            "delta_s": statistics.median(s["seconds"] for s in saves),
            "delta_bytes": statistics.median(s["bytes"] for s in saves),
            "restore_s": restore_s, "restore_bytes_per_s": ck.last_restore["bytes_per_s"],
            "restore_exact": exact}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--deltas", type=int, default=4, help="delta saves after the base")
    ap.add_argument("--touch", type=float, default=0.01, help="share of rows changed per save")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where tables and checkpoints go")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeat = 50_000, 1
    parent = args.dir or tempfile.gettempdir()
    os.makedirs(parent, exist_ok=True)
    rounds = [one_round(tempfile.mkdtemp(dir=parent), args.rows, args.dim, args.deltas,
                        args.touch, seed) for seed in range(args.repeat)]
    result = {k: (statistics.median(r[k] for r in rounds) if k != "restore_exact"
                  else all(r[k] for r in rounds)) for k in rounds[0]}
    result.update(rows=args.rows, dim=args.dim, deltas=args.deltas, touch=args.touch,
                  repeat=args.repeat, nbtools=os.path.dirname(nbtools.__file__))
    harness.print_table(["measure", "value"], [[k, v] for k, v in result.items()],
                        title="disk-table checkpoints")
    harness.save(args, "checkpoint_disk", result)
    if not result["restore_exact"]:
        raise SystemExit("the restore did not give back the saved rows")


if __name__ == "__main__":
    main()
