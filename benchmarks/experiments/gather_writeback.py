"""How the step's row traffic is best moved: Triton's masked gather against index_select, and
the fused update writing rows straight to host memory against updating in GPU memory and
writing back with index_copy_. 4M x 384 fp32 pinned rows ([weight | m | v] of dim 128).

    python benchmarks/experiments/gather_writeback.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import hostmem, kernels  # noqa: E402


def ms(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    n, d = 4_000_000, 128
    w = 3 * d
    h = hostmem.HostTensor((n, w), torch.float32, name="exp")
    view = h.view()
    dev = torch.device("cuda")
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    fused = kernels.fused_update_for(torch.optim.Adam, group, ["exp_avg", "exp_avg_sq"],
                                     torch.float32)
    values, consts = fused.scalars(group, 5, 0)
    hyper = torch.tensor(values, dtype=torch.float64, device=dev)
    guard = torch.zeros(1, dtype=torch.long, device=dev)

    def adam(rows, grad, dst, ids):
        """The fused Adam update of ``rows`` (at ``ids``) written to ``dst``."""
        target = kernels.Target(dst, dst[:, :d], d)
        count = torch.tensor([ids.numel()], device=dev)
        fused(rows, rows[:, :d], grad, target, ids, count, guard, hyper, consts)
    for label, m, cap in (("65,536 unique", 65536, 65536), ("19,000 of cap 65,536", 19000, 65536),
                          ("4,096 unique", 4096, 4096)):
        ids = torch.sort(torch.randperm(n, device=dev)[:m]).values
        padded = torch.full((cap,), n, device=dev)
        padded[:m] = ids
        count = torch.tensor([m], device=dev)
        out = torch.empty(cap, w, device=dev)
        grad = torch.randn(m, d, device=dev)
        rows = torch.randn(m, w, device=dev)
        arange = torch.arange(m, device=dev)
        mb = m * w * 4 / 1e6
        res = {
            "index_select (m rows)": ms(lambda: view.index_select(0, ids)),
            "triton masked gather": ms(lambda: kernels.gather_rows(view, padded, count, out)),
            "index_select clamped (cap rows)": ms(lambda: view.index_select(0, padded.clamp(max=n - 1))),
            "index_copy_ (m rows)": ms(lambda: view.index_copy_(0, ids, rows)),
            "fused adam -> host": ms(lambda: adam(rows, grad, view, ids)),
            "fused adam in GPU + index_copy_": ms(lambda: (adam(rows, grad, rows, arange),
                                                          view.index_copy_(0, ids, rows))),
        }
        print(f"\n## {label}: {m:,} rows of {w * 4} B ({mb:.0f} MB)")
        for k, v in res.items():
            print(f"{k:<36}{v:8.3f} ms  {mb / v:6.1f} GB/s")
    for br in (2, 4, 8, 16):
        for nw in (4, 8):
            m = 65536
            ids = torch.sort(torch.randperm(n, device=dev)[:m]).values
            out = torch.empty(m, w, device=dev)
            count = torch.tensor([m], device=dev)
            kernels.TILES["gather"] = (br, 512, nw)
            t = ms(lambda: kernels.gather_rows(view, ids, count, out))
            kernels.TILES.pop("gather")
            print(f"gather BLOCK_R={br:<3} num_warps={nw}: {t:.3f} ms {m * w * 4 / 1e6 / t:.1f} GB/s")


if __name__ == "__main__":
    main()
