"""Where a word2vec step's time goes, per system: ms/step and the profiler's kernel table.

The model, corpus, vocabulary and hyper-parameters of bench_word2vec.py; for each system (its
names: host, gpu, with modifiers such as +cache75 and +bf16s) the first batches of an epoch:
warm-up steps, then ``--steps`` timed steps (one synchronisation at the end), then 10 profiled.

    python benchmarks/experiments/profile_word2vec_step.py --systems gpu+bf16s,host+cache75+bf16s
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
import bench_word2vec as bw  # noqa: E402
import nbtools  # noqa: E402
from nbtools import models  # noqa: E402
from nbtools.devices import resolve_device, synchronize  # noqa: E402


def run(system, ids, words, counts, args, device):
    cfg = models.SkipGramConfig(negatives=bw.HYPER["negatives"], seed=1,
                                **bw.system_config(system))
    torch.manual_seed(1)
    model = models.SkipGram(len(words), bw.HYPER["dim"], counts=counts, words=words, config=cfg,
                            device=device)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, model, lr=0.02)
    keep = models.keep_probabilities(counts, bw.HYPER["sample"])
    loader = models.CorpusLoader(ids, args.batch_size, window=bw.HYPER["window"], keep_prob=keep,
                                 seed=1, device=device)
    it = iter(loader)
    batches = [next(it) for _ in range(args.warmup + args.steps + 10)]
    if args.steps > len(batches) - args.warmup - 10:
        sys.exit("profile_word2vec_step: the epoch has fewer batches than --steps")

    def step(batch):
        loss = model.loss(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    for b in batches[:args.warmup]:
        step(b)
    synchronize(device)
    t0 = time.perf_counter()
    for b in batches[args.warmup:args.warmup + args.steps]:
        step(b)
    synchronize(device)
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    table = ""
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for b in batches[-10:]:
                step(b)
            synchronize(device)
        table = p.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows)
        table += "\n\n" + p.key_averages().table(sort_by="self_cpu_time_total",
                                                  row_limit=args.rows)
    stats = {}
    for name, t in (("input", model.input), ("output", model.output)):
        if getattr(t, "cache", None) is not None:
            stats[name] = t.cache_stats()
    return ms, table, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus", default=os.path.join(bw.ROOT, ".scratch", "w2v", "corpus.txt.gz"))
    ap.add_argument("--systems", default="gpu+bf16s,host+cache75+bf16s,host+bf16s")
    ap.add_argument("--batch-size", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    device = resolve_device("auto")
    lines, _ = bw.read_corpus(args.corpus, args.max_tokens)
    ids, words, counts = bw.encode(lines, bw.HYPER["min_count"])
    out = {}
    for system in args.systems.split(","):
        ms, table, stats = run(system, ids, words, counts, args, device)
        out[system] = ms
        print(f"\n=== {system}: {ms:.3f} ms/step  cache {stats}\n{table}")
    base = next(iter(out.values()))
    print("\nsystem                          ms/step   base / system")
    for k, v in out.items():
        print(f"{k:<32}{v:8.3f}   {base / v:6.3f}")


if __name__ == "__main__":
    main()
