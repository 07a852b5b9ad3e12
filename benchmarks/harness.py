"""What the benchmark scripts share: their command line, the device, timing loops, batches of
ids, the standard training steps, one process per system, JSON results, and the word2vec and
matrix-factorisation recipes that more than one script trains.

Scripts run as ``python benchmarks/bench_x.py`` and import this module first: it puts the
repository root first on ``sys.path``, so the checkout's own nbtools is the one measured.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import nbtools  # noqa: E402
from nbtools import models  # noqa: E402
from nbtools.devices import resolve_device, synchronize  # noqa: E402,F401 (scripts use it)
from nbtools.optim import OffloadConfig  # noqa: E402

DATASETS = os.path.join(ROOT, "nbtools", "datasets")     # the bundled samples --quick reads
SCRATCH = os.path.join(ROOT, ".scratch")                 # git-ignored: full-size data sets


# --- command line, device, results ------------------------------------------------------------

def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every script has: --quick, --out, --device."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny sizes on any machine (a CPU is enough) in seconds; "
                    "the same code path and the same table as a full run")
    ap.add_argument("--out", default=None, metavar="DIR", help="also write the results as JSON "
                    "into DIR")
    ap.add_argument("--device", default="auto", help="compute device (default: the GPU if "
                    "there is one, else the CPU)")
    return ap


def corpus_args(ap: argparse.ArgumentParser) -> None:
    """The word2vec benchmarks' corpus flags: --corpus, --eval-dir, --epochs, --max-tokens."""
    ap.add_argument("--corpus", default=W2V_CORPUS)
    ap.add_argument("--eval-dir", default=W2V_EVAL)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=None, help="use the corpus' first N tokens")


def setup(args) -> torch.device:
    """The compute device of ``args.device``. A --quick run uses one CPU thread: on a busy
    few-core machine tiny ops lose more to OpenMP's barriers than they gain from threads."""
    if args.quick:
        torch.set_num_threads(1)
    return resolve_device(args.device)


def device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def save(args, name: str, result: dict) -> None:
    """Write ``result`` to ``args.out``/``name`` (where --out was given)."""
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {os.path.join(args.out, name)}")


def print_table(header: list, rows: list, title: str | None = None) -> None:
    """A plain-text table: the first column left-aligned, the others right-aligned; cells are
    printed as given (None as N/A)."""
    cells = [[("N/A" if c is None else str(c)) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    if title:
        print(f"\n## {title}")
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths))).rstrip())


# --- timing -----------------------------------------------------------------------------------

