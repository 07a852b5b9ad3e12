"""Every kernel specialisation the fast paths launch builds for the GPUs nbtools may meet:
compiled (never run) with Triton's compile-only API for sm_60 (P100) to sm_90 (H100), on any
machine with Triton installed, GPU or not.

The specialisations are those the launchers themselves make: each launcher of
:mod:`nbtools.kernels` is called on small CPU tensors with its kernels replaced by a recorder,
for the storage dtypes, caches, guards and optimizer rules the fast paths use, and each
recorded launch (argument types, compile-time constants, warps) is compiled for each target.
On sm_60 what builds builds: the test asserts that :func:`nbtools.kernels.usable_on`'s answer
per family for a compute capability 6.0 GPU is what actually builds there.
"""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from nbtools import kernels
from nbtools.kernels import common
from nbtools.rowwise import PartialRowWiseAdam, RowWiseAdagrad

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAPABILITIES = (60, 70, 75, 80, 86, 89, 90)

_TYPES = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16",
          torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
          torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


class _Recorder:
    """Stands for a family's module: ``k.name[grid](*args, **constexprs)`` records the launch."""

    def __init__(self, family, log):
        self.family, self.log = family, log

    def __getattr__(self, name):
        family, log = self.family, self.log

        class Launch:
            def __getitem__(self, grid):
                def call(*args, num_warps=4, **constexprs):
                    log.append((family, name, args, constexprs, num_warps))
                return call
        return Launch()


def record_launches(call) -> list:
    """The launches ``call()`` makes through the launchers, (family, kernel, args, constexprs,
    warps), each recorded instead of run."""
    log = []
    real = kernels.jit
    kernels.jit = lambda family: _Recorder(family, log)
    try:
        call()
    finally:
        kernels.jit = real
    return log


def _launches() -> list:
    """Every (family, kernel, args, constexprs, warps) the launchers make for the cases below."""
    return record_launches(_call_launchers)


def _call_launchers() -> None:
    i64 = dict(dtype=torch.int64)
    ids, count = torch.arange(8), torch.tensor([8])
    for dtype, width in [(torch.float32, 96), (torch.float32, 72), (torch.bfloat16, 144),
                         (torch.float16, 64)]:
        src, out = torch.zeros(16, width, dtype=dtype), torch.zeros(8, width, dtype=dtype)
        cache, slots = torch.zeros(4, width, dtype=dtype), torch.full((8,), -1, dtype=torch.int32)
        for keep in (False, True):
            kernels.gather_rows(src, ids, count, out, keep=keep)
            kernels.gather_rows(src, ids, count, out, cache=cache, slots=slots, keep=keep,
                                num_rows=20)
        kernels.put_rows(src, ids, count, out)
        kernels.put_rows(src, ids, count, out, guard=torch.zeros(1, dtype=torch.int32))
        kernels.patch_rows(out, ids, count, 16, out.clone(), ids, count)
        kernels.copy_rows(src, ids, out, ids)
        if dtype != torch.float32:
            kernels.take_rows(src[:, :32], ids, torch.float32)
    # the fused updates: every rule, weights and state in fp32 and bf16 (both roundings), with
    # and without a cache of hot rows, written in place or to the table
    d = 32
    rules = [(torch.optim.SGD, dict(lr=0.1), []),
             (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
              ["momentum_buffer"]),
             (torch.optim.Adam, dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8), ["exp_avg",
                                                                               "exp_avg_sq"]),
             (torch.optim.AdamW, dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1,
                                      amsgrad=True), ["exp_avg", "exp_avg_sq",
                                                      "max_exp_avg_sq"]),
             (torch.optim.SparseAdam, dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8),
              ["exp_avg", "exp_avg_sq"]),
             (torch.optim.Adagrad, dict(lr=0.1, eps=1e-10), ["sum"]),
             (RowWiseAdagrad, dict(lr=0.1, eps=1e-10), ["sum"]),
             (PartialRowWiseAdam, dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8),
              ["exp_avg", "exp_avg_sq"])]
    hyper = torch.zeros(kernels.HYPER, dtype=torch.float64)
    for cls, group, names in rules:
        fused = kernels.fused_update_for(cls, group, names, torch.float32)
        assert fused is not None, cls
        _, consts = fused.scalars(group, 1, 0)
        width = d * (1 + len(names))
        for dtype, rounding, cached, in_place in [
                (torch.float32, "nearest", False, False), (torch.float32, "nearest", True, False),
                (torch.float32, "nearest", False, True), (torch.bfloat16, "nearest", False, False),
                (torch.bfloat16, "stochastic", True, False)]:
            rows = torch.zeros(8, width, dtype=dtype)
            view = torch.zeros(16, width, dtype=dtype)
            target = kernels.Target(view, view[:, :d], d, rounding=rounding, in_place=in_place,
                                    **(dict(cache=torch.zeros(4, width, dtype=dtype),
                                            cache_w=torch.zeros(4, d, dtype=dtype),
                                            slots=torch.full((8,), -1, dtype=torch.int32))
                                       if cached else {}))
            fused(rows, rows[:, :d], torch.zeros(8, d), target, ids, count,
                  torch.zeros(1, dtype=torch.int32), hyper, consts)
    # the GPU cache's admission, and the fixed-order gradient sum (with and without its check)
    n, ways, sets = 64, 4, 8
    for width in (32, 40):
        kernels.admit(ids, count, torch.zeros(n, width), rows=torch.zeros(sets * ways, width),
                      tags=torch.full((sets * ways + 1,), -1, **i64),
                      slot_of=torch.full((n + 1,), -1, dtype=torch.int32),
                      freq=torch.zeros(n + 1, dtype=torch.int32),
                      stamp=torch.zeros(sets * ways + 1, **i64), tick=torch.ones(1, **i64),
                      best=torch.full((sets,), -1, **i64), stats=torch.zeros(4, **i64),
                      ways=ways)
    for found in (None, torch.zeros(1)):
        kernels.segment_sum(torch.zeros(40, d), torch.arange(40), torch.arange(40) // 3,
                            torch.zeros(16, d), found)


