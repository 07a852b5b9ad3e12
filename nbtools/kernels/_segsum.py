"""The fixed-order sum of each unique id's gradient rows (:func:`segment_sum`, two Triton
kernels): no atomics, so the same inputs give the same bits on every run, whatever the GPU's
scheduling (docs/reproducibility.md). An optimizer's ``collect`` sums a lookup's gradient rows
with it (``nbtools.store.rows.sum_by_slot``).

Apart from the step's kernels (:mod:`nbtools.kernels`, which re-exports :func:`segment_sum`,
:data:`SEGMENT_CHUNK` and :data:`SEGMENT_PARTS`) because it reads only gradients and a
lookup's sort, never a table's rows. Triton is imported on first use (:func:`_kernels`);
callers check :func:`nbtools.kernels.usable_on` first.
"""
from __future__ import annotations

import functools

import torch

from ..devices import on
from ._common import pow2, triton_cdiv


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    # The sum of each unique id's gradient rows, in a fixed order (segment_sum): no atomics,
    # so the same inputs give the same bits on every run. The rows are taken in sorted order
    # (order: positions sorted by slot; slot: nondecreasing) and cut into chunks of CHUNK
    # positions, whatever the runs of equal slots are.
    @triton.jit
    def _run_sum(a_new, a_val, b_new, b_val):
        # a segmented sum's step: a run that starts at b forgets what came before it
        return a_new | b_new, tl.where(b_new != 0, b_val, a_val + b_val)

    # Triton resolves a kernel's callees (and a scan's combine function) among the module's
    # globals, not this closure.
    globals()["_run_sum"] = _run_sum

    @triton.jit
    def _flag_nonfinite(found, acc, mask):
        # found[0] = 1.0 where a value of acc under mask is inf or nan (every program that
        # finds one stores the same value: no atomics needed)
        bad = tl.sum(tl.sum((mask & ~(tl.abs(acc) < float("inf"))).to(tl.int32), 1), 0)
        tl.store(found, 1.0, mask=bad > 0)

    globals()["_flag_nonfinite"] = _flag_nonfinite

    @triton.jit
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

    @triton.jit
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

    return {"segment_chunks": segment_chunks, "segment_join": segment_join}


# segment_sum: positions per program of its first pass, and chunks summed per reduction of its
# second (a run of r equal ids takes r / SEGMENT_CHUNK pieces, r / (SEGMENT_CHUNK *
# SEGMENT_PARTS) rounds of the second pass: 4 for the hottest id of 65,536 Zipf(1.1) ids).
SEGMENT_CHUNK = 32
SEGMENT_PARTS = 64


def segment_sum(src: torch.Tensor, order: torch.Tensor, slot: torch.Tensor,
                out: torch.Tensor, found: torch.Tensor | None = None) -> torch.Tensor:
    """``out[slot[j]] = sum of src[order[j]]`` over each run of equal ``slot[j]``, in a fixed
    order: the same bits on every run, whatever the GPU's scheduling (no atomics).

    ``src`` [n, d] (any strides); ``order`` [n]: positions of ``src`` sorted by their slot
    (stable: ascending within a slot); ``slot`` [n]: the slot of each sorted position,
    nondecreasing, every slot below the last one present (a RowBatch's ``order`` and
    ``slot``). ``out`` [cap, d] with a unit column stride, any contents: every row is written,
    the rows of slots past the last one with zeros. Runs are summed in chunks of
    :data:`SEGMENT_CHUNK` positions, in order within a chunk; a run spanning chunks adds its
    chunks' sums by a fixed tree. The association is fixed by ``n`` and the runs, so it is
    not ``index_add_``'s left-to-right order (it equals it for runs within one chunk).

    ``found`` (a float [1] on the device): set to 1.0 where a sum written is inf or nan, and
    left as it is otherwise, so the step's non-finite check needs no pass over ``out`` of its
    own. A sum is inf or nan wherever one of its terms is (IEEE arithmetic keeps them), and
    where finite terms overflow.
    """
    n, d = src.shape
    if n == 0 or d == 0:
        return out
    chunks = triton_cdiv(n, SEGMENT_CHUNK)
    block_c = min(256, pow2(d, 16))
    grid = (chunks, triton_cdiv(d, block_c))
    parts = torch.empty(2, chunks, d, dtype=out.dtype, device=out.device)
    warps = max(1, min(4, block_c // 32))
    k = _kernels()
    with on(out.device):
        k["segment_chunks"][grid](src, src.stride(0), src.stride(1), order, slot, n, out,
                                  out.stride(0), out.shape[0], parts[0], parts[1], d,
                                  out if found is None else found, CHUNK=SEGMENT_CHUNK,
                                  BLOCK_C=block_c, CHECK=found is not None, num_warps=warps)
        k["segment_join"][grid](slot, n, chunks, out, out.stride(0), parts[0], parts[1], d,
                                out if found is None else found, CHUNK=SEGMENT_CHUNK,
                                PARTS=SEGMENT_PARTS, BLOCK_C=block_c, CHECK=found is not None,
                                num_warps=warps)
    return out

