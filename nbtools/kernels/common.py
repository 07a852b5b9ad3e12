"""What the kernel families share on the host: whether Triton runs for a device, the grid
arithmetic of their launchers, and :func:`jit`, which imports a family's ``@triton.jit``
functions on their first launch.

It imports no Triton: :func:`triton_ok` tries on first call, and the modules that define the
kernels (``_rows``, ``_update``, ``_admission``, ``_segsum``) import it when :func:`jit` first
loads them, so ``import nbtools.kernels`` works on a machine without Triton (a table on the
CPU takes the torch path) and Triton reads ``TRITON_INTERPRET`` only once a kernel runs.
"""
from __future__ import annotations

import functools
import importlib
import math
import os
import sys
import types

import torch


@functools.lru_cache(maxsize=None)
def triton_ok() -> bool:
    """True when Triton can be imported (kernels then run on CUDA, or on the CPU when
    ``TRITON_INTERPRET=1`` is set)."""
    try:
        import triton  # noqa: F401  (only whether it imports)
    except Exception:          # missing, or a broken install: the torch path still works
        return False
    return True


FAMILIES = ("rows", "update", "admission", "segsum")
# What runs on the torch path when a family's kernels cannot, for the one line that says so.
_WORK = {"rows": "row gathers and write-backs", "update": "fused optimizer updates",
         "admission": "the GPU cache's admission", "segsum": "the fixed-order gradient sum"}
# The oldest GPU each family's kernels build for (tests/kernels/test_compile_matrix.py compiles
# every specialisation the fast paths launch for sm_60 to sm_90): the admission's atomics take
# a form of their own below sm_70 (plain_atomics), which makes every family build for sm_60.
MIN_CAPABILITY = {family: (6, 0) for family in FAMILIES}

# Per CUDA device index: each family's reason not to run there ("" where it runs).
_decided: dict = {}
# usable_on's answers once decided, per (device with its index, family, NBTOOLS_KERNELS): a step
# asks several times, and deciding again costs microseconds a question (the environment, the
# current device, the capability), which a GPU step of half a millisecond feels.
_answers: dict = {}
# Per CUDA device index: whether the admission's atomics take their pre-sm_70 form.
_plain: dict = {}


def family_ok_for_capability(family: str, capability: tuple) -> bool:
    """Whether ``family``'s kernels build for a GPU of compute ``capability`` (major, minor)."""
    return tuple(capability) >= MIN_CAPABILITY[family]


def plain_atomics_for(capability: tuple) -> bool:
    """Whether the admission's atomics use their pre-sm_70 form on a GPU of ``capability``."""
    return tuple(capability) < (7, 0)


