"""A set of row numbers as a bitmap: one bit a row where a bool array takes a byte.

A disk table marks the rows written since its last checkpoint (:class:`nbtools.disk.DiskRows`,
12.5 MB at 100M rows instead of 100 MB), and a log file the slots in use while it moves rows
home (:meth:`nbtools.disk.log.LogFile.identity`).

>>> b = BitSet(20)
>>> b.add([3, 17]); b.add_range(5, 8); b.count(), b.members().tolist(), b.members(4, 10).tolist()
(5, [3, 5, 6, 7, 17], [5, 6, 7])
>>> b.discard([5, 17]); b.contains([3, 5, 6]).tolist()
[True, False, True]
"""
from __future__ import annotations

import numpy as np

CHUNK = 1 << 23          # bits unpacked at a time (members, count): 8 MiB of booleans at most


class BitSet:
    """Row numbers ``0 .. n - 1``, each in the set or not (see the module)."""

    __slots__ = ("n", "bits")

    def __init__(self, n: int, full: bool = False):
        self.n = int(n)
        self.bits = np.zeros(-(-self.n // 8), dtype=np.uint8)
        if full:
            self.fill(True)

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes

    def fill(self, value: bool) -> None:
        """Every row in the set (True) or none."""
        self.bits[:] = 0xFF if value else 0
        if value and self.n % 8:
            self.bits[-1] = (1 << (self.n % 8)) - 1     # (no bits past n)

    def add(self, rows) -> None:
        _update(self.bits, rows, True)

    def discard(self, rows) -> None:
        _update(self.bits, rows, False)

    def add_range(self, start: int, stop: int) -> None:
        """Rows ``start .. stop - 1``: whole bytes at once, the ends bit by bit."""
        start, stop = max(0, int(start)), min(self.n, int(stop))
        if start >= stop:
            return
        a, b = -(-start // 8), stop // 8                  # the whole bytes inside
        if a < b:
            self.bits[a:b] = 0xFF
            self.add(np.r_[start:a * 8, b * 8:stop])
        else:
            self.add(np.arange(start, stop))

    def contains(self, rows) -> np.ndarray:
        """Booleans: whether each of ``rows`` is in the set."""
        rows = np.asarray(rows, dtype=np.int64)
        return ((self.bits[rows >> 3] >> (rows & 7).astype(np.uint8)) & 1).astype(bool)

    def members(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The rows in the set within ``start .. stop - 1``, sorted (int64)."""
        stop = self.n if stop is None else min(self.n, int(stop))
        out = []
        for a in range(max(0, int(start)), stop, CHUNK):
            b = min(stop, a + CHUNK)
            out.append(np.flatnonzero(self._unpacked(a, b)) + a)
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def count(self) -> int:
        return sum(int(self._unpacked(a, min(self.n, a + CHUNK)).sum())
                   for a in range(0, self.n, CHUNK))

    def _unpacked(self, a: int, b: int) -> np.ndarray:
        """Booleans of rows ``a .. b - 1``."""
        lo = a // 8
        got = np.unpackbits(self.bits[lo:-(-b // 8)], bitorder="little").view(bool)
        return got[a - lo * 8: b - lo * 8]


def _update(bits: np.ndarray, rows, value: bool) -> None:
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if not len(rows):
        return
    mask = np.left_shift(1, rows & 7).astype(np.uint8)
    if value:
        np.bitwise_or.at(bits, rows >> 3, mask)
    else:
        np.bitwise_and.at(bits, rows >> 3, ~mask)
