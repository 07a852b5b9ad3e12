"""What the host pays for each stream and event call a step makes (issue 23: a row-wise step's
host time, ~1 ms, is as long as its link time).

A training step of an offloaded table asks for the current stream, records and waits for events,
enters side-stream contexts and replays small CUDA graphs several times a step. Each call is
timed alone, ``--calls`` times in a row (microseconds per call, host time only, the median
of 5 runs), on the first CUDA device.

    python3 benchmarks/experiments/stream_calls.py        # GPU machine, ~10 s
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def per_call_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    main_stream = torch.cuda.current_stream(dev)
    event = torch.cuda.Event()
    event.record()
    torch.cuda.synchronize()
    x = torch.zeros(16, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):          # capture off the default stream
        graph.capture_begin()
        x.add_(1)
        graph.capture_end()
    torch.cuda.synchronize()

    def in_side():
        with torch.cuda.stream(side):
            pass
    cases = [
        ("torch.cuda.current_stream()", lambda: torch.cuda.current_stream()),
        ("torch.cuda.current_stream(device cuda:N)", lambda: torch.cuda.current_stream(dev)),
        ("torch.cuda.current_stream(index)", lambda: torch.cuda.current_stream(dev.index)),
        ("torch._C._cuda_getCurrentStream(index)",
         lambda: torch._C._cuda_getCurrentStream(dev.index)),
        ("stream == stream", lambda: main_stream == side),
        ("torch.cuda.Event()", lambda: torch.cuda.Event()),
        ("event.record()", lambda: event.record()),
        ("event.record(stream)", lambda: event.record(main_stream)),
        ("event.query()", lambda: event.query()),
        ("stream.wait_event(event)", lambda: main_stream.wait_event(event)),
        ("stream.wait_stream(stream)", lambda: side.wait_stream(main_stream)),
        ("with torch.cuda.stream(side): pass", in_side),
        ("CUDAGraph.replay() (one kernel)", lambda: graph.replay()),
        ("x.add_(1) (one eager kernel)", lambda: x.add_(1)),
        ("tensor.record_stream(side)", lambda: x.record_stream(side)),
    ]
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}; host us per call "
          f"(median of 5 runs of {args.calls:,} calls)")
    print("| call | us |\n|---|---:|")
    for name, fn in cases:
        print(f"| {name} | {per_call_us(fn, args.calls):.2f} |", flush=True)


if __name__ == "__main__":
    main()
