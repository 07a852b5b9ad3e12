"""Triton kernels of the training step: the row gather of a lookup, and fused optimizer updates
that read a row's weight and state, apply the update and write the row back in one pass.

Why kernels of our own (the measurements are in benchmarks/RESULTS.md):

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

This module is the host side: the launchers and what callers pass them. The ``@triton.jit``
functions live in one private module per family, each imported with Triton on its first launch
(:func:`nbtools.kernels.common.jit`): ``_rows`` (gather, write-back, patch, copy, take),
``_update`` (the fused updates: one kernel, a rule per optimizer family), ``_admission`` (the
GPU cache's admission, :func:`admit`) and ``_segsum`` (the fixed-order gradient sum,
:func:`segment_sum`).

Triton compiles a kernel once per specialisation of its arguments (an integer's divisibility
by 16, a pointer's 16-byte alignment), seconds each, on the first launch in a session. So the
sizes that change from one launch to the next, or from one table to another (a lookup's rows,
a table's row count), are ``do_not_specialize`` in the kernels, and the index tensors a step
hands them start on 16-byte boundaries: a table's kernels compile in its first steps and never
again (tests/kernels/test_specialisation.py). Row strides do choose a specialisation: rows
move in 16-byte vectors where the stride allows it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from ..devices import on
from .common import (FAMILIES, jit, plain_atomics, pow2, triton_cdiv, triton_ok,  # noqa: F401
                      usable_on)    # (public names)


# Tile shapes, (rows, columns, warps) per program, by kernel kind ("gather", "put", "patch",
# "copy", "update"); a kind left out uses _blocks.
TILES: dict = {}


def _blocks(width: int, kind: str = "") -> tuple[int, int, int]:
    if kind in TILES:
        return TILES[kind]
    block_c = min(1024, pow2(width, 16))
    return max(1, 4096 // block_c), block_c, 4


# Grid caps of the kernels that move rows over PCIe (0: one program per block of rows). Reads
# and writes share the link: with a write-back running behind the next step's gather, their
# shares follow their programs, and a few gather programs beside fewer writing ones bring a
# large step to the traffic floor, where one program per block keeps it above (the sweep is
# in benchmarks/RESULTS.md, "Write-behind"). 32 programs also keep the link busy alone, and
# leave the SMs to kernels running beside them. A gather through a cache of hot rows reads
# most rows from GPU memory, which takes more programs: two per SM (word2vec with most of
# its rows cached ran markedly slower on 32 programs).
ZERO_COPY_PROGRAMS = 32       # a gather from pinned host memory
CACHED_PER_SM = 2             # ... through a cache of hot rows, programs per SM
WRITE_BEHIND_PROGRAMS = 16    # a write-back behind the next step (WriteBehind.write_behind)


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
                keep: bool = False, num_rows: int | None = None) -> torch.Tensor:
    """``out[r] = src[ids[r], col0:col0 + out.shape[1]]`` for ``r < count`` and ids in range;
    zero rows elsewhere. ``count`` is a one-element tensor on the GPU: no host sync. With a
    ``cache``, rows whose ``slots[r] >= 0`` are read from ``cache[slots[r]]`` instead.

    ``src`` is 2-D with unit column stride (a zero-copy view of host memory, or a GPU tensor).
    ``programs``: at most this many programs per column block, each looping over blocks of
    rows. A gather from host memory spends its time waiting on PCIe; uncapped, its waiting
    programs fill every SM and kernels running beside it (a prefetch's gather beside the
    step's compute) cannot start until it ends. ``keep``: rows not read (past ``count``, out
    of range) keep what ``out`` held instead of becoming zeros. ``num_rows``: ids below it are
    in range (default ``len(src)``; more where ids past ``src`` address ``cache`` rows).
    """
    cap, width = out.shape
    if cap == 0:
        return out
    result = out
    num_rows = src.shape[0] if num_rows is None else num_rows
    has_cache = cache is not None
    (src, out, *cached), (col0, width) = as_vectors(
        [src, out] + ([cache] if has_cache else []), (col0, width))
    cache = cached[0] if has_cache else None
    block_r, block_c, warps = _blocks(width, "gather")
    row_blocks = triton_cdiv(cap, block_r)
    grid = (min(row_blocks, programs or row_blocks), triton_cdiv(width, block_c))
    with on(ids.device):
        jit("rows").gather[grid](src, src.stride(0), col0, ids, count, num_rows, out,
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
# those they are gathered and written back faster; 768- and 1,536-byte rows move alike either
# way (benchmarks/RESULTS.md, "row copies in 16-value vectors").
#
# VECTOR_VIEWS: the row copies that see rows this way; the others see them as their own dtype,
# as the earlier path did (2-byte rows written back as 4-byte words). Not the write-back: alone
# it was faster as vectors too, but in the step, beside the next gather, the steps whose
# write-back kept its old view were faster (alternating loops of row-wise steps in bf16 and
# fp32; benchmarks/RESULTS.md, "row copies in 16-value vectors").
_VECTOR_UNITS = (torch.int32, torch.int16)
ROW_COPIES = frozenset({"gather", "put", "patch", "copy"})
VECTOR_VIEWS = ROW_COPIES - {"put"}


def as_vectors(tensors: list, cols: tuple = (), kind: str = "gather") -> tuple[list, tuple]:
    """``tensors`` (2-D rows of one dtype, unit column stride) seen as the first of
    :data:`_VECTOR_UNITS` in which every row stride is a multiple of 16 values, and ``cols``
    (column offsets and counts) in that unit (``kind``: which copy, "gather", "put", "patch"
    or "copy", one of :data:`VECTOR_VIEWS`). Where none is and ``kind`` is "put",
    2-byte rows are seen as 4-byte words where they can be: a program of a capped grid moves
    a block of 4,096 values per turn, whatever their size, so 2-byte values would take
    nearly as long as twice the bytes in 4-byte ones (a profile in benchmarks/RESULTS.md).
    Else unchanged."""
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
    (dst, src), _ = as_vectors([dst, src], kind="put")
    width = src.shape[1]
    block_r, block_c, warps = _blocks(width, "put")
    row_blocks = triton_cdiv(cap, block_r)
    grid = (min(row_blocks, programs or row_blocks), triton_cdiv(width, block_c))
    with on(ids.device):
        jit("rows").put[grid](dst, dst.stride(0), ids, count, count if guard is None else guard,
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
    (out, src), (width,) = as_vectors([out, src], (width,), "patch")
    block_r, block_c, warps = _blocks(width, "patch")
    grid = (triton_cdiv(cap, block_r), triton_cdiv(width, block_c))
    steps = max(1, math.ceil(math.log2(src_ids.numel() + 1)))
    with on(ids.device):
        jit("rows").patch[grid](out, out.stride(0), ids, count, num_rows, src, src.stride(0),
                                src_ids, src_count, width, steps, BLOCK_R=block_r,
                                BLOCK_C=block_c, num_warps=warps)


def copy_rows(src: torch.Tensor, sidx: torch.Tensor, dst: torch.Tensor,
              didx: torch.Tensor) -> None:
    """``dst[didx[r]] = src[sidx[r]]`` (whole rows) wherever both indices are >= 0; rows with a
    negative index are skipped, so a fixed-size index list needs no host sync to trim it."""
    cap, width = sidx.numel(), dst.shape[1]
    if cap == 0:
        return
    (src, dst), (width,) = as_vectors([src, dst], (width,), "copy")
    block_r, block_c, warps = _blocks(width, "copy")
    grid = (triton_cdiv(cap, block_r), triton_cdiv(width, block_c))
    with on(sidx.device):
        jit("rows").copy[grid](src, src.stride(0), sidx, dst, dst.stride(0), didx, cap, width,
                               BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)


def take_rows(src: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``src.index_select(0, idx).to(dtype)`` in one kernel: a new [len(idx), d] tensor of
    ``dtype``. ``src`` is 2-D with unit column stride (a lookup's gathered weights, a view of
    its [weight | state] rows); every ``idx`` is a row of it. One read of the rows in their
    storage dtype and one write of the result, where index_select and an upcast read and write
    the reordered rows once more."""
    n, width = idx.numel(), src.shape[1]
    out = torch.empty(n, width, dtype=dtype, device=src.device)
    if n == 0 or width == 0:
        return out
    block_r, block_c, warps = _blocks(width, "take")
    grid = (triton_cdiv(n, block_r), triton_cdiv(width, block_c))
    with on(idx.device):
        jit("rows").take[grid](src, src.stride(0), idx, n, out, out.stride(0), width,
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

    ``rule``: the family, as the update kernel's ``RULE`` names it ("sgd", "adam", "adagrad",
    "rowwise_adagrad", "partial_rowwise_adam"); every family shares the kernel's arguments.
    """

    rule: str
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
            jit("update").update[grid](
                rows, rows.stride(0), rows_w, rows_w.stride(0), grad, grad.stride(0), t.view,
                t.view.stride(0), t.view_w, t.view_w.stride(0), ids, count, guard,
                t.cache if has_cache else t.view, t.cache.stride(0) if has_cache else 0,
                t.cache_w if has_cache else t.view_w, t.cache_w.stride(0) if has_cache else 0,
                t.slots if has_cache else ids,
                t.num_rows if t.num_rows is not None else t.view.shape[0], cap, d, t.state_col, hyper,
                ROUND_W=mode if t.view_w.dtype == torch.bfloat16 else 0,
                ROUND_S=mode if t.view.dtype == torch.bfloat16 else 0,
                RULE=self.rule, HAS_CACHE=has_cache, IN_PLACE=t.in_place, BLOCK_R=block_r,
                BLOCK_C=block_c, num_warps=warps, **consts)


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
    and PartialRowWiseAdam (every option). A class outside torch.optim names its family itself,
    in its own body (``fused_kernel = "rowwise_adagrad"``): a subclass does not inherit it,
    since it may change the arithmetic.
    """
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
    own = vars(cls).get("fused_kernel")     # named by the class itself, not inherited
    if own == "rowwise_adagrad":
        if names != ["sum"]:
            return None
        return FusedUpdate("rowwise_adagrad", rowwise_adagrad_scalars, whole_row=True)
    if own == "partial_rowwise_adam":
        if names != ["exp_avg", "exp_avg_sq"]:      # exp_avg_sq's column follows exp_avg's
            return None
        return FusedUpdate("partial_rowwise_adam", partial_rowwise_adam_scalars, whole_row=True)
    return None


