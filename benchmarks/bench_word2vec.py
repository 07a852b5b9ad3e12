"""word2vec on one corpus, three ways: nbtools offloaded, nbtools GPU-placed, gensim on every core.

Same corpus, vocabulary and hyper-parameters for all three (skip-gram, dim 100, window 5,
5 negatives, min_count 5, sample 1e-4, 5 epochs):
  host     nbtools SkipGram, tables in pinned host RAM (placement="host"), CorpusLoader on the
           GPU, OffloadOptimizer(Adam), linear lr decay, 131,072 pairs per step
  gpu      the same model with its tables in GPU memory (placement="gpu")
  gensim   gensim.models.Word2Vec(sg=1, negative=5, workers=os.cpu_count()), corpus_file mode
Other nbtools systems: a placement with modifiers joined by '+' (cache, cacheNN, bf16, bf16s,
sr; harness.skipgram_config), e.g. --systems host,host+cache,gpu+bf16.
Speed is words/s as gensim counts it: raw tokens in the corpus per epoch x epochs / training
seconds. One-off setup (reading the corpus, vocabulary, tables, a short warm-up) is timed
separately. Quality: WS353 and SimLex-999 Spearman, Google analogies (3CosAdd, top 30K words),
all three scored by nbtools.models.wordsim.

    python benchmarks/bench_word2vec.py --out DIR       # GPU machine: ~10.9M-token corpus
    python benchmarks/bench_word2vec.py --quick         # the bundled text8-sample, 1 epoch

Data (ignored by git): .scratch/w2v/corpus.txt.gz from /work/shared/data/build_offline_corpus.py
(lowercase a-z tokens, one sentence of <= 1000 tokens per line) and .scratch/w2v/eval/ with
wordsim353.tsv, simlex999.txt, questions-words.txt (fetch_offline_eval.sh). gensim is a
benchmark-only dependency: pip install gensim (or pip install -e ".[bench]" in this checkout);
where it is missing its row is skipped.
"""
from __future__ import annotations

import gc
import os
import tempfile
import time

import harness
import torch

from nbtools.models import wordsim

# first learning rates (linear decay to 0): Adam's measured on the corpus (RESULTS.md); the
# row-wise ones chosen on it in bench_rowwise.py
DEFAULT_LR = {"adam": 0.02, "adagrad": 0.1, "rowwise_adagrad": 0.1, "partial_rowwise_adam": 0.02}
RATIOS = (("host", "gensim"), ("gpu", "gensim"), ("host", "gpu"), ("host+cache", "gensim"),
          ("host+cache", "gpu"), ("host+cache75", "gpu"), ("host+bf16", "host"),
          ("host+cache75+bf16s", "gpu+bf16s"), ("host+bf16s", "gpu+bf16s"), ("gpu+bf16", "gpu"))


def train_gensim(lines, args):
    """(model, setup seconds, train seconds), or None where gensim is not installed."""
    try:
        from gensim.models import Word2Vec
    except ImportError:
        print("gensim is not installed: its row is skipped (pip install gensim)")
        return None
    hyper = harness.W2V
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        model = Word2Vec(vector_size=hyper["dim"], window=hyper["window"],
                         negative=hyper["negatives"], min_count=hyper["min_count"],
                         sample=hyper["sample"], sg=1, workers=args.workers, seed=args.seed)
        model.build_vocab(corpus_file=path)
        setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.train(corpus_file=path, total_words=model.corpus_total_words,
                    total_examples=model.corpus_count, epochs=args.epochs)
        return model, setup_s, time.perf_counter() - t0


