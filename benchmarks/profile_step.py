"""Where one of bench_step's systems spends a step, for comparing two trees of nbtools: the
Python functions a step calls (cProfile: calls per step, and the functions with the most own
time), the CUDA kernels and torch ops it launches (torch.profiler: launches per step), and the
plain loop's ms per step. Run once per tree; ``--diff`` compares two such JSON files.

    python benchmarks/profile_step.py --tree .scratch/old --system "nbtools gpu bf16 rowwise" --out DIR/old.json
    python benchmarks/profile_step.py --tree . --system "nbtools gpu bf16 rowwise" --out DIR/new.json
    python benchmarks/profile_step.py --diff DIR/old.json DIR/new.json

``--tree`` is imported as it is (its nbtools, its benchmarks' harness and systems), so an older
checkout profiles with its own code.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import sys

from sample_threads import short_path     # (this script's folder; before --tree's is added)


def where(code) -> str:
    """A function's name as a tree-independent key: its file (:func:`short_path`) and name."""
    path, line, name = code
    return f"{short_path(path)}:{re.sub(r' at 0x[0-9a-f]+', '', name)}"    # (no addresses)


def profile(args) -> dict:
    tree = os.path.realpath(args.tree)
    sys.path[:0] = [tree, os.path.join(tree, "benchmarks")]
    import torch
    import harness
    import bench_step

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kw = dict(bench_step.SYSTEMS[args.system])
    step, keep = harness.nbtools_step(args.rows, args.dim, device, **kw)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.rows, (args.ids,), generator=gen).to(device)
               for _ in range(args.steps)]
    harness.follow(step, batches)
    out = {"tree": tree, "system": args.system, "ids": args.ids, "steps": args.steps,
           "loop_ms": [harness.loop_ms(step, batches, device, repeats=5) for _ in range(3)]}

    prof = cProfile.Profile()
    harness.synchronize(device)
    prof.enable()
    for ids in batches:
        step(ids)
    harness.synchronize(device)
    prof.disable()
    stats = pstats.Stats(prof).stats
    calls, own = {}, {}
    for code, (cc, nc, tt, ct, callers) in stats.items():
        key = where(code)
        calls[key] = calls.get(key, 0) + nc / args.steps
        own[key] = own.get(key, 0.0) + tt / args.steps * 1e6
    out["calls_per_step"] = calls
    out["own_us_per_step"] = own
    out["total_calls_per_step"] = sum(calls.values())

    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile as tprofile
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
            for ids in batches:
                step(ids)
            harness.synchronize(device)
        ops, kernels = {}, {}
        for e in tp.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] = kernels.get(e.name, 0) + 1 / args.steps
            else:
                ops[e.name] = ops.get(e.name, 0) + 1 / args.steps
        out["cpu_events_per_step"] = ops
        out["cuda_kernels_per_step"] = kernels
    return out


def show(res: dict, top: int = 25) -> None:
    print(f"{res['system']} ({res['tree']}): loop ms {[round(v, 4) for v in res['loop_ms']]}, "
          f"{res['total_calls_per_step']:.0f} Python calls a step")
    for key, us in sorted(res["own_us_per_step"].items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {us:9.1f} us  {res['calls_per_step'][key]:6.1f} calls  {key}")
    if "cuda_kernels_per_step" in res:
        print(f"  {sum(res['cuda_kernels_per_step'].values()):.1f} CUDA kernels a step, "
              f"{sum(res['cpu_events_per_step'].values()):.1f} CPU events")


def diff(old: dict, new: dict) -> None:
    print(f"loop ms: old {min(old['loop_ms']):.4f}, new {min(new['loop_ms']):.4f} (minima), "
          f"new/old {min(new['loop_ms']) / min(old['loop_ms']):.3f}")
    print(f"Python calls a step: old {old['total_calls_per_step']:.1f}, "
          f"new {new['total_calls_per_step']:.1f}")
    for table, label in (("calls_per_step", "calls"), ("cuda_kernels_per_step", "kernels"),
                         ("cpu_events_per_step", "cpu events")):
        a, b = old.get(table, {}), new.get(table, {})
        changed = [(k, a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)
                   if abs(a.get(k, 0) - b.get(k, 0)) > 0.05]
        print(f"-- {label} a step that differ ({len(changed)}):")
        for k, x, y in sorted(changed, key=lambda t: -abs(t[2] - t[1]))[:40]:
            print(f"  {x:7.1f} -> {y:7.1f}  {k}")
    a, b = old["own_us_per_step"], new["own_us_per_step"]
    print("-- own time a step, largest changes (us; cProfile's, inflated):")
    for k in sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0) - a.get(k, 0)))[:25]:
        print(f"  {a.get(k, 0):8.1f} -> {b.get(k, 0):8.1f}  {k}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=".")
    ap.add_argument("--system", default="nbtools gpu bf16 rowwise")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"))
    args = ap.parse_args()
    if args.diff:
        diff(*(json.load(open(p)) for p in args.diff))
        return
    res = profile(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f)
    show(res)


if __name__ == "__main__":
    main()
