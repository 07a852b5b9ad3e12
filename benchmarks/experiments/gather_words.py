"""The zero-copy gather and write-back of small bf16 rows, by how the kernel sees them (issue 23:
the bf16 row-wise step's gather took ~0.6 ms in a step's profile where the floor's
index_select of the same 288-byte rows took ~0.4 ms).

A pinned 4,000,000-row table of rows of ``--row-bytes`` (288: bf16 RowWiseAdagrad rows at
dim 128, padded to whole sectors; 544 fp32 RowWiseAdagrad; 768 bf16 Adam with bf16 state;
1,536 fp32 Adam); 20 batches of 65,536 uniform ids, deduplicated. Each way of moving them is
timed in a loop (ms a batch, median of 3 loops): torch's index_select then index_copy_ on
the rows as fp32 values (bench_step's floor), and nbtools.kernels.gather_rows / put_rows on
the rows as int16 and as int32 values, with the grid capped at two program counts. Triton
reads and writes a row in wide vectors only where it knows the row stride is a multiple of
16 values.

    python3 benchmarks/experiments/gather_words.py      # GPU machine, ~20 s
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_step
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
import bench_step as bs  # noqa: E402
from nbtools import hostmem, kernels  # noqa: E402


def unique_batches(rows: int, ids: int, device) -> tuple[list, list]:
    """bench_step's 20 batches of ``ids`` uniform ids below ``rows``, deduplicated, and each
    one's count as a one-element GPU tensor (what the kernels take)."""
    uniq = [torch.unique(b) for b in bs.uniform_batches(ids, device, n=rows)]
    return uniq, [torch.tensor([u.numel()], dtype=torch.int32, device=device) for u in uniq]


def loop_ms(fn, k: int, device) -> float:
    """ms per call of ``fn(i)``, i < k: bench_step.loop_ms after a whole pass of warm-up."""
    return bs.loop_ms(fn, list(range(k)), device, repeats=3, warmup=k)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--row-bytes", default="288,544,768,1536",
                    help="comma-separated row sizes (multiples of 4)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    uniq, counts = unique_batches(args.rows, args.ids, dev)
    k = len(uniq)
    as_vectors = kernels._as_vectors
    print(f"# {torch.cuda.get_device_name(dev)}: {args.rows:,} rows, {args.ids:,} uniform ids "
          "a batch (ms a batch); each kernel sees a row as values of the dtype named, its "
          "stride in those values in brackets")
    print("| row B | how | ms |\n|---:|---|---:|")
    for row_bytes in (int(b) for b in args.row_bytes.split(",")):
        h = hostmem.HostTensor((args.rows, row_bytes // 4), torch.float32, name="words")
        views = {"fp32": h.view(), "int16": h.view().view(torch.int16),
                 "int32": h.view().view(torch.int32)}
        outs = {name: torch.zeros(args.ids, v.shape[1], dtype=v.dtype, device=dev)
                for name, v in views.items()}
        res = [("torch index_select + index_copy_ (floor)", loop_ms(
            lambda i: (hostmem.gather_rows(views["fp32"], uniq[i]),
                       hostmem.scatter_rows(views["fp32"], uniq[i],
                                            outs["fp32"][:uniq[i].numel()])), k, dev))]
        kernels._as_vectors = lambda tensors, cols=(), kind="": (tensors, cols)   # as they are
        try:
            for name in ("int16", "int32"):
                stride = views[name].stride(0)
                for programs in (32, 64):
                    res.append((f"gather_rows {name} [{stride}], {programs} programs", loop_ms(
                        lambda i: kernels.gather_rows(views[name], uniq[i], counts[i],
                                                      outs[name], programs=programs), k, dev)))
                for programs in (16, 32):
                    res.append((f"put_rows {name} [{stride}], {programs} programs", loop_ms(
                        lambda i: kernels.put_rows(views[name], uniq[i], counts[i], outs[name],
                                                   programs=programs), k, dev)))
        finally:
            kernels._as_vectors = as_vectors
        h.close()
        for name, ms in res:
            print(f"| {row_bytes} | {name} | {ms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
