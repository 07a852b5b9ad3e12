"""word2vec on one corpus, three ways: nbtools offloaded, nbtools GPU-placed, gensim on every core.

Same corpus, vocabulary and hyper-parameters for all three (skip-gram, dim 100, window 5,
5 negatives, min_count 5, sample 1e-4, 5 epochs):
  host     nbtools SkipGram, tables in pinned host RAM (placement="host"), CorpusLoader on the
           GPU, OffloadOptimizer(Adam), linear lr decay, 131,072 pairs per step
  gpu      the same model with its tables in GPU memory (placement="gpu")
  gensim   gensim.models.Word2Vec(sg=1, negative=5, workers=os.cpu_count()), corpus_file mode
Speed is words/s as gensim counts it: raw tokens in the corpus per epoch x epochs / training
seconds. One-off setup (reading the corpus, vocabulary, tables, a short warm-up) is timed
separately. Quality: WS353 and SimLex-999 Spearman, Google analogies (3CosAdd, top 30K words),
all three scored by nbtools.models.wordsim.

    python benchmarks/bench_word2vec.py --out DIR       # GPU machine: ~10.9M-token corpus
    python benchmarks/bench_word2vec.py --quick         # CPU, under a minute: checks the plumbing

Data (ignored by git): .scratch/w2v/corpus.txt.gz from /work/shared/data/build_offline_corpus.py
(lowercase a-z tokens, one sentence of <= 1000 tokens per line) and .scratch/w2v/eval/ with
wordsim353.tsv, simlex999.txt, questions-words.txt (fetch_offline_eval.sh). gensim is a
benchmark-only dependency: pip install "nbtools-offload[bench]".
"""
from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import nbtools  # noqa: E402
from nbtools import models  # noqa: E402
from nbtools.devices import resolve_device, synchronize  # noqa: E402
from nbtools.models import wordsim  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HYPER = dict(dim=100, window=5, negatives=5, min_count=5, sample=1e-4)
OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD,
              "rowwise_adagrad": nbtools.RowWiseAdagrad,
              "partial_rowwise_adam": nbtools.PartialRowWiseAdam}
# first learning rates (linear decay to 0): Adam's measured on the corpus (RESULTS.md); the
# row-wise ones chosen on it in bench_rowwise.py
DEFAULT_LR = {"adam": 0.02, "adagrad": 0.1, "rowwise_adagrad": 0.1, "partial_rowwise_adam": 0.02}


def read_corpus(path, max_tokens=None):
    """Lines of the corpus (each a sentence), up to ``max_tokens`` tokens in all."""
    opener = gzip.open if path.endswith(".gz") else open
    lines, n = [], 0
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            k = line.count(" ") + 1 if line.strip() else 0
            if not k:
                continue
            lines.append(line.rstrip("\n"))
            n += k
            if max_tokens is not None and n >= max_tokens:
                break
    return lines, n


def encode(lines, min_count):
    """(ids with -1 between sentences and rare words dropped, words by frequency, counts)."""
    counts = collections.Counter()
    for line in lines:
        counts.update(line.split())
    words = sorted((w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w))
    index = {w: i for i, w in enumerate(words)}
    index["\0"] = -1                      # sentence break
    tokens = " \0 ".join(lines).split()
    ids = np.fromiter((index.get(w, -2) for w in tokens), dtype=np.int32, count=len(tokens))
    ids = torch.from_numpy(ids[ids != -2])
    return ids, words, torch.tensor([counts[w] for w in words], dtype=torch.int64)


def system_config(system: str) -> dict:
    """SkipGramConfig fields of an nbtools system name: a placement ("host", "gpu") and
    modifiers joined by "+": "cache" (a quarter of the vocabulary's rows in a GPU cache,
    warmed from the word counts; "cacheNN": NN percent of them, e.g. "cache75"), "bf16" (bf16
    weights, fp32 Adam state), "bf16s" (bf16 weights and state), "sr" (stochastic rounding).
    E.g. "host+cache", "gpu+bf16", "host+cache90+bf16s"."""
    placement, *mods = system.split("+")
    shares = {m: (int(m[5:]) if m[5:] else 25) / 100 for m in mods
              if m.startswith("cache") and (m[5:] == "" or m[5:].isdigit())}
    bad = sorted(set(mods) - {"bf16", "bf16s", "sr"} - set(shares))
    if placement not in ("host", "gpu") or bad or any(not 0 < v <= 1 for v in shares.values()):
        sys.exit(f"bench_word2vec: unknown system {system!r}: a placement (host, gpu) and "
                 "modifiers cache, cacheNN (a percentage), bf16, bf16s, sr joined by '+'")
    cfg = {"placement": placement}
    for share in shares.values():
        cfg["cache_share"] = share
    if "bf16" in mods or "bf16s" in mods:
        cfg["dtype"] = torch.bfloat16
    if "bf16s" in mods:                   # the Adam state in bf16 too: half the row bytes
        cfg["state_dtype"] = torch.bfloat16
    if "sr" in mods:
        cfg["rounding"] = "stochastic"
    return cfg


