"""word2vec on 2 GPUs against 1: words/s and quality of bench_word2vec.py's recipe, data-parallel.

The recipe of bench_word2vec.py (skip-gram, dim 100, window 5, 5 negatives, min_count 5, sample
1e-4, Adam with a linear lr decay, 5 epochs), one rank a GPU over NCCL: SkipGram built in the
process group (its tables ShardedEmbedding), CorpusLoader(rank=, world=), data_parallel,
models.train. --batch-size is the global batch (131,072 pairs a step over all ranks, split
evenly), so every world size takes the same steps on the same pairs and negatives; --per-rank
gives each rank that many pairs instead (weak scaling: fewer, larger steps). World 1 runs in
this process, the others in one process a rank. Speed: words/s as bench_word2vec counts them
(corpus tokens x epochs / the slowest rank's training seconds). Quality: WS353, SimLex-999 and
analogies of the gathered input vectors. Targets: 1.7x words/s on 2 GPUs, quality within 0.02.

    python benchmarks/bench_word2vec_ddp.py --out DIR      # 1 and 2 GPUs, NCCL
    python benchmarks/bench_word2vec_ddp.py --quick        # 1 and 2 CPU ranks (gloo), the sample

Data: as bench_word2vec.py (.scratch/w2v/corpus.txt.gz and .scratch/w2v/eval/).
"""
from __future__ import annotations

import gc
import os
import time

import harness
import torch
import torch.distributed as dist

import nbtools
from nbtools import models
from nbtools.distributed import data_parallel
from nbtools.models import wordsim


def job(rank, world, a):
    """Train on rank ``rank`` of ``world``; rank 0 returns the scores, every rank its times."""
    device = torch.device("cuda", rank) if a["backend"] == "nccl" else torch.device(a["device"])
    lines, tokens = harness.read_corpus(a["corpus"], a["max_tokens"])
    ids, words, counts = harness.encode(lines, harness.W2V["min_count"])
    keep = models.keep_probabilities(counts, harness.W2V["sample"])
    batch = a["batch_size"] if a["per_rank"] else a["batch_size"] // world

    def run(corpus, epochs):
        cfg = models.SkipGramConfig(negatives=harness.W2V["negatives"], seed=a["seed"],
                                    **harness.skipgram_config(a["system"]))
        model = data_parallel(models.SkipGram(len(words), harness.W2V["dim"], counts=counts,
                                              words=words, config=cfg, device=device))
        opt = nbtools.OffloadOptimizer(torch.optim.Adam, model, lr=a["lr"])
        loader = models.CorpusLoader(corpus, batch, window=harness.W2V["window"], seed=a["seed"],
                                     keep_prob=keep, device=device, rank=rank, world=world)
        len(loader)                                 # the first epoch's pairs: setup
        if world > 1:
            dist.barrier()
        harness.synchronize(device)
        t0 = time.perf_counter()
        history = models.train(model, loader, opt, epochs=epochs, config=models.TrainConfig(
            progress=False, lr_decay="linear"))
        harness.synchronize(device)
        return model, time.perf_counter() - t0, history

    run(ids[:4 * a["batch_size"]], 1)               # warm-up: CUDA context, kernels, NCCL
    model, train_s, history = run(ids, a["epochs"])
    vectors = model.vectors()                        # a collective: every rank
    out = {"train_s": train_s, "tokens": tokens, "vocab": len(words), "batch_per_rank": batch,
           "last_loss": history["loss"][-1] if history["loss"] else None, "quality": None}
    if rank == 0:
        out["quality"] = harness.word_scores((words, vectors), a["eval_dir"])
    return out


def main():
    ap = harness.parser(__doc__)
    harness.corpus_args(ap)
    ap.add_argument("--system", default="host", help="a bench_word2vec system (host, gpu, ...)")
    ap.add_argument("--batch-size", type=int, default=131072, help="pairs a step, all ranks")
    ap.add_argument("--per-rank", action="store_true", help="--batch-size pairs for each rank")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    args = ap.parse_args()
    device = harness.setup(args)
    if args.quick:
        args.corpus, args.eval_dir, args.epochs, args.backend = harness.QUICK_CORPUS, None, 1, "gloo"
        args.batch_size = min(args.batch_size, 4096)
    worlds = [int(w) for w in args.worlds.split(",")]
    if args.backend == "auto":
        args.backend = "nccl" if torch.cuda.device_count() >= max(worlds) else "gloo"
    if args.backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")     # NVLink multicast off
    harness.skipgram_config(args.system)                   # exits on a name it does not know
    a = {k: getattr(args, k) for k in ("corpus", "max_tokens", "system", "batch_size", "per_rank",
                                       "lr", "seed", "epochs", "eval_dir", "backend")}
    a["device"] = str(device)
    res = {"device": harness.device_name(device), "backend": args.backend, **a, "worlds": {}}
    for world in worlds:
        if args.backend == "nccl" and world > torch.cuda.device_count():
            print(f"world {world}: skipped, {torch.cuda.device_count()} GPU(s)")
            continue
        per_rank = [job(0, 1, a)] if world == 1 else nbtools.distributed.spawn(
            job, world, args=(a,), timeout=590, backend=args.backend)
        r = {**per_rank[0], "train_s": max(p["train_s"] for p in per_rank)}
        r["words_per_s"] = r["tokens"] * args.epochs / r["train_s"]
        res["worlds"][world] = r
        q = r["quality"]
        print(f"{world} rank(s): {r['words_per_s'] / 1e6:.2f}M words/s, {r['batch_per_rank']:,} "
              f"pairs a rank a step  {wordsim.format_scores(q) if q else ''}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    w = res["worlds"]
    rows = []
    for world, r in w.items():
        q, base = r["quality"] or {}, w.get(1)
        rows.append([world, f"{r['words_per_s'] / 1e6:.2f}",
                     f"{r['words_per_s'] / base['words_per_s']:.2f}" if base else None,
                     *(f"{q[k]['spearman']:.3f}" if k in q else None for k in ("ws353", "simlex")),
                     f"{100 * q['analogy']['accuracy']:.1f}%" if "analogy" in q else None])
    harness.print_table(["ranks", "M words/s", "x 1 rank", "WS353", "SimLex", "analogy"], rows,
                        f"word2vec data-parallel: {r['tokens']:,} tokens x {args.epochs} epochs, "
                        f"{res['device']}, {args.backend}, {args.system}, {args.batch_size:,} "
                        f"pairs a step{' a rank' if args.per_rank else ''} (targets: 1.7x on 2 "
                        "GPUs, quality within 0.02)")
    harness.save(args, "word2vec_ddp.json", res)


if __name__ == "__main__":
    main()
