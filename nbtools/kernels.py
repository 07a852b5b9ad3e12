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
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch

# Multiplier of the GPU row cache's id -> set hash (Knuth's multiplicative hashing, 2^32 / golden
# ratio); nbtools.cache's torch code and the admission kernel below must agree on it.
CACHE_HASH = 2654435761


@functools.lru_cache(maxsize=None)
def triton_ok() -> bool:
    """True when Triton can be imported (kernels then run on CUDA, or on the CPU when
    ``TRITON_INTERPRET=1`` is set)."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except Exception:          # missing, or a broken install: the torch path still works
        return False
    return True


def usable_on(device: torch.device) -> bool:
    """Whether the kernels run for tensors on ``device``."""
    if not triton_ok():
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


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

    @triton.jit
    def admit_count(ids, count_ptr, cap, n_rows, freq, slot_of, stamp, tick_ptr, best, sets,
                    stats, HASH: tl.constexpr, BLOCK: tl.constexpr):
        # The cache's admission, pass 1, over a lookup's unique ids (each at most once, so no
        # two programs touch the same id): count each live id, stamp the slots of the hits
        # (this lookup's rows are not evicted by it), and offer each miss to its set: the
        # set's best[] keeps the largest (count << 32 | id), its most frequent miss.
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        count = tl.load(count_ptr)
        idx = tl.load(ids + r, mask=r < cap, other=n_rows)
        live = (r < count) & (idx >= 0) & (idx < n_rows)
        f = tl.load(freq + idx, mask=live, other=0) + 1
        tl.store(freq + idx, f, mask=live)
        slot = tl.load(slot_of + idx, mask=live, other=-1)
        hit = live & (slot >= 0)
        tick = tl.load(tick_ptr)
        tl.store(stamp + slot, tl.zeros_like(slot).to(tl.int64) + tick, mask=hit)
        miss = live & (slot < 0)
        key = (f.to(tl.int64) << 32) | idx.to(tl.int64)
        s = (idx.to(tl.int64) * HASH) % sets
        tl.atomic_max(best + s, key, mask=miss)
        tl.atomic_add(stats + 0, tl.sum(live.to(tl.int64), 0))
        tl.atomic_add(stats + 1, tl.sum(hit.to(tl.int64), 0))

    @triton.jit
    def admit_sets(best, tags, stamp, freq, slot_of, tick_ptr, rows, rows_stride, host,
                   host_stride, width, stats, WAYS: tl.constexpr, WAYS_P2: tl.constexpr,
                   BLOCK_C: tl.constexpr):
        # Pass 2, one program per set: its candidate (best[s], then reset to -1 for the next
        # lookup) takes the set's least frequent way (the first one, on ties; empty ways
        # count -1, this lookup's rows never lose theirs) when its count is higher; the
        # evicted row is written back to host memory, the admitted one copied in.
        s = tl.program_id(0)
        key = tl.load(best + s)
        tl.store(best + s, -1)
        if key >= 0:
            cand = key & 0xFFFFFFFF
            f = key >> 32
            w = tl.arange(0, WAYS_P2)
            real = w < WAYS
            tag = tl.load(tags + s * WAYS + w, mask=real, other=-1)
            score = tl.where(tag >= 0, tl.load(freq + tag, mask=tag >= 0, other=0).to(tl.int64),
                             -1)
            tick = tl.load(tick_ptr)
            taken = tl.load(stamp + s * WAYS + w, mask=real, other=0) == tick
            score = tl.where(taken | ~real, 0x7FFFFFFFFFFFFFFF, score)
            low = tl.min(score, 0)
            way = tl.min(tl.where(score == low, w, WAYS), 0)
            if f > low:
                slot = s * WAYS + way
                victim = tl.load(tags + slot)
                for c0 in range(0, width, BLOCK_C):
                    c = c0 + tl.arange(0, BLOCK_C)
                    cm = c < width
                    if victim >= 0:
                        v = tl.load(rows + slot * rows_stride + c, mask=cm)
                        tl.store(host + victim * host_stride + c, v, mask=cm)
                    v = tl.load(host + cand * host_stride + c, mask=cm)
                    tl.store(rows + slot * rows_stride + c, v, mask=cm)
                if victim >= 0:
                    tl.store(slot_of + victim, -1)
                    tl.atomic_add(stats + 3, 1)
                tl.store(slot_of + cand, slot.to(tl.int32))
                tl.store(tags + slot, cand)
                tl.store(stamp + slot, tick)
                tl.atomic_add(stats + 2, 1)

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
        # M_COL etc.: which state (1-based) holds exp_avg, exp_avg_sq, max_exp_avg_sq.
        lr, beta1, beta2 = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
        eps, wd = _scalar(hyper, 3), _scalar(hyper, 4)
        step_size, bc2_sqrt = _scalar(hyper, 5), _scalar(hyper, 6)
        seed = _seed(hyper)
        ea = tl.load(src + s0 + (M_COL - 1) * d, mask=mask, other=0.0).to(tl.float32)
        eq = tl.load(src + s0 + (V_COL - 1) * d, mask=mask, other=0.0).to(tl.float32)
        if SPARSE:
            ea = ea + (g - ea) * (1.0 - beta1)
            eq = eq + (g * g - eq) * (1.0 - beta2)
            p = p + (-step_size) * (ea / (tl.sqrt(eq) + eps))
        else:
            if HAS_WD:
                if DECOUPLED:
                    p = p * (1.0 - lr * wd)
                else:
                    g = g + wd * p
            ea = ea + (1.0 - beta1) * (g - ea)        # torch.lerp for weights below 0.5
            eq = eq * beta2 + g * g * (1.0 - beta2)
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
    # column block (FusedUpdate.whole_row), so a row's mean(g^2) is one tl.sum over its tile,
    # with no second pass and no exchange between programs. The per-row state is one column
    # wide: read and written in the tile's first column only (FIRST).
    @triton.jit
    def _row_value(src, off, mask, first):
        # [BLOCK_R] float32: each row's value at column `off` of its row (a one-column state)
        return tl.sum(tl.load(src + off, mask=mask & first, other=0.0).to(tl.float32), 1)

    globals()["_row_value"] = _row_value

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
        s = _row_value(src, s0, mask, first) + tl.sum(g * g, 1) / d
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
        v = v * beta2 + one_minus_beta2 * (tl.sum(g * g, 1) / d)
        denom = tl.sqrt(v) / bc2_sqrt + eps
        p = p + (-step_size) * (ea / denom[:, None])
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask, cmask, s0, ea, seed, 1, elem, ROUND_S, HAS_CACHE)
        _put(out, cout, hmask & first, cmask & first, s0 + d, v[:, None] + tl.zeros_like(p),
             seed, 2, elem, ROUND_S, HAS_CACHE)

    # The sum of each unique id's gradient rows, in a fixed order (segment_sum): no atomics,
    # so the same inputs give the same bits on every run. The rows are taken in sorted order
    # (order: positions sorted by slot; slot: nondecreasing) and cut into chunks of CHUNK
    # positions, whatever the runs of equal slots are.
    @triton.jit
    def _run_sum(a_new, a_val, b_new, b_val):
        # a segmented sum's step: a run that starts at b forgets what came before it
        return a_new | b_new, tl.where(b_new != 0, b_val, a_val + b_val)

    globals()["_run_sum"] = _run_sum

    @triton.jit
    def segment_chunks(src, src_stride, src_cstride, order, slot, n, out, out_stride, cap,
                       part_first, part_last, d, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
        # Pass 1, one program per chunk (and block of columns): the chunk's rows, loaded as one
        # tile (every load in flight at once), summed run by run by a segmented scan down the
        # tile (a fixed tree for the chunk's size). A run that begins and ends in the chunk is
        # written to out[slot]; the piece of a run that began in an earlier chunk goes to
        # part_first[chunk], the start of a run that goes on past the chunk to
        # part_last[chunk] (segment_join adds them up).
        # The program also zeroes its share of the rows of out that no position maps to (the
        # slots from the last one in use, slot[n - 1], up to cap), so out needs no memset.
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
        tl.store(out + orow, acc, mask=m2 & (tail & ~through)[:, None])
        at_end = r == CHUNK - 1
        here = tl.zeros([CHUNK, BLOCK_C], dtype=tl.int64) + pc + cols[None, :]
        tl.store(part_first + here, acc, mask=m2 & (through & (tail | at_end))[:, None])
        tl.store(part_last + here, acc, mask=m2 & (at_end & ~tail & ~through)[:, None])

    @triton.jit
    def segment_join(slot, n, chunks, out, out_stride, part_first, part_last, d,
                     CHUNK: tl.constexpr, PARTS: tl.constexpr, BLOCK_C: tl.constexpr):
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

    return {"gather": gather, "put": put, "patch": patch, "copy": copy, "sgd": sgd, "adam": adam, "adagrad": adagrad,
            "rowwise_adagrad": rowwise_adagrad, "partial_rowwise_adam": partial_rowwise_adam,
            "admit_count": admit_count, "admit_sets": admit_sets,
            "segment_chunks": segment_chunks, "segment_join": segment_join}


# Tile shapes, (rows, columns, warps) per program, by kernel kind ("gather", "put", "patch",
# "copy", "update"); a kind left out uses _blocks. benchmarks/experiments/zero_copy_tiles.py times the
# choices.
TILES: dict = {}


def _pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``least``)."""
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _blocks(width: int, kind: str = "") -> tuple[int, int, int]:
    if kind in TILES:
        return TILES[kind]
    block_c = min(1024, _pow2(width, 16))
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
    block_r, block_c, warps = _blocks(width, "gather")
    row_blocks = triton_cdiv(cap, block_r)
    grid = (min(row_blocks, programs or row_blocks), triton_cdiv(width, block_c))
    has_cache = cache is not None
    _kernels()["gather"][grid](src, src.stride(0), col0, ids, count, src.shape[0], out,
                               out.stride(0), cap, width, cache if has_cache else src,
                               cache.stride(0) if has_cache else 0,
                               slots if has_cache else ids, row_blocks, HAS_CACHE=has_cache,
                               KEEP=keep,
                               BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return out


def _as_words(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of 2-byte values (bf16 tables) as 4-byte words, for a copy that converts nothing:
    a program of a capped grid moves a block of 4,096 values per turn, whatever their size,
    so 2-byte rows crossed the link at half the rate of fp32 rows (the write-behind of bf16
    weights and state took 2.27 ms a step for 38 MB where fp32 took 2.81 ms for 76 MB, H100
    profile in benchmarks/RESULTS.md). Unchanged where a row, a stride or an address is not a
    whole number of words, or the dtypes differ (the store converts)."""
    if src.dtype != dst.dtype or src.element_size() != 2 or src.dim() != 2 or dst.dim() != 2:
        return dst, src
    if any(t.stride(1) != 1 or t.stride(0) % 2 or t.storage_offset() % 2 or t.data_ptr() % 4
           for t in (dst, src)) or src.shape[1] % 2 or dst.shape[1] % 2:
        return dst, src
    return dst.view(torch.int32), src.view(torch.int32)


def put_rows(dst: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, src: torch.Tensor,
             guard: torch.Tensor | None = None, programs: int | None = None) -> None:
    """``dst[ids[r]] = src[r]`` for ``r < count`` and ids in range (:func:`gather_rows`'
    mirror; ``count`` is a one-element tensor on the GPU); nothing when ``guard`` (the same)
    is nonzero. ``programs`` caps the grid as for :func:`gather_rows`."""
    cap, width = src.shape
    if cap == 0:
        return
    dst, src = _as_words(dst, src)
    width = src.shape[1]
    block_r, block_c, warps = _blocks(width, "put")
    row_blocks = triton_cdiv(cap, block_r)
    grid = (min(row_blocks, programs or row_blocks), triton_cdiv(width, block_c))
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
    block_r, block_c, warps = _blocks(width, "patch")
    grid = (triton_cdiv(cap, block_r), triton_cdiv(width, block_c))
    steps = max(1, math.ceil(math.log2(src_ids.numel() + 1)))
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
    block_r, block_c, warps = _blocks(width, "copy")
    grid = (triton_cdiv(cap, block_r), triton_cdiv(width, block_c))
    _kernels()["copy"][grid](src, src.stride(0), sidx, dst, dst.stride(0), didx, cap, width,
                             BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


def admit(cache, ids: torch.Tensor, count: torch.Tensor, host: torch.Tensor) -> None:
    """A :class:`~nbtools.cache.RowCache`'s admission for one lookup's unique ``ids`` in two
    kernels (one pass over the ids, one over the sets), the same decisions as its torch
    code; ``cache.tick`` has been advanced already."""
    cap = ids.numel()
    k = _kernels()
    block = 1024
    k["admit_count"][(triton_cdiv(cap, block),)](
        ids, count, cap, cache.num_rows, cache.freq, cache.slot_of, cache.stamp, cache.tick,
        cache._best, cache.sets, cache.stats, HASH=CACHE_HASH, BLOCK=block)
    width = cache.rows.shape[1]
    k["admit_sets"][(cache.sets,)](
        cache._best, cache.tags, cache.stamp, cache.freq, cache.slot_of, cache.tick, cache.rows,
        cache.rows.stride(0), host, host.stride(0), width, cache.stats, WAYS=cache.ways,
        WAYS_P2=_pow2(cache.ways), BLOCK_C=min(1024, _pow2(width, 16)))


# segment_sum: positions per program of its first pass, and chunks summed per reduction of its
# second (a run of r equal ids takes r / SEGMENT_CHUNK pieces, r / (SEGMENT_CHUNK *
# SEGMENT_PARTS) rounds of the second pass: 4 for the hottest id of 65,536 Zipf(1.1) ids).
SEGMENT_CHUNK = 32
SEGMENT_PARTS = 64


def segment_sum(src: torch.Tensor, order: torch.Tensor, slot: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:
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
    """
    n, d = src.shape
    if n == 0 or d == 0:
        return out
    chunks = triton_cdiv(n, SEGMENT_CHUNK)
    block_c = min(256, _pow2(d, 16))
    grid = (chunks, triton_cdiv(d, block_c))
    parts = torch.empty(2, chunks, d, dtype=out.dtype, device=out.device)
    warps = max(1, min(4, block_c // 32))
    k = _kernels()
    k["segment_chunks"][grid](src, src.stride(0), src.stride(1), order, slot, n, out,
                              out.stride(0), out.shape[0], parts[0], parts[1], d,
                              CHUNK=SEGMENT_CHUNK,
                              BLOCK_C=block_c, num_warps=warps)
    k["segment_join"][grid](slot, n, chunks, out, out.stride(0), parts[0], parts[1], d,
                            CHUNK=SEGMENT_CHUNK, PARTS=SEGMENT_PARTS, BLOCK_C=block_c,
                            num_warps=warps)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
            block_c = _pow2(d, 16)          # the whole row; 4,096 values a program, as _blocks
            block_r, warps = max(1, 4096 // block_c), (4 if block_c <= 2048 else 8)
        else:
            block_r, block_c, warps = _blocks(d, "update")
        grid = (triton_cdiv(cap, block_r), triton_cdiv(d, block_c))
        t = target
        has_cache = t.cache is not None
        mode = 2 if t.rounding == "stochastic" else 1
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
    return _pad([lr, beta1, beta2, float(group["eps"]), wd, step_size, math.sqrt(bc2)], seed), \
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
    from .rowwise import PartialRowWiseAdam, RowWiseAdagrad
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
