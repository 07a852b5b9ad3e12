"""Epochs/s of PinnedLoader against DataLoader and against data already on the GPU.

Two datasets, each feeding a small model (forward + backward + optimizer step per batch):
  images  MNIST-sized: 60,000 x 28 x 28 uint8 + int64 labels, batch 512, an MLP 784-256-10
          with Adam (the batch is normalised on the GPU inside the step).
  pairs   an id-pair stream: 100,000,000 x 2 int64 ids, batch 32,768, skip-gram with negative
          sampling (two 1M x 64 nn.Embedding(sparse=True) tables, 5 negatives, SGD).
Compared, per dataset:
  ceiling       the same tensors already on the GPU, batches x[perm[i:i+bs]] (torch.randperm on
                the GPU each epoch): the speed to approach.
  PinnedLoader  nbtools.PinnedLoader over the CPU tensors (pinned in place; the GPU gathers).
  DataLoader    over a TensorDataset, pin_memory False/True x num_workers 0/2/4/8 (fork, so the
                tensors are shared with the workers, not copied); batches moved with
                .to(device, non_blocking=pin_memory): the stock DataLoader(ds, batch_size,
                shuffle=True), which indexes and collates sample by sample. This is the grid
                the targets are stated against.
  tuned         (pairs only, beyond that grid) the same pin x workers settings with a sampler
                that yields whole batches of indices (a BatchSampler over one precomputed
                permutation, as index tensors, batch_size=None: one TensorDataset index per
                batch), and the textbook DataLoader(ds, sampler=BatchSampler(RandomSampler(ds))).
PinnedLoader and ceiling are timed over whole epochs after a warm-up epoch (the per-epoch
permutation included). DataLoader rows are timed over a window of at most --max-batches batches
or --window-s seconds after a few warm-up batches, and epochs/s is extrapolated from the batch
rate: worker start-up and the sampler's per-epoch shuffle are left out, in DataLoader's favour.
Then PinnedLoader vs ceiling on the pairs at other batch sizes (--pair-sweep, 1 timed epoch
each): small batches are bound by Python launch overhead, large ones by the PCIe gather.

GPU idle fraction = 1 - (time the compute stream spent inside model steps, from CUDA events
around each step) / wall time: waiting for data or for copies counts as idle.

    python benchmarks/bench_loader.py --out artifacts/gpu    # GPU machine, about 4 minutes
    python benchmarks/bench_loader.py --quick                # small, on a CPU in seconds
"""
from __future__ import annotations

import gc
import itertools
import os
import platform
import sys
import time

import harness
import torch
import torch.nn.functional as F
from harness import synchronize
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from nbtools import hostmem
from nbtools.loader import PinnedLoader


# --- models: one step = forward, backward, optimizer step --------------------------------------

def image_step(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=device.type == "cuda")

    def step(x, y):
        logits = model(x.view(len(x), -1).float().div_(255))   # normalise on the device
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def pair_step(device, vocab, dim, negatives=5):
    torch.manual_seed(0)
    emb_in = nn.Embedding(vocab, dim, sparse=True).to(device)
    emb_out = nn.Embedding(vocab, dim, sparse=True).to(device)
    opt = torch.optim.SGD([emb_in.weight, emb_out.weight], lr=0.05)

    def step(pairs):
        u, v = emb_in(pairs[:, 0]), emb_out(pairs[:, 1])                       # (B, d)
        neg = emb_out(torch.randint(vocab, (len(pairs), negatives), device=device))  # (B, k, d)
        pos = F.logsigmoid((u * v).sum(-1))
        negs = F.logsigmoid(-torch.bmm(neg, u.unsqueeze(-1)).squeeze(-1)).sum(-1)
        loss = -(pos + negs).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


# --- timing -------------------------------------------------------------------------------------

def measure(batches, step, device, *, warmup, max_batches, window_s, to_device=None):
    """Run ``step`` over ``batches``; time up to ``max_batches`` after ``warmup`` of them.

    Returns wall seconds, batches timed and GPU-busy seconds (CUDA events around each step).
    """
    cuda = device.type == "cuda"
    it = iter(batches)
    for batch in itertools.islice(it, warmup):
        step(*(to_device(batch) if to_device else batch))
    synchronize(device)
    events, n = [], 0
    t0 = time.perf_counter()
    for batch in it:
        if to_device:
            batch = to_device(batch)
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(*batch)
            end.record()
            events.append((start, end))
        else:
            step(*batch)
        n += 1
        if n >= max_batches or time.perf_counter() - t0 > window_s:
            break
    synchronize(device)
    wall = time.perf_counter() - t0
    busy = sum(s.elapsed_time(e) for s, e in events) / 1e3 if cuda else None
    del it                                     # stops DataLoader workers now
    return {"wall_s": wall, "batches": n, "busy_s": busy}


