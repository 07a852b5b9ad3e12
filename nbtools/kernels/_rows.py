"""The ``@triton.jit`` functions of a lookup's row copies: the gather of a lookup's rows (and
its mirror, the write-back), the patch of rows written behind, the row copy and the reordered
upcast (launched by :func:`nbtools.kernels.gather_rows`, ``put_rows``, ``patch_rows``,
``copy_rows``, ``take_rows``). Importing this module imports Triton: :mod:`nbtools.kernels`
loads it on the first launch.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["cap", "row_blocks", "n_rows"])
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


@triton.jit(do_not_specialize=["cap", "row_blocks", "n_rows"])
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


@triton.jit(do_not_specialize=["steps", "n_rows"])
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


@triton.jit(do_not_specialize=["cap"])
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


@triton.jit(do_not_specialize=["n"])
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
