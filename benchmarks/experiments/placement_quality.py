"""Is one placement's word2vec worse than another's, or is it seed noise? (issue 24, item 2)

bench_word2vec.py's recipe (the benchmark corpus, skip-gram dim 100, window 5, 5 negatives,
min_count 5, sample 1e-4, 5 epochs; nbtools: Adam 0.02 with linear decay, 131,072 pairs per
step), trained with several seeds per system:

  host                 tables in pinned host RAM
  gpu                  tables in GPU memory (what placement="auto" picks on the H100 machine)
  host+cache75+bf16s   host tables, 75% of the rows in a GPU cache, bf16 weights and Adam state
  gensim               gensim.models.Word2Vec(sg=1) on every core, with its own seed

--optimizer picks nbtools' optimizer (bench_word2vec's OPTIMIZERS; default adam, as above).
Its first lr defaults to bench_word2vec's DEFAULT_LR; sgd defaults to gensim's recipe:
  lr            gensim steps each pair by alpha 0.025, and nbtools' SkipGram.loss is the *mean*
                over a step's pairs, so the same per-pair step is lr = 0.025 x --batch-size
  min-lr-ratio  the linear decay ends at 0.004 x the first lr (gensim's min_alpha 0.0001 /
                alpha 0.025) rather than TrainConfig's 1e-4: 0.025 -> 0.0001 per pair, as gensim
  batch-size    4,096 pairs per step, not 131,072: at 131,072 that step diverged (CPU, 2M tokens,
                1 epoch: loss 4.16 -> 6.6e16, a frequent word's row sums thousands of pair
                steps at once), while 1,024, 4,096 and 32,768 trained alike (2M tokens,
                5 epochs: WS353 0.393 / 0.394 / 0.389, gensim 0.405)

A seed sets the initial vectors, the negatives and the corpus loader's draws (subsampling,
windows, order). Each system's WS353 / SimLex-999 Spearman and analogy accuracy are reported
as mean ± sample standard deviation (and min..max) over its seeds, with the issue's targets:
every placement's mean analogy within 1 point of gensim's mean, WS353 and SimLex within 0.02.
A placement whose mean sits outside another's seed spread is flagged.

With fixed-order sums (docs/reproducibility.md), "host" and "gpu" train to the same bits at the
same seed; the script checks that too (their input vectors, torch.equal), since identical
vectors settle whether the placements can differ at all.

    python benchmarks/experiments/placement_quality.py --out DIR             # GPU machine
    python benchmarks/experiments/placement_quality.py --systems gensim      # one part at a time
    python benchmarks/experiments/placement_quality.py --quick               # CPU: the plumbing
    python benchmarks/experiments/placement_quality.py --systems host,gensim --optimizer sgd

Data and gensim as for bench_word2vec.py (whose corpus reading, vocabulary, training and
gensim run this reuses). Runtime on the H100 machine, estimated from bench_word2vec's speeds
(10.9M tokens x 5 epochs): ~10-25 s per nbtools run with its scoring, ~2 min per gensim run
on 16 threads: ~8 min in all; --systems splits it. On the 2-core CPU machine, --optimizer sgd
--systems host,gensim --workers 2 took 62 min (host 636-1939 s a seed, shared with other jobs;
gensim ~90 s a seed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # bench_word2vec
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
import bench_word2vec as w2v  # noqa: E402
from nbtools.devices import resolve_device  # noqa: E402
from nbtools.models import wordsim  # noqa: E402

# gensim.models.Word2Vec's defaults (4.4.0): alpha decays linearly to min_alpha over the run
GENSIM_ALPHA, GENSIM_MIN_ALPHA = 0.025, 0.0001
METRICS = (("ws353", "spearman", "WS353", 0.02, 1.0),      # key, field, label, target gap, scale
           ("simlex", "spearman", "SimLex", 0.02, 1.0),
           ("analogy", "accuracy", "analogy %", 1.0, 100.0))


def scores(quality: dict) -> dict:
    """{label: value} of one run's wordsim.evaluate answer (analogy in percent)."""
    return {label: quality[key][field] * scale
            for key, field, label, _, scale in METRICS if key in quality}