def summarise(m, batches_per_epoch, extrapolated):
    rate = m["batches"] / m["wall_s"] if m["wall_s"] > 0 else float("nan")
    return {"epochs_per_s": rate / batches_per_epoch, "batches_per_s": rate,
            "batches_measured": m["batches"], "wall_s": m["wall_s"],
            "gpu_idle_frac": None if m["busy_s"] is None else max(0.0, 1 - m["busy_s"] / m["wall_s"]),
            "extrapolated": extrapolated}


def on_gpu_epoch(tensors, batch_size):
    """One epoch of the ceiling: every tensor already on the device, batches gathered there."""
    def epoch():
        n = tensors[0].shape[0]
        perm = torch.randperm(n, device=tensors[0].device)
        for i in range(0, n, batch_size):
            idx = perm[i:i + batch_size]
            yield tuple(t[idx] for t in tensors)
    return epoch


class IndexBatches:
    """A BatchSampler over one precomputed permutation that yields index tensors (no Python
    lists): the fastest way for a DataLoader to ask a TensorDataset for whole batches."""

    def __init__(self, n, batch_size, seed=0):
        self.perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        self.batch_size = batch_size

    def __len__(self):
        return -(-len(self.perm) // self.batch_size)

    def __iter__(self):
        for i in range(0, len(self.perm), self.batch_size):
            yield self.perm[i:i + self.batch_size].clone()   # clone: workers get 1 batch, not the perm


# --- one dataset --------------------------------------------------------------------------------

def bench_dataset(name, tensors, step, batch_size, device, args, tuned, dataloaders=True):
    n = tensors[0].shape[0]
    nb = -(-n // batch_size)
    res = {"samples": n, "batch_size": batch_size, "batches_per_epoch": nb,
           "shapes": [list(t.shape) for t in tensors], "dtypes": [str(t.dtype) for t in tensors],
           "results": {}}
    out = res["results"]

    def run(key, batches, to_device=None):
        """A DataLoader: a few warm-up batches, then a window."""
        m = measure(batches, step, device, warmup=args.dl_warmup, max_batches=args.max_batches,
                    window_s=args.window_s, to_device=to_device)
        out[key] = summarise(m, nb, extrapolated=True)
        print(f"{name:7s} {key:58s} {out[key]['epochs_per_s']:9.3f} epochs/s", flush=True)
        gc.collect()
        return m

    # DataLoader first: the tensors are not registered with CUDA yet, so forked workers share
    # their pages plainly.
    ds = TensorDataset(*tensors)
    index_batches = None if not tuned or not dataloaders else IndexBatches(n, batch_size)
    fork = "fork" if platform.system() == "Linux" else None
    pins = [pin for pin in (False, True) if device.type == "cuda" or not pin]
    settings = []
    if dataloaders:
        settings += [("stock", pin, w) for pin in pins for w in args.workers]
    if dataloaders and tuned:
        settings += [("index", pin, w) for pin in pins for w in args.workers]
        settings.append(("textbook", pins[-1], max(args.workers)))
    labels = {"stock": "DataLoader", "index": "tuned: DataLoader, index-batch sampler,",
              "textbook": "tuned: DataLoader, BatchSampler(RandomSampler),"}
    for kind, pin, w in settings:
        kw = dict(num_workers=w, pin_memory=pin, multiprocessing_context=fork if w else None)
        if kind == "stock":
            dl = DataLoader(ds, batch_size=batch_size, shuffle=True, **kw)
        elif kind == "textbook":
            dl = DataLoader(ds, sampler=BatchSampler(RandomSampler(ds), batch_size, False),
                            batch_size=None, **kw)
        else:
            dl = DataLoader(ds, sampler=index_batches, batch_size=None, **kw)
        run(f"{labels[kind]} pin={pin} workers={w}", dl,
            lambda b, pin=pin: tuple(t.to(device, non_blocking=pin) for t in b))
        del dl
    del index_batches, ds

    # PinnedLoader (pinned in place, the GPU gathers each batch from host RAM) against the
    # ceiling (the same data already on the GPU): a warm-up epoch each, then timed epochs in
    # alternation, so that drift of the machine affects both alike; the median epoch counts.
    t0 = time.perf_counter()
    loader = PinnedLoader(*tensors, batch_size=batch_size, device=device, seed=0)
    res["pinned_setup_s"] = time.perf_counter() - t0
    on_dev = [t.to(device) for t in tensors]
    contenders = {"PinnedLoader": loader,   # a loader, or a function giving one epoch
                  "ceiling (data on GPU)": on_gpu_epoch(on_dev, batch_size)}
    h2d0 = hostmem.transfer_counters()["h2d_bytes"]
    rounds = {k: [] for k in contenders}
    for r in range(1 + args.epochs):
        for key in (list(contenders) if r % 2 else list(contenders)[::-1]):
            c = contenders[key]
            m = measure(c() if callable(c) else iter(c), step, device, warmup=0, max_batches=nb,
                        window_s=float("inf"))
            if r:                                # round 0 is the warm-up
                rounds[key].append(m)
    for key, ms in rounds.items():
        med = sorted(ms, key=lambda m: m["wall_s"])[len(ms) // 2]
        out[key] = summarise(med, nb, extrapolated=False)
        out[key]["epoch_s_each"] = [m["wall_s"] for m in ms]
        took = ", ".join(f"{m['wall_s']:.2f}" for m in ms)
        print(f"{name:7s} {key:58s} {out[key]['epochs_per_s']:9.3f} epochs/s (epochs: {took} s)",
              flush=True)
    per_epoch = (hostmem.transfer_counters()["h2d_bytes"] - h2d0) / (1 + args.epochs)
    out["PinnedLoader"]["h2d_bytes_per_epoch"] = per_epoch
    out["PinnedLoader"]["h2d_GBps"] = per_epoch * out["PinnedLoader"]["epochs_per_s"] / 1e9
    loader.close()
    del loader, on_dev, contenders
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    ceiling = out["ceiling (data on GPU)"]["epochs_per_s"]
    res["pinned_vs_ceiling"] = out["PinnedLoader"]["epochs_per_s"] / ceiling
    dls = {k: v["epochs_per_s"] for k, v in out.items() if k.startswith("DataLoader")}
    if not dls:
        return res
    best = max(dls, key=dls.get)
    res["best_dataloader"] = best
    res["pinned_vs_best_dataloader"] = out["PinnedLoader"]["epochs_per_s"] / dls[best]
    tuned_dls = {k: v["epochs_per_s"] for k, v in out.items() if k.startswith("tuned")}
    if tuned_dls:
        best = max(tuned_dls, key=tuned_dls.get)
        res["best_tuned"] = best
        res["pinned_vs_best_tuned"] = out["PinnedLoader"]["epochs_per_s"] / tuned_dls[best]
    return res


def print_table(name, res, device_name):
    shapes = " + ".join(f"{'x'.join(f'{s:,}' for s in sh)} {dt.replace('torch.', '')}"
                        for sh, dt in zip(res["shapes"], res["dtypes"]))
    print(f"\n## {name}: {shapes}, batch {res['batch_size']:,} "
          f"({res['batches_per_epoch']:,} batches/epoch), {device_name}")
    print(f"{'method':<68}{'epochs/s':>10}{'vs ceiling':>12}{'GPU idle':>10}  measured")
    ceiling = res["results"]["ceiling (data on GPU)"]["epochs_per_s"]
    for k, v in sorted(res["results"].items(), key=lambda kv: -kv[1]["epochs_per_s"]):
        idle = "N/A" if v["gpu_idle_frac"] is None else f"{100 * v['gpu_idle_frac']:.0f}%"
        how = (f"{v['batches_measured']:,} batches, extrapolated" if v["extrapolated"]
               else f"median of {len(v.get('epoch_s_each', [1]))} epochs")
        print(f"{k:<68}{v['epochs_per_s']:>10.3f}{v['epochs_per_s'] / ceiling:>11.2f}x{idle:>10}  {how}")
    print(f"PinnedLoader: {res['pinned_vs_ceiling']:.2f}x the ceiling, "
          f"{res['pinned_vs_best_dataloader']:.2f}x the best DataLoader ({res['best_dataloader']}); "
          f"pinning took {res['pinned_setup_s']:.2f} s")
    if "best_tuned" in res:
        print(f"beyond the grid: {res['pinned_vs_best_tuned']:.2f}x the best tuned setting "
              f"({res['best_tuned']})")


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--images", type=int, default=60_000, help="image samples (28 x 28 uint8)")
    ap.add_argument("--image-batch", type=int, default=512)
    ap.add_argument("--pairs", type=int, default=100_000_000, help="id pairs (int64)")
    ap.add_argument("--pair-batch", type=int, default=32_768)
    ap.add_argument("--pair-sweep", default="131072",
                    help="more pair batch sizes, PinnedLoader vs ceiling only (1 timed epoch)")
    ap.add_argument("--vocab", type=int, default=1_000_000, help="ids in the pair stream")
    ap.add_argument("--dim", type=int, default=64, help="embedding dimension of the pair model")
    ap.add_argument("--workers", default="0,2,4,8", help="DataLoader num_workers settings")
    ap.add_argument("--epochs", type=int, default=0,
                    help="timed epochs, alternating with the ceiling's (0: 10 images, 3 pairs)")
    ap.add_argument("--max-batches", type=int, default=200, help="DataLoader: batches timed at most")
    ap.add_argument("--window-s", type=float, default=2.5, help="DataLoader: seconds timed at most")
    args = ap.parse_args()
    if args.quick:
        args.images, args.pairs, args.vocab, args.dim = 2_000, 100_000, 10_000, 16
        args.pair_batch, args.workers, args.max_batches, args.window_s = 8_192, "0,2", 6, 0.2
        args.pair_sweep = "32768"
    args.workers = [int(w) for w in args.workers.split(",")]
    args.dl_warmup = 3 if args.quick else 5
    device = harness.setup(args)
    device_name = harness.device_name(device)
    t_start = time.perf_counter()
    res = {"device": device_name, "torch": torch.__version__, "cpu_count": os.cpu_count(),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "idle_definition": "1 - sum(CUDA event time inside model steps) / wall time",
           "dataloader_timing": "window after warm-up batches, epochs/s extrapolated from batches/s"}
    print(f"# {device_name}, torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.images, 28, 28), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 10, (args.images,), generator=g)
    epochs = args.epochs
    args.epochs = epochs or (2 if args.quick else 10)
    res["images"] = bench_dataset("images", (images, labels), image_step(device), args.image_batch,
                                  device, args, tuned=False)
    del images, labels
    gc.collect()

    pairs = torch.randint(0, args.vocab, (args.pairs, 2), generator=g)
    args.epochs = epochs or (1 if args.quick else 3)
    step = pair_step(device, args.vocab, args.dim)
    res["pairs"] = bench_dataset("pairs", (pairs,), step, args.pair_batch, device, args,
                                 tuned=True)
    args.epochs = 1
    res["pair_sweep"] = {int(bs): bench_dataset("pairs", (pairs,), step, int(bs), device, args,
                                                tuned=False, dataloaders=False)
                         for bs in args.pair_sweep.split(",") if bs}
    del pairs
    res["total_s"] = time.perf_counter() - t_start

    print_table("images", res["images"], device_name)
    print_table("id pairs", res["pairs"], device_name)
    print("\n## id pairs by batch size (the others: 1 timed epoch each)")
    print(f"{'batch':>10}{'Pinned ep/s':>14}{'ceiling ep/s':>14}{'ratio':>8}{'GPU idle P/C':>14}")
    for bs, r in sorted({args.pair_batch: res["pairs"], **res["pair_sweep"]}.items()):
        pl, ce = r["results"]["PinnedLoader"], r["results"]["ceiling (data on GPU)"]
        idle = ("N/A" if pl["gpu_idle_frac"] is None else
                f"{100 * pl['gpu_idle_frac']:.0f}%/{100 * ce['gpu_idle_frac']:.0f}%")
        print(f"{bs:>10,}{pl['epochs_per_s']:>14.3f}{ce['epochs_per_s']:>14.3f}"
              f"{r['pinned_vs_ceiling']:>7.2f}x{idle:>14}")
    p = res["pairs"]
    print(f"\ntargets on the id-pair stream: >= 0.9x ceiling: {p['pinned_vs_ceiling']:.2f}x "
          f"({'met' if p['pinned_vs_ceiling'] >= 0.9 else 'NOT met'}); >= 3x best DataLoader: "
          f"{p['pinned_vs_best_dataloader']:.2f}x "
          f"({'met' if p['pinned_vs_best_dataloader'] >= 3 else 'NOT met'}); beyond the grid, "
          f"{p.get('pinned_vs_best_tuned', float('nan')):.2f}x the best tuned DataLoader")
    print(f"DataLoader rows: timed over a window after warm-up, epochs/s extrapolated from "
          f"batches/s. Total {res['total_s']:.0f} s.")
    harness.save(args, "loader.json", res)


if __name__ == "__main__":
    main()
