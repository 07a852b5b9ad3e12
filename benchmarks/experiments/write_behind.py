"""Can a step's write-back run behind the next step, and does that bring an offloaded step to its
traffic floor? bench_step.py's 65,536-uniform-id step: 4,000,000 x 384 fp32 rows ([weight | m |
v] of a 128-wide Adam table) in pinned host RAM, a new batch of 65,536 uniform draws each step.

  floor            gather + write back of each batch's unique rows (bench_step.py's floor)
  series           dedup, gather, the step's compute, the fused Adam update writing host
                   memory: what an offloaded step does today, in series
  behind W=w       the same, but the update writes the gathered rows in GPU memory and a side
                   stream writes them back to host memory (a grid capped at w programs) while
                   the next step deduplicates, gathers and computes. Rows the next step shares
                   with the last one are taken from the last step's GPU rows, not host memory.

  --real           bench_step.py's nbtools step itself, writing through and behind, over grid
                   caps of the gather (P programs) and the write-back (W)
  --sizes          write-behind against write-through at 4,096, 16,384 and 65,536 ids

Before timing, ``behind`` and ``series`` train a 200,000-row table for 12 steps from the same
start and must leave it bit-identical (a third of each batch's rows were in the step before).

    python benchmarks/experiments/write_behind.py [--real] [--sizes]   # GPU machine, 1-2 min
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import hostmem, kernels  # noqa: E402
from nbtools.store.rows import unique_ids  # noqa: E402

N, D, IDS = 4_000_000, 128, 65_536
GROUP = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
         "amsgrad": False, "maximize": False}


class Stepper:
    """One table's steps, in series or with the write-back behind."""

    def __init__(self, view, dev, write_programs="series", gather_programs="default"):
        self.view, self.dev = view, dev
        self.n = view.shape[0]
        self.behind = write_programs != "series"
        self.write_programs = None if write_programs in ("series", None) else write_programs
        self.gather_programs = (kernels.zero_copy_programs(dev) if gather_programs == "default"
                                else gather_programs)
        self.update = kernels.fused_update_for(torch.optim.Adam, GROUP,
                                               ["exp_avg", "exp_avg_sq"], torch.float32)
        self.t = 0
        self.guard = torch.zeros(1, dtype=torch.long, device=dev)
        self.side = torch.cuda.Stream(dev)
        self.bufs = [torch.empty(IDS, 3 * D, device=dev) for _ in range(2)]
        self.written = [None, None]        # event: the side stream's write of bufs[i] is done
        self.prev = None                   # (ids, count, buf) of the step before

    def step(self, draws):
        main = torch.cuda.current_stream(self.dev)
        self.t += 1
        i = self.t % 2
        buf = self.bufs[i]
        if self.written[i] is not None:
            main.wait_event(self.written[i])
        batch = unique_ids(draws, self.n)
        cache = slots = None
        if self.behind and self.prev is not None:
            pids, pcount, pbuf = self.prev
            pos = torch.searchsorted(pids, batch.ids).clamp_(max=pids.numel() - 1)
            hit = (pids.gather(0, pos) == batch.ids) & (pos < pcount) & (batch.ids < self.n)
            slots = torch.where(hit, pos, -1).int()
            cache = pbuf
        kernels.gather_rows(self.view, batch.ids, batch.count, buf, 0, cache, slots,
                            self.gather_programs)
        # the step's compute: the lookup's forward, a loss, its backward summed per id
        y = buf[:, :D].index_select(0, batch.inverse)
        g = torch.zeros(buf.shape[0], D, device=self.dev)
        g.index_add_(0, batch.inverse, 2 * y)
        values, consts = self.update.scalars(GROUP, self.t, 0)
        hyper = torch.tensor(values, dtype=torch.float64).to(self.dev, non_blocking=True)
        if self.behind:
            target = kernels.Target(buf, buf[:, :D], D, in_place=True, num_rows=self.n)
        else:
            target = kernels.Target(self.view, self.view[:, :D], D)
        self.update(buf, buf[:, :D], g, target, batch.ids, batch.count, self.guard, hyper,
                    consts)
        if self.behind:
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                kernels.put_rows(self.view, batch.ids, batch.count, buf,
                                 programs=self.write_programs)
                ev = torch.cuda.Event()
                ev.record()
            self.written[i] = ev
            batch.ids.record_stream(self.side)
            batch.count.record_stream(self.side)
            self.prev = (batch.ids, batch.count, buf)

    def finish(self):
        torch.cuda.current_stream(self.dev).wait_stream(self.side)


def check_identical(dev):
    n = 200_000
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(n, 3 * D, generator=gen).abs_()
    tables = []
    for mode in ("series", None):
        h = hostmem.HostTensor((n, 3 * D), torch.float32, name="wb-check")
        h.tensor.copy_(start)
        s = Stepper(h.view(), dev, mode)
        g2 = torch.Generator().manual_seed(2)
        for _ in range(12):
            s.step(torch.randint(0, n, (IDS,), generator=g2).to(dev))
        s.finish()
        torch.cuda.synchronize()
        tables.append(h.tensor.clone())
        h.close()
    same = torch.equal(tables[0], tables[1])
    print(f"behind == series after 12 steps on {n:,} rows: {same} "
          f"(max diff {(tables[0] - tables[1]).abs().max().item():.3g})")
    return same


