"""Word-vector quality: WS353 and SimLex-999 (Spearman) and Google analogies (3CosAdd).

One scorer for any word -> vector mapping, so nbtools and gensim are measured by the same code:
pass a :class:`~nbtools.models.SkipGram` (its input vectors), or ``(words, matrix)`` with the
words ordered by frequency (gensim: ``(model.wv.index_to_key, model.wv.vectors)``).

The files are the ones gensim ships in its test data (``wordsim353.tsv``, ``simlex999.txt``:
``word1<TAB>word2<TAB>score`` lines, ``#`` comments; ``questions-words.txt``: ``: section``
headers, then ``a b c d`` lines). Words are lower-cased, as the corpus is. They are datasets of
:mod:`nbtools.data` (``"ws353"``, ``"simlex999"``, ``"questions-words"``): ``evaluate(model)``
fetches them once, checks their hashes and caches them (on Google Drive in Colab).
``evaluate(model, sample=True)`` uses tiny made-up sets of the bundled text8 sample's words
instead, with no network: a smoke test of the plumbing, not a measure of quality.

>>> words = ["king", "queen", "man", "woman", "cat"]
>>> m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0],
...                   [0.3, -1.0, 0.2]])
>>> pairs = [("king", "queen", 8.0), ("man", "woman", 7.0), ("cat", "king", 1.0),
...          ("dog", "cat", 6.0)]
>>> r = word_similarity((words, m), pairs)
>>> round(r["spearman"], 3), r["coverage"]
(1.0, 0.75)
>>> analogies((words, m), [("", "man", "king", "woman", "queen")])["accuracy"]
1.0
"""
from __future__ import annotations

import math
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data import load_analogies, load_word_pairs
from ..files import make_folder, write_private

FILES = {"ws353": "wordsim353.tsv", "simlex": "simlex999.txt", "analogy": "questions-words.txt"}
DATASETS = {"ws353": "ws353", "simlex": "simlex999", "analogy": "questions-words"}  # nbtools.data


def fetch_sets(*, sample: bool = False, **fetch_options) -> dict:
    """``{"ws353": path, "simlex": path, "analogy": path}``: the three files from the data
    registry (downloaded once, hash-checked, cached; on Google Drive in Colab), or with
    ``sample=True`` the small bundled samples (no network). ``fetch_options`` go to
    :func:`nbtools.data.fetch` (``cache_dir=``, ``quiet=``, ...)."""
    from .. import data

    suffix = "-sample" if sample else ""
    return {key: data.fetch(name + suffix, **fetch_options) for key, name in DATASETS.items()}


# --- statistics ---------------------------------------------------------------------------------

