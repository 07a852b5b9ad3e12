"""nbtools.disk.bits.BitSet against a numpy bool array doing the same edits."""
import numpy as np
import pytest

from nbtools.disk.bits import CHUNK, BitSet


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 1000, CHUNK + 13])
def test_bitset_matches_a_bool_array(n):
    rng = np.random.default_rng(n)
    ref, b = np.zeros(n, dtype=bool), BitSet(n)
    for _ in range(20):
        rows = rng.integers(0, n, int(rng.integers(0, 50)))
        value = bool(rng.random() < 0.6)
        (b.add if value else b.discard)(rows)
        ref[rows] = value
        a = int(rng.integers(0, n))
        c = int(rng.integers(a, n + 1))
        b.add_range(a, c)
        ref[a:c] = True
        if rng.random() < 0.1:
            value = bool(rng.random() < 0.5)
            b.fill(value)
            ref[:] = value
        assert np.array_equal(b.members(), np.flatnonzero(ref)) and b.count() == ref.sum()
        a = int(rng.integers(0, n))
        c = int(rng.integers(a, n + 1))
        assert np.array_equal(b.members(a, c), np.flatnonzero(ref[a:c]) + a)
        q = rng.integers(0, n, 100)
        assert np.array_equal(b.contains(q), ref[q])
    assert b.nbytes == -(-n // 8)
    full = BitSet(n, full=True)
    assert full.count() == n and np.array_equal(full.members(), np.arange(n))