def summary(values: list) -> dict:
    """mean, sample standard deviation (0 for one value), min, max."""
    return {"mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def run_nbtools(ids, words, counts, args, system, seed, device):
    """(scores, input vectors on the CPU) of one nbtools run."""
    run_args = argparse.Namespace(**{**vars(args), "seed": seed})
    model, _, train_s, _ = w2v.train_nbtools(ids, words, counts, run_args, system, device)
    quality = wordsim.evaluate(model, args.eval_dir)
    vectors = model.input.weight.float().cpu().clone()
    print(f"{system:>20} seed {seed}: train {train_s:6.1f} s  {wordsim.format_scores(quality)}",
          flush=True)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return scores(quality), vectors


def run_gensim(lines, args, seed):
    run_args = argparse.Namespace(**{**vars(args), "seed": seed})
    model, _, train_s = w2v.train_gensim(lines, run_args, args.workers)
    quality = wordsim.evaluate((model.wv.index_to_key, model.wv.vectors), args.eval_dir)
    print(f"{'gensim':>20} seed {seed}: train {train_s:6.1f} s  {wordsim.format_scores(quality)}",
          flush=True)
    return scores(quality)


def verdicts(table: dict) -> list:
    """Lines comparing each system's means with gensim's (the issue's targets) and with each
    other (outside the other's seed spread, mean ± sd)."""
    out = []
    ref = table.get("gensim")
    for name, per in table.items():
        if name == "gensim":
            continue
        for _, _, label, gap, _ in METRICS:
            if label not in per:
                continue
            m = per[label]["mean"]
            if ref and label in ref:
                # the target, "within" read both ways: |d| <= gap, and no worse
                d = m - ref[label]["mean"]
                out.append(f"{name} {label}: mean {m:.3f} vs gensim {ref[label]['mean']:.3f} "
                           f"({d:+.3f}): within ±{gap:g} {'yes' if abs(d) <= gap else 'NO'}, "
                           f"no worse than -{gap:g} {'yes' if d >= -gap else 'NO'}")
            for other, oper in table.items():
                if other in (name, "gensim") or label not in oper:
                    continue
                o = oper[label]
                if abs(m - o["mean"]) > max(o["sd"], per[label]["sd"]) and \
                        not o["min"] <= m <= o["max"]:
                    out.append(f"  {name} {label} mean {m:.3f} lies outside {other}'s seeds "
                               f"({o['min']:.3f}..{o['max']:.3f}, sd {o['sd']:.3f})")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=os.path.join(w2v.ROOT, ".scratch", "w2v", "corpus.txt.gz"))
    ap.add_argument("--eval-dir", default=os.path.join(w2v.ROOT, ".scratch", "w2v", "eval"))
    ap.add_argument("--systems", default="host,gpu,host+cache75+bf16s,gensim",
                    help="comma list: gensim and bench_word2vec's nbtools system names")
    ap.add_argument("--seeds", default="1,2,3", help="comma list of seeds, each system")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=None,
                    help="pairs per nbtools step (default 131,072; sgd: 4,096)")
    ap.add_argument("--optimizer", choices=tuple(w2v.OPTIMIZERS), default="adam",
                    help="nbtools' optimizer (default adam)")
    ap.add_argument("--lr", type=float, default=None,
                    help="first lr (default: bench_word2vec's DEFAULT_LR; sgd: 0.025 x "
                    "--batch-size, gensim's alpha per pair on the mean loss)")
    ap.add_argument("--min-lr-ratio", type=float, default=None,
                    help="the decay's last lr / first (default: TrainConfig's 1e-4; sgd: "
                    f"{GENSIM_MIN_ALPHA / GENSIM_ALPHA:g}, gensim's min_alpha / alpha)")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="gensim threads")
    ap.add_argument("--quick", action="store_true", help="100K tokens, 1 epoch, host only")
    ap.add_argument("--out", default=None, help="write DIR/placement_quality.json")
    args = ap.parse_args()
    args.log_every = None                                   # what train_nbtools reads
    if args.batch_size is None:
        args.batch_size = 4096 if args.optimizer == "sgd" else 131072
    if args.quick:
        args.max_tokens, args.epochs = args.max_tokens or 100_000, 1
        args.batch_size = min(args.batch_size, 8192)
    if args.optimizer == "sgd":
        # SkipGram.loss is the mean over the step's pairs: each pair's gradient is 1/batch of
        # what gensim's per-pair update sees, so gensim's alpha is scaled up by the batch
        if args.lr is None:
            args.lr = GENSIM_ALPHA * args.batch_size
        if args.min_lr_ratio is None:
            args.min_lr_ratio = GENSIM_MIN_ALPHA / GENSIM_ALPHA
    elif args.lr is None:
        args.lr = w2v.DEFAULT_LR[args.optimizer]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    seeds = [int(s) for s in args.seeds.split(",")]
    device = resolve_device("auto")
    if args.quick and device.type != "cuda":
        systems = [s for s in systems if s == "gensim" or s.split("+")[0] == "host"]
    for s in systems:
        if s != "gensim":
            w2v.system_config(s)                  # exits on a name it does not know
    for path, what in ((args.corpus, "corpus"), (args.eval_dir, "evaluation sets")):
        if not os.path.exists(path):
            sys.exit(f"placement_quality: no {what} at {path}; see bench_word2vec.py's "
                     "docstring for how to make it, or pass --corpus / --eval-dir")

    lines, tokens = w2v.read_corpus(args.corpus, args.max_tokens)
    ids, words, counts = w2v.encode(lines, w2v.HYPER["min_count"])
    print(f"corpus: {tokens:,} tokens, vocabulary {len(words):,}; device {device}; "
          f"seeds {seeds}; {args.epochs} epochs; nbtools {args.optimizer} lr {args.lr:g} "
          f"(decay to x{args.min_lr_ratio if args.min_lr_ratio is not None else 1e-4:g}), "
          f"{args.batch_size:,} pairs/step", flush=True)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "tokens": tokens, "vocab": len(words),
           "epochs": args.epochs, "batch_size": args.batch_size, "optimizer": args.optimizer,
           "lr": args.lr, "min_lr_ratio": args.min_lr_ratio,
           "seeds": seeds, "runs": {}, "summary": {}, "same_bits": {}}
    t0 = time.perf_counter()
    vectors = {}
    for system in systems:
        runs = []
        for seed in seeds:
            if system == "gensim":
                runs.append(run_gensim(lines, args, seed))
            else:
                got, vec = run_nbtools(ids, words, counts, args, system, seed, device)
                runs.append(got)
                if system in ("host", "gpu"):
                    vectors[(system, seed)] = vec
        res["runs"][system] = runs
        res["summary"][system] = {label: summary([r[label] for r in runs])
                                  for label in runs[0]}
    for seed in seeds:
        if ("host", seed) in vectors and ("gpu", seed) in vectors:
            res["same_bits"][f"host vs gpu, seed {seed}"] = torch.equal(
                vectors[("host", seed)], vectors[("gpu", seed)])
    res["seconds"] = time.perf_counter() - t0

    print(f"\n## word2vec quality over seeds {seeds} ({res['device']}, {tokens:,} tokens x "
          f"{args.epochs} epochs): mean ± sd (min..max)")
    labels = [label for _, _, label, _, _ in METRICS]
    print(f"{'system':<22}" + "".join(f"{label:>34}" for label in labels))
    for system, per in res["summary"].items():
        cells = []
        for label in labels:
            s = per.get(label)
            cells.append("n/a" if s is None else
                         f"{s['mean']:.3f} ± {s['sd']:.3f} ({s['min']:.3f}..{s['max']:.3f})")
        print(f"{system:<22}" + "".join(f"{c:>34}" for c in cells))
    for key, same in res["same_bits"].items():
        print(f"{key}: input vectors {'bit-identical' if same else 'DIFFER'}")
    res["verdicts"] = verdicts(res["summary"])
    for line in res["verdicts"]:
        print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "placement_quality.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
