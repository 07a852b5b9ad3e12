"""Triton kernels of the training step: the row gather of a lookup, and fused optimizer updates
that read a row's weight and state, apply the update and write the row back in one pass.

Why kernels of our own (measured on an H100, benchmarks/RESULTS.md):

* A lookup deduplicates its ids on the GPU without asking the host how many are unique (that
  question is a host synchronisation). The unique ids sit in a buffer of fixed capacity with
  their count in GPU memory; :func:`gather_rows` reads only the first ``count`` rows and writes
  zeros for the rest, so no row crosses PCIe for nothing.
* A stock optimizer on gathered rows costs ~10 kernels per state tensor plus the write-back;
  the fused updates do the same arithmetic, in the same order as ``torch.optim``, in one kernel
  per table that also writes ``[weight | state]`` straight into host memory (zero-copy) or into
  the GPU-placed table.

Triton is imported on first use, so ``import nbtools`` stays light; without Triton (or on the
CPU) callers use the equivalent torch code. With ``TRITON_INTERPRET=1`` the same kernels run on
CPU tensors, which is how CPU CI checks them against ``torch.optim``.

Two other kernel modules hold what shares nothing with a table's rows on the device, and this
one re-exports their names: :mod:`nbtools.kernels._admission` (the GPU cache's admission, :func:`admit`,
:data:`CACHE_HASH`) and :mod:`nbtools.kernels._segsum` (the fixed-order gradient sum,
:func:`segment_sum`). :mod:`nbtools.kernels._common` holds what all three share (:func:`usable_on`,
:func:`triton_ok`, the grid arithmetic).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from . import _admission as admission
from . import _segsum as segsum
from ..devices import on
from ._admission import CACHE_HASH, admit  # noqa: F401  (re-exported: nbtools.store.cache uses both)
from ._common import pow2, triton_cdiv, triton_ok, usable_on  # noqa: F401  (re-exported)
from ._segsum import SEGMENT_CHUNK, SEGMENT_PARTS, segment_sum  # noqa: F401  (re-exported)


@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gather(src, src_stride, col0, ids, count_ptr, n_rows, out, out_stride, cap, width,
               cache, cache_stride, slots, row_blocks,
               HAS_CACHE: tl.constexpr, KEEP: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr):
        # out[r] = src[ids[r], col0:col0 + width] for r < count and 0 <= ids[r] < n_rows;
        # zeros for every other row below cap. HAS_CACHE: rows with slots[r] >= 0 are read
        # from cache[slots[r]] instead (the GPU copy of a hot row). Each program takes every
        # num_programs(0)-th block of rows (one block each, unless the grid was capped).
        # KEEP: rows not read are left as they are in out (not zeroed).
        for rb in range(tl.program_id(0), row_blocks, tl.num_programs(0)):
            _gather_block(src, src_stride, col0, ids, count_ptr, n_rows, out, out_stride, cap,
                          width, cache, cache_stride, slots, rb, HAS_CACHE, KEEP, BLOCK_R,
                          BLOCK_C)

    @triton.jit
    def _gather_block(src, src_stride, col0, ids, count_ptr, n_rows, out, out_stride, cap,
                      width, cache, cache_stride, slots, rb, HAS_CACHE: tl.constexpr,
                      KEEP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        count = tl.load(count_ptr)
        live = r < count
        idx = tl.load(ids + r, mask=live, other=-1)
        ok = live & (idx >= 0) & (idx < n_rows)
        cmask = c < width
        if HAS_CACHE:
            slot = tl.load(slots + r, mask=ok, other=-1).to(tl.int64)
            hot = ok & (slot >= 0)
            vals = tl.load(src + idx[:, None] * src_stride + col0 + c[None, :],
                           mask=(ok & (slot < 0))[:, None] & cmask[None, :], other=0.0)
            hv = tl.load(cache + slot[:, None] * cache_stride + col0 + c[None, :],
                         mask=hot[:, None] & cmask[None, :], other=0.0)
            vals = tl.where(hot[:, None], hv, vals)
        else:
            vals = tl.load(src + idx[:, None] * src_stride + col0 + c[None, :],
                           mask=ok[:, None] & cmask[None, :], other=0.0)
        if KEEP:
            tl.store(out + r[:, None] * out_stride + c[None, :], vals,
                     mask=ok[:, None] & cmask[None, :])
        else:
            tl.store(out + r[:, None] * out_stride + c[None, :], vals,
                     mask=(r < cap)[:, None] & cmask[None, :])

    @triton.jit
    def put(dst, dst_stride, ids, count_ptr, guard_ptr, n_rows, src, src_stride, cap, width,
            row_blocks, HAS_GUARD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # gather's mirror: dst[ids[r]] = src[r] for r < count and 0 <= ids[r] < n_rows (nothing
        # when HAS_GUARD and the guard is set). Each program takes every num_programs(0)-th
        # block of rows.
        count = tl.load(count_ptr)
        if HAS_GUARD:
            count = tl.where(tl.load(guard_ptr) == 0, count, 0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < width
        for rb in range(tl.program_id(0), row_blocks, tl.num_programs(0)):
            r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
            live = r < count
            idx = tl.load(ids + r, mask=live, other=-1)
            mask = (live & (idx >= 0) & (idx < n_rows))[:, None] & cmask[None, :]
            vals = tl.load(src + r[:, None] * src_stride + c[None, :], mask=mask)
            tl.store(dst + idx[:, None] * dst_stride + c[None, :], vals, mask=mask)

    @triton.jit
    def patch(out, out_stride, ids, count_ptr, n_rows, src, src_stride, src_ids, src_count_ptr,
              width, steps, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # out[r] = src[j] where src_ids[j] == ids[r], for r < count, ids in range and j <
        # src_count; other rows of out untouched. src_ids is sorted: a binary search of
        # ``steps`` halvings (steps >= log2(len(src_ids) + 1)).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        live = r < tl.load(count_ptr)
        x = tl.load(ids + r, mask=live, other=-1)
        live = live & (x >= 0) & (x < n_rows)
        m = tl.load(src_count_ptr)
        lo = tl.zeros_like(x)
        hi = lo + m
        for _ in range(steps):
            go = live & (lo < hi)
            mid = (lo + hi) // 2
            below = tl.load(src_ids + mid, mask=go, other=0) < x
            lo = tl.where(go & below, mid + 1, lo)
            hi = tl.where(go & ~below, mid, hi)
        found = live & (lo < m)
        found = found & (tl.load(src_ids + lo, mask=found, other=-1) == x)
        mask = found[:, None] & (c < width)[None, :]
        vals = tl.load(src + lo[:, None] * src_stride + c[None, :], mask=mask)
        tl.store(out + r[:, None] * out_stride + c[None, :], vals, mask=mask)

    @triton.jit
    def copy(src, src_stride, sidx, dst, dst_stride, didx, cap, width,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # dst[didx[r]] = src[sidx[r]] for r < cap where both are >= 0 (whole rows).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        s = tl.load(sidx + r, mask=r < cap, other=-1).to(tl.int64)
        t = tl.load(didx + r, mask=r < cap, other=-1).to(tl.int64)
        mask = ((s >= 0) & (t >= 0))[:, None] & (c < width)[None, :]
        vals = tl.load(src + s[:, None] * src_stride + c[None, :], mask=mask, other=0.0)
        tl.store(dst + t[:, None] * dst_stride + c[None, :], vals, mask=mask)

    @triton.jit
    def take(src, src_stride, idx, n, out, out_stride, width,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # out[r] = src[idx[r]] for r < n, converted to out's dtype (a lookup's rows in the
        # order of its ids, upcast from their storage dtype in the same pass).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        live = r < n
        s = tl.load(idx + r, mask=live, other=0).to(tl.int64)
        mask = live[:, None] & (c < width)[None, :]
        vals = tl.load(src + s[:, None] * src_stride + c[None, :], mask=mask, other=0.0)
        tl.store(out + r.to(tl.int64)[:, None] * out_stride + c[None, :],
                 vals.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _tile(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
              dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
              cache_w_stride, slots, n_rows, cap, d, HAS_CACHE: tl.constexpr,
              MAXIMIZE: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr):
        # This program's rows and columns: where to read the state (src, in the gathered rows)
        # and where to write it (out, in the table; cout, in the cache for hot rows), the same
        # for the weights (whose storage may be narrower: bf16 weights, fp32 state), which
        # rows are live and go to the table (hmask) or to the cache (cmask), the weights and
        # the gradients (fp32, negated to maximize).
        # Rows past the count, the sentinel, and every row when the guard is set: untouched.
        # IN_PLACE: the rows are written where they were read, the gathered rows in GPU
        # memory (a write-back to the table follows: RowStore.write_behind).
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        idx = tl.load(ids + r, mask=r < cap, other=-1)
        count = tl.where(tl.load(guard_ptr) == 0, tl.load(count_ptr), 0)
        live = (r < count) & (idx >= 0) & (idx < n_rows)
        mask = live[:, None] & (c < d)[None, :]
        src = rows + r[:, None] * rows_stride + c[None, :]
        if IN_PLACE:
            out = src
            out_w = rows_w + r[:, None] * rows_w_stride + c[None, :]
        else:
            out = dst + idx[:, None] * dst_stride + c[None, :]
            out_w = dst_w + idx[:, None] * dst_w_stride + c[None, :]
        if HAS_CACHE:
            slot = tl.load(slots + r, mask=live, other=-1).to(tl.int64)
            cout = cache + slot[:, None] * cache_stride + c[None, :]
            cout_w = cache_w + slot[:, None] * cache_w_stride + c[None, :]
            hmask = mask & (slot < 0)[:, None]
            cmask = mask & (slot >= 0)[:, None]
        else:
            cout = out
            cout_w = out_w
            hmask = mask
            cmask = mask
        g = tl.load(grad + r[:, None] * grad_stride + c[None, :], mask=mask, other=0.0)
        g = g.to(tl.float32)
        if MAXIMIZE:
            g = -g
        p = tl.load(rows_w + r[:, None] * rows_w_stride + c[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        elem = idx[:, None] * d + c[None, :]          # each value's own index: rounding noise
        return src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem

    # An update's scalars (learning rate, betas, bias corrections, ...) and its rounding seed
    # are read from memory, float64 [HYPER]: the host writes them each step where the kernel
    # reads them (pinned host memory on CUDA), so a step queued once as a CUDA graph replays
    # with this step's values. A float64 value cast to float32 here is the value a float
    # argument would have been.
    @triton.jit
    def _scalar(hyper, i):
        return tl.load(hyper + i).to(tl.float32)

    @triton.jit
    def _seed(hyper):
        return tl.load(hyper + 7).to(tl.int32)

    @triton.jit
    def _put(out, cout, hmask, cmask, off, val, seed, salt, elem, ROUND: tl.constexpr,
             HAS_CACHE: tl.constexpr):
        # Write one column block of the rows, rounded to the storage dtype, to the table, or
        # to the cache for hot rows. ROUND 0: a plain cast; 1: bf16, to nearest, ties to even
        # (spelled out: Triton's interpreter truncates); 2: bf16, stochastic (up with
        # probability = the fraction dropped; the noise depends on the row id, not on where
        # the row lives, so a cache changes nothing).
        if ROUND == 1:
            bits = val.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            val = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
        if ROUND == 2:
            noise = tl.randint(seed + salt, elem.to(tl.uint32)) & 0xFFFF
            bits = val.to(tl.uint32, bitcast=True)
            val = (((bits + noise) >> 16) << 16).to(tl.float32, bitcast=True)
        val = val.to(out.dtype.element_ty)
        tl.store(out + off, val, mask=hmask)
        if HAS_CACHE:
            tl.store(cout + off, val, mask=cmask)

    # Triton resolves a kernel's callees among the module's globals (not this closure), and
    # the kernels are made here so that Triton is imported only when first used.
    globals()["_tile"] = _tile
    globals()["_put"] = _put
    globals()["_scalar"] = _scalar
    globals()["_seed"] = _seed
    globals()["_gather_block"] = _gather_block

    # The updates. Every one reads the weights through rows_w and writes them through dst_w /
    # cache_w (their storage dtype, maybe narrower than the state's), and the state k
    # (1-based) at column s0 + (k - 1) * d of the [weight | state...] rows; ROUND_W /
    # ROUND_S: how the weights / the state are rounded to their storage (see _put).
    @triton.jit
    def sgd(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride, dst_w,
            dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w, cache_w_stride,
            slots, n_rows, cap, d, s0, hyper,
            MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, HAS_WD: tl.constexpr,
            ROUND_W: tl.constexpr, ROUND_S: tl.constexpr, HAS_CACHE: tl.constexpr,
            MAXIMIZE: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_C: tl.constexpr):
        src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem = _tile(
            rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
            dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
            cache_w_stride, slots, n_rows, cap, d, HAS_CACHE, MAXIMIZE, IN_PLACE, BLOCK_R,
            BLOCK_C)
        lr, momentum, wd = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
        seed = _seed(hyper)
        if HAS_WD:
            g = g + wd * p
        if MOMENTUM:
            buf = tl.load(src + s0, mask=mask, other=0.0).to(tl.float32)
            buf = buf * momentum + g
            _put(out, cout, hmask, cmask, s0, buf, seed, 1, elem, ROUND_S, HAS_CACHE)
            if NESTEROV:
                g = g + momentum * buf
            else:
                g = buf
        p = p - lr * g
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)

    @triton.jit
    def adam(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride, dst_w,
            dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w, cache_w_stride,
            slots, n_rows, cap, d, s0, hyper,
             M_COL: tl.constexpr, V_COL: tl.constexpr, VMAX_COL: tl.constexpr,
             DECOUPLED: tl.constexpr, HAS_WD: tl.constexpr, AMSGRAD: tl.constexpr,
             SPARSE: tl.constexpr, ROUND_W: tl.constexpr, ROUND_S: tl.constexpr,
             HAS_CACHE: tl.constexpr,
            MAXIMIZE: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_C: tl.constexpr):
        src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem = _tile(
            rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
            dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
            cache_w_stride, slots, n_rows, cap, d, HAS_CACHE, MAXIMIZE, IN_PLACE, BLOCK_R,
            BLOCK_C)
        # Adam / AdamW as torch.optim.Adam computes them; SPARSE: as torch.optim.SparseAdam.
        # M_COL etc.: which state (1-based) holds exp_avg, exp_avg_sq, max_exp_avg_sq. Every
        # scalar torch derives in Python floats (1 - beta1, 1 - beta2, 1 - lr * wd, the bias
        # corrections) comes from the host, computed in float64 (adam_scalars): in float32
        # here, 1 - float32(0.999) would scale each g^2 by 0.00099998713, not 0.001.
        one_minus_beta1, beta2 = _scalar(hyper, 0), _scalar(hyper, 1)
        one_minus_beta2, eps = _scalar(hyper, 2), _scalar(hyper, 3)
        wd = _scalar(hyper, 4)          # L2: weight_decay; DECOUPLED: 1 - lr * weight_decay
        step_size, bc2_sqrt = _scalar(hyper, 5), _scalar(hyper, 6)
        seed = _seed(hyper)
        ea = tl.load(src + s0 + (M_COL - 1) * d, mask=mask, other=0.0).to(tl.float32)
        eq = tl.load(src + s0 + (V_COL - 1) * d, mask=mask, other=0.0).to(tl.float32)
        if SPARSE:
            ea = ea + (g - ea) * one_minus_beta1
            eq = eq + (g * g - eq) * one_minus_beta2
            p = p + (-step_size) * (ea / (tl.sqrt(eq) + eps))
        else:
            if HAS_WD:
                if DECOUPLED:
                    p = p * wd
                else:
                    g = g + wd * p
            ea = ea + one_minus_beta1 * (g - ea)      # torch.lerp for weights below 0.5
            eq = eq * beta2 + one_minus_beta2 * g * g     # torch.addcmul: value * t1 * t2
            if AMSGRAD:
                vmax = tl.load(src + s0 + (VMAX_COL - 1) * d, mask=mask,
                               other=0.0).to(tl.float32)
                vmax = tl.maximum(vmax, eq)
                _put(out, cout, hmask, cmask, s0 + (VMAX_COL - 1) * d, vmax, seed, VMAX_COL,
                     elem, ROUND_S, HAS_CACHE)
                denom = tl.sqrt(vmax) / bc2_sqrt + eps
            else:
                denom = tl.sqrt(eq) / bc2_sqrt + eps
            p = p + (-step_size) * (ea / denom)
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask, cmask, s0 + (M_COL - 1) * d, ea, seed, M_COL, elem, ROUND_S,
             HAS_CACHE)
        _put(out, cout, hmask, cmask, s0 + (V_COL - 1) * d, eq, seed, V_COL, elem, ROUND_S,
             HAS_CACHE)

    @triton.jit
    def adagrad(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride, dst_w,
            dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w, cache_w_stride,
            slots, n_rows, cap, d, s0, hyper,
                HAS_WD: tl.constexpr, ROUND_W: tl.constexpr, ROUND_S: tl.constexpr,
                HAS_CACHE: tl.constexpr,
            MAXIMIZE: tl.constexpr, IN_PLACE: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_C: tl.constexpr):
        src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem = _tile(
            rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
            dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
            cache_w_stride, slots, n_rows, cap, d, HAS_CACHE, MAXIMIZE, IN_PLACE, BLOCK_R,
            BLOCK_C)
        clr, wd, eps = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
        seed = _seed(hyper)
        s = tl.load(src + s0, mask=mask, other=0.0).to(tl.float32)
        if HAS_WD:
            g = g + wd * p
        s = s + g * g
        p = p + (-clr) * (g / (tl.sqrt(s) + eps))
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask, cmask, s0, s, seed, 1, elem, ROUND_S, HAS_CACHE)

    # The row-wise updates (nbtools.rowwise). A program holds whole rows, the row in one
    # column block (FusedUpdate.whole_row), so a row's mean(g^2) is one sum over its tile,
    # with no second pass and no exchange between programs. The per-row state is one column
    # wide: read and written in the tile's first column only (FIRST).
    @triton.jit
    def _row_value(src, off, mask, first):
        # [BLOCK_R] float32: each row's value at column `off` of its row (a one-column state)
        return tl.sum(tl.load(src + off, mask=mask & first, other=0.0).to(tl.float32), 1)

    globals()["_row_value"] = _row_value

    @triton.jit
    def _halve(x, R: tl.constexpr, C: tl.constexpr):
        # [R, C] -> [R, C // 2]: each pair of neighbouring columns added (one addition each,
        # so the result does not depend on how Triton lays the tile out over threads)
        a, b = tl.split(tl.reshape(x, [R, C // 2, 2]))
        return a + b

    globals()["_halve"] = _halve

    @triton.jit
    def _row_sum_sq(g, R: tl.constexpr, C: tl.constexpr):
        # [R] float32: each row's sum of g^2 as a pairwise tree over neighbouring columns
        # (16 <= C <= 65536, a power of two; masked columns are zeros). tl.sum's order
        # follows the tile's layout, which Triton picks from the strides of everything the
        # kernel loads: a 260-byte disk row and a 288-byte padded RAM row summed the same
        # gradient differently. nbtools.rowwise._mean_sq adds in this same order.
        # the first level as an explicit FMA (a*a + b*b, a's square unrounded): left to the
        # compiler, whether a square fuses into its addition depended on where Triton moved
        # the tile between threads (a 100-wide row's state differed by an ulp between a disk
        # table and the same table in RAM)
        a, b = tl.split(tl.reshape(g, [R, C // 2, 2]))
        x = tl.fma(a, a, b * b)
        x = _halve(x, R, C // 2)
        x = _halve(x, R, C // 4)
        x = _halve(x, R, C // 8)
        if C >= 32:
            x = _halve(x, R, C // 16)
        if C >= 64:
            x = _halve(x, R, C // 32)
        if C >= 128:
            x = _halve(x, R, C // 64)
        if C >= 256:
            x = _halve(x, R, C // 128)
        if C >= 512:
            x = _halve(x, R, C // 256)
        if C >= 1024:
            x = _halve(x, R, C // 512)
        if C >= 2048:
            x = _halve(x, R, C // 1024)
        if C >= 4096:
            x = _halve(x, R, C // 2048)
        if C >= 8192:
            x = _halve(x, R, C // 4096)
        if C >= 16384:
            x = _halve(x, R, C // 8192)
        if C >= 32768:
            x = _halve(x, R, C // 16384)
        if C >= 65536:
            x = _halve(x, R, C // 32768)
        return tl.reshape(x, [R])

    globals()["_row_sum_sq"] = _row_sum_sq

    @triton.jit
    def rowwise_adagrad(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst,
                        dst_stride, dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache,
                        cache_stride, cache_w, cache_w_stride, slots, n_rows, cap, d, s0, hyper,
                        HAS_WD: tl.constexpr, ROUND_W: tl.constexpr, ROUND_S: tl.constexpr,
                        HAS_CACHE: tl.constexpr, MAXIMIZE: tl.constexpr, IN_PLACE: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # RowWiseAdagrad: s += sum(g^2) / d per row (state "sum", one column at s0), then
        # w -= lr * g / (sqrt(s) + eps).
        src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem = _tile(
            rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
            dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
            cache_w_stride, slots, n_rows, cap, d, HAS_CACHE, MAXIMIZE, IN_PLACE, BLOCK_R,
            BLOCK_C)
        lr, wd, eps = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
        seed = _seed(hyper)
        first = (tl.arange(0, BLOCK_C) == 0)[None, :]
        if HAS_WD:
            g = g + wd * p
        s = _row_value(src, s0, mask, first) + _row_sum_sq(g, BLOCK_R, BLOCK_C) / d
        p = p + (-lr) * (g / (tl.sqrt(s)[:, None] + eps))
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask & first, cmask & first, s0, s[:, None] + tl.zeros_like(p), seed,
             1, elem, ROUND_S, HAS_CACHE)

    @triton.jit
    def partial_rowwise_adam(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst,
                             dst_stride, dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache,
                             cache_stride, cache_w, cache_w_stride, slots, n_rows, cap, d, s0,
                             hyper, HAS_WD: tl.constexpr, ROUND_W: tl.constexpr,
                             ROUND_S: tl.constexpr, HAS_CACHE: tl.constexpr,
                             MAXIMIZE: tl.constexpr, IN_PLACE: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # PartialRowWiseAdam, in the order of operations of nbtools.rowwise: exp_avg (d
        # columns at s0) per value, exp_avg_sq (one column at s0 + d) per row.
        src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem = _tile(
            rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
            dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
            cache_w_stride, slots, n_rows, cap, d, HAS_CACHE, MAXIMIZE, IN_PLACE, BLOCK_R,
            BLOCK_C)
        one_minus_beta1, beta2 = _scalar(hyper, 0), _scalar(hyper, 1)
        one_minus_beta2, eps = _scalar(hyper, 2), _scalar(hyper, 3)
        decay, step_size, bc2_sqrt = _scalar(hyper, 4), _scalar(hyper, 5), _scalar(hyper, 6)
        seed = _seed(hyper)
        first = (tl.arange(0, BLOCK_C) == 0)[None, :]
        ea = tl.load(src + s0, mask=mask, other=0.0).to(tl.float32)
        v = _row_value(src, s0 + d, mask, first)
        if HAS_WD:
            p = p * decay                              # decay = 1 - lr * weight_decay
        ea = ea + one_minus_beta1 * (g - ea)          # torch.lerp for weights below 0.5
        v = tl.fma(v, beta2, one_minus_beta2 * (_row_sum_sq(g, BLOCK_R, BLOCK_C) / d))
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p + (-step_size) * (ea / denom[:, None])
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask, cmask, s0, ea, seed, 1, elem, ROUND_S, HAS_CACHE)
        _put(out, cout, hmask & first, cmask & first, s0 + d, v[:, None] + tl.zeros_like(p),
             seed, 2, elem, ROUND_S, HAS_CACHE)

    return {"gather": gather, "put": put, "patch": patch, "copy": copy, "take": take, "sgd": sgd,
            "adam": adam, "adagrad": adagrad,
            "rowwise_adagrad": rowwise_adagrad, "partial_rowwise_adam": partial_rowwise_adam,
            **admission._kernels(), **segsum._kernels()}     # every kernel, by name


# Tile shapes, (rows, columns, warps) per program, by kernel kind ("gather", "put", "patch",
# "copy", "update"); a kind left out uses _blocks. benchmarks/experiments/zero_copy_tiles.py times the
# choices.
TILES: dict = {}


def _blocks(width: int, kind: str = "") -> tuple[int, int, int]:
    if kind in TILES:
        return TILES[kind]
    block_c = min(1024, pow2(width, 16))
    return max(1, 4096 // block_c), block_c, 4


# Grid caps of the kernels that move rows over PCIe (0: one program per block of rows). Reads
# and writes share the link: with a write-back running behind the next step's gather, their
# shares follow their programs, and 32 gather programs beside 16 writing ones brought the
# 65,536-id step to the traffic floor, where 264 beside 16 stayed 1.2x above it (sweep in
# benchmarks/RESULTS.md, benchmarks/experiments/write_behind.py --real). 32 programs also
# keep the link busy alone, and leave the SMs to kernels running beside them. A gather
# through a cache of hot rows reads most rows from GPU memory, which takes more programs:
# two per SM (word2vec with 75% of its rows cached: 0.71x the GPU-placed model's speed on 32
# programs, 0.85-0.91x on two per SM).
ZERO_COPY_PROGRAMS = 32       # a gather from pinned host memory
CACHED_PER_SM = 2             # ... through a cache of hot rows, programs per SM
WRITE_BEHIND_PROGRAMS = 16    # a write-back behind the next step (RowStore.write_behind)


@functools.lru_cache(maxsize=None)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def zero_copy_programs(device: torch.device, cached: bool = False) -> int | None:
    """The grid cap of a gather from pinned host memory: :data:`ZERO_COPY_PROGRAMS`
    programs, each looping over blocks of rows, or :data:`CACHED_PER_SM` per SM for a
    gather through a cache of hot rows (None off CUDA, or uncapped)."""
    if device.type != "cuda" or not ZERO_COPY_PROGRAMS:
        return None
    return CACHED_PER_SM * _sms(device) if cached else ZERO_COPY_PROGRAMS


def gather_rows(src: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, out: torch.Tensor,
                col0: int = 0, cache: torch.Tensor | None = None,
                slots: torch.Tensor | None = None, programs: int | None = None,
                keep: bool = False) -> torch.Tensor:
    """``out[r] = src[ids[r], col0:col0 + out.shape[1]]`` for ``r < count`` and ids in range;
    zero rows elsewhere. ``count`` is a one-element tensor on the GPU: no host sync. With a
    ``cache``, rows whose ``slots[r] >= 0`` are read from ``cache[slots[r]]`` instead.

    ``src`` is 2-D with unit column stride (a zero-copy view of host memory, or a GPU tensor).
    ``programs``: at most this many programs per column block, each looping over blocks of
    rows. A gather from host memory spends its time waiting on PCIe; uncapped, its waiting
    programs fill every SM and kernels running beside it (a prefetch's gather beside the
    step's compute) cannot start until it ends. ``keep``: rows not read (past ``count``, out
    of range) keep what ``out`` held instead of becoming zeros.
    """
    cap, width = out.shape
    if cap == 0:
        return out
    result = out
    has_cache = cache is not None
    (src, out, *cached), (col0, width) = _as_vectors(
        [src, out] + ([cache] if has_cache else []), (col0, width))
    cache = cached[0] if has_cache else None
    block_r, block_c, warps = _blocks(width, "gather")
    row_blocks = triton_cdiv(cap, block_r)
    grid = (min(row_blocks, programs or row_blocks), triton_cdiv(width, block_c))
    with on(ids.device):
        _kernels()["gather"][grid](src, src.stride(0), col0, ids, count, src.shape[0], out,
                                   out.stride(0), cap, width, cache if has_cache else src,
                                   cache.stride(0) if has_cache else 0,
                                   slots if has_cache else ids, row_blocks, HAS_CACHE=has_cache,
                                   KEEP=keep,
                                   BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return result


# Row copies (the gather, the write-back, the patch, the row copy) move bits, not numbers, so
# they may see a row as 4-byte or 2-byte integers instead of its dtype. Triton loads and stores
# a row in 16-byte vectors only where it knows the row stride is a multiple of 16 values (it
# specialises integer arguments divisible by 16), else a value at a time, and a gather from
# pinned memory waits on PCIe for each. 288-byte rows (bf16 weights with RowWiseAdagrad's fp32
# accumulator, padded) are 72 fp32 values, not a multiple of 16, but 144 2-byte ones: as
# those, 65,536 of them were gathered in 0.70x the time and written back in 0.87x; 544-byte
# rows (fp32 RowWiseAdagrad) in 0.87x and 0.95x; 768- and 1,536-byte rows alike either way
# (H200, benchmarks/experiments/gather_words.py, benchmarks/RESULTS.md session 23).
#
# VECTOR_VIEWS: the row copies that see rows this way; the others see them as their own dtype,
# as before session 23 (2-byte rows written back as 4-byte words). Not the write-back: alone
# it was faster as vectors too, but in the step, beside the next gather, the steps whose
# write-back kept its old view were faster (alternating loops, H200, 4 rounds: bf16
# RowWiseAdagrad 0.94x, fp32 0.86x, bf16 with bf16 state 0.97x). Both timed by
# benchmarks/experiments/prefetch_overlap.py --toggle vector_views / vector_puts.
_VECTOR_UNITS = (torch.int32, torch.int16)
ROW_COPIES = frozenset({"gather", "put", "patch", "copy"})
VECTOR_VIEWS = ROW_COPIES - {"put"}


def _as_vectors(tensors: list, cols: tuple = (), kind: str = "gather") -> tuple[list, tuple]:
    """``tensors`` (2-D rows of one dtype, unit column stride) seen as the first of
    :data:`_VECTOR_UNITS` in which every row stride is a multiple of 16 values, and ``cols``
    (column offsets and counts) in that unit (``kind``: which copy, "gather", "put", "patch"
    or "copy", one of :data:`VECTOR_VIEWS`). Where none is and ``kind`` is "put",
    2-byte rows are seen as 4-byte words where they can be: a program of a capped grid moves
    a block of 4,096 values per turn, whatever their size (bf16 rows' write-back took 2.27 ms
    a step for 38 MB where fp32's took 2.81 ms for 76 MB, H100 profile in
    benchmarks/RESULTS.md). Else unchanged."""
    dtype = tensors[0].dtype
    size = tensors[0].element_size()
    if dtype.is_complex or any(t.dtype != dtype or t.dim() != 2 or t.stride(1) != 1
                               for t in tensors):
        return tensors, cols

    def fits(unit, vectors):
        e = unit.itemsize
        return all((t.stride(0) * size) % (e * (16 if vectors else 1)) == 0
                   and (t.shape[1] * size) % e == 0 and (t.storage_offset() * size) % e == 0
                   for t in tensors) and all((c * size) % e == 0 for c in cols)
    unit = next((u for u in _VECTOR_UNITS if fits(u, True)), None) \
        if kind in VECTOR_VIEWS else None
    if unit is None and kind == "put" and size == 2 and fits(torch.int32, False):
        unit = torch.int32
    if unit is None or unit == dtype:
        return tensors, cols
    return [t.view(unit) for t in tensors], tuple(c * size // unit.itemsize for c in cols)


def put_rows(dst: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, src: torch.Tensor,
             guard: torch.Tensor | None = None, programs: int | None = None) -> None:
    """``dst[ids[r]] = src[r]`` for ``r < count`` and ids in range (:func:`gather_rows`'
    mirror; ``count`` is a one-element tensor on the GPU); nothing when ``guard`` (the same)
    is nonzero. ``programs`` caps the grid as for :func:`gather_rows`."""
    cap, width = src.shape
    if cap == 0:
        return
    (dst, src), _ = _as_vectors([dst, src], kind="put")
    width = src.shape[1]
    block_r, block_c, warps = _blocks(width, "put")
    row_blocks = triton_cdiv(cap, block_r)
    grid = (min(row_blocks, programs or row_blocks), triton_cdiv(width, block_c))
    with on(ids.device):
        _kernels()["put"][grid](dst, dst.stride(0), ids, count, count if guard is None else guard,
                                dst.shape[0], src, src.stride(0), cap, width, row_blocks,
                                HAS_GUARD=guard is not None, BLOCK_R=block_r, BLOCK_C=block_c,
                                num_warps=warps)


def patch_rows(out: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, num_rows: int,
               src: torch.Tensor, src_ids: torch.Tensor, src_count: torch.Tensor) -> None:
    """``out[r] = src[j]`` wherever ``ids[r] == src_ids[j]`` (``r < count``, ``j <
    src_count``, ``0 <= ids[r] < num_rows``); the other rows of ``out`` keep their values.
    ``src_ids`` is sorted (a lookup's unique ids); counts are one-element GPU tensors."""
    cap, width = out.shape
    if cap == 0 or src_ids.numel() == 0:
        return
    (out, src), (width,) = _as_vectors([out, src], (width,), "patch")
    block_r, block_c, warps = _blocks(width, "patch")
    grid = (triton_cdiv(cap, block_r), triton_cdiv(width, block_c))
    steps = max(1, math.ceil(math.log2(src_ids.numel() + 1)))
    with on(ids.device):
        _kernels()["patch"][grid](out, out.stride(0), ids, count, num_rows, src, src.stride(0),
                                  src_ids, src_count, width, steps, BLOCK_R=block_r,
                                  BLOCK_C=block_c, num_warps=warps)


def copy_rows(src: torch.Tensor, sidx: torch.Tensor, dst: torch.Tensor,
              didx: torch.Tensor) -> None:
    """``dst[didx[r]] = src[sidx[r]]`` (whole rows) wherever both indices are >= 0; rows with a
    negative index are skipped, so a fixed-size index list needs no host sync to trim it."""
    cap, width = sidx.numel(), dst.shape[1]
    if cap == 0:
        return
    (src, dst), (width,) = _as_vectors([src, dst], (width,), "copy")
    block_r, block_c, warps = _blocks(width, "copy")
    grid = (triton_cdiv(cap, block_r), triton_cdiv(width, block_c))
    with on(sidx.device):
        _kernels()["copy"][grid](src, src.stride(0), sidx, dst, dst.stride(0), didx, cap, width,
                                 BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


def take_rows(src: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src.index_select(0, idx).to(dtype)`` in one kernel: a new [len(idx), d] tensor of
    ``dtype``. ``src`` is 2-D with unit column stride (a lookup's gathered weights, a view of
    its [weight | state] rows); every ``idx`` is a row of it. One read of the rows in their
    storage dtype and one write of the result, where index_select and an upcast read and write
    the reordered rows once more (bf16 weights: 65,536 x 128 of them, 41 + 22 us, H200)."""
    n, width = idx.numel(), src.shape[1]
    out = torch.empty(n, width, dtype=dtype, device=src.device)
    if n == 0 or width == 0:
        return out
    block_r, block_c, warps = _blocks(width, "take")
    grid = (triton_cdiv(n, block_r), triton_cdiv(width, block_c))
    with on(idx.device):
        _kernels()["take"][grid](src, src.stride(0), idx, n, out, out.stride(0), width,
                                 BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


@dataclasses.dataclass
class Target:
    """Where a fused update writes its rows.

    ``view``: the table's [N, W] rows as the GPU reaches them (zero-copy host memory or a GPU
    tensor); ``view_w``: their weights as stored ([N, d], maybe a narrower dtype packed into
    the first columns). For rows held in a GPU cache of hot rows: ``cache`` [C, W],
    ``cache_w`` and ``slots`` [capacity] (the cache slot of each unique id, -1 for rows
    written to the table). ``state_col``: the first state column; ``rounding``: how
    low-precision values are rounded (stochastic rounding's seed is a scalar: :data:`HYPER`).
    ``in_place``: the update writes each row where it read it, into the gathered rows (which
    ``view`` / ``view_w`` then are); ``num_rows`` is then the table's row count.
    """

    view: torch.Tensor
    view_w: torch.Tensor
    state_col: int
    cache: torch.Tensor | None = None
    cache_w: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    rounding: str = "nearest"
    in_place: bool = False
    num_rows: int | None = None


HYPER = 8      # an update's scalars: float64 [HYPER], the rounding seed last


@dataclasses.dataclass(frozen=True)
class FusedUpdate:
    """One optimizer family's fused update, as :func:`fused_update_for` chose it.

    ``scalars(group, t, seed)`` gives what a step needs from the host: the [HYPER] float64
    values the kernel reads from memory (learning rate, bias corrections, ..., seed) and the
    kernel's compile-time options (weight decay on, momentum, ...). Calling it queues the
    kernel: rows [cap, W] (the gathered [weight | state] of the unique ids, on the compute
    device), rows_w (their weights: a view of rows, or the float32 rows of a lookup that
    carried no state), grad [cap, d] (summed per id), target (where the rows go), ids [cap]
    (sorted unique ids, then the sentinel N), count [1] (slots in use), guard [1] (nonzero:
    write nothing), hyper (the [HYPER] values, where the device reads them) and the options.
    Count, guard and hyper are read on the device, so an update can be queued before the host
    knows whether the step may proceed, and replayed as a CUDA graph.
    """

    kernel: str
    scalars: object
    whole_row: bool = False     # a program holds whole rows (row-wise rules: a mean per row)

    def __call__(self, rows, rows_w, grad, target: Target, ids, count, guard, hyper,
                 consts: dict) -> None:
        cap, d = ids.numel(), grad.shape[1]
        if cap == 0:
            return
        if self.whole_row:
            block_c = pow2(d, 16)          # the whole row; 4,096 values a program, as _blocks
            block_r, warps = max(1, 4096 // block_c), (4 if block_c <= 2048 else 8)
        else:
            block_r, block_c, warps = _blocks(d, "update")
        grid = (triton_cdiv(cap, block_r), triton_cdiv(d, block_c))
        t = target
        has_cache = t.cache is not None
        mode = 2 if t.rounding == "stochastic" else 1
        with on(ids.device):
            _kernels()[self.kernel][grid](
                rows, rows.stride(0), rows_w, rows_w.stride(0), grad, grad.stride(0), t.view,
                t.view.stride(0), t.view_w, t.view_w.stride(0), ids, count, guard,
                t.cache if has_cache else t.view, t.cache.stride(0) if has_cache else 0,
                t.cache_w if has_cache else t.view_w, t.cache_w.stride(0) if has_cache else 0,
                t.slots if has_cache else ids,
                t.num_rows if t.num_rows is not None else t.view.shape[0], cap, d, t.state_col, hyper,
                ROUND_W=mode if t.view_w.dtype == torch.bfloat16 else 0,
                ROUND_S=mode if t.view.dtype == torch.bfloat16 else 0,
                HAS_CACHE=has_cache, IN_PLACE=t.in_place, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=warps, **consts)


def _pad(values: list, seed: int) -> list:
    return values + [0.0] * (HYPER - 1 - len(values)) + [float(seed)]


# --- the fused updates' scalars, one per optimizer family ----------------------------------------

def sgd_scalars(group: dict, t: int, seed: int) -> tuple[list, dict]:
    momentum = float(group.get("momentum", 0.0))
    wd = float(group.get("weight_decay", 0.0))
    return _pad([float(group["lr"]), momentum, wd], seed), dict(
        MOMENTUM=momentum != 0.0, NESTEROV=bool(group.get("nesterov", False)),
        HAS_WD=wd != 0.0, MAXIMIZE=bool(group.get("maximize", False)))


def adam_scalars(group: dict, t: int, seed: int, *, cols: dict, decoupled: bool,
                 sparse: bool = False) -> tuple[list, dict]:
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
    bc1 = 1 - beta1 ** t
    bc2 = 1 - beta2 ** t
    # torch.optim.Adam: step_size = lr / bc1, denom = sqrt(v) / sqrt(bc2) + eps.
    # torch.optim.SparseAdam: step_size = lr * sqrt(bc2) / bc1, denom = sqrt(v) + eps.
    step_size = lr * math.sqrt(bc2) / bc1 if sparse else lr / bc1
    # AdamW multiplies the weights by 1 - lr * wd (in float64 here, as torch's Python does)
    decay = 1 - lr * wd if decoupled else wd
    return _pad([1 - beta1, beta2, 1 - beta2, float(group["eps"]), decay, step_size,
                 math.sqrt(bc2)], seed), \
        dict(M_COL=cols["exp_avg"], V_COL=cols["exp_avg_sq"],
             VMAX_COL=cols.get("max_exp_avg_sq", 1), DECOUPLED=decoupled, HAS_WD=wd != 0.0,
             AMSGRAD=bool(group.get("amsgrad", False)), SPARSE=sparse,
             MAXIMIZE=bool(group.get("maximize", False)))


def adagrad_scalars(group: dict, t: int, seed: int) -> tuple[list, dict]:
    clr = float(group["lr"]) / (1 + (t - 1) * float(group.get("lr_decay", 0.0)))
    wd = float(group.get("weight_decay", 0.0))
    return _pad([clr, wd, float(group["eps"])], seed), dict(
        HAS_WD=wd != 0.0, MAXIMIZE=bool(group.get("maximize", False)))


def rowwise_adagrad_scalars(group: dict, t: int, seed: int) -> tuple[list, dict]:
    wd = float(group.get("weight_decay", 0.0))
    return _pad([float(group["lr"]), wd, float(group["eps"])], seed), dict(
        HAS_WD=wd != 0.0, MAXIMIZE=bool(group.get("maximize", False)))


def partial_rowwise_adam_scalars(group: dict, t: int, seed: int) -> tuple[list, dict]:
    # each value as nbtools.rowwise.PartialRowWiseAdam computes it in float64 on the host
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
    return _pad([1 - beta1, beta2, 1 - beta2, float(group["eps"]), 1 - lr * wd,
                 lr / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t)], seed), dict(
        HAS_WD=wd != 0.0, MAXIMIZE=bool(group.get("maximize", False)))


def fused_update_for(cls, group: dict, names: list, dtype: torch.dtype):
    """The fused update for optimizer class ``cls`` with hyper-parameters ``group`` and per-row
    state ``names``, or None when there is none (the generic path then runs ``cls`` itself).

    Fused updates compute in float32; they are offered for tables whose compute dtype
    (``dtype``) is float32 (float32, bfloat16 or float16 storage), for the optimizers and
    options whose arithmetic they reproduce exactly: SGD (momentum, nesterov, weight decay),
    Adam and AdamW (weight decay, amsgrad), SparseAdam, Adagrad, and nbtools' RowWiseAdagrad
    and PartialRowWiseAdam (every option).
    """
    from ..rowwise import PartialRowWiseAdam, RowWiseAdagrad
    if dtype != torch.float32:
        return None
    if any(torch.is_tensor(v) for k, v in group.items() if k != "params"):
        return None                     # tensor hyper-parameters (capturable lr, ...): generic
    if group.get("differentiable"):
        return None
    cols = {n: i + 1 for i, n in enumerate(names)}
    exact = lambda cls_: cls is cls_        # subclasses may change the arithmetic
    if exact(torch.optim.SGD):
        if group.get("dampening", 0.0):
            return None
        if group.get("momentum", 0.0) and names != ["momentum_buffer"]:
            return None
        return FusedUpdate("sgd", sgd_scalars)
    if exact(torch.optim.Adam) or exact(torch.optim.AdamW):
        want = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        if sorted(names) != sorted(want):
            return None
        decoupled = exact(torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        return FusedUpdate("adam", functools.partial(adam_scalars, cols=cols,
                                                     decoupled=decoupled))
    if exact(torch.optim.SparseAdam):
        if sorted(names) != ["exp_avg", "exp_avg_sq"]:
            return None
        return FusedUpdate("adam", functools.partial(adam_scalars, cols=cols, decoupled=False,
                                                     sparse=True))
    if exact(torch.optim.Adagrad):
        if names != ["sum"]:
            return None
        return FusedUpdate("adagrad", adagrad_scalars)
    if exact(RowWiseAdagrad):
        if names != ["sum"]:
            return None
        return FusedUpdate("rowwise_adagrad", rowwise_adagrad_scalars, whole_row=True)
    if exact(PartialRowWiseAdam):
        if names != ["exp_avg", "exp_avg_sq"]:      # exp_avg_sq's column follows exp_avg's
            return None
        return FusedUpdate("partial_rowwise_adam", partial_rowwise_adam_scalars, whole_row=True)
    return None
