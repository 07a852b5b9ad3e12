"""Recommender quality and speed against the usual baselines.

Protocols, the same data and the same candidates for every system:
  ratings   MovieLens-100K, 5 random folds (models.kfold, seed 0): RMSE and MAE of nbtools MF
            (models.recommender.RATINGS_DEFAULTS), surprise SVD and BaselineOnly, the global mean.
  ranking   MovieLens-100K, each user's last interaction by timestamp held out
            (models.leave_last_out), ranked among 99 items the user never interacted with
            (models.sample_candidates, seed 0): HR@10 and NDCG@10 of nbtools MF with BCE
            (RANKING_DEFAULTS), implicit ALS and BPR, popularity.
  synthetic a MovieLens-1M-sized synthetic set with a planted optimum (models.make_synthetic): the
            same two protocols (ratings: one of 5 folds), with the oracle and popularity, and
            the gap-normalised HR@10 (model - popularity) / (oracle - popularity).
  --large   10M users x 1M items, 128-dim tables and Adam state offloaded, BCE with 4 sampled
            negatives per positive, under a GPU memory cap: steps/s, peak GPU and pinned memory,
            next to GPU-resident nn.Embedding(sparse=True) + SparseAdam at the largest size that
            fits under the same cap. GPU machine only.

MovieLens-100K is read from recbole 1.2.1's wheel (its licence forbids committing it):
    bash /work/shared/data/fetch_offline_eval.sh .scratch/offline_eval

    python benchmarks/bench_recommender.py                  # ML-100K + synthetic (~3 min, GPU)
    python benchmarks/bench_recommender.py --quick   # bundled movielens-sample (19 negatives),
                                                     # a small synthetic set, 1 fold: seconds
    python benchmarks/bench_recommender.py --large --gpu-cap-gib 16       # GPU machine
surprise and implicit are the `bench` extra (pip install scikit-surprise implicit, or
pip install -e ".[bench]" in this checkout); a missing one is reported and skipped.
"""
from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import time

import harness
import torch

import nbtools
from nbtools import models
from nbtools.devices import synchronize
from nbtools.models import ranking as K
from nbtools.models.recommender import RANKING_DEFAULTS, RATINGS_DEFAULTS
from nbtools.models.synthetic import SyntheticConfig, gap_normalised, make_synthetic

ROWS = []          # (section, system, metrics dict, seconds) for the table at the end


def record(section, system, metrics, seconds):
    ROWS.append((section, system, metrics, seconds))
    shown = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    print(f"  {section:<10}{system:<26}{shown}   {seconds:7.1f} s", flush=True)


def missing(name):
    print(f"  ({name} is not installed: its baseline is skipped. pip install "
          f"scikit-surprise implicit installs both)", flush=True)


# --- baselines --------------------------------------------------------------------------------------

def surprise_rmse(train, test, algo_name):
    import surprise

    with tempfile.NamedTemporaryFile("w", suffix=".tsv", delete=False) as f:
        for u, i, x in zip(train.user_ids.tolist(), train.item_ids.tolist(), train.ratings.tolist()):
            f.write(f"{u}\t{i}\t{x}\n")
    try:
        reader = surprise.Reader(line_format="user item rating", sep="\t", rating_scale=(1, 5))
        trainset = surprise.Dataset.load_from_file(f.name, reader=reader).build_full_trainset()
    finally:
        os.unlink(f.name)
    algo = {"SVD": lambda: surprise.SVD(random_state=0),
            "BaselineOnly": lambda: surprise.BaselineOnly(verbose=False)}[algo_name]()
    t0 = time.perf_counter()
    algo.fit(trainset)
    pred = torch.tensor([algo.predict(str(u), str(i)).est
                         for u, i in zip(test.user_ids.tolist(), test.item_ids.tolist())])
    return pred, time.perf_counter() - t0