def main():
    ap = harness.parser(__doc__)
    harness.corpus_args(ap)
    ap.add_argument("--systems", default="host,gpu,gensim",
                    help="comma list of gensim and nbtools systems (host, gpu, with modifiers)")
    ap.add_argument("--batch-size", type=int, default=131072, help="pairs per nbtools step")
    ap.add_argument("--optimizer", choices=tuple(DEFAULT_LR), default="adam")
    ap.add_argument("--lr", type=float, default=None, help="first lr (default: the recipe's)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="gensim threads")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--autograd-threads", action="store_true",
                    help="backward on autograd's device thread (torch's default) instead of "
                    "the training loop's (TrainConfig.backward_on_loop_thread)")
    args = ap.parse_args()
    device = harness.setup(args)
    eval_dir = args.eval_dir
    if args.quick:
        args.corpus, eval_dir, args.epochs = harness.QUICK_CORPUS, None, 1
        args.batch_size = min(args.batch_size, 4096)
    args.lr = args.lr or DEFAULT_LR[args.optimizer]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    placements = [s for s in systems if s != "gensim"
                  and (device.type == "cuda" or not s.startswith("gpu"))]  # gpu: CUDA only
    for system in placements:
        harness.skipgram_config(system)            # exits on a name it does not know
    if not os.path.exists(args.corpus):
        raise SystemExit(f"no corpus at {args.corpus}; build it with python3 "
                         "/work/shared/data/build_offline_corpus.py DIR and gzip "
                         "DIR/combined.txt there, or pass --corpus PATH (--quick: the bundled "
                         "sample)")
    res = {"device": harness.device_name(device), "torch": torch.__version__,
           "corpus": os.path.basename(args.corpus), "epochs": args.epochs,
           "batch_size": args.batch_size, "optimizer": args.optimizer, "lr": args.lr,
           "gensim_workers": args.workers, **harness.W2V, "systems": {}}
    t0 = time.perf_counter()
    lines, tokens = harness.read_corpus(args.corpus, args.max_tokens)
    ids, words, counts = harness.encode(lines, harness.W2V["min_count"])
    res.update(tokens=tokens, vocab=len(words), read_s=time.perf_counter() - t0)
    print(f"corpus: {tokens:,} tokens in {len(lines):,} lines, vocabulary {len(words):,}; "
          f"read in {res['read_s']:.1f} s; device {device}")
    kw = dict(optimizer=args.optimizer, lr=args.lr, seed=args.seed,
              batch_size=args.batch_size, autograd_threads=args.autograd_threads)

    def record(name, vectors, setup_s, train_s, extra=None):
        r = {"setup_s": setup_s, "train_s": train_s,
             "words_per_s": tokens * args.epochs / train_s, **(extra or {})}
        q = harness.word_scores(vectors, eval_dir)
        if q is not None:
            r["quality"] = q
        res["systems"][name] = r
        print(f"{name:>16}: train {train_s:7.1f} s, {r['words_per_s'] / 1e6:6.2f}M words/s, "
              f"setup {setup_s:5.1f} s  {wordsim.format_scores(q) if q else ''}", flush=True)

    for system in placements:     # a few steps first: CUDA context, kernels, allocator
        harness.train_skipgram(ids[:4 * args.batch_size], words, counts, system, device,
                               epochs=1, **kw)
    for system in placements:
        model, setup_s, train_s, history = harness.train_skipgram(
            ids, words, counts, system, device, epochs=args.epochs, **kw)
        losses = history["loss"]
        record(system, model, setup_s, train_s,
               {"first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                "placement": model.input.placement,
                "cache": {t.name: t.cache_stats() for t in (model.input, model.output)
                          if t.cache is not None}})
        del model
        gc.collect()
    got = train_gensim(lines, args) if "gensim" in systems else None
    if got is not None:
        model, setup_s, train_s = got
        record("gensim", (model.wv.index_to_key, model.wv.vectors), setup_s, train_s,
               {"vocab": len(model.wv.index_to_key)})

    s = res["systems"]
    res["ratios"] = {f"{a}_vs_{b}": s[a]["words_per_s"] / s[b]["words_per_s"]
                     for a, b in RATIOS if a in s and b in s}
    rows = []
    for name, r in s.items():
        q = r.get("quality", {})
        rows.append([name, f"{r['words_per_s'] / 1e6:.2f}", f"{r['train_s']:.1f}",
                     f"{r['setup_s']:.1f}",
                     *(f"{q[k]['spearman']:.3f}" if k in q else None for k in ("ws353", "simlex")),
                     f"{100 * q['analogy']['accuracy']:.1f}%" if "analogy" in q else None])
    harness.print_table(["system", "M words/s", "train s", "setup s", "WS353", "SimLex",
                         "analogy"], rows,
                        f"word2vec: {tokens:,} tokens x {args.epochs} epochs, {res['device']}; "
                        f"nbtools {args.optimizer} lr {args.lr:g}, {args.batch_size:,} pairs/step")
    for k, v in res["ratios"].items():
        print(f"{k}: {v:.2f}x")
    harness.save(args, "word2vec.json", res)


if __name__ == "__main__":
    main()