def _signature(fn, args, constexprs) -> tuple[dict, dict]:
    """Triton's signature of a launch: each argument's type, as the JIT would specialise it."""
    names = fn.arg_names
    signature, consts = {}, {}
    for name, value in zip(names, args):
        if torch.is_tensor(value):
            signature[name] = "*" + _TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}({name}=...): cannot type {type(value).__name__}")
    params = {p.name: p for p in fn.params}
    for name in names[len(args):]:
        signature[name] = "constexpr"
        if name in constexprs:
            consts[name] = constexprs[name]
        else:
            consts[name] = params[name].default
    return signature, consts


@functools.lru_cache(maxsize=None)
def _specialisations() -> tuple:
    seen, out = set(), []
    for family, name, args, constexprs, warps in _launches():
        key = (family, name, tuple(_TYPES.get(getattr(a, "dtype", None), type(a).__name__)
                                   for a in args), tuple(sorted(constexprs.items())), warps)
        if key not in seen:
            seen.add(key)
            out.append((family, name, args, constexprs, warps))
    return tuple(out)


def test_the_launchers_make_every_kernel_launch_recorded():
    """The recorder sees every kernel of every family (a launcher that stopped launching one
    would shrink the matrix unnoticed), and the constexprs the launchers pass are named
    parameters of the kernels (needs no Triton: runs in CPU CI)."""
    got = {(f, n) for f, n, *_ in _specialisations()}
    assert got == {("rows", k) for k in ("gather", "put", "patch", "copy", "take")} | {
        ("update", "update"), ("admission", "admit_count"), ("admission", "admit_sets"),
        ("segsum", "segment_chunks"), ("segsum", "segment_join")}
    assert len(_specialisations()) >= 40


needs_triton = pytest.mark.skipif(not common.triton_ok(), reason="needs Triton")


def _compile(family, name, args, constexprs, warps, cc):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = getattr(common.jit(family), name)
    if "PLAIN" in fn.arg_names:         # the admission's atomics take the target's form
        constexprs = dict(constexprs, PLAIN=common.plain_atomics_for(divmod(cc, 10)))
    signature, consts = _signature(fn, args, constexprs)
    src = ASTSource(fn=fn, signature=signature, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32),
                          options=dict(num_warps=warps))


def failures(cc: int) -> dict:
    """Per family, its first specialisation that does not build for sm_<cc> (and why)."""
    failed = {}
    for family, name, args, constexprs, warps in _specialisations():
        try:
            _compile(family, name, args, constexprs, warps, cc)
        except Exception as e:          # noqa: BLE001  (what failed, reported by the test)
            lines = [line for line in str(e).splitlines() if "error" in line.lower()]
            failed.setdefault(family, f"{name}: {(lines or [repr(e)])[0].strip()[:300]}")
    return failed


@needs_triton
@pytest.mark.parametrize("cc", CAPABILITIES)
def test_every_specialisation_builds_where_usable_on_says_it_runs(cc):
    # compiled in a process of its own: Triton's interpreter (TRITON_INTERPRET=1, the CPU
    # tests') has no compiler to call
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), ROOT,
                                         env.get("PYTHONPATH", "")])
    got = subprocess.run([sys.executable, "-c", "import json, sys, test_compile_matrix as m; "
                          f"print(json.dumps(m.failures({cc})))"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    failed = json.loads(got.stdout.strip().splitlines()[-1])
    if cc >= 70:
        assert not failed, failed
    builds = {f: f not in failed for f in common.FAMILIES}
    answer = {f: common.family_ok_for_capability(f, divmod(cc, 10)) for f in common.FAMILIES}
    assert answer == builds, failed