def implicit_scores(train, users, candidates, kind, factors):
    import numpy as np
    import scipy.sparse as sp
    from implicit.cpu.als import AlternatingLeastSquares
    from implicit.cpu.bpr import BayesianPersonalizedRanking

    ui = sp.csr_matrix((np.ones(train.user_ids.numel(), dtype=np.float32),
                        (train.user_ids.numpy(), train.item_ids.numpy())),
                       shape=(train.num_users, train.num_items))
    ui.data[:] = 1.0                                  # duplicates summed: binarise again
    model = (AlternatingLeastSquares(factors=factors, random_state=0) if kind == "ALS" else
             BayesianPersonalizedRanking(factors=factors, random_state=0))
    t0 = time.perf_counter()
    model.fit(ui, show_progress=False)
    uf = torch.from_numpy(np.asarray(model.user_factors))[users]
    itf = torch.from_numpy(np.asarray(model.item_factors))[candidates]
    return (uf[:, None, :] * itf).sum(-1), time.perf_counter() - t0


def mean_sd(runs):
    """Mean of each metric over runs, with ``<metric>_sd`` (sample sd) when there are several."""
    out = {k: sum(m[k] for m in runs) / len(runs) for k in runs[0]}
    if len(runs) > 1:
        out.update({f"{k}_sd": (sum((m[k] - out[k]) ** 2 for m in runs) / (len(runs) - 1)) ** .5
                    for k in runs[0]})
    return out


# --- protocols --------------------------------------------------------------------------------------

def rating_protocol(section, r, folds, device, oracle=None, **overrides):
    splits = models.kfold(r, 5, seed=0)[:folds]
    systems = {"nbtools MF": [], "global mean": []}
    times = {k: 0.0 for k in systems}
    for fold, (train, test) in enumerate(splits):
        print(f"  {section:<10}fold {fold + 1} of {len(splits)}", flush=True)
        model, s = harness.fit_mf(r, train, RATINGS_DEFAULTS, device, **overrides)
        systems["nbtools MF"].append(K.rating_metrics(model.predict(test.user_ids, test.item_ids),
                                                      test.ratings))
        times["nbtools MF"] += s
        systems["global mean"].append(K.rating_metrics(
            torch.full_like(test.ratings, float(train.ratings.mean())), test.ratings))
        if oracle is not None:
            systems.setdefault("oracle", []).append(K.rating_metrics(
                oracle.expected_rating(test.user_ids, test.item_ids), test.ratings))
            times.setdefault("oracle", 0.0)
            # a floor for any MF: the true item factors known, only the users' estimated
            floor = oracle.with_estimated_users(train)
            systems.setdefault("known-items floor", []).append(K.rating_metrics(
                floor.expected_rating(test.user_ids, test.item_ids), test.ratings))
            times.setdefault("known-items floor", 0.0)
        for name in ("SVD", "BaselineOnly"):
            try:
                pred, s = surprise_rmse(train, test, name)
            except ImportError:
                continue
            systems.setdefault(f"surprise {name}", []).append(K.rating_metrics(pred, test.ratings))
            times[f"surprise {name}"] = times.get(f"surprise {name}", 0.0) + s
    if not any(k.startswith("surprise") for k in systems):
        missing("surprise")
    out = {}
    for name, per_fold in systems.items():
        mean = {k: sum(m[k] for m in per_fold) / len(per_fold) for k in per_fold[0]}
        if len(per_fold) > 1:
            sd = (sum((m["rmse"] - mean["rmse"]) ** 2 for m in per_fold) / (len(per_fold) - 1)) ** .5
            mean["rmse_sd"] = sd
        record(section, name, mean, times[name])
        out[name] = mean
    return out


