"""The ``@triton.jit`` functions of the fixed-order sum of each unique id's gradient rows
(launched by :func:`nbtools.kernels.segment_sum`): no atomics, so the same inputs give the
same bits on every run, whatever the GPU's scheduling (docs/reproducibility.md). Importing
this module imports Triton: :mod:`nbtools.kernels` loads it on the first launch.
"""
import triton
import triton.language as tl


# The rows are taken in sorted order (order: positions sorted by slot; slot: nondecreasing)
# and cut into chunks of CHUNK positions, whatever the runs of equal slots are.


@triton.jit
def _run_sum(a_new, a_val, b_new, b_val):
    # a segmented sum's step: a run that starts at b forgets what came before it
    return a_new | b_new, tl.where(b_new != 0, b_val, a_val + b_val)


@triton.jit
def _flag_nonfinite(found, acc, mask):
    # found[0] = 1.0 where a value of acc under mask is inf or nan (every program that
    # finds one stores the same value: no atomics needed)
    bad = tl.sum(tl.sum((mask & ~(tl.abs(acc) < float("inf"))).to(tl.int32), 1), 0)
    tl.store(found, 1.0, mask=bad > 0)


@triton.jit(do_not_specialize=["n", "cap"])
def segment_chunks(src, src_stride, src_cstride, order, slot, n, out, out_stride, cap,
                   part_first, part_last, d, found, CHUNK: tl.constexpr,
                   BLOCK_C: tl.constexpr, CHECK: tl.constexpr):
    # Pass 1, one program per chunk (and block of columns): the chunk's rows, loaded as one
    # tile (every load in flight at once), summed run by run by a segmented scan down the
    # tile (a fixed tree for the chunk's size). A run that begins and ends in the chunk is
    # written to out[slot]; the piece of a run that began in an earlier chunk goes to
    # part_first[chunk], the start of a run that goes on past the chunk to
    # part_last[chunk] (segment_join adds them up).
    # The program also zeroes its share of the rows of out that no position maps to (the
    # slots from the last one in use, slot[n - 1], up to cap), so out needs no memset.
    # CHECK: found[0] = 1.0 where a sum it writes to out is inf or nan (a run's pieces
    # are checked once segment_join has added them up).
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < d
    r = tl.arange(0, CHUNK)
    unused = tl.load(slot + n - 1) + 1 + c * CHUNK + r
    tl.store(out + unused[:, None] * out_stride + cols[None, :],
             tl.zeros([CHUNK, BLOCK_C], dtype=out.dtype.element_ty),
             mask=(unused < cap)[:, None] & cm[None, :])
    pc = c.to(tl.int64) * d                         # this chunk's row of the parts
    base = c * CHUNK + tl.zeros([CHUNK], dtype=tl.int32)  # (vectors: every mask is one)
    p = base + r
    live = p < n
    s = tl.load(slot + p, mask=live, other=-1)
    prev = tl.load(slot + p - 1, mask=live & (p > 0), other=-1)
    nxt = tl.load(slot + p + 1, mask=p + 1 < n, other=-2)
    row = tl.load(order + p, mask=live, other=0).to(tl.int64)
    m2 = live[:, None] & cm[None, :]
    v = tl.load(src + row[:, None] * src_stride + cols[None, :] * src_cstride, mask=m2,
                other=0.0).to(out.dtype.element_ty)
    new = (r == 0) | (s != prev)                    # a run starts at this position
    starts = (new[:, None] | ~m2).to(tl.int32)
    _, acc = tl.associative_scan((starts, v), 0, _run_sum)
    first = tl.load(slot + base)
    before = tl.load(slot + base - 1, mask=base > 0, other=-1)
    through = (base > 0) & (before == first) & (s == first)   # the run began earlier
    tail = live & (nxt != s)                        # the run ends here
    orow = s.to(tl.int64)[:, None] * out_stride + cols[None, :]
    whole = m2 & (tail & ~through)[:, None]
    tl.store(out + orow, acc, mask=whole)
    if CHECK:
        _flag_nonfinite(found, acc, whole)
    at_end = r == CHUNK - 1
    here = tl.zeros([CHUNK, BLOCK_C], dtype=tl.int64) + pc + cols[None, :]
    tl.store(part_first + here, acc, mask=m2 & (through & (tail | at_end))[:, None])
    tl.store(part_last + here, acc, mask=m2 & (at_end & ~tail & ~through)[:, None])


@triton.jit(do_not_specialize=["n", "chunks"])
def segment_join(slot, n, chunks, out, out_stride, part_first, part_last, d, found,
                 CHUNK: tl.constexpr, PARTS: tl.constexpr, BLOCK_C: tl.constexpr,
                 CHECK: tl.constexpr):
    # Pass 2, one program per chunk: where a run begins in this chunk and goes on past it,
    # its start (part_last) plus its pieces in the chunks after (part_first), PARTS
    # chunks at a time, each block summed by one fixed reduction tree.
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = cols < d
    base = c * CHUNK
    last = base + CHUNK - 1
    s = tl.load(slot + last, mask=last < n, other=-1)
    nxt = tl.load(slot + last + 1, mask=last + 1 < n, other=-2)
    first = tl.load(slot + base)
    before = tl.load(slot + base - 1, mask=base > 0, other=-1)
    through = (base > 0) & (before == first) & (first == s)   # one run from before
    start = (last + 1 < n) & (nxt == s) & ~through
    mask = tl.where(start, cm, False)
    acc = tl.load(part_last + c.to(tl.int64) * d + cols, mask=mask, other=0.0)
    k = c + 1
    go = start
    while go:
        ks = k + tl.arange(0, PARTS)
        inside = ks < chunks
        mine = inside & (tl.load(slot + ks * CHUNK, mask=inside, other=-1) == s)
        piece = tl.load(part_first + ks.to(tl.int64)[:, None] * d + cols[None, :],
                        mask=mine[:, None] & cm[None, :], other=0.0)
        acc = acc + tl.sum(piece, 0)
        k = k + PARTS
        go = tl.sum(mine.to(tl.int32), 0) == PARTS
    tl.store(out + s.to(tl.int64) * out_stride + cols, acc, mask=mask)
    if CHECK:
        _flag_nonfinite(found, acc[None, :], mask[None, :])
