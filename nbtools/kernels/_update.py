"""The ``@triton.jit`` functions of the fused optimizer updates: one kernel, :func:`update`,
reads a row's weight and state, applies one optimizer family's rule (its constexpr ``RULE``)
and writes the row back in one pass (launched by :class:`nbtools.kernels.FusedUpdate`).
Importing this module imports Triton: :mod:`nbtools.kernels` loads it on the first launch.
"""
import triton
import triton.language as tl


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
    # memory (a write-back to the table follows: WriteBehind.write_behind).
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


# The row-wise rules (nbtools.rowwise). A program holds whole rows, the row in one column
# block (FusedUpdate.whole_row), so a row's mean(g^2) is one sum over its tile, with no
# second pass and no exchange between programs. The per-row state is one column wide: read
# and written in the tile's first column only (FIRST).
@triton.jit
def _row_value(src, off, mask, first):
    # [BLOCK_R] float32: each row's value at column `off` of its row (a one-column state)
    return tl.sum(tl.load(src + off, mask=mask & first, other=0.0).to(tl.float32), 1)


@triton.jit
def _halve(x, R: tl.constexpr, C: tl.constexpr):
    # [R, C] -> [R, C // 2]: each pair of neighbouring columns added (one addition each,
    # so the result does not depend on how Triton lays the tile out over threads)
    a, b = tl.split(tl.reshape(x, [R, C // 2, 2]))
    return a + b


@triton.jit
def _row_sum_sq(g, R: tl.constexpr, C: tl.constexpr):
    # [R] float32: each row's sum of g^2 as a pairwise tree over neighbouring columns
    # (16 <= C <= 65536, a power of two; masked columns are zeros). tl.sum's order
    # follows the tile's layout, which Triton picks from the strides of everything the
    # kernel loads: a 260-byte disk row and a 288-byte padded RAM row summed the same
    # gradient differently. nbtools.rowwise.mean_square adds in this same order.
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


# The update: one signature for every rule. It reads the weights through rows_w and writes
# them through dst_w / cache_w (their storage dtype, maybe narrower than the state's), and
# the state k (1-based) at column s0 + (k - 1) * d of the [weight | state...] rows; ROUND_W /
# ROUND_S: how the weights / the state are rounded to their storage (see _put). RULE picks the
# optimizer family's arithmetic at compile time (one compiled kernel per rule, as five
# kernels would be); the options after HAS_WD belong to one rule each, and the others leave
# them at their defaults.
@triton.jit(do_not_specialize=["cap", "n_rows"])
def update(rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride, dst_w,
           dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w, cache_w_stride,
           slots, n_rows, cap, d, s0, hyper, RULE: tl.constexpr, ROUND_W: tl.constexpr,
           ROUND_S: tl.constexpr, HAS_CACHE: tl.constexpr, MAXIMIZE: tl.constexpr,
           IN_PLACE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
           HAS_WD: tl.constexpr, MOMENTUM: tl.constexpr = False,
           NESTEROV: tl.constexpr = False, M_COL: tl.constexpr = 1, V_COL: tl.constexpr = 2,
           VMAX_COL: tl.constexpr = 1, DECOUPLED: tl.constexpr = False,
           AMSGRAD: tl.constexpr = False, SPARSE: tl.constexpr = False):
    src, out, cout, out_w, cout_w, mask, hmask, cmask, p, g, elem = _tile(
        rows, rows_stride, rows_w, rows_w_stride, grad, grad_stride, dst, dst_stride,
        dst_w, dst_w_stride, ids, count_ptr, guard_ptr, cache, cache_stride, cache_w,
        cache_w_stride, slots, n_rows, cap, d, HAS_CACHE, MAXIMIZE, IN_PLACE, BLOCK_R,
        BLOCK_C)
    seed = _seed(hyper)
    if RULE == "sgd":
        # torch.optim.SGD (momentum, nesterov, weight decay)
        lr, momentum, wd = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
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
    elif RULE == "adam":
        # Adam / AdamW as torch.optim.Adam computes them; SPARSE: as torch.optim.SparseAdam.
        # M_COL etc.: which state (1-based) holds exp_avg, exp_avg_sq, max_exp_avg_sq. Every
        # scalar torch derives in Python floats (1 - beta1, 1 - beta2, 1 - lr * wd, the bias
        # corrections) comes from the host, computed in float64 (adam_scalars): in float32
        # here, 1 - float32(0.999) would scale each g^2 by 0.00099998713, not 0.001.
        one_minus_beta1, beta2 = _scalar(hyper, 0), _scalar(hyper, 1)
        one_minus_beta2, eps = _scalar(hyper, 2), _scalar(hyper, 3)
        wd = _scalar(hyper, 4)          # L2: weight_decay; DECOUPLED: 1 - lr * weight_decay
        step_size, bc2_sqrt = _scalar(hyper, 5), _scalar(hyper, 6)
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
    elif RULE == "adagrad":
        # torch.optim.Adagrad (the learning rate already decayed on the host: clr)
        clr, wd, eps = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
        s = tl.load(src + s0, mask=mask, other=0.0).to(tl.float32)
        if HAS_WD:
            g = g + wd * p
        s = s + g * g
        p = p + (-clr) * (g / (tl.sqrt(s) + eps))
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask, cmask, s0, s, seed, 1, elem, ROUND_S, HAS_CACHE)
    elif RULE == "rowwise_adagrad":
        # RowWiseAdagrad: s += sum(g^2) / d per row (state "sum", one column at s0), then
        # w -= lr * g / (sqrt(s) + eps).
        lr, wd, eps = _scalar(hyper, 0), _scalar(hyper, 1), _scalar(hyper, 2)
        first = (tl.arange(0, BLOCK_C) == 0)[None, :]
        if HAS_WD:
            g = g + wd * p
        s = _row_value(src, s0, mask, first) + _row_sum_sq(g, BLOCK_R, BLOCK_C) / d
        p = p + (-lr) * (g / (tl.sqrt(s)[:, None] + eps))
        _put(out_w, cout_w, hmask, cmask, 0, p, seed, 0, elem, ROUND_W, HAS_CACHE)
        _put(out, cout, hmask & first, cmask & first, s0, s[:, None] + tl.zeros_like(p), seed,
             1, elem, ROUND_S, HAS_CACHE)
    elif RULE == "partial_rowwise_adam":
        # PartialRowWiseAdam, in the order of operations of nbtools.rowwise: exp_avg (d
        # columns at s0) per value, exp_avg_sq (one column at s0 + d) per row.
        one_minus_beta1, beta2 = _scalar(hyper, 0), _scalar(hyper, 1)
        one_minus_beta2, eps = _scalar(hyper, 2), _scalar(hyper, 3)
        decay, step_size, bc2_sqrt = _scalar(hyper, 4), _scalar(hyper, 5), _scalar(hyper, 6)
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
    else:
        tl.static_assert(False, "RULE: sgd, adam, adagrad, rowwise_adagrad or partial_rowwise_adam")