def ranking_protocol(section, r, device, oracle=None, seeds=1, variants=None, negatives=99,
                     **overrides):
    train, test, cand = harness.candidates(r, negatives)
    out, runs, seconds = {}, [], 0.0
    for seed in range(seeds):                 # the candidates stay fixed; the model's seed moves
        model, s = harness.fit_mf(r, train, RANKING_DEFAULTS, device, seed=seed, **overrides)
        runs.append(K.ranking_metrics(model.score_candidates(test.user_ids, cand)))
        seconds += s
        if seeds > 1:
            print(f"  {section:<10}seed {seed}: " + "  ".join(f"{k} {v:.4f}"
                                                            for k, v in runs[-1].items()))
    out["nbtools MF (BCE)"] = mean_sd(runs)
    record(section, "nbtools MF (BCE)", out["nbtools MF (BCE)"], seconds / seeds)
    for name, extra in (variants or {}).items():
        model, s = harness.fit_mf(r, train, RANKING_DEFAULTS, device, **extra)
        out[name] = K.ranking_metrics(model.score_candidates(test.user_ids, cand))
        record(section, name, out[name], s)
    out["popularity"] = K.ranking_metrics(models.popularity_scores(train, cand))
    record(section, "popularity", out["popularity"], 0.0)
    if oracle is not None:
        out["oracle"] = K.ranking_metrics(oracle.affinity(test.user_ids[:, None], cand))
        record(section, "oracle", out["oracle"], 0.0)
        for name in ["nbtools MF (BCE)", *(variants or {})]:
            gap = gap_normalised(out[name]["hr@10"], out["popularity"]["hr@10"],
                                 out["oracle"]["hr@10"])
            out[f"gap-normalised hr@10, {name}"] = gap
            print(f"  {section:<10}gap-normalised HR@10, {name}: {gap:.3f}")
    for kind, factors in (("ALS", 32), ("ALS", 64), ("BPR", 64)):
        try:
            scores, s = implicit_scores(train, test.user_ids, cand, kind, factors)
        except ImportError:
            missing("implicit")
            break
        out[f"implicit {kind} {factors}"] = K.ranking_metrics(scores)
        record(section, f"implicit {kind} ({factors} f.)", out[f"implicit {kind} {factors}"], s)
    return out


# --- the large synthetic run ------------------------------------------------------------------------

def _gib(nbytes):
    return nbytes / 2**30


@contextlib.contextmanager
def phase_timer(seconds: dict, name: str, device):
    """Time a phase of the large run (synchronised at both ends) into ``seconds[name]``."""
    synchronize(device)
    t0 = time.perf_counter()
    yield
    synchronize(device)
    seconds[name] = time.perf_counter() - t0
    print(f"  large     {name}: {seconds[name]:.1f} s", flush=True)


