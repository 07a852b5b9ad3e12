"""The random number generators a checkpoint saves, so that a resumed run draws what the
uninterrupted run would have drawn: python's ``random``, numpy's global generator, torch's CPU
generator and, where there is a GPU, each CUDA device's.

>>> import torch
>>> state = rng_state()
>>> a = torch.rand(2)
>>> set_rng_state(state)
>>> torch.equal(torch.rand(2), a)
True
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import torch

from ..devices import cuda_ok
from .format import CheckpointWarning


def rng_state() -> dict:
    """Every generator's state, as tensors and plain values (the checkpoint's ``rng`` tree)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if cuda_ok():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def check_rng_state(state) -> None:
    """Raise ValueError where ``state`` is not what :func:`rng_state` returns, so that
    :func:`set_rng_state` would fail part-way: each state is tried on a generator of its own,
    never on the global ones (changes nothing)."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise ValueError(f"the RNG states are {type(state).__name__} "
                         f"{sorted(state) if isinstance(state, dict) else ''}, expected python, "
                         "numpy, torch and cuda")
    try:
        random.Random().setstate(state["python"])
        n = state["numpy"]
        np.random.RandomState().set_state((n["kind"], n["keys"].numpy().astype(np.uint32),
                                           n["pos"], n["has_gauss"], n["cached_gaussian"]))
        torch.Generator().set_state(state["torch"].cpu())
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError, IndexError) as e:
        raise ValueError(f"the RNG states do not load ({type(e).__name__}: {e})") from None
    cuda = state.get("cuda")
    if cuda is not None and (not isinstance(cuda, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda)):
        raise ValueError("the CUDA RNG states are not a list of byte tensors")
    if cuda is not None and cuda_ok():
        sizes = {torch.cuda.get_rng_state(i).numel() for i in range(torch.cuda.device_count())}
        if any(t.numel() not in sizes for t in cuda):
            raise ValueError(f"the CUDA RNG states hold {[t.numel() for t in cuda]} bytes, this "
                             f"machine's {sorted(sizes)}")


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned. CUDA states are restored for the GPUs this
    machine has, with a warning when that is not all of them."""
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None:
        if not cuda_ok():
            warnings.warn("the checkpoint holds CUDA RNG states but there is no GPU here: "
                          "CUDA random streams are not restored", CheckpointWarning, stacklevel=3)
        elif len(state["cuda"]) != torch.cuda.device_count():
            warnings.warn(f"the checkpoint holds RNG states of {len(state['cuda'])} GPUs, this "
                          f"machine has {torch.cuda.device_count()}: restoring the common ones",
                          CheckpointWarning, stacklevel=3)
            for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu(), i)
        else:
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