def train_nbtools(ids, words, counts, args, system, device):
    """Returns (model, setup seconds, train seconds, history)."""
    t0 = time.perf_counter()
    cfg = models.SkipGramConfig(negatives=HYPER["negatives"], seed=args.seed,
                                **system_config(system))
    torch.manual_seed(args.seed)
    model = models.SkipGram(len(words), HYPER["dim"], counts=counts, words=words, config=cfg,
                            device=device)
    opt_cls = OPTIMIZERS[args.optimizer]
    optimizer = nbtools.OffloadOptimizer(opt_cls, model, lr=args.lr)
    keep = models.keep_probabilities(counts, HYPER["sample"])
    loader = models.CorpusLoader(ids, args.batch_size, window=HYPER["window"], keep_prob=keep,
                                 seed=args.seed, device=device)
    # the decay's end: args.min_lr_ratio where a caller sets it (placement_quality's sgd:
    # gensim's min_alpha / alpha), else TrainConfig's 1e-4
    ratio = getattr(args, "min_lr_ratio", None)
    config = models.TrainConfig(progress=False, lr_decay="linear", log_every=args.log_every,
                                backward_on_loop_thread=not getattr(args, "autograd_threads",
                                                                    False),
                                **({} if ratio is None else {"min_lr_ratio": ratio}))
    len(loader)                              # the first epoch's pairs: part of setup
    synchronize(device)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    history = models.train(model, loader, optimizer, epochs=args.epochs, config=config)
    synchronize(device)
    return model, setup_s, time.perf_counter() - t0, history


def warm_up(ids, words, counts, args, device):
    """A few steps on a slice of the corpus: CUDA context, kernels, allocator (not timed)."""
    small = argparse.Namespace(**{**vars(args), "epochs": 1})
    for placement in args.placements:
        train_nbtools(ids[:min(ids.numel(), 4 * args.batch_size)], words, counts, small,
                      placement, device)