def loop_ms(step, batches, device, repeats=5, warmup=3) -> float:
    """Median ms per step over ``repeats`` loops through ``batches``, each loop timed with one
    synchronisation at its end (none between steps), after ``warmup`` untimed steps."""
    for ids in batches[:warmup]:
        step(ids)
    synchronize(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for ids in batches:
            step(ids)
        synchronize(device)
        out.append((time.perf_counter() - t0) / len(batches) * 1e3)
    return statistics.median(out)


def step_ms(step, batches, device, warmup=3) -> float:
    """Median ms of single steps (synchronised before and after each) of ``batches`` after the
    first ``warmup``."""
    for ids in batches[:warmup]:
        step(ids)
    synchronize(device)
    times = []
    for ids in batches[warmup:]:
        t0 = time.perf_counter()
        step(ids)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def count_syncs(step, batches, device) -> float | None:
    """Host synchronisations per step (torch.cuda.set_sync_debug_mode); None off CUDA."""
    if device.type != "cuda":
        return None
    step(batches[0])
    synchronize(device)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for ids in batches:
                step(ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / len(batches)


# --- ids --------------------------------------------------------------------------------------

ZIPF_PRIME = 1_000_000_007       # rank -> id: hot rows spread over a whole table (file)


def zipf_ids(gen: np.random.Generator, n_rows: int, size: int, a: float = 1.1) -> np.ndarray:
    ranks = gen.zipf(a, size)
    while (ranks > n_rows).any():
        bad = ranks > n_rows
        ranks[bad] = gen.zipf(a, int(bad.sum()))
    return ((ranks - 1) * ZIPF_PRIME) % n_rows


def hottest(n_rows: int, k: int) -> np.ndarray:
    """The ``k`` hottest rows of :func:`zipf_ids`' streams, hottest first: int32 where the
    rows fit (70M ids take 280 MB, not 560), made 1M at a time."""
    out = np.empty(k, dtype=np.int32 if n_rows < 2 ** 31 else np.int64)
    for a in range(0, k, 1 << 20):
        ids = np.arange(a, min(k, a + (1 << 20)), dtype=np.int64)
        ids *= ZIPF_PRIME
        ids %= n_rows
        out[a:a + len(ids)] = ids
    return out


def zipf_shares(n_rows: int, a: float = 1.1) -> torch.Tensor:
    """Each row's share of :func:`zipf_ids`' draws (float64 ``[n_rows]``, summing to 1): what
    a model hands ``table.warm_cache``."""
    shares = torch.zeros(n_rows, dtype=torch.float64)
    shares[torch.from_numpy(hottest(n_rows, n_rows)).long()] = \
        torch.arange(1, n_rows + 1, dtype=torch.float64) ** -a
    return shares / shares.sum()


def uniform_batches(n: int, ids: int, count: int, device, seed: int = 0) -> list:
    """``count`` batches of ``ids`` uniform ids below ``n`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n, (ids,), generator=gen).to(device) for _ in range(count)]


_ZIPF = {}   # (n, dist, device) -> (cdf over ranks, rank -> row id): one at a time


class IdStream:
    """Batches of ``batch`` ids in ``[0, n)`` on ``device``: ``"uniform"``, or ``"zipf<s>"``
    (rank r drawn with probability proportional to 1 / r^s), the ranks mapped to row ids
    through a fixed random permutation, so that hot rows lie scattered through the table as in
    real data. The permutation is the same in every process."""

    def __init__(self, n: int, dist: str, batch: int, device, seed: int):
        self.n, self.batch, self.device = n, batch, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.cdf = None
        if dist != "uniform":
            key = (n, dist, str(device))
            if key not in _ZIPF:
                _ZIPF.clear()            # 16 bytes a row: keep one
                ranks = torch.arange(1, n + 1, device=device, dtype=torch.float64)
                cdf = torch.cumsum(ranks.pow_(-float(dist[len("zipf"):])), 0)
                cdf /= cdf[-1].clone()
                perm = torch.randperm(n, device=device,
                                      generator=torch.Generator(device=device).manual_seed(7))
                _ZIPF[key] = cdf, perm
            self.cdf, self.perm = _ZIPF[key]

    def next(self) -> torch.Tensor:
        if self.cdf is None:
            return torch.randint(self.n, (self.batch,), generator=self.gen, device=self.device)
        u = torch.rand(self.batch, generator=self.gen, device=self.device, dtype=torch.float64)
        return self.perm[torch.searchsorted(self.cdf, u).clamp_(max=self.n - 1)]


# --- the standard step: lookup, a small loss, backward, optimizer step ---------------------------

OPTIMIZERS = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD,
              "rowwise_adagrad": nbtools.RowWiseAdagrad,
              "partial_rowwise_adam": nbtools.PartialRowWiseAdam}


def loss_of(rows):
    return rows.float().pow(2).sum() * 1e-3


def cache_bytes_for(n, dim, share, states=2) -> int:
    """cache_bytes that hold ``share`` of an n x dim fp32 table's rows with ``states`` state
    tensors (what nbtools sizes a GPU cache by)."""
    from nbtools.store.cache import RowCache
    rows = int(share * n)
    return RowCache.overhead_bytes(n) + rows * RowCache.slot_bytes(4 * dim * (1 + states))


def nbtools_step(n, dim, device, placement="host", fused="auto", cache_share=None,
                 prefetch=False, deterministic=True, optimizer="adam", **table_kw):
    """``(step, (table, optimizer))`` of an n x dim OffloadedEmbedding. With ``prefetch``, each
    step starts the next batch's lookup (``step.next``: batch id -> the batch after it; see
    :func:`follow`)."""
    if cache_share:
        table_kw["cache_bytes"] = cache_bytes_for(n, dim, cache_share)
    table = nbtools.OffloadedEmbedding(n, dim, device=device, name="t", placement=placement,
                                       **table_kw)
    opt = nbtools.OffloadOptimizer(OPTIMIZERS[optimizer], [table], lr=1e-3,
                                   config=OffloadConfig(fused=fused, deterministic=deterministic))
    nxt = {}

    def step(ids):
        rows = table(ids)
        if prefetch:      # the next step's lookup runs on a side stream during this one
            table.prefetch(nxt[id(ids)])
        loss_of(rows).backward()
        opt.step()
        opt.zero_grad()
    step.next = nxt
    return step, (table, opt)


def follow(step, batches) -> None:
    """Tell a prefetching step which batch comes after each of ``batches`` in a loop."""
    getattr(step, "next", {}).update(
        {id(b): batches[(i + 1) % len(batches)] for i, b in enumerate(batches)})


def torch_sparse_step(n, dim, device):
    """nn.Embedding(sparse=True) on ``device`` with torch.optim.SparseAdam: the reference."""
    emb = nn.Embedding(n, dim, sparse=True).to(device)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)

    def step(ids):
        opt.zero_grad()
        loss_of(emb(ids)).backward()
        opt.step()
    return step, (emb, opt)


# --- one process per system -------------------------------------------------------------------

def report(result: dict) -> None:
    """A child's figures, as the one line :func:`run_child` looks for."""
    print("RESULT " + json.dumps(result), flush=True)


def run_child(name, cmd, timeout=None) -> dict | None:
    """Run one system's process (``cmd``); the figures it reported, or None after printing why
    there are none (a failure, or ``timeout`` seconds passed)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        print(f"{name}: stopped after {timeout:.0f} s\n{(e.stdout or b'')[-2000:]!r}", flush=True)
        return None
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not line:
        print(f"{name}: failed\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", flush=True)
        return None
    return json.loads(line[-1][len("RESULT "):])


# --- disk -------------------------------------------------------------------------------------

def dd(args: list) -> float:
    """Bytes per second of one ``dd`` run (its own count)."""
    r = subprocess.run(["dd", *args], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", r.stderr)
    if r.returncode or not m:
        raise RuntimeError(f"dd {' '.join(args)} failed: {r.stderr.strip()}")
    return int(m.group(1)) / float(m.group(2))


# --- word2vec (bench_word2vec, bench_rowwise) ---------------------------------------------------

W2V = dict(dim=100, window=5, negatives=5, min_count=5, sample=1e-4)
W2V_CORPUS = os.path.join(SCRATCH, "w2v", "corpus.txt.gz")
W2V_EVAL = os.path.join(SCRATCH, "w2v", "eval")
QUICK_CORPUS = os.path.join(DATASETS, "text8-sample.txt")


def read_corpus(path, max_tokens=None):
    """Lines of the corpus (each a sentence), up to ``max_tokens`` tokens in all."""
    opener = gzip.open if path.endswith(".gz") else open
    lines, n = [], 0
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            k = len(line.split())
            if not k:
                continue
            lines.append(line.strip())
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


def skipgram_config(system: str) -> dict:
    """SkipGramConfig fields of a system name: a placement ("host", "gpu") and modifiers
    joined by "+": "cache" (a quarter of the vocabulary's rows in a GPU cache, warmed from the
    word counts; "cacheNN": NN percent), "bf16" (bf16 weights, fp32 Adam state), "bf16s" (bf16
    weights and state), "sr" (stochastic rounding). E.g. "host+cache", "host+cache75+bf16s"."""
    placement, *mods = system.split("+")
    shares = {m: (int(m[5:]) if m[5:] else 25) / 100 for m in mods
              if m.startswith("cache") and (m[5:] == "" or m[5:].isdigit())}
    bad = sorted(set(mods) - {"bf16", "bf16s", "sr"} - set(shares))
    if placement not in ("host", "gpu") or bad or any(not 0 < v <= 1 for v in shares.values()):
        raise SystemExit(f"unknown system {system!r}: a placement (host, gpu) and modifiers "
                         "cache, cacheNN (a percentage), bf16, bf16s, sr joined by '+'")
    cfg = {"placement": placement}
    for share in shares.values():
        cfg["cache_share"] = share
    if "bf16" in mods or "bf16s" in mods:
        cfg["dtype"] = torch.bfloat16
    if "bf16s" in mods:
        cfg["state_dtype"] = torch.bfloat16
    if "sr" in mods:
        cfg["rounding"] = "stochastic"
    return cfg


def train_skipgram(ids, words, counts, system, device, *, optimizer="adam", lr=0.02, seed=1,
                   epochs=5, batch_size=131072, log_every=None, autograd_threads=False,
                   chunk_tokens=1 << 22):
    """SkipGram trained with OffloadOptimizer and a linear lr decay: (model, setup seconds,
    train seconds, history)."""
    t0 = time.perf_counter()
    cfg = models.SkipGramConfig(negatives=W2V["negatives"], seed=seed, **skipgram_config(system))
    torch.manual_seed(seed)
    model = models.SkipGram(len(words), W2V["dim"], counts=counts, words=words, config=cfg,
                            device=device)
    opt = nbtools.OffloadOptimizer(OPTIMIZERS[optimizer], model, lr=lr)
    keep = models.keep_probabilities(counts, W2V["sample"])
    loader = models.CorpusLoader(ids, batch_size, window=W2V["window"], keep_prob=keep,
                                 seed=seed, device=device, chunk_tokens=chunk_tokens)
    config = models.TrainConfig(progress=False, lr_decay="linear", log_every=log_every,
                                backward_on_loop_thread=not autograd_threads)
    len(loader)                              # the first epoch's pairs: part of setup
    synchronize(device)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    history = models.train(model, loader, opt, epochs=epochs, config=config)
    synchronize(device)
    return model, setup_s, time.perf_counter() - t0, history


def word_scores(vectors, eval_dir) -> dict | None:
    """WS353, SimLex-999 and analogies (nbtools.models.wordsim) from ``eval_dir``; the bundled
    samples where it is None; None where ``eval_dir`` does not exist."""
    from nbtools.models import wordsim
    if eval_dir is None:
        return wordsim.evaluate(vectors, sample=True, quiet=True)
    return wordsim.evaluate(vectors, eval_dir) if os.path.isdir(eval_dir) else None


# --- matrix factorisation (bench_recommender, bench_rowwise) -------------------------------------

ML100K = os.path.join(SCRATCH, "offline_eval", "ml-100k")


def ratings(args):
    """ML-100K (``args.ml100k``), or with --quick the bundled movielens-sample; None (and why,
    printed) where ML-100K is missing."""
    from nbtools import data
    if args.quick:
        return data.load("movielens-sample")
    if not os.path.exists(args.ml100k):
        print(f"ML-100K not found at {args.ml100k}: bash /work/shared/data/fetch_offline_eval.sh "
              ".scratch/offline_eval (or --ml100k PATH)", flush=True)
        return None
    return data.load(args.ml100k)


def fit_mf(r, train, defaults, device, seed=0, **overrides):
    """nbtools MatrixFactorization with ``defaults`` (RATINGS_DEFAULTS, RANKING_DEFAULTS) and
    ``overrides`` (fit's arguments; ``config=`` MFConfig fields), fitted on ``train``; ``seed``:
    initial weights, negatives and batch order. Returns (model, seconds)."""
    cfg = {**defaults["config"], "seed": seed, **overrides.pop("config", {})}
    fit_kw = {**defaults["fit"], **overrides}
    torch.manual_seed(seed)
    model = models.MatrixFactorization(r.num_users, r.num_items, defaults["dim"],
                                       config=models.MFConfig(**cfg), device=device)
    t0 = time.perf_counter()
    history = models.fit(model, train, seed=seed, **fit_kw)
    synchronize(model.device)
    if "choice" in history:       # fit chose a setting on a validation split: say which
        c = history["choice"]
        print(f"            chose {c['chosen']} (validation HR@10 "
              + " / ".join(f"{v:.4f}" for v in c["valid_hr@10"]) + f" for {fit_kw['choices']}, "
              f"{c['choice_s']:.1f} s)", flush=True)
    return model, time.perf_counter() - t0


def candidates(r, n=99):
    """Leave-last-out split and each user's ``n`` sampled negatives (seed 0), the same for every
    system: (train, test, candidates)."""
    from nbtools.models import ranking
    train, test = models.leave_last_out(r)
    cand = models.sample_candidates(ranking.interactions_of(train, test), test.user_ids,
                                    test.item_ids, n, seed=0)
    return train, test, cand
