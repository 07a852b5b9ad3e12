"""A GPU timeline of bench_step.py's 65,536-uniform-id step: where the time between the
traffic floor and the step goes.

For each system (``--systems``, names from bench_step.SYSTEMS; default nbtools host, its update
writing host memory itself instead of writing behind the next step, and with prefetch): 6 profiled steps after a warm-up;
from the profiler's trace, per CUDA stream: busy time, and the wall span of the steps; the
kernels by total time; the largest idle gaps of the main stream and what came before them.

    python benchmarks/experiments/step_timeline.py [--out DIR]     # GPU machine, ~1 minute
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import bench_step as bs  # noqa: E402


def timeline(trace_path):
    events = json.load(open(trace_path))["traceEvents"]
    kern = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
            and "dur" in e]
    kern.sort(key=lambda e: e["ts"])
    by_stream = collections.defaultdict(list)
    for e in kern:
        by_stream[e["args"].get("stream", e.get("tid"))].append(e)
    span = kern[-1]["ts"] + kern[-1]["dur"] - kern[0]["ts"]
    out = {"span_us": span, "streams": {}}
    for s, ks in by_stream.items():
        gaps = []
        for a, b in zip(ks, ks[1:]):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap > 0:
                gaps.append((gap, a["name"][:50], b["name"][:50]))
        gaps.sort(reverse=True)
        out["streams"][str(s)] = {"busy_us": sum(k["dur"] for k in ks), "kernels": len(ks),
                                  "idle_us": sum(g[0] for g in gaps), "top_gaps": gaps[:8]}
    totals = collections.Counter()
    for e in kern:
        totals[e["name"][:60]] += e["dur"]
    out["top_kernels"] = totals.most_common(14)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--steps", type=int, default=6)
    bs.add_systems_arg(ap, "nbtools host,nbtools host write-through,nbtools host prefetch")
    ap.add_argument("--cuda-only", action="store_true",
                    help="record GPU activity only: the host runs nearly as fast as unprofiled "
                    "(where the step is bound by the host, the CPU trace changes the timeline)")
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = bs.uniform_batches(65_536, device)
    from torch.profiler import ProfilerActivity, profile
    for name in args.systems.split(","):
        step, keep = bs.system_step(name, device)
        bs.follow(step, batches)
        for b in batches[:8]:
            step(b)
        torch.cuda.synchronize()
        acts = [ProfilerActivity.CUDA] + ([] if args.cuda_only else [ProfilerActivity.CPU])
        with profile(activities=acts) as p:
            for b in batches[8:8 + args.steps]:
                step(b)
            torch.cuda.synchronize()
        path = os.path.join(args.out, f"trace_{name.replace(' ', '_')}.json")
        p.export_chrome_trace(path)
        t = timeline(path)
        print(f"\n=== {name}: span {t['span_us'] / args.steps / 1e3:.3f} ms/step")
        for s, v in t["streams"].items():
            print(f"stream {s}: busy {v['busy_us'] / args.steps / 1e3:.3f} ms/step, idle "
                  f"{v['idle_us'] / args.steps / 1e3:.3f} ms/step, {v['kernels'] / args.steps:.0f}"
                  " kernels/step")
            for gap in v["top_gaps"]:
                print(f"    gap {gap[0]:8.1f} us after {gap[1]!r} before {gap[2]!r}")
        for k, us in t["top_kernels"]:
            print(f"  {us / args.steps:9.1f} us/step  {k}")
        del step, keep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
