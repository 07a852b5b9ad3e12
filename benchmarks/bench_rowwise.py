"""Row-wise optimizers against Adam: quality of word2vec and of the recommender.

Same models, data and protocols as bench_word2vec.py and bench_recommender.py; only the optimizer
and its learning rate change. Each (optimizer, lr) runs over several seeds; the table shows the
mean and the spread (sample sd) of each metric, and each metric's difference to Adam's mean.

  word2vec     SkipGram on the benchmark corpus (.scratch/w2v/corpus.txt.gz), dim 100, 5 epochs,
               131,072 pairs per step, linear lr decay; WS353 and SimLex-999 Spearman, Google
               analogies (top 30K words), scored by nbtools.models.wordsim
  ranking      ML-100K, each user's last interaction held out, ranked among 99 items the user never
               touched (the same candidates for every run); RANKING_DEFAULTS; HR@10, NDCG@10
  ratings      ML-100K, the first of 5 random folds; RATINGS_DEFAULTS; RMSE

The targets: the best row-wise optimizer within 0.02 of Adam on WS353 and SimLex, within
1.5 points on the analogies, and within 0.01 on HR@10.

    python3 benchmarks/bench_rowwise.py --out DIR                     # GPU machine, ~5 minutes
    python3 benchmarks/bench_rowwise.py --parts ranking,ratings        # CPU is fine for these
    python3 benchmarks/bench_rowwise.py --quick      # bundled text8 and MovieLens samples, 1 seed

Learning rates: a list per optimizer (``--w2v-lrs``, ``--rec-lrs``, "name:lr/lr/..."); every
value is run, so the table shows how sensitive each rule is. Adam's values are the benchmarks'
defaults (0.02 for word2vec, 0.003 for the recommender).
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import harness

from nbtools import models
from nbtools.models import ranking as K
from nbtools.models import wordsim

W2V_LRS = "adam:0.02,rowwise_adagrad:0.1/0.2,partial_rowwise_adam:0.02"
REC_LRS = "adam:0.003,rowwise_adagrad:0.03/0.1,partial_rowwise_adam:0.003"
TARGETS = {"ws353": 0.02, "simlex": 0.02, "analogy": 1.5, "hr@10": 0.01}


def parse_lrs(text: str) -> list[tuple[str, float]]:
    out = []
    for part in text.split(","):
        name, _, lrs = part.strip().partition(":")
        if name not in harness.OPTIMIZERS or not lrs:
            sys.exit(f"bench_rowwise: {part!r} is not 'optimizer:lr[/lr...]' with an optimizer of "
                     f"{', '.join(harness.OPTIMIZERS)}")
        out += [(name, float(lr)) for lr in lrs.split("/")]
    return out


def summarise(runs: list[dict]) -> dict:
    """{metric: (mean, sd)} over runs (sd 0 for one run)."""
    return {k: (statistics.fmean(r[k] for r in runs),
                statistics.stdev(r[k] for r in runs) if len(runs) > 1 else 0.0)
            for k in runs[0]}


def word2vec_runs(args, device, lrs):
    lines, tokens = harness.read_corpus(args.corpus, args.max_tokens)
    ids, words, counts = harness.encode(lines, harness.W2V["min_count"])
    print(f"word2vec: {tokens:,} tokens, vocabulary {len(words):,}, {args.epochs} epochs, "
          f"{args.batch_size:,} pairs/step, placement {args.placement}, device {device}", flush=True)
    out = {}
    for name, lr in lrs:
        runs = []
        for seed in range(1, args.seeds + 1):
            model, _, train_s, history = harness.train_skipgram(
                ids, words, counts, args.placement, device, optimizer=name, lr=lr, seed=seed,
                epochs=args.epochs, batch_size=args.batch_size)
            q = harness.word_scores(model, args.eval_dir)
            runs.append({"ws353": q["ws353"]["spearman"], "simlex": q["simlex"]["spearman"],
                         "analogy": 100 * q["analogy"]["accuracy"],
                         "last_loss": history["loss"][-1]})
            print(f"  {name:<22}lr {lr:<7g}seed {seed}: {wordsim.format_scores(q)}  "
                  f"({train_s:.1f} s)", flush=True)
            del model
            gc.collect()
        out[f"{name} lr {lr:g}"] = summarise(runs)
    return out


def ranking_runs(args, r, device, lrs):
    train, test, cand = harness.candidates(r, 19 if args.quick else 99)
    out = {}
    for name, lr in lrs:
        runs = []
        for seed in range(args.seeds):
            model, s = harness.fit_mf(r, train, models.RANKING_DEFAULTS, device, seed=seed,
                                    optimizer=harness.OPTIMIZERS[name], lr=lr)
            runs.append(K.ranking_metrics(model.score_candidates(test.user_ids, cand)))
            print(f"  {name:<22}lr {lr:<7g}seed {seed}: " + "  ".join(
                f"{k} {v:.4f}" for k, v in runs[-1].items()) + f"  ({s:.1f} s)", flush=True)
        out[f"{name} lr {lr:g}"] = summarise(runs)
    return out


def ratings_runs(args, r, device, lrs):
    train, test = models.kfold(r, 5, seed=0)[0]
    out = {}
    for name, lr in lrs:
        runs = []
        for seed in range(args.seeds):
            # RATINGS_DEFAULTS decays the lr tenfold; the row-wise rules keep that shape
            model, s = harness.fit_mf(r, train, models.RATINGS_DEFAULTS, device, seed=seed,
                               optimizer=harness.OPTIMIZERS[name], lr=lr, lr_final=lr / 10)
            runs.append({"rmse": K.rating_metrics(model.predict(test.user_ids, test.item_ids),
                                                  test.ratings)["rmse"]})
            print(f"  {name:<22}lr {lr:<7g}seed {seed}: rmse {runs[-1]['rmse']:.4f}  "
                  f"({s:.1f} s)", flush=True)
        out[f"{name} lr {lr:g}"] = summarise(runs)
    return out


def table(title: str, rows: dict, metrics: list[str]) -> list[str]:
    """Markdown table: mean ± sd per metric, and the difference to Adam's best row."""
    adam = [k for k in rows if k.startswith("adam ")]
    ref = rows[adam[0]] if adam else None
    lines = [f"\n### {title}", "", "| optimizer | " + " | ".join(metrics) + " |",
             "|---|" + "---:|" * len(metrics)]
    for name, m in rows.items():
        cells = []
        for k in metrics:
            mean, sd = m[k]
            cell = f"{mean:.3f} ± {sd:.3f}" if k != "analogy" else f"{mean:.1f} ± {sd:.1f}"
            if ref is not None and not name.startswith("adam "):
                d = mean - ref[k][0]
                cell += f" ({d:+.3f})" if k != "analogy" else f" ({d:+.1f})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def verdicts(res: dict) -> list[str]:
    """For each targeted metric: the best row-wise row's distance to Adam, and whether it is met."""
    out = []
    for part, metric in (("word2vec", "ws353"), ("word2vec", "simlex"), ("word2vec", "analogy"),
                         ("ranking", "hr@10")):
        rows = res.get(part)
        if not rows:
            continue
        adam = [m[metric][0] for k, m in rows.items() if k.startswith("adam ")]
        for rule in ("rowwise_adagrad", "partial_rowwise_adam"):
            mine = [m[metric][0] for k, m in rows.items() if k.startswith(rule + " ")]
            if adam and mine:
                gap = max(adam) - max(mine)
                ok = gap <= TARGETS[metric]
                out.append(f"{part} {metric}: Adam minus the best {rule}: {gap:+.3f} "
                           f"(target <= {TARGETS[metric]}): {'met' if ok else 'NOT met'}")
    return out


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--parts", default="word2vec,ranking,ratings")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--corpus", default=harness.W2V_CORPUS)
    ap.add_argument("--eval-dir", default=harness.W2V_EVAL)
    ap.add_argument("--ml100k", default=harness.ML100K)
    ap.add_argument("--epochs", type=int, default=5, help="word2vec epochs")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=131072, help="word2vec pairs per step")
    ap.add_argument("--placement", default=None, help="word2vec tables: gpu or host "
                    "(+modifiers, as bench_word2vec's systems; default gpu on a GPU, else host)")
    ap.add_argument("--w2v-lrs", default=W2V_LRS)
    ap.add_argument("--rec-lrs", default=REC_LRS)
    args = ap.parse_args()
    device = harness.setup(args)
    args.placement = args.placement or ("gpu" if device.type == "cuda" else "host")
    if args.quick:
        args.corpus, args.eval_dir = harness.QUICK_CORPUS, None
        args.epochs, args.seeds, args.batch_size = 1, 1, min(args.batch_size, 4096)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    res, lines = {"device": harness.device_name(device), "seeds": args.seeds}, []
    t0 = time.perf_counter()
    if "word2vec" in parts:
        res["word2vec"] = word2vec_runs(args, device, parse_lrs(args.w2v_lrs))
        lines += table(f"word2vec ({args.placement}, {args.seeds} seeds)", res["word2vec"],
                       ["ws353", "simlex", "analogy"])
    r = harness.ratings(args) if {"ranking", "ratings"} & set(parts) else None
    if r is not None and "ranking" in parts:
        res["ranking"] = ranking_runs(args, r, device, parse_lrs(args.rec_lrs))
        lines += table(f"ranking ({args.seeds} seeds)", res["ranking"], ["hr@10", "ndcg@10"])
    if r is not None and "ratings" in parts:
        res["ratings"] = ratings_runs(args, r, device, parse_lrs(args.rec_lrs))
        lines += table(f"ratings, fold 1 ({args.seeds} seeds)", res["ratings"], ["rmse"])
    res["verdicts"] = verdicts(res)
    print(f"\n## bench_rowwise ({device}, {time.perf_counter() - t0:.0f} s)")
    print("\n".join(lines + [""] + res["verdicts"]))
    harness.save(args, "rowwise.json", res)


if __name__ == "__main__":
    main()
