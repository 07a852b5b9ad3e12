"""What a step's CUDA graph replays cost the host, graph by graph (issue 23: the row-wise steps
are host-bound, ~1.1 ms of host time a step against a ~0.9 ms traffic floor).

A looped step of ``--systems`` (bench_step.SYSTEMS, 4,000,000 x 128, ``--ids`` uniform ids)
runs until its graphs are captured; then every CUDA graph the process holds is replayed alone
``--calls`` times in a row (host microseconds a replay, through ``CUDAGraph.replay`` and
through the C method it wraps), with its node count where libcudart answers. Then the user's
own backward (``loss_of`` of a leaf of the step's shape) is timed alone, and torch's profiler
lists the host time of each CUDA runtime call and op over ``--steps`` steps.

    python3 benchmarks/experiments/replay_costs.py [--systems "nbtools host bf16 rowwise"]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import glob
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                              # gather_words, stream_calls
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import bench_step as bs  # noqa: E402
from gather_words import loop_ms  # noqa: E402
from stream_calls import per_call_us  # noqa: E402


def _cudart():
    """libcudart as ctypes sees it (torch's own copy first), or None."""
    cands = []
    for path in sys.path:
        cands += glob.glob(os.path.join(path, "nvidia", "cu*", "lib", "libcudart.so*"))
        cands += glob.glob(os.path.join(path, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
    cands += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart*.so*"))
    cands += ["libcudart.so"]
    for name in cands:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def node_count(graph, rt) -> int | None:
    if rt is None:
        return None
    try:
        raw = ctypes.c_void_p(graph.raw_cuda_graph())
        n = ctypes.c_size_t(0)
        err = rt.cudaGraphGetNodes(raw, None, ctypes.byref(n))
        return int(n.value) if err == 0 else None
    except Exception:      # noqa: BLE001  (an older torch without raw_cuda_graph)
        return None


def link_parts(n, row_bytes, batches, device) -> dict:
    """ms a batch of the link's parts on an n-row table of ``row_bytes`` rows (zero-copy view,
    torch's index_select / index_copy_, as bench_step's floor): gather alone, scatter alone, the
    two in series (the floor), and the gather of one batch beside the scatter of another on a
    second stream (torch's kernels take every SM: beside, they still run one after the other,
    whatever the link could carry both ways)."""
    from nbtools import hostmem
    h = hostmem.HostTensor((n, row_bytes // 4), torch.float32, name="parts")
    view = h.view()
    uniq = [torch.unique(b) for b in batches]
    rows = [torch.empty(u.numel(), row_bytes // 4, device=device) for u in uniq]
    side = torch.cuda.Stream(device)
    k = len(uniq)

    def beside(i):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            hostmem.scatter_rows(view, uniq[i - 1], rows[i - 1])
        hostmem.gather_rows(view, uniq[i])
        torch.cuda.current_stream().wait_stream(side)
    out = {"gather": loop_ms(lambda i: hostmem.gather_rows(view, uniq[i]), k, device),
           "scatter": loop_ms(lambda i: hostmem.scatter_rows(view, uniq[i], rows[i]), k,
                              device),
           "series (floor)": loop_ms(lambda i: (hostmem.gather_rows(view, uniq[i]),
                                                hostmem.scatter_rows(view, uniq[i], rows[i])),
                                     k, device),
           "beside": loop_ms(beside, k, device)}
    h.close()
    return out


def queued_and_done(step, batches, n: int) -> None:
    """Unprofiled: how long the host takes to queue ``n`` steps, and the wait for the GPU."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        step(batches[i % len(batches)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"queued {(t1 - t0) / n * 1e6:.0f} us a step, then {(t2 - t1) * 1e6:.0f} us "
          f"until the GPU was done ({(t2 - t0) / n * 1e6:.0f} us a step)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--quick", action="store_true",
                    help="only each system's step time, and how long the host took to queue "
                    "the steps (at a small --ids, the host's own cost of a step)")
    ap.add_argument("--timeline", type=int, default=0,
                    help="also list the GPU work of the last N profiled steps (start, length, "
                    "stream, name)")
    bs.add_systems_arg(ap, "nbtools host bf16 rowwise,nbtools gpu bf16 rowwise")
    args = ap.parse_args()
    device = torch.device("cuda")
    rt = _cudart()
    batches = bs.uniform_batches(args.ids, device)
    for system in args.systems.split(","):
        before = {id(o) for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)}
        step, keep = bs.system_step(system, device)
        bs.follow(step, batches)
        for i in range(3 * len(batches)):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(2 * len(batches)):
            step(batches[i % len(batches)])
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / (2 * len(batches)) * 1e6
        print(f"\n=== {system}: {wall:.0f} us a step (no timers)")
        if args.quick:
            queued_and_done(step, batches, 4 * len(batches))
            del step, keep
            gc.collect()
            torch.cuda.empty_cache()
            continue
        if getattr(keep[0], "placement", None) == "host":
            row_bytes = bs.stored_row_bytes(keep[0])
            parts = link_parts(4_000_000, row_bytes, batches, device)
            print(f"link, {row_bytes} B rows, ms a batch: " +
                  ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        graphs = [o for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)
                  and id(o) not in before]
        print("| graph | nodes | replay() us | C replay us |\n|---|---:|---:|---:|")
        for k, g in enumerate(graphs):
            py = per_call_us(g.replay, args.calls)
            c = per_call_us(lambda: torch._C._CUDAGraph.replay(g), args.calls)
            print(f"| {k} | {node_count(g, rt)} | {py:.1f} | {c:.1f} |", flush=True)
        leaf = torch.randn(args.ids, 128, device=device, requires_grad=True)

        def backward():
            bs.loss_of(leaf).backward()
            leaf.grad = None
        print(f"user's backward alone (loss_of, [{args.ids}, 128] leaf): "
              f"{per_call_us(backward, args.calls):.1f} us")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps):
                step(batches[i % len(batches)])
            torch.cuda.synchronize()
        print(f"--- torch.profiler, {args.steps} steps, by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                        max_name_column_width=50))
        print(f"--- torch.profiler, {args.steps} steps, by self CUDA time")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20,
                                        max_name_column_width=50))
        # how busy the GPU was: the union of its kernels' and copies' intervals, any stream
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA)
        busy, end = 0.0, None
        for a, b in spans:
            if end is None or a > end:
                busy += b - a
                end = b
            elif b > end:
                busy += b - end
                end = b
        first, last = spans[0][0], max(b for _, b in spans)
        if args.timeline:
            work = sorted((e for e in prof.events()
                           if e.device_type == torch.autograd.DeviceType.CUDA),
                          key=lambda e: e.time_range.start)
            start = last - (last - first) / args.steps * args.timeline
            print(f"--- GPU work of the last {args.timeline} steps: start us, length us, stream")
            for e in work:
                if e.time_range.start >= start:
                    print(f"{e.time_range.start - start:9.1f} {e.time_range.elapsed_us():8.1f}"
                          f"  s{getattr(e, 'device_resource_id', '?')}  {e.name[:60]}")
        print(f"GPU busy {busy / args.steps:.0f} us a step of {(last - first) / args.steps:.0f}"
              f" us from first to last GPU work (profiled)")
        queued_and_done(step, batches, 4 * len(batches))
        del step, keep, graphs
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
