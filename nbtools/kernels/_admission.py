"""The ``@triton.jit`` functions of the GPU row cache's admission
(:class:`nbtools.store.cache.RowCache`): per lookup, one pass over its unique ids (count them,
stamp the hits, offer each miss to its set) and one over the sets (each set's most frequent
miss takes its least frequent way), the same decisions as the cache's torch code (launched by
:func:`nbtools.kernels.admit`). Importing this module imports Triton: :mod:`nbtools.kernels`
loads it on the first launch.
"""
import triton
import triton.language as tl


# The admission's atomics order nothing: each best[s] is only combined by atomic_max within
# pass 1 and read by pass 2, a later launch (a kernel boundary orders every write before it),
# and stats are counters read after the step. So they need no acquire-release semantics,
# Triton's default, whose PTX (as any .sem qualifier, .relaxed included) ptxas builds only for
# sm_70 and newer. PLAIN (GPUs below sm_70, kernels.plain_atomics): the same reductions as
# PTX's red without a .sem, which every GPU from sm_60 on builds; both forms apply each
# update atomically, so the results are the same.
@triton.jit
def _max(ptr, val, mask, PLAIN: tl.constexpr):
    if PLAIN:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p red.global.max.s64 [$1], $2; "
            "mov.u32 $0, 0; }", "=r,l,l,r", [ptr, val.to(tl.int64), mask.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_max(ptr, val, mask=mask, sem="relaxed")


@triton.jit
def _add(ptr, val, PLAIN: tl.constexpr):
    # a program's one add (ptr and val are scalars: every thread holds them, thread 0 adds)
    if PLAIN:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p red.global.add.u64 [$1], $2; mov.u32 $0, 0; }", "=r,l,l",
            [ptr, tl.cast(val, tl.int64)], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.atomic_add(ptr, val, sem="relaxed")


@triton.jit(do_not_specialize=["cap", "n_rows"])
def admit_count(ids, count_ptr, cap, n_rows, freq, slot_of, stamp, tick_ptr, best, sets,
                stats, HASH: tl.constexpr, BLOCK: tl.constexpr, PLAIN: tl.constexpr = False):
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
    _max(best + s, key, miss, PLAIN)
    _add(stats + 0, tl.sum(live.to(tl.int64), 0), PLAIN)
    _add(stats + 1, tl.sum(hit.to(tl.int64), 0), PLAIN)


@triton.jit
def admit_sets(best, tags, stamp, freq, slot_of, tick_ptr, rows, rows_stride, host,
               host_stride, width, stats, WAYS: tl.constexpr, WAYS_P2: tl.constexpr,
               BLOCK_C: tl.constexpr, PLAIN: tl.constexpr = False):
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
                _add(stats + 3, 1, PLAIN)
            tl.store(slot_of + cand, slot.to(tl.int32))
            tl.store(tags + slot, cand)
            tl.store(stamp + slot, tick)
            _add(stats + 2, 1, PLAIN)