def timed(fn, batches, loops=5, finish=lambda: None):
    """Median ms per step over ``loops`` passes of every batch, ``finish`` (the last
    write-back) included."""
    for b in batches[:4]:
        fn(b)
    finish()
    torch.cuda.synchronize()
    ms = []
    for _ in range(loops):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for b in batches:
            fn(b)
        finish()
        z.record()
        z.synchronize()
        ms.append(a.elapsed_time(z) / len(batches))
    return statistics.median(ms)


def main():
    dev = torch.device("cuda")
    ok = check_identical(dev)
    h = hostmem.HostTensor((N, 3 * D), torch.float32, name="write-behind")
    view = h.view()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, N, (IDS,), generator=gen).to(dev) for _ in range(16)]
    uniq = [torch.unique(b) for b in batches]
    out = torch.empty(IDS, 3 * D, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []

    def floor(i):
        u = uniq[i]
        torch.index_select(view, 0, u, out=out[:u.numel()])
        view.index_copy_(0, u, out[:u.numel()])
    rows.append(("floor", timed(floor, list(range(len(batches))))))
    for name, w, gp in [("series", "series", "default"),
                        ("behind W=uncapped", None, "default"),
                        (f"behind W={2 * sms}", 2 * sms, "default"),
                        (f"behind W={sms}", sms, "default"),
                        ("behind W=64", 64, "default"),
                        ("behind W=32", 32, "default"),
                        ("behind W=16", 16, "default"),
                        ("behind W=8", 8, "default"),
                        ("behind W=4", 4, "default"),
                        ("behind W=32, gather 66", 32, sms // 2),
                        ("behind W=32, gather 528", 32, 4 * sms),
                        ("behind W=uncapped, gather uncapped", None, None),
                        ("series, gather uncapped", "series", None)]:
        s = Stepper(view, dev, w, gp)

        def run(b):
            s.step(b)
        ms = timed(run, batches, finish=s.finish)
        torch.cuda.synchronize()
        rows.append((name, ms))
    for w in (None, 2 * sms, 32, 16, 8, 4):
        def write(i):
            u = uniq[i]
            kernels.put_rows(view, u, counts[i], out[:u.numel()], programs=w)
        counts = [torch.tensor([u.numel()], device=dev) for u in uniq]
        rows.append((f"write alone W={w}", timed(write, list(range(len(batches))))))
    if "--real" in sys.argv:
        rows += real_grid(dev, batches, sms)
    base = rows[0][1]
    print(f"{N:,} x {3 * D} fp32 rows, {IDS:,} uniform draws per step, {sms} SMs")
    for name, ms in rows:
        print(f"  {name:40s} {ms:7.3f} ms   {ms / base:5.2f}x floor")
    if "--sizes" in sys.argv:
        sizes(dev, view, gen)
    h.close()
    if not ok:
        sys.exit(1)


def nbtools_ms(dev, batches, behind, write_programs=None, gather_programs=None):
    """bench_step.py's "nbtools host" step (write-behind as ``behind`` says), ms per step."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import bench_step as bs
    saved = kernels.WRITE_BEHIND_PROGRAMS, kernels.ZERO_COPY_PROGRAMS
    if write_programs is not None:
        kernels.WRITE_BEHIND_PROGRAMS = write_programs
    if gather_programs is not None:
        kernels.ZERO_COPY_PROGRAMS = gather_programs
    try:
        step, keep = bs.nbtools_step(N, D, dev, write_behind=behind)
        ms = bs.loop_ms(step, batches, dev)
        del step, keep
    finally:
        kernels.WRITE_BEHIND_PROGRAMS, kernels.ZERO_COPY_PROGRAMS = saved
    torch.cuda.empty_cache()
    return ms


def real_grid(dev, batches, sms):
    """--real: the nbtools step itself, writing through and behind, over grid caps."""
    out = [("nbtools write-through, gather P=264", nbtools_ms(dev, batches, False, 16, 2 * sms)),
           ("nbtools write-through, gather P=32", nbtools_ms(dev, batches, False, 16, 32))]
    for p in (16, 32, 64, 132):
        for w in (8, 16, 32):
            out.append((f"nbtools behind W={w}, gather P={p}",
                        nbtools_ms(dev, batches, None, w, p)))
    return out


def sizes(dev, view, gen):
    """--sizes: write-behind against write-through at the default caps, by batch size, each
    against the traffic floor of its own batches."""
    print("by batch size (default grid caps), ms per step:")
    for n in (4096, 16384, 65536):
        batches = [torch.randint(0, N, (n,), generator=gen).to(dev) for _ in range(16)]
        uniq = [torch.unique(b) for b in batches]
        out = torch.empty(n, 3 * D, device=dev)

        def floor(i):
            u = uniq[i]
            torch.index_select(view, 0, u, out=out[:u.numel()])
            view.index_copy_(0, u, out[:u.numel()])
        f = timed(floor, list(range(len(batches))))
        through = nbtools_ms(dev, batches, False)
        behind = nbtools_ms(dev, batches, None)
        print(f"  {n:6,} ids: floor {f:6.3f}  write-through {through:6.3f} ({through / f:4.2f}x)"
              f"  behind {behind:6.3f} ({behind / f:4.2f}x)  behind/through {behind / through:4.2f}")


if __name__ == "__main__":
    main()
