"""The recommender notebook's past-the-GPU ranking model against recommending popular items, at a
fraction of its size with as many steps: HR@10 of matrix factorisation (RANKING_DEFAULTS, recency
off, one epoch as the notebook trains) and of item popularity, on planted genres
(nbtools.data.make_planted_ratings), for shapes of catalogue against users.

The notebook's SIZE = "past_t4" draws 8M users x 16M items, 6 ratings a user, and trains one epoch
of 65,536 interactions a step (611 steps: 40M training interactions). At --scale 0.01 each shape here keeps that number of
steps: the batch shrinks with the data, so each row sees as many updates as it would at full size.

    python benchmarks/bench_planted_ranking.py --out DIR        # the shapes below, on the CPU
    python benchmarks/bench_planted_ranking.py --quick          # a tiny shape, seconds
"""
from __future__ import annotations

import time

import harness

from nbtools import data, models
from nbtools.models import RANKING_DEFAULTS, RATINGS_DEFAULTS

FULL_BATCH = 65_536          # the notebook's interactions a step at full size
# (users, items, per user, epochs, lr) at full size; --scale divides users and items
SHAPES = [(8_000_000, 16_000_000, 6, 1, 0.01), (8_000_000, 16_000_000, 6, 2, 0.01),
          (8_000_000, 16_000_000, 6, 3, 0.01), (20_000_000, 4_000_000, 6, 1, 0.01),
          (20_000_000, 4_000_000, 6, 3, 0.01)]


def one(users, items, per_user, epochs, lr, scale, eval_users, seed=0) -> dict:
    u, i = max(100, int(users * scale)), max(100, int(items * scale))
    batch = max(16, int(FULL_BATCH * scale))
    ratings = data.make_planted_ratings(users=u, items=i, per_user=per_user, seed=seed)
    train, test = models.leave_last_out(ratings)
    test = models.sample_users(test, eval_users, seed=seed)
    cand = models.sample_candidates(models.interactions_of(train, test), test.user_ids,
                                    test.item_ids, 19, seed=seed)
    cfg = dict(RANKING_DEFAULTS["config"], recency_weight=0.0)
    model = models.MatrixFactorization(u, i, RATINGS_DEFAULTS["dim"],
                                       config=models.MFConfig(**cfg, seed=seed))
    fit = {**RANKING_DEFAULTS["fit"], "epochs": epochs, "batch_size": batch, "lr": lr,
           "choices": None}
    t0 = time.perf_counter()
    models.fit(model, train, **fit, seed=seed, progress=False)
    seconds = time.perf_counter() - t0
    hr = {name: models.ranking_metrics(s, k=10)["hr@10"] for name, s in (
        ("model", model.score_candidates(test.user_ids, cand)),
        ("popularity", models.popularity_scores(train, cand)))}
    return dict(users=u, items=i, per_user=per_user, epochs=epochs, lr=lr, batch=batch,
                steps=epochs * -(-train.user_ids.numel() // batch), train_s=seconds,
                model_hr10=hr["model"], popularity_hr10=hr["popularity"])


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--scale", type=float, default=0.01, help="users and items of full size")
    ap.add_argument("--eval-users", type=int, default=10_000)
    args = ap.parse_args()
    harness.setup(args)
    shapes = SHAPES[:1] if args.quick else SHAPES
    scale = 0.0005 if args.quick else args.scale
    rows = []
    for shape in shapes:
        r = one(*shape, scale=scale, eval_users=min(args.eval_users, 1_000 if args.quick else
                                                    args.eval_users))
        rows.append(r)
        print(f"{r['users']:,} users x {r['items']:,} items, {r['per_user']} a user, "
              f"{r['epochs']} epoch(s), {r['steps']:,} steps of {r['batch']:,}: HR@10 model "
              f"{r['model_hr10']:.3f}, popularity {r['popularity_hr10']:.3f} "
              f"({r['train_s']:.0f} s)", flush=True)
    harness.print_table(["users x items", "epochs", "steps", "model HR@10", "popularity HR@10"],
                        [[f"{r['users']:,} x {r['items']:,}", r["epochs"], f"{r['steps']:,}",
                          f"{r['model_hr10']:.3f}", f"{r['popularity_hr10']:.3f}"]
                         for r in rows], title="planted genres: ranking against popularity")
    harness.save(args, "planted_ranking.json", {"scale": scale, "rows": rows})


if __name__ == "__main__":
    main()
