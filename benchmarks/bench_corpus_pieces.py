"""word2vec's CorpusLoader pieces in corpus order (as it trains) against pieces made of blocks
strided over the corpus (a candidate, patched in here only): the loss over one epoch and the
word-similarity scores.

The loader reads the corpus in pieces of ``chunk_tokens`` tokens and shuffles the pairs within
each piece. On a corpus that joins texts of different kinds, the loss jumps where a piece of
another kind starts. The candidate makes piece ``p`` of ``P`` from blocks ``p``, ``p + P``, ...
of ``chunk_tokens / 16`` tokens each, so every piece samples the whole corpus. Same corpus,
vocabulary, seed and recipe as bench_word2vec.py's host system; one epoch each, on any device.

    python benchmarks/bench_corpus_pieces.py --corpus corpus.txt.gz --eval-dir eval --out DIR
    python benchmarks/bench_corpus_pieces.py --quick
"""
from __future__ import annotations

import numpy as np
import torch

import harness
from nbtools.models import word2vec

BLOCKS = 16


def strided_piece(loader, piece: int) -> torch.Tensor:
    """Piece ``piece``'s token ids: blocks ``piece``, ``piece + P``, ... joined by sentence
    breaks (the corpus as it is where there is one piece)."""
    pieces = loader.num_pieces
    if pieces == 1:
        return loader.ids
    block = -(-loader.chunk_tokens // BLOCKS)
    parts = []
    for lo in range(piece * block, loader.ids.numel(), pieces * block):
        if parts:
            parts.append(loader.ids.new_full((1,), -1))
        parts.append(loader.ids[lo:lo + block])
    return torch.cat(parts)


def score(quality, test: str, measure: str) -> str:
    """One score of ``quality`` (harness.word_scores), or N/A where it has none."""
    got = (quality or {}).get(test) or {}
    return f"{got[measure]:.3f}" if isinstance(got.get(measure), float) else "N/A"


def main():
    ap = harness.parser(__doc__)
    harness.corpus_args(ap)
    ap.add_argument("--log-every", type=int, default=5, help="steps between logged losses")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    device = harness.setup(args)
    eval_dir, batch = args.eval_dir, 131072
    chunk = 1 << 22
    if args.quick:
        args.corpus, eval_dir, batch, chunk = harness.QUICK_CORPUS, None, 4096, 1 << 14
        args.log_every = 1
    lines, tokens = harness.read_corpus(args.corpus, args.max_tokens)
    ids, words, counts = harness.encode(lines, harness.W2V["min_count"])
    res = {"device": harness.device_name(device), "tokens": tokens, "vocab": len(words),
           "chunk_tokens": chunk, "runs": {}}
    plain = word2vec.CorpusLoader._piece_args
    for mode in ("in_order", "strided"):
        def piece_args(self, epoch, piece, seed=None, *, _plain=plain, _mode=mode):
            got, gen, key = _plain(self, epoch, piece, seed)
            return (got if _mode == "in_order" else strided_piece(self, piece)), gen, key
        word2vec.CorpusLoader._piece_args = piece_args
        try:
            model, _, train_s, history = harness.train_skipgram(
                ids, words, counts, "host", device, epochs=1, batch_size=batch,
                seed=args.seed, log_every=args.log_every, chunk_tokens=chunk)
        finally:
            word2vec.CorpusLoader._piece_args = plain
        loss = np.asarray(history["loss"], dtype=float)
        rises = np.diff(loss) if len(loss) > 1 else np.zeros(1)     # (a run of one step)
        res["runs"][mode] = {"train_s": train_s, "losses": loss.tolist(),
                             "last_loss": float(loss[-1]) if len(loss) else None,
                             "largest_rise": float(rises.max()),
                             "rises_over_0.05": int((rises > 0.05).sum()),
                             "quality": harness.word_scores(model, eval_dir)}
        del model
    harness.print_table(
        ["pieces", "largest rise", "rises > 0.05", "last loss", "WS353", "SimLex", "analogy"],
        [[m, f"{r['largest_rise']:.3f}", r["rises_over_0.05"], f"{r['last_loss'] or float('nan'):.3f}",
          *(score(r["quality"], k, v) for k, v in (("ws353", "spearman"),
                                                   ("simlex", "spearman"),
                                                   ("analogy", "accuracy")))]
         for m, r in res["runs"].items()],
        f"{tokens:,} tokens, {len(words):,} words, pieces of {chunk:,} tokens, one epoch, "
        f"logged every {args.log_every} steps")
    harness.save(args, "corpus_pieces.json", res)


if __name__ == "__main__":
    main()
