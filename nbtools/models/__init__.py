"""Two models and one training loop, built from nbtools' parts: what the notebooks call.

* :class:`SkipGram`: word2vec with negative sampling (SGNS). Input and output vectors are
  :class:`~nbtools.OffloadedEmbedding` tables; negatives are drawn on the compute device from
  the unigram distribution raised to 3/4.
* :class:`MatrixFactorization`: a recommender. User and item tables (each row ends with the
  row's bias) plus an optional small NCF head, an MLP on the GPU trained by the same
  :class:`~nbtools.OffloadOptimizer` as the tables. :data:`RATINGS_DEFAULTS` and
  :data:`RANKING_DEFAULTS` are the settings measured on MovieLens-100K
  (``benchmarks/RESULTS.md``, "Recommender").
* :class:`CorpusLoader`: word2vec's training pairs, subsampled and windowed afresh each epoch.
* :mod:`~nbtools.models.wordsim`: WS353, SimLex-999 and Google analogies for any word vectors.
* :func:`train`: one loop for both. It feeds a :class:`~nbtools.Dashboard` from the loop's own
  thread, saves checkpoints every ``every`` steps and, when it starts, restores the newest one,
  so a Colab run that was disconnected continues where its last checkpoint left it.

A model here is an ``nn.Module`` with ``loss(*batch) -> scalar tensor``, where ``batch`` is
what the loader yields; :func:`train` needs nothing else.

>>> ids = torch.tensor([0, 1, 2, 1, 0, 3, 1, 2])
>>> centers, contexts = pairs_from_corpus(ids, window=1, dynamic=False)
>>> centers[:4].tolist(), contexts[:4].tolist()
([0, 1, 2, 1], [1, 2, 1, 0])
>>> model = SkipGram(4, 8, counts=torch.bincount(ids), device="cpu")
>>> opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.01)
>>> loader = PinnedLoader(centers, contexts, batch_size=4, device="cpu")
>>> history = train(model, loader, opt, epochs=2, progress=False)
>>> len(history["loss"]) > 0
True
"""
from __future__ import annotations

import torch  # noqa: F401  (the doctest above uses it)

from ..loader import PinnedLoader  # noqa: F401  (the doctest above uses it)
from ..optim import OffloadOptimizer  # noqa: F401  (the doctest above uses it)
from . import wordsim
from .ranking import (Interactions, full_ranking_metrics, interactions_of, kfold, leave_last_out,
                      per_user_split, popularity_scores, ranking_metrics, rating_metrics, recency,
                      sample_candidates, sample_users, train_valid_test)
from .recommender import (RANKING_DEFAULTS, RATINGS_DEFAULTS, MatrixFactorization, MFConfig,
                          choose_config, evaluate_rmse, fit, holdout, recency_weights)
from .synthetic import SyntheticConfig, SyntheticData, gap_normalised, make_synthetic
from .training import TrainConfig, train
from .word2vec import (CorpusLoader, SkipGram, SkipGramConfig, count_pairs, keep_probabilities,
                       pairs_from_corpus)

__all__ = ["SkipGram", "SkipGramConfig", "CorpusLoader", "MatrixFactorization", "MFConfig",
           "train", "TrainConfig", "pairs_from_corpus", "count_pairs", "keep_probabilities",
           "evaluate_rmse", "holdout", "wordsim"]
__all__ += ["fit", "Interactions", "leave_last_out", "per_user_split", "kfold", "train_valid_test",
            "sample_candidates", "sample_users", "ranking_metrics", "full_ranking_metrics",
            "rating_metrics",
            "popularity_scores", "SyntheticConfig", "SyntheticData", "make_synthetic",
            "gap_normalised"]
# the measured recommender settings (benchmarks/RESULTS.md, "Recommender"), and the
# helpers a ranking evaluation needs
__all__ += ["RATINGS_DEFAULTS", "RANKING_DEFAULTS", "interactions_of", "recency",
            "recency_weights", "choose_config"]
