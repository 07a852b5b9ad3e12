"""Which slot a row takes, for a disk table's RAM slots (:class:`nbtools.disk.DiskRows`) and its
GPU cache's (:class:`nbtools.disk.gpu.GpuLevel`): a free list, and CLOCK (second chance)."""
from __future__ import annotations

import collections

import numpy as np


def take_free(free: collections.deque, k: int) -> np.ndarray:
    """Up to ``k`` slots from a free list (a deque of slot arrays), oldest first."""
    got, need = [], k
    while need and free:
        part = free.popleft()
        if len(part) > need:
            free.appendleft(part[need:])
            part = part[:need]
        got.append(part)
        need -= len(part)
    return np.concatenate(got) if got else np.zeros(0, dtype=np.int64)


def clock_sweep(owner, need: int, size: int, usable) -> np.ndarray:
    """CLOCK (second chance) over ``size`` slots of ``owner`` (its ``hand``, ``ref`` and
    ``locked`` arrays), vectorised over windows: up to ``need`` slots that ``usable(lo, hi)``
    (a bool array of slots ``lo:hi``) allows and whose reference bit is clear, clearing the
    bits of the usable slots it passes (two turns at most)."""
    out, taken, passed = [], 0, 0
    window = max(4 * need, 4096)
    while taken < need and passed < 2 * size:
        lo = owner.hand
        hi = min(lo + window, size)
        ok = usable(lo, hi)
        pick = np.flatnonzero(ok & ~owner.ref[lo:hi])[: need - taken] + lo
        end = pick[-1] + 1 if len(pick) and taken + len(pick) == need else hi
        owner.ref[lo:end] &= ~ok[: end - lo]      # second chance spent
        owner.locked[pick] = True                 # not picked twice on the next turn
        out.append(pick)
        taken += len(pick)
        passed += end - lo
        owner.hand = end % size
    out = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    owner.locked[out] = False
    return out
