"""Host microseconds of what surrounds a training step's own work (issue 23: on the lent
machines the row-wise steps are host-bound, the GPU-placed one at 0.6-1.1 ms of host time a
step against the offloaded rows' ~0.88 ms traffic floor).

Per call, on the GPU machine: torch's profiler scope around ``Optimizer.step`` (torch wraps
every optimizer's step in one), ``torch.no_grad()``, nbtools' ``deferred_interrupts``, the
reorder and upcast of a lookup's rows (torch's two ops, nbtools.kernels.take_rows),
the benchmark's loss and its backward on a leaf of the step's shape (autograd's device thread,
and with ``torch.autograd.set_multithreading_enabled(False)``, on the calling thread), then
whole looped steps of ``--systems`` with autograd's multithreading on and off, and with
Python's cyclic garbage collector off (what its collections cost a step).

    python3 benchmarks/experiments/host_wrappers.py [--ids 65536] [--systems S]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import bench_step as bs  # noqa: E402
from stream_calls import per_call_us  # noqa: E402

from nbtools.devices import deferred_interrupts  # noqa: E402


def wrappers(calls: int) -> dict:
    def scope():
        with torch.autograd.profiler.record_function("Optimizer.step#X.step"):
            pass

    def no_grad():
        with torch.no_grad():
            pass

    def set_grad():
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        torch._C._set_grad_enabled(prev)

    def interrupts():
        with deferred_interrupts():
            pass

    return {"record_function scope": per_call_us(scope, calls),
            "torch.no_grad() block": per_call_us(no_grad, calls),
            "grad mode off and on (C calls)": per_call_us(set_grad, calls),
            "deferred_interrupts block": per_call_us(interrupts, calls),
            "torch.autograd.profiler._is_profiler_enabled":
                per_call_us(lambda: torch.autograd.profiler._is_profiler_enabled, calls)}


def take_costs(calls: int, device) -> dict:
    """A lookup's reorder and upcast of 64 bf16 rows (the GPU's share is nothing): torch's
    two launches against nbtools' one Triton kernel."""
    from nbtools import kernels
    rows = torch.randn(64, 144, device=device).to(torch.bfloat16)[:, :128]
    idx = torch.randperm(64, device=device)
    return {"index_select + upcast, 64 rows":
                per_call_us(lambda: rows.index_select(0, idx).to(torch.float32), calls),
            "kernels.take_rows, 64 rows":
                per_call_us(lambda: kernels.take_rows(rows, idx, torch.float32), calls)}


def backward_costs(ids: int, dim: int, calls: int, device) -> dict:
    leaf = torch.randn(ids, dim, device=device, requires_grad=True)

    def forward():
        bs.loss_of(leaf)

    def backward():
        bs.loss_of(leaf).backward()
        leaf.grad = None

    out = {"the loss alone (forward)": per_call_us(forward, calls),
           "the loss and its backward": per_call_us(backward, calls)}
    with torch.autograd.set_multithreading_enabled(False):
        out["... backward on the calling thread"] = per_call_us(backward, calls)
    return out


def step_loops(systems: list, ids: int, device, rounds: int) -> dict:
    batches = bs.uniform_batches(ids, device)
    out = {}
    for system in systems:
        step, keep = bs.system_step(system, device)
        bs.follow(step, batches)
        on, off, nogc = [], [], []
        seen = [0, 0, 0]

        def count(phase, info):
            if phase == "start":
                seen[info["generation"]] += 1
        for _ in range(rounds):
            gc.callbacks.append(count)
            try:
                on.append(bs.loop_ms(step, batches, device, repeats=3))
            finally:
                gc.callbacks.remove(count)
            with torch.autograd.set_multithreading_enabled(False):
                off.append(bs.loop_ms(step, batches, device, repeats=3))
            gc.collect()
            gc.disable()
            try:
                nogc.append(bs.loop_ms(step, batches, device, repeats=3))
            finally:
                gc.enable()
        steps = rounds * (3 + 3 * len(batches))          # loop_ms: warm-up + 3 loops
        print(f"{system}: Python's gc collections a step (generations 0, 1, 2): "
              + ", ".join(f"{c / steps:.2f}" for c in seen), flush=True)
        out[system] = (on, off, nogc)
        del step, keep
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    bs.add_systems_arg(ap, "nbtools gpu bf16 rowwise,nbtools host bf16 rowwise")
    args = ap.parse_args()
    device = torch.device("cuda")
    print("| host cost | us a call |\n|---|---:|")
    for k, v in wrappers(args.calls).items():
        print(f"| {k} | {v:.2f} |")
    for k, v in take_costs(args.calls, device).items():
        print(f"| {k} | {v:.2f} |")
    for k, v in backward_costs(args.ids, 128, max(50, args.calls // 20), device).items():
        print(f"| {k} ([{args.ids}, 128] leaf) | {v:.1f} |")
    print("\n| system | autograd threads ms a step (rounds) | calling thread ms | Python's "
          "gc off ms |\n|---|---|---|---|")
    for system, runs in step_loops(args.systems.split(","), args.ids, device,
                                   args.rounds).items():
        print("| " + " | ".join([system] + [" ".join(f"{x:.3f}" for x in r) for r in runs])
              + " |", flush=True)


if __name__ == "__main__":
    main()
