"""tests/conftest.py speeds up Triton's interpreter (the CPU runs of the fused kernels): these
check that what it changes computes the same bits as the interpreter's own code and as a plain
sequential loop."""
import json
import os
import subprocess
import sys

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


def test_remembered_numpy_dtypes_are_the_interpreters():
    remembered = ti._get_np_dtype
    if not hasattr(remembered, "real"):
        pytest.skip("tests/conftest.py did not patch this Triton's interpreter")
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32, tl.int64,
               tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64]
    types = scalars + [tl.pointer_type(t) for t in scalars] + \
        [tl.block_type(t, shape) for t in scalars + [tl.pointer_type(tl.float32)]
         for shape in ([4], [8, 16])]
    for _ in range(2):                  # remembered the first time, then read back
        for t in types:
            assert remembered(t) == remembered.real(t), t
    # equal types made apart answer alike
    assert remembered(tl.block_type(tl.bfloat16, [2])) == np.dtype(np.uint16)


def test_remembered_builtins_are_the_ones_the_interpreter_patches():
    """The builtins patched at a launch are those the interpreter's own function patches in a
    fresh process, where nothing is patched yet (here kernels that ran before may have left
    some patched: Triton 3.9 leaves most of triton.language.core patched after a cache's
    kernels)."""
    remembered = ti._patch_builtin
    if not hasattr(remembered, "real"):
        pytest.skip("tests/conftest.py did not patch this Triton's interpreter")
    code = """if 1:
        import json
        from triton.runtime import interpreter as ti
        tl, out = ti.tl, {}
        for pkg in (tl, tl.core, tl.math, tl.core.tensor):
            scope = ti._LangPatchScope()
            ti._patch_builtin(pkg, ti.interpreter_builder, scope)
            out[pkg.__name__] = sorted(name for _, name, _ in scope._changes)
            scope.restore()
        print(json.dumps(out))"""
    fresh = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                      text=True, check=True).stdout)
    for pkg in (tl, tl.core, tl.math, tl.core.tensor):
        scope = ti._LangPatchScope()
        remembered(pkg, ti.interpreter_builder, scope)
        got = sorted(name for _, name, _ in scope._changes)
        scope.restore()
        assert got == fresh[pkg.__name__] and got, (pkg, set(got) ^ set(fresh[pkg.__name__]))