# --- the GPU row cache's admission (nbtools.store.cache.RowCache) -------------------------------

# Multiplier of the GPU row cache's id -> set hash (Knuth's multiplicative hashing, 2^32 / golden
# ratio); nbtools.store.cache's torch code and the admission kernel must agree on it.
CACHE_HASH = 2654435761


def admit(ids: torch.Tensor, count: torch.Tensor, host: torch.Tensor, *, rows: torch.Tensor,
          tags: torch.Tensor, slot_of: torch.Tensor, freq: torch.Tensor, stamp: torch.Tensor,
          tick: torch.Tensor, best: torch.Tensor, stats: torch.Tensor, ways: int) -> None:
    """A GPU row cache's admission for one lookup's unique ``ids`` (sorted, sentinel-padded,
    ``count`` [1] in use) in two kernels, one pass over the ids and one over the sets: the
    same decisions as :meth:`nbtools.store.cache.RowCache.admit`'s torch code.

    The cache is given as its tensors, all on the device: ``rows`` [sets * ways, W] (the
    cached rows), ``tags`` (each slot's row, -1 empty), ``slot_of`` [N + 1] (each row's slot,
    -1 in ``host``), ``freq`` [N + 1] (lookups per row), ``stamp`` (the tick a slot was last
    used), ``tick`` [1] (this lookup's, advanced already), ``best`` [sets] (-1 between
    lookups: each set's candidate during one) and ``stats`` [4] (lookups, hits, admitted,
    evicted). ``host`` [N, W]: the table's rows, where evicted rows are written back and
    admitted ones read from."""
    cap = ids.numel()
    sets = best.numel()
    k = jit("admission")
    block = 1024
    plain = plain_atomics(ids.device)
    with on(ids.device):
        k.admit_count[(triton_cdiv(cap, block),)](
            ids, count, cap, slot_of.numel() - 1, freq, slot_of, stamp, tick, best, sets, stats,
            HASH=CACHE_HASH, BLOCK=block, PLAIN=plain)
        width = rows.shape[1]
        k.admit_sets[(sets,)](
            best, tags, stamp, freq, slot_of, tick, rows, rows.stride(0), host, host.stride(0),
            width, stats, WAYS=ways, WAYS_P2=pow2(ways), BLOCK_C=min(1024, pow2(width, 16)),
            PLAIN=plain)


# --- the fixed-order gradient sum ----------------------------------------------------------------
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
    k = jit("segsum")
    with on(out.device):
        k.segment_chunks[grid](src, src.stride(0), src.stride(1), order, slot, n, out,
                               out.stride(0), out.shape[0], parts[0], parts[1], d,
                               out if found is None else found, CHUNK=SEGMENT_CHUNK,
                               BLOCK_C=block_c, CHECK=found is not None, num_warps=warps)
        k.segment_join[grid](slot, n, chunks, out, out.stride(0), parts[0], parts[1], d,
                             out if found is None else found, CHUNK=SEGMENT_CHUNK,
                             PARTS=SEGMENT_PARTS, BLOCK_C=block_c, CHECK=found is not None,
                             num_warps=warps)
    return out

