"""MF RMSE on MovieLens-100K with low-precision table storage (issue 12: "measure the quality
effect ... on MF RMSE"): the notebook's rating defaults (RATINGS_DEFAULTS), 5 random folds, with
the tables stored as fp32, bf16 weights + fp32 state, bf16 weights + state, and bf16 with
stochastic rounding. Every variant computes in fp32; only storage differs.

    OMP_NUM_THREADS=1 python benchmarks/experiments/mf_low_precision.py .scratch/offline_eval/ml-100k
"""
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_recommender import RATINGS_DEFAULTS, K, ours  # noqa: E402
from nbtools import data, models  # noqa: E402
from nbtools.devices import resolve_device  # noqa: E402

VARIANTS = {
    "fp32": {},
    "bf16 weights, fp32 state": dict(dtype=torch.bfloat16),
    "bf16 weights and state": dict(dtype=torch.bfloat16, state_dtype=torch.bfloat16),
    "bf16, stochastic rounding": dict(dtype=torch.bfloat16, rounding="stochastic"),
}


def main():
    torch.set_num_threads(1)
    r = data.load(sys.argv[1] if len(sys.argv) > 1 else ".scratch/offline_eval/ml-100k")
    device = resolve_device("auto")
    splits = models.kfold(r, 5, seed=0)
    for name, storage in VARIANTS.items():
        rmse = []
        for train, test in splits:
            model, _ = ours(r, train, RATINGS_DEFAULTS, device, config=dict(storage))
            rmse.append(K.rating_metrics(model.predict(test.user_ids, test.item_ids),
                                         test.ratings)["rmse"])
        print(f"{name:<28} RMSE {statistics.mean(rmse):.4f} +- {statistics.stdev(rmse):.4f} "
              f"(folds: {' '.join(f'{x:.4f}' for x in rmse)})", flush=True)


if __name__ == "__main__":
    main()
