"""What OffloadConfig(deterministic=True) costs per step, measured without the noise of
separate processes (issue 24's target: <= 3% of step time).

bench_step.py --deterministic both times each system in its own child process, one after the
other; on a host-bound step (a few hundred microseconds of launches) two children differ by
more than the cost being measured. Here one model per case is built once, and rounds of steps
alternate between the fixed-order sum and the atomics on that same model (the table's
``deterministic`` flag, which is all that OffloadConfig.deterministic sets: it decides only how
a training lookup's backward sums each id's gradient rows). The figure is the median of the
rounds' ms per step for each mode, and their ratio.

Cases: bench_step's 4M x 128 Adam table (4,096 and 65,536 uniform ids, 65,536 Zipf(1.1)),
and its word2vec-sized model (two 59,754 x 100 tables, 4,096 pairs, 5 negatives), each on
placement "host" and "gpu".

    python benchmarks/experiments/determinism_cost.py [--rounds 9] [--steps 30] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import nbtools  # noqa: E402
from nbtools import OffloadConfig  # noqa: E402


def big_model(placement, device):
    table = nbtools.OffloadedEmbedding(4_000_000, 128, device=device, name="t",
                                       placement=placement)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, [table], lr=1e-3)

    def step(ids):
        table(ids).float().pow(2).sum().mul(1e-3).backward()
        opt.step()
        opt.zero_grad()
    return step, [table], opt


def small_model(placement, device, vocab=59_754, dim=100):
    a = nbtools.OffloadedEmbedding(vocab, dim, device=device, name="in", placement=placement)
    b = nbtools.OffloadedEmbedding(vocab, dim, device=device, name="out", placement=placement)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, [a, b], lr=1e-3,
                                   config=OffloadConfig())

    def step(batch):
        opt.zero_grad()
        v, u = a(batch[0]), b(batch[1])
        scores = torch.bmm(u, v.unsqueeze(2)).squeeze(2)
        sign = torch.ones_like(scores)
        sign[:, 1:] = -1
        (-F.logsigmoid(sign * scores).sum(1).mean()).backward()
        opt.step()
    return step, [a, b], opt


def batches_of(case, device, steps, gen):
    if case == "small":
        zipf = 1.0 / torch.arange(1, 59_755, dtype=torch.float64)
        return [(torch.multinomial(zipf, 4096, True, generator=gen).to(device),
                 torch.multinomial(zipf, 4096 * 6, True, generator=gen).view(4096, 6).to(device))
                for _ in range(steps)]
    n, dist = case
    if dist == "uniform":
        return [torch.randint(0, 4_000_000, (n,), generator=gen).to(device) for _ in range(steps)]
    p = 1.0 / torch.arange(1, 4_000_001, dtype=torch.float64).pow(1.1)
    return [torch.multinomial(p, n, True, generator=gen).to(device) for _ in range(steps)]


def measure(step, tables, opt, batches, rounds, device):
    """Median ms per step over ``rounds`` rounds per mode, the modes alternating, and the
    share of each mode's steps that replayed a CUDA graph."""
    times = {True: [], False: []}
    replays = {True: 0, False: 0}
    for mode in (True, False):                   # warm-up (graph captures, compiles)
        for t in tables:
            t.deterministic = mode
        for b in batches[:5]:
            step(b)
    torch.cuda.synchronize(device)
    for r in range(rounds):
        for mode in ((True, False) if r % 2 == 0 else (False, True)):
            for t in tables:
                t.deterministic = mode
            torch.cuda.synchronize(device)
            before = opt._graphs.replays
            t0 = time.perf_counter()
            for b in batches:
                step(b)
            torch.cuda.synchronize(device)
            times[mode].append((time.perf_counter() - t0) / len(batches) * 1e3)
            replays[mode] += opt._graphs.replays - before
    share = {m: replays[m] / (rounds * len(batches)) for m in replays}
    return statistics.median(times[True]), statistics.median(times[False]), share


def profile(step, tables, batches):
    from torch.profiler import ProfilerActivity, profile as prof
    for mode in (True, False):
        for t in tables:
            t.deterministic = mode
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for b in batches[:10]:
                step(b)
            torch.cuda.synchronize()
        print(f"--- deterministic={mode}, 10 steps")
        avg = p.key_averages()
        print(avg.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))
        print(avg.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=50))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, help="a case's name: torch.profiler tables of "
                    "its steps in each mode")
    args = ap.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    results = {}
    cases = [("small", "small"), ((4096, "uniform"), "big"), ((65536, "uniform"), "big"),
             ((65536, "zipf"), "big")]
    for placement in ("host", "gpu"):
        for case, kind in cases:
            step, tables, opt = (small_model if kind == "small" else big_model)(placement, device)
            batches = batches_of(case, device, args.steps, gen)
            det, atom, graphed = measure(step, tables, opt, batches, args.rounds, device)
            name = (f"{placement}, word2vec-sized" if kind == "small"
                    else f"{placement}, 4M x 128, {case[0]:,} {case[1]}")
            results[name] = {"deterministic_ms": det, "atomics_ms": atom, "ratio": det / atom,
                             "graphed_steps": {"deterministic": graphed[True],
                                               "atomics": graphed[False]}}
            print(f"{name:38s} deterministic {det:7.3f} ms  atomics {atom:7.3f} ms  "
                  f"ratio {det / atom:5.3f}x (target <= 1.03)  step graphs replayed "
                  f"{graphed[True]:.0%} / {graphed[False]:.0%}", flush=True)
            if args.profile and name == args.profile:
                profile(step, tables, batches)
            del step, tables, opt, batches
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "determinism_cost.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rounds": args.rounds,
                       "steps": args.steps, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
