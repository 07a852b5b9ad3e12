"""tests/conftest.py speeds up Triton's interpreter (the CPU runs of the fused kernels): these
check that what it changes computes the same bits as the interpreter's own code and as a plain
sequential loop."""
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the patches apply to Triton's interpreter only (no GPU)")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
ti = pytest.importorskip("triton.runtime.interpreter")


@triton.jit
def _halve_and_add(a, b):
    # not associative in floating point: every order of combining gives other bits
    return a * 0.5 + b


@triton.jit
def _segmented(a_new, a_val, b_new, b_val):
    return a_new | b_new, tl.where(b_new != 0, b_val, a_val * 0.5 + b_val)


@triton.jit
def _scan_kernel(x, starts, out1, out2, R: tl.constexpr, C: tl.constexpr,
                 AXIS: tl.constexpr, REVERSE: tl.constexpr):
    off = tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
    v = tl.load(x + off)
    s = tl.load(starts + off)
    tl.store(out1 + off, tl.associative_scan(v, AXIS, _halve_and_add, reverse=REVERSE))
    _, seg = tl.associative_scan((s, v), AXIS, _segmented, reverse=REVERSE)
    tl.store(out2 + off, seg)


def _reference(x: np.ndarray, starts: np.ndarray, axis: int, reverse: bool):
    """The interpreter's scan order: one element after another along the axis."""
    x, starts = np.moveaxis(x, axis, 0), np.moveaxis(starts, axis, 0)
    order = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    plain, seg = np.empty_like(x), np.empty_like(x)
    acc = acc_seg = acc_new = None
    half = np.float32(0.5)
    for i in order:
        if acc is None:
            acc, acc_seg, acc_new = x[i].copy(), x[i].copy(), starts[i].copy()
        else:
            acc = acc * half + x[i]
            acc_seg = np.where(starts[i] != 0, x[i], acc_seg * half + x[i])
            acc_new = acc_new | starts[i]
        plain[i], seg[i] = acc, acc_seg
    return np.moveaxis(plain, 0, axis), np.moveaxis(seg, 0, axis)


@pytest.mark.parametrize("axis,reverse", [(0, False), (1, False), (0, True)])
def test_scan_a_slice_at_a_time_matches_the_interpreters_own_scan(axis, reverse):
    patched = ti.ScanOps.generic_scan
    if not hasattr(patched, "real"):
        pytest.skip("tests/conftest.py did not patch this Triton's interpreter")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=gen)
    starts = (torch.rand(8, 4, generator=gen) < 0.3).to(torch.int32)
    want = _reference(x.numpy(), starts.numpy(), axis, reverse)
    for generic_scan in (patched, patched.real):
        ti.ScanOps.generic_scan = generic_scan
        try:
            out1, out2 = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
            _scan_kernel[(1,)](x, starts, out1, out2, R=8, C=4, AXIS=axis, REVERSE=reverse)
        finally:
            ti.ScanOps.generic_scan = patched
        assert np.array_equal(out1.numpy(), want[0]), (generic_scan, out1, want[0])
        assert np.array_equal(out2.numpy(), want[1]), (generic_scan, out2, want[1])