def plain_atomics(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _plain.get(index)
    if got is None:
        got = _plain[index] = plain_atomics_for(torch.cuda.get_device_capability(index))
    return got


def forced_torch() -> bool:
    """``NBTOOLS_KERNELS=torch``: every family takes the torch path, on any device."""
    value = os.environ.get("NBTOOLS_KERNELS", "").strip().lower()
    if value not in ("", "auto", "torch"):
        raise ValueError(f"NBTOOLS_KERNELS must be 'auto' or 'torch', got {value!r}")
    return value == "torch"


def usable_on(device: torch.device, family: str | None = None) -> bool:
    """Whether ``family``'s kernels (one of :data:`FAMILIES`; None: every family's) run for
    tensors on ``device``. On a CUDA device it is decided once, on the first question: from
    the GPU's compute capability, then a first launch of each family on a few rows, whose
    error (a compile that fails, a kernel image the GPU cannot load) is caught there, never
    in a step; one line names the GPU and what runs on the exact torch path instead."""
    key = (device, family, os.environ.get("NBTOOLS_KERNELS"))
    got = _answers.get(key)
    if got is not None:
        return got
    if family is not None and family not in MIN_CAPABILITY:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {FAMILIES}")
    if not triton_ok() or forced_torch():
        return False
    if device.type != "cuda":
        return os.environ.get("TRITON_INTERPRET") == "1"
    why = unavailable(device)
    got = not (why.get(family) if family else any(why.values()))
    if device.index is not None and device.index in _decided:    # (not while capturing)
        _answers[key] = got
    return got


def unavailable(device: torch.device) -> dict:
    """Each family's reason not to run on CUDA ``device`` ("" where its kernels run)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _decided:
        return _decided[index]
    device = torch.device("cuda", index)
    capability = torch.cuda.get_device_capability(device)
    why = {f: "" if family_ok_for_capability(f, capability) else
           "needs sm_%d%d" % MIN_CAPABILITY[f] for f in FAMILIES}
    if torch.cuda.is_current_stream_capturing():
        return why              # no launch inside a CUDA graph's capture: asked again later
    for family in FAMILIES:
        if not why[family]:
            try:
                probe(family, device)
                torch.cuda.synchronize(device)
            except Exception as e:      # noqa: BLE001  (any failure: the torch path runs)
                why[family] = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    _decided[index] = why
    if any(why.values()):
        import warnings
        slow = [f for f in FAMILIES if why[f]]
        reasons = sorted({why[f] for f in slow})
        warnings.warn(
            f"nbtools: {torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}): "
            f"Triton kernels unavailable for {', '.join(slow)} ({'; '.join(reasons)}); "
            f"{', '.join(_WORK[f] for f in slow)} run on the exact torch path (slower)",
            RuntimeWarning, stacklevel=3)
    return why


def compiled_by_kernel() -> dict:
    """Per kernel (``"family.name"``) of the families loaded so far, the specialisations Triton
    has compiled (or loaded from its cache) in this process: each is a pause of seconds at its
    first launch on a machine with an empty Triton cache (every new Colab session). Empty
    without Triton, on the torch path or before a first launch; imports nothing."""
    out = {}
    for family in FAMILIES:
        module = sys.modules.get(f"nbtools.kernels._{family}")
        for name, fn in (vars(module) if module is not None else {}).items():
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            n = sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches.values())
            if n:
                out[f"{family}.{name}"] = n
    return out


def compiled() -> int:
    """The specialisations :func:`compiled_by_kernel` counts, all together."""
    return sum(compiled_by_kernel().values())


def forget() -> None:
    """Decide again on the next question (tests that change what a device reports)."""
    _decided.clear()
    _answers.clear()
    _plain.clear()


def describe_line(device: torch.device) -> str:
    """Which families run as kernels on ``device``, for :func:`nbtools.describe`."""
    if forced_torch():
        return "torch path everywhere (NBTOOLS_KERNELS=torch)"
    if not triton_ok():
        return "torch path (Triton not installed)"
    if device.type != "cuda":
        return ("Triton's interpreter (TRITON_INTERPRET=1)" if usable_on(device) else
                "torch path (CPU compute)")
    import triton
    major, minor = torch.cuda.get_device_capability(device)
    why = unavailable(device)
    slow = [f for f in FAMILIES if why[f]]
    if not slow:
        return f"Triton {triton.__version__} for sm_{major}{minor} (every family)"
    fast = [f for f in FAMILIES if not why[f]]
    return (f"Triton {triton.__version__} for sm_{major}{minor}: "
            f"{', '.join(fast) or 'no family'}; torch path for {', '.join(slow)} "
            f"({'; '.join(sorted(set(why[f] for f in slow)))})")


def probe(family: str, device: torch.device) -> None:
    """A first launch of ``family``'s kernels on a few rows of ``device``."""
    import importlib
    k = importlib.import_module(__package__)
    ids = torch.arange(4, device=device)
    count = torch.tensor([4], device=device)
    rows = torch.ones(8, 16, device=device)
    if family == "rows":
        out = torch.empty(4, 16, device=device)
        k.gather_rows(rows, ids, count, out)
        k.copy_rows(rows, ids, rows, ids + 4)
    elif family == "update":
        group = dict(lr=0.1)
        fused = k.fused_update_for(torch.optim.SGD, group, [], torch.float32)
        hyper, consts = fused.scalars(group, 1, 0)
        fused(rows[:4], rows[:4], torch.ones(4, 16, device=device),
              k.Target(rows, rows, 16), ids, count, torch.zeros(1, dtype=torch.int32,
                                                                device=device),
              torch.tensor(hyper, dtype=torch.float64, device=device), consts)
    elif family == "admission":
        i64 = dict(dtype=torch.int64, device=device)
        k.admit(ids, count, rows, rows=torch.zeros(4, 16, device=device),
                tags=torch.full((5,), -1, **i64),
                slot_of=torch.full((9,), -1, dtype=torch.int32, device=device),
                freq=torch.zeros(9, dtype=torch.int32, device=device),
                stamp=torch.zeros(5, **i64), tick=torch.ones(1, **i64),
                best=torch.full((2,), -1, **i64), stats=torch.zeros(4, **i64), ways=2)
    elif family == "segsum":
        # four positions, one per slot: src, order and slot all of four rows
        k.segment_sum(rows[:4], ids, ids, torch.empty(4, 16, device=device))


@functools.lru_cache(maxsize=None)
def jit(family: str) -> types.ModuleType:
    """The module of one family's ``@triton.jit`` functions: ``"rows"`` (a lookup's row
    copies), ``"update"`` (the fused optimizer updates), ``"admission"`` (the GPU cache's)
    or ``"segsum"`` (the fixed-order gradient sum), imported with Triton on first use."""
    return importlib.import_module(f"{__package__}._{family}")


def pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= ``n`` (and >= ``least``)."""
    return max(least, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
