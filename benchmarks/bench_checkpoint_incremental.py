"""Incremental checkpoints of a table in RAM (or on the GPU, --placement gpu): the bytes of a
base save and of the delta save after --steps training steps, and a restore of base + delta
checked bit for bit against the live table.

A table of --rows x --dim float32 rows with Adam's state (weights, exp_avg, exp_avg_sq in each
row) is saved once (a base: every row), trained --steps steps of --batch ids drawn Zipf(--zipf)
over its rows (harness.zipf_ids: the hot rows spread over the table), and saved again (a delta:
the rows those steps changed, each as [id | row]). The distinct ids the steps drew are counted
beside it: the delta should hold exactly those rows. Then a fresh table of the same placement
restores the newest checkpoint (the base, then the delta) and is compared with the live one
(``torch.equal`` on the weights and each optimizer state). Bytes are counts, not timings: the
figures are the same on any machine (the seconds are printed for information).

    python benchmarks/bench_checkpoint_incremental.py --dir /tmp/cki        # 4M x 128, ~13 GB RAM
    python benchmarks/bench_checkpoint_incremental.py --quick

The steps' loss projects each looked-up row on a fresh random vector, so the trained rows hold
what training gives (a constant gradient would make them compress unlike any real run).
--zlib: also what zlib (level 1, float32 bytes split into their four byte planes first) would
keep of each save's files, sampled in 1 MiB blocks spread over them: whether compressing
both saves would bring the second under a smaller share of the first.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import zlib

import harness
import numpy as np
import torch

import nbtools
from nbtools.checkpoint import CheckpointConfig, CheckpointManager


def table(rows: int, dim: int, placement: str, device):
    t = nbtools.OffloadedEmbedding(rows, dim, name="emb", device=device, placement=placement)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, t, lr=0.01)
    return t, opt


def same(a, aopt, b, bopt) -> bool:
    """Weights and every per-row state bit-identical (read through the state dicts)."""
    if not torch.equal(a.state_dict()["weight"], b.state_dict()["weight"]):
        return False
    sa = aopt.state_dict()["tables"]["emb"]["row_state"]
    sb = bopt.state_dict()["tables"]["emb"]["row_state"]
    return sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def zlib_kept(folder: str, blocks: int = 64) -> float:
    """The share of ``folder``'s data files zlib keeps (level 1, byte planes split), sampled
    in ``blocks`` 1 MiB blocks spread evenly over their bytes."""
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith("data-"))
    sizes = [os.path.getsize(f) for f in files]
    total, kept, block = sum(sizes), [0, 0], 1 << 20
    for k in range(blocks):
        at = min(total - 1, k * total // blocks)
        for f, n in zip(files, sizes):
            if at < n:
                with open(f, "rb") as fh:
                    fh.seek(at - at % 4)
                    raw = fh.read(block)
                break
            at -= n
        raw = raw[:len(raw) - len(raw) % 4]
        planes = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 4).T
        kept[0] += len(raw)
        kept[1] += sum(len(zlib.compress(p.tobytes(), 1)) for p in planes)
    return kept[1] / kept[0]


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100, help="training steps between the saves")
    ap.add_argument("--batch", type=int, default=65_536, help="ids a step")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--placement", default="host", choices=["host", "gpu"])
    ap.add_argument("--dir", default=None, help="where the checkpoints go")
    ap.add_argument("--zlib", action="store_true",
                    help="also what zlib would keep of each save (sampled)")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.dim, args.steps, args.batch = 50_000, 16, 10, 4096
    device = harness.resolve_device(args.device)
    root = tempfile.mkdtemp(dir=args.dir)
    try:
        torch.manual_seed(0)
        live, opt = table(args.rows, args.dim, args.placement, device)
        ck = CheckpointManager(os.path.join(root, "ckpt"), keep=2,
                               config=CheckpointConfig(progress=False, verbose=False))
        first = ck.save(0, model=live, opt=opt, rng=False)
        gen = np.random.default_rng(1)
        touched = np.zeros(args.rows, dtype=bool)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ids = harness.zipf_ids(gen, args.rows, args.batch, args.zipf)
            touched[ids] = True
            rows = live(torch.from_numpy(ids).to(device))
            (rows * torch.randn(rows.shape, device=device)).sum().backward()
            opt.step()
            opt.zero_grad()
        harness.synchronize(device)
        steps_s = time.perf_counter() - t0
        second = ck.save(args.steps, model=live, opt=opt, rng=False)
        fresh, fopt = table(args.rows, args.dim, args.placement, device)
        t0 = time.perf_counter()
        restored = CheckpointManager(os.path.join(root, "ckpt"), config=CheckpointConfig(
            progress=False, verbose=False)).restore(model=fresh, opt=fopt, rng=False)
        restore_s = time.perf_counter() - t0
        exact = restored == args.steps and same(live, opt, fresh, fopt)
        kept = [zlib_kept(s["path"]) for s in (first, second)] if args.zlib else None
    finally:
        shutil.rmtree(root, ignore_errors=True)
    kinds = [s["tables"]["emb"] for s in (first, second)]
    result = {
        "rows": args.rows, "dim": args.dim, "steps": args.steps, "batch": args.batch,
        "zipf": args.zipf, "placement": args.placement, "device": str(device),
        "first_save": kinds[0]["kind"], "first_save_bytes": first["bytes"],
        "second_save": kinds[1]["kind"], "second_save_bytes": second["bytes"],
        "second_over_first": second["bytes"] / first["bytes"],
        "rows_in_delta": kinds[1]["rows"], "distinct_rows_trained": int(touched.sum()),
        "share_of_rows_trained": float(touched.mean()),
        "first_save_s": first["seconds"], "steps_s": steps_s,
        "second_save_s": second["seconds"], "restore_s": restore_s,
        "restore_bit_identical": exact,
    }
    if kept:
        result.update({"zlib_kept_first": kept[0], "zlib_kept_second": kept[1],
                       "second_over_first_both_zlib":
                           second["bytes"] * kept[1] / (first["bytes"] * kept[0])})
    harness.print_table(["measure", "value"], [[k, v] for k, v in result.items()],
                        title="incremental checkpoints of a table in memory")
    harness.save(args, "checkpoint_incremental", result)
    if not exact or result["rows_in_delta"] != result["distinct_rows_trained"]:
        raise SystemExit("the delta does not hold exactly the rows trained, or the restore "
                         "of base + delta is not the live table")


if __name__ == "__main__":
    main()