def average_ranks(x) -> torch.Tensor:
    """Ranks 1..n of ``x`` (float64), ties sharing their average rank.

    >>> average_ranks([10, 20, 20, 5]).tolist()
    [2.0, 3.5, 3.5, 1.0]
    """
    x = torch.as_tensor(x, dtype=torch.float64).reshape(-1)
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    n = x.numel()
    # runs of equal values: each gets the mean of the positions it spans
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = sorted_x[1:] != sorted_x[:-1]
    run = torch.cumsum(new_run.long(), 0) - 1
    positions = torch.arange(1, n + 1, dtype=torch.float64)
    runs = int(run[-1]) + 1 if n else 0
    sums = torch.zeros(runs, dtype=torch.float64).index_add_(0, run, positions)
    sizes = torch.bincount(run).to(torch.float64)
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = (sums / sizes)[run]
    return ranks


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks (NaN when fewer
    than two values, or when one side is constant).

    >>> round(spearman([1, 2, 3, 4], [10, 30, 20, 40]), 12)
    0.8
    """
    rx, ry = average_ranks(x), average_ranks(y)
    if rx.numel() != ry.numel():
        raise ValueError(f"spearman needs two equally long sequences, got {rx.numel()} and "
                         f"{ry.numel()}")
    if rx.numel() < 2:
        return math.nan
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = float(rx.norm() * ry.norm())
    return float(rx @ ry) / denom if denom > 0 else math.nan


# --- vectors ------------------------------------------------------------------------------------

def _vectors(vectors):
    """``(words, float32 CPU matrix)`` of a SkipGram or a ``(words, matrix)`` pair."""
    if hasattr(vectors, "input") and hasattr(vectors, "words"):     # a SkipGram
        if vectors.words is None:
            raise ValueError("this SkipGram has no words; build it with words=[...]")
        if getattr(vectors, "world", 1) > 1:    # sharded over ranks: gathered (a collective)
            return list(vectors.words), vectors.vectors()
        return list(vectors.words), vectors.input.read_weight().detach().float().cpu()
    try:
        words, matrix = vectors
    except (TypeError, ValueError):
        raise TypeError(f"expected a SkipGram or (words, matrix), got "
                        f"{type(vectors).__name__}") from None
    matrix = torch.as_tensor(matrix).detach().float().cpu()
    if matrix.dim() != 2 or matrix.shape[0] != len(words):
        raise ValueError(f"matrix has shape {tuple(matrix.shape)}; expected ({len(words)}, dim), "
                         "one row per word")
    return list(words), matrix


def word_similarity(vectors, pairs) -> dict:
    """Spearman correlation between cosine similarities and human scores.

    Args:
        vectors: a :class:`~nbtools.models.SkipGram` or ``(words, matrix)``.
        pairs: ``[(word1, word2, score), ...]`` (:func:`load_word_pairs`).

    Returns:
        ``{"spearman", "coverage", "pairs"}``: the correlation over the pairs whose two words
        are in the vocabulary, the fraction of pairs that are, and how many.
    """
    words, matrix = _vectors(vectors)
    index = {w: i for i, w in enumerate(words)}
    known = [(index[a], index[b], s) for a, b, s in pairs if a in index and b in index]
    if not known:
        return {"spearman": math.nan, "coverage": 0.0, "pairs": 0}
    a, b, human = (torch.tensor(col) for col in zip(*known))
    cosine = F.cosine_similarity(matrix[a], matrix[b], dim=1)
    return {"spearman": spearman(cosine, human), "coverage": len(known) / len(pairs),
            "pairs": len(known)}


@torch.no_grad()
def analogies(vectors, questions, *, restrict: int = 30000, chunk: int = 2048) -> dict:
    """Accuracy on ``a : b = c : d`` questions with 3CosAdd, as gensim scores them.

    The answer is the word nearest (cosine) to ``unit(b) - unit(a) + unit(c)`` among the first
    ``restrict`` words (the most frequent, if ``words`` is ordered by frequency), ``a``, ``b``
    and ``c`` excluded. Only questions whose four words are all among those are asked.
    Batched: ``chunk`` questions at a time as one matrix product.

    Returns:
        ``{"accuracy", "coverage", "questions", "correct"}``: accuracy over the questions
        asked, and the fraction of all questions that were asked.
    """
    words, matrix = _vectors(vectors)
    words, matrix = words[:restrict], F.normalize(matrix[:restrict], dim=1)
    index = {w: i for i, w in enumerate(words)}
    asked = [[index[w] for w in q[1:]] for q in questions if all(w in index for w in q[1:])]
    if not asked:
        return {"accuracy": math.nan, "coverage": 0.0, "questions": 0, "correct": 0}
    ids = torch.tensor(asked)                                    # [Q, 4]: a, b, c, d
    correct = 0
    for lo in range(0, ids.shape[0], chunk):
        q = ids[lo:lo + chunk]
        target = matrix[q[:, 1]] - matrix[q[:, 0]] + matrix[q[:, 2]]
        scores = target @ matrix.T                               # [chunk, restrict]
        scores.scatter_(1, q[:, :3], -math.inf)                  # never answer a, b or c
        correct += int((scores.argmax(1) == q[:, 3]).sum())
    return {"accuracy": correct / len(asked), "coverage": len(asked) / len(questions),
            "questions": len(asked), "correct": correct}


def evaluate(vectors, eval_dir=None, *, sample: bool = False, restrict: int = 30000,
             **fetch_options) -> dict:
    """WS353 and SimLex-999 Spearman, Google analogy accuracy (top ``restrict`` words).

    Args:
        vectors: a :class:`~nbtools.models.SkipGram` or ``(words, matrix)`` (words ordered by
            frequency).
        eval_dir: folder with ``wordsim353.tsv``, ``simlex999.txt`` and ``questions-words.txt``
            (a missing file's entry is left out). None (the default): the files come from the
            data registry, fetched and cached on first use (:func:`fetch_sets`).
        sample: with no ``eval_dir``, score on the tiny bundled samples instead (offline; a
            smoke test: the numbers mean little).
        fetch_options: passed to :func:`nbtools.data.fetch` (``cache_dir=``, ``quiet=``, ...).

    Returns:
        ``{"ws353": {...}, "simlex": {...}, "analogy": {...}}`` as :func:`word_similarity` and
        :func:`analogies` return them.

    Raises:
        nbtools.data.DownloadError, nbtools.data.HashMismatchError: fetching failed; pass
            ``eval_dir`` to use local copies.
    """
    if eval_dir is None:
        paths = fetch_sets(sample=sample, **fetch_options)
    else:
        if sample or fetch_options:
            raise TypeError(f"evaluate(eval_dir={str(eval_dir)!r}) reads that folder; sample= "
                            "and fetch options apply only without eval_dir")
        eval_dir = Path(eval_dir)
        if not eval_dir.is_dir():
            raise FileNotFoundError(f"eval_dir {str(eval_dir)!r} is not a folder; it should hold "
                                    f"{sorted(FILES.values())} (or leave eval_dir out to fetch "
                                    "them)")
        paths = {key: eval_dir / name for key, name in FILES.items()}
    words_matrix = _vectors(vectors)            # one copy of the table for all three
    out = {}
    for key, path in paths.items():
        if not path.exists():
            continue
        if key == "analogy":
            out[key] = analogies(words_matrix, load_analogies(path), restrict=restrict)
        else:
            out[key] = word_similarity(words_matrix, load_word_pairs(path))
    if not out:
        raise FileNotFoundError(f"{eval_dir} holds none of {sorted(FILES.values())}")
    return out


def format_scores(scores: dict) -> str:
    """One line: ``WS353 0.672 (cov 0.98)  SimLex 0.376 (...)  analogy 23.5% (...)``."""
    parts = []
    for key, label in (("ws353", "WS353"), ("simlex", "SimLex"), ("analogy", "analogy")):
        if key in scores:
            r = scores[key]
            value = f"{100 * r['accuracy']:.1f}%" if key == "analogy" else f"{r['spearman']:.3f}"
            parts.append(f"{label} {value} (coverage {r['coverage']:.2f})")
    return "  ".join(parts)


# --- bundled samples (tests/models/test_word2vec.py regenerates them to prove they are what this makes) --

_SAMPLE_FILES = {"ws353": "wordsim353-sample.tsv", "simlex": "simlex999-sample.txt",
                 "analogy": "questions-words-sample.txt"}


def make_samples(folder, seed: int = 0) -> None:
    """Write the three small made-up evaluation files bundled with nbtools, in the real files'
    formats, over the words of the bundled text8 sample (:func:`nbtools.data.make_text8_sample`):
    pairs of one topic score 6-10, pairs across topics 0-4; an analogy question takes ``a b``
    from one topic and ``c d`` from another. Each file also holds one pair or question of words
    the sample lacks, so that coverage is below 1 as on real data."""
    from ..data import SAMPLE_TOPICS

    rnd = random.Random(seed)
    topics = [t.split() for t in SAMPLE_TOPICS.values()]
    folder = Path(folder)
    make_folder(str(folder))
    made_up = ("# Made up for nbtools' smoke runs (nbtools.models.wordsim.make_samples): words of "
               "the bundled text8 sample,\n# scored 6-10 within a topic and 0-4 across topics. "
               "Not a measure of quality.\n")
    for key, label in (("ws353", "relatedness"), ("simlex", "similarity")):
        lines = [made_up.rstrip("\n"), f"# Word 1\tWord 2\tHuman (mean {label})"]
        for n in range(30):
            same = n % 2 == 0
            t1 = rnd.randrange(len(topics))
            t2 = t1 if same else (t1 + rnd.randrange(1, len(topics))) % len(topics)
            a, b = rnd.choice(topics[t1]), rnd.choice(topics[t2])
            while b == a:
                b = rnd.choice(topics[t2])
            score = rnd.uniform(6, 10) if same else rnd.uniform(0, 4)
            lines.append(f"{a}\t{b}\t{score:.2f}")
        lines.append("tiger\tcat\t7.35")                 # not in the sample: coverage < 1
        write_private(folder / _SAMPLE_FILES[key], ("\n".join(lines) + "\n").encode("utf-8"))
    lines = []
    for section in ("topic-to-topic", "numbers-to-topic"):
        lines.append(f": {section}")
        for _ in range(12):
            t1 = 0 if section.startswith("numbers") else rnd.randrange(len(topics))
            t2 = (t1 + rnd.randrange(1, len(topics))) % len(topics)
            a, b = rnd.sample(topics[t1], 2)
            c, d = rnd.sample(topics[t2], 2)
            lines.append(f"{a} {b} {c} {d}")
    lines.append("Athens Greece Baghdad Iraq")            # not in the sample
    write_private(folder / _SAMPLE_FILES["analogy"], ("\n".join(lines) + "\n").encode("utf-8"))