def large_run(args, device):
    """Steps/s of implicit MF at 10M x 1M x 128 (Adam) offloaded, under a GPU memory cap.

    No interaction table is materialised: each step draws its positives on the compute device
    (users uniform, items Zipf-distributed, exponent 0.8) and 4 uniform negatives each, so the
    set-up is the tables alone. Each phase is timed and printed.
    """
    from torch import nn

    wall0 = time.perf_counter()
    if device.type == "cuda" and args.gpu_cap_gib:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_cap_gib * 2**30 / total))
    users = max(1, int(args.large_users * args.scale))
    items = max(1, int(args.large_items * args.scale))
    dim, batch = args.large_dim, args.large_batch
    seconds = {}
    phase = functools.partial(phase_timer, seconds, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    zipf = 1.0 / torch.arange(1, items + 1, device=device, dtype=torch.float64) ** 0.8
    cdf = torch.cumsum(zipf / zipf.sum(), 0)

    def batch_ids():
        u = torch.randint(users, (batch,), generator=g, device=device)
        i = torch.searchsorted(cdf, torch.rand(batch, generator=g, device=device,
                                                 dtype=torch.float64)).clamp_(max=items - 1)
        return u, i

    def timed(name, step):
        with phase(f"{name}: first step"):
            step(*batch_ids())
        with phase(f"{name}: warm-up ({args.large_warmup} steps)"):
            for _ in range(args.large_warmup):
                step(*batch_ids())
        with phase(f"{name}: timed ({args.large_steps} steps)"):
            for _ in range(args.large_steps):
                step(*batch_ids())
        return args.large_steps / seconds[f"{name}: timed ({args.large_steps} steps)"]

    res = {"users": users, "items": items, "dim": dim, "batch": batch, "negatives": 4,
           "gpu_cap_gib": args.gpu_cap_gib, "device": str(device)}
    table_gib = _gib((users + items) * (dim + 1) * 4)
    print(f"  large     {users:,} users x {items:,} items x {dim} (+ bias), fp32: tables "
          f"{table_gib:.1f} GiB, with Adam's two moments {3 * table_gib:.1f} GiB", flush=True)
    with phase("set-up: tables (allocate, pin, initialise)"):
        model = models.MatrixFactorization(users, items, dim, config=models.MFConfig(
            loss="bce", negatives=4, exclude_seen=False), device=device)
    with phase("set-up: Adam state (rows grow to [weight | exp_avg | exp_avg_sq])"):
        opt = nbtools.OffloadOptimizer(torch.optim.Adam, model, lr=1e-3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step(u, i):
        model.loss(u, i).backward()
        opt.step()
        opt.zero_grad()
    res["offload_steps_per_s"] = timed("offloaded", step)
    res["pinned_gib"] = _gib(nbtools.pinned_bytes())
    if device.type == "cuda":
        res["offload_peak_gpu_gib"] = _gib(torch.cuda.max_memory_allocated(device))
    print(f"  large     offloaded {users:,} x {items:,} x {dim} Adam: "
          f"{res['offload_steps_per_s']:.1f} steps/s ({batch:,} positives + 4 negatives each), "
          f"peak GPU {res.get('offload_peak_gpu_gib', float('nan')):.2f} GiB, pinned "
          f"{res['pinned_gib']:.1f} GiB", flush=True)
    model = opt = step = None       # free the offloaded tables before the resident ones
    # GPU-resident reference: the most users that fit under the cap with SparseAdam (weights + 2
    # moments, fp32), the same items, batch and negatives (on a CPU run: all users, for a check)
    fit_users = users
    if device.type == "cuda":
        torch.cuda.empty_cache()
        budget = 0.6 * args.gpu_cap_gib * 2**30 / (3 * 4 * (dim + 1))
        fit_users = int(min(users, max(1, budget - items)))
    with phase("set-up: GPU-resident tables"):
        emb_u = nn.Embedding(fit_users, dim + 1, sparse=True, device=device)
        emb_i = nn.Embedding(items, dim + 1, sparse=True, device=device)
        sparse = torch.optim.SparseAdam(list(emb_u.parameters()) + list(emb_i.parameters()),
                                        lr=1e-3)

    def gpu_step(u, i):
        u = u % fit_users
        negs = torch.randint(items, (u.numel(), 4), generator=g, device=device)
        p = emb_u(u)
        q = emb_i(torch.cat((i[:, None], negs), 1))
        s = (p[:, None, :dim] * q[..., :dim]).sum(-1) + p[:, None, dim] + q[..., dim]
        loss = (nn.functional.softplus(-s[:, 0]) + nn.functional.softplus(s[:, 1:]).sum(1)).mean()
        loss.backward()
        sparse.step()
        sparse.zero_grad()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    res["gpu_resident_users"] = fit_users
    res["gpu_resident_steps_per_s"] = timed("resident", gpu_step)
    if device.type == "cuda":
        res["gpu_resident_peak_gpu_gib"] = _gib(torch.cuda.max_memory_allocated(device))
    print(f"  large     resident nn.Embedding(sparse=True) + SparseAdam, {fit_users:,} users "
          f"(fits the cap): {res['gpu_resident_steps_per_s']:.1f} steps/s, peak GPU "
          f"{res.get('gpu_resident_peak_gpu_gib', float('nan')):.2f} GiB", flush=True)
    res["phases_s"] = seconds
    res["total_s"] = time.perf_counter() - wall0
    print(f"  large     total {res['total_s']:.0f} s", flush=True)
    return res


# --- main ------------------------------------------------------------------------------------------

def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--ml100k", default=harness.ML100K,
                    help="directory or file with ML-100K (u.data or ml-100k.inter)")
    ap.add_argument("--folds", type=int, default=5, help="RMSE folds on ML-100K (of 5)")
    ap.add_argument("--seeds", type=int, default=3,
                    help="ML-100K ranking: runs of nbtools MF (seeds 0..N-1), mean and sd")
    ap.add_argument("--synthetic-seeds", type=int, default=1,
                    help="synthetic ranking: runs of nbtools MF (seeds 0..N-1), mean and sd")
    ap.add_argument("--skip-synthetic", action="store_true")
    ap.add_argument("--skip-ml100k", action="store_true")
    ap.add_argument("--large", action="store_true", help="only the 10M x 1M offloaded run")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="--large: multiply users and items by this (0.01: a CPU smoke check)")
    ap.add_argument("--large-users", type=int, default=10_000_000)
    ap.add_argument("--large-items", type=int, default=1_000_000)
    ap.add_argument("--large-dim", type=int, default=128)
    ap.add_argument("--large-batch", type=int, default=65_536)
    ap.add_argument("--large-steps", type=int, default=200)
    ap.add_argument("--large-warmup", type=int, default=10)
    ap.add_argument("--gpu-cap-gib", type=float, default=16.0)
    args = ap.parse_args()
    device = harness.setup(args)
    print(f"device {device}; torch {torch.__version__}; {torch.get_num_threads()} threads", flush=True)
    res = {"device": harness.device_name(device)}
    if args.large:
        res["large"] = large_run(args, device)
    else:
        quick = dict(epochs=2) if args.quick else {}     # fit's epochs
        r = None if args.skip_ml100k else harness.ratings(args)
        if r is not None:
            name = "sample" if args.quick else "ML-100K"
            print(f"{name}: {r.ratings.numel():,} ratings, {r.num_users} users, "
                  f"{r.num_items} items", flush=True)
            res["ml100k_ratings"] = rating_protocol(name, r, 1 if args.quick else args.folds,
                                                    device, **quick)
            res["ml100k_ranking"] = ranking_protocol(name, r, device,
                                                     seeds=1 if args.quick else args.seeds,
                                                     negatives=19 if args.quick else 99, **quick)
        if not args.skip_synthetic:
            cfg = (SyntheticConfig(num_users=600, num_items=400, per_user=40) if args.quick
                   else SyntheticConfig())
            t0 = time.perf_counter()
            syn = make_synthetic(cfg)
            print(f"synthetic: {syn.ratings.ratings.numel():,} interactions, {cfg.num_users:,} "
                  f"users, {cfg.num_items:,} items (made in {time.perf_counter() - t0:.1f} s)",
                  flush=True)
            # the same defaults as on ML-100K (batch 1,024 with lr 0.006 was faster, but reached
            # gap-normalised HR@10 0.73 against 0.79)
            res["synthetic_ratings"] = rating_protocol("synthetic", syn.ratings, 1, device,
                                                       oracle=syn, **quick)
            # the generator's draw order carries no drift of taste, so recency weights only thin
            # the data there; fit chooses them on a validation split (shown: recency without the choice)
            res["synthetic_ranking"] = ranking_protocol(
                "synthetic", syn.ratings, device, oracle=syn, seeds=args.synthetic_seeds, **quick,
                variants={} if args.quick else {
                    "MF (BCE), recency 16 always": dict(config=dict(recency_weight=16.0),
                                                        choices=None)})
            rmse = {k: v["rmse"] for k, v in res["synthetic_ratings"].items()}
            print(f"  synthetic RMSE / oracle RMSE: nbtools MF {rmse['nbtools MF'] / rmse['oracle']:.4f}, "
                  f"known-items floor {rmse['known-items floor'] / rmse['oracle']:.4f}")
    metrics = sorted({k for _, _, m, _ in ROWS for k in m if not k.endswith("_sd")})
    if ROWS:
        harness.print_table(["protocol", "system", *metrics, "seconds"],
                            [[section, system, *(f"{m[k]:.4f}" if k in m else "" for k in metrics),
                              f"{seconds:.1f}"] for section, system, m, seconds in ROWS],
                            "bench_recommender summary")
    harness.save(args, "recommender.json", res)


if __name__ == "__main__":
    main()
