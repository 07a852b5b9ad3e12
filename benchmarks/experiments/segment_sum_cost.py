"""What the fixed-order duplicate-id sum costs against the atomics (issue 24's <= 3% target).

For lookups of n ids (uniform or Zipf(1.1) over 60K-4M rows) at d = 100 / 128, three ways to
sum a lookup's gradient rows per unique id: nbtools.rows.sum_by_slot (kernels.segment_sum,
two Triton launches), index_add_ (atomics, what deterministic=False runs) and torch's
embedding_dense_backward (sort-based, launched from C++). Two figures each:
  host us  CPU time per call when the GPU is not the wait (launch cost, Python included)
  gpu us   GPU time per call (CUDA events over 200 back-to-back calls)

    python benchmarks/experiments/segment_sum_cost.py        # GPU machine
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from nbtools import rows as R  # noqa: E402


def main():
    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    print(f"{'case':34s} {'way':22s} {'host us':>8s} {'gpu us':>8s}")
    for n, rows_, dist, d in [(4096, 59754, "zipf", 100), (24576, 59754, "zipf", 100),
                              (4096, 4_000_000, "uniform", 128),
                              (65536, 4_000_000, "uniform", 128), (65536, 4_000_000, "zipf", 128)]:
        if dist == "zipf":
            p = 1.0 / torch.arange(1, rows_ + 1, dtype=torch.float64).pow(1.1)
            ids = torch.multinomial(p, n, True, generator=gen)
        else:
            ids = torch.randint(0, rows_, (n,), generator=gen)
        ids = ids.to(dev)
        batch = R.unique_ids(ids, rows_)
        grad = torch.randn(n, d, device=dev)
        cap = batch.capacity
        ways = {
            "segment_sum": lambda: R.sum_by_slot(grad, batch, True),
            "index_add_ (atomics)": lambda: R.sum_by_slot(grad, batch, False),
            "embedding_dense_bwd": lambda: torch.ops.aten.embedding_dense_backward(
                grad, batch.inverse, cap, -1, False),
        }
        for name, fn in ways.items():
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            # host: calls while the GPU runs something long (a sleep), so launches never wait
            torch.cuda._sleep(200_000_000)
            t = time.perf_counter()
            for _ in range(50):
                fn()
            host = (time.perf_counter() - t) / 50 * 1e6
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(200):
                fn()
            b.record()
            torch.cuda.synchronize()
            gpu = a.elapsed_time(b) / 200 * 1e3
            print(f"{f'{n:,} {dist} rows {rows_:,} d {d}':34s} {name:22s} {host:8.1f} {gpu:8.1f}")
        ref = R.sum_by_slot(grad, batch, True)
        emb = torch.ops.aten.embedding_dense_backward(grad, batch.inverse, cap, -1, False)
        again = torch.ops.aten.embedding_dense_backward(grad, batch.inverse, cap, -1, False)
        print(f"  embedding_dense_bwd: max diff to segment_sum {(ref - emb).abs().max().item():.2e},"
              f" twice bit-identical {torch.equal(emb, again)}")


if __name__ == "__main__":
    main()