def train_gensim(lines, args, workers):
    try:
        from gensim.models import Word2Vec
    except ImportError:
        sys.exit("bench_word2vec: gensim is not installed; pip install 'nbtools-offload[bench]' "
                 "(or gensim), or leave it out with --systems host,gpu")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "corpus.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        t0 = time.perf_counter()
        model = Word2Vec(vector_size=HYPER["dim"], window=HYPER["window"],
                         negative=HYPER["negatives"], min_count=HYPER["min_count"],
                         sample=HYPER["sample"], sg=1, workers=workers, seed=args.seed)
        model.build_vocab(corpus_file=path)
        setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.train(corpus_file=path, total_words=model.corpus_total_words,
                    total_examples=model.corpus_count, epochs=args.epochs)
        train_s = time.perf_counter() - t0
    return model, setup_s, train_s


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=os.path.join(ROOT, ".scratch", "w2v", "corpus.txt.gz"))
    ap.add_argument("--eval-dir", default=os.path.join(ROOT, ".scratch", "w2v", "eval"))
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=None, help="use the corpus' first N tokens")
    ap.add_argument("--systems", default="host,gpu,gensim",
                    help="comma list of gensim and nbtools systems: host, gpu, with modifiers "
                    "joined by '+': cache, bf16, sr (e.g. host+cache,gpu+bf16)")
    ap.add_argument("--batch-size", type=int, default=131072, help="pairs per nbtools step")
    ap.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adam")
    ap.add_argument("--lr", type=float, default=None, help="first lr (default: the recipe's)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="gensim threads")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="100K tokens, 1 epoch: CPU, < 1 min")
    ap.add_argument("--autograd-threads", action="store_true",
                    help="backward on autograd's device thread (torch's default) instead of "
                    "the training loop's (TrainConfig.backward_on_loop_thread)")
    ap.add_argument("--out", default=None, help="write DIR/word2vec.json")
    args = ap.parse_args()
    if args.quick:
        args.max_tokens = args.max_tokens or 100_000
        args.epochs = 1
        args.batch_size = min(args.batch_size, 8192)
    if args.lr is None and args.optimizer == "sgd":
        # word2vec's alpha (0.025 per pair, i.e. lr = 0.025 * batch on the mean loss) made
        # inf/nan gradients at 131,072 pairs/step (CPU, 2M tokens): frequent words' rows sum
        # thousands of pair gradients in one step
        sys.exit("bench_word2vec: pass --lr with --optimizer sgd (no tested default)")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.placements = [s for s in systems if s != "gensim"]
    for system in args.placements:
        system_config(system)                   # exits on a name it does not know
    if not os.path.exists(args.corpus):
        sys.exit(f"bench_word2vec: no corpus at {args.corpus}; build it with "
                 "python3 /work/shared/data/build_offline_corpus.py DIR and gzip DIR/combined.txt "
                 "there, or pass --corpus PATH")
    device = resolve_device("auto")
    res = {"device": str(device), "torch": torch.__version__,
           "corpus": os.path.basename(args.corpus),
           "epochs": args.epochs, "batch_size": args.batch_size, "optimizer": args.optimizer,
           "lr": args.lr, "gensim_workers": args.workers, **HYPER, "systems": {}}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)

    t0 = time.perf_counter()
    lines, tokens = read_corpus(args.corpus, args.max_tokens)
    ids, words, counts = encode(lines, HYPER["min_count"])
    res.update(tokens=tokens, vocab=len(words), read_s=time.perf_counter() - t0)
    print(f"corpus: {tokens:,} tokens in {len(lines):,} lines, vocabulary {len(words):,} "
          f"(min_count {HYPER['min_count']}); read in {res['read_s']:.1f} s; device {device}")
    have_eval = os.path.isdir(args.eval_dir)
    if not have_eval:
        print(f"no eval data at {args.eval_dir}: quality is not scored "
              "(bash /work/shared/data/fetch_offline_eval.sh DIR; --eval-dir DIR/eval)")

    def record(name, vectors, setup_s, train_s, extra=None):
        r = {"setup_s": setup_s, "train_s": train_s,
             "words_per_s": tokens * args.epochs / train_s, **(extra or {})}
        if have_eval:
            t = time.perf_counter()
            r["quality"] = wordsim.evaluate(vectors, args.eval_dir)
            r["eval_s"] = time.perf_counter() - t
        res["systems"][name] = r
        q = wordsim.format_scores(r["quality"]) if have_eval else ""
        print(f"{name:>16}: train {train_s:7.1f} s, {r['words_per_s'] / 1e6:6.2f}M words/s, "
              f"setup {setup_s:5.1f} s  {q}", flush=True)

    if args.placements:
        t = time.perf_counter()
        warm_up(ids, words, counts, args, device)
        res["warmup_s"] = time.perf_counter() - t
    for placement in args.placements:
        model, setup_s, train_s, history = train_nbtools(ids, words, counts, args, placement,
                                                         device)
        losses = history["loss"]
        record(placement, model, setup_s, train_s,
               {"steps": history["step"][-1] if history["step"] else None,
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
                "placement": model.input.placement, "tables": model.input.transfer_mode,
                "cache": {t.name: t.cache_stats() for t in (model.input, model.output)
                          if t.cache is not None}})
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "gensim" in systems:
        model, setup_s, train_s = train_gensim(lines, args, args.workers)
        record("gensim", (model.wv.index_to_key, model.wv.vectors), setup_s, train_s,
               {"vocab": len(model.wv.index_to_key)})
        if len(model.wv.index_to_key) != len(words):
            print(f"note: gensim's vocabulary has {len(model.wv.index_to_key):,} words, "
                  f"nbtools' {len(words):,}")

    s = res["systems"]
    ratios = {}
    for a, b in (("host", "gensim"), ("gpu", "gensim"), ("host", "gpu"),
                 ("host+cache", "gensim"), ("host+cache", "gpu"), ("host+cache75", "gpu"),
                 ("host+bf16", "host"), ("host+cache75+bf16s", "gpu+bf16s"),
                 ("host+bf16s", "gpu+bf16s"),
                 ("gpu+bf16", "gpu")):
        if a in s and b in s:
            ratios[f"{a}_vs_{b}"] = s[a]["words_per_s"] / s[b]["words_per_s"]
    res["ratios"] = ratios

    print(f"\n## word2vec: {tokens:,} tokens x {args.epochs} epochs, {device}"
          f"{' (' + res['gpu'] + ')' if 'gpu' in res else ''}; nbtools {args.optimizer} "
          f"lr {args.lr:g}, {args.batch_size:,} pairs/step; gensim {args.workers} workers")
    print(f"{'system':<16}{'M words/s':>10}{'train s':>9}{'setup s':>9}{'WS353':>8}{'SimLex':>8}"
          f"{'analogy':>9}{'coverage (ws/sl/an)':>22}")
    for name, r in s.items():
        q = r.get("quality", {})
        cov = "/".join(f"{q[k]['coverage']:.2f}" for k in ("ws353", "simlex", "analogy") if k in q)
        print(f"{name:<16}{r['words_per_s'] / 1e6:>10.2f}{r['train_s']:>9.1f}{r['setup_s']:>9.1f}"
              f"{q.get('ws353', {}).get('spearman', float('nan')):>8.3f}"
              f"{q.get('simlex', {}).get('spearman', float('nan')):>8.3f}"
              f"{100 * q.get('analogy', {}).get('accuracy', float('nan')):>8.1f}%{cov:>22}")
    line = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
    print(f"summary word2vec: {line}" if line else "summary word2vec: (one system only)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "word2vec.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
