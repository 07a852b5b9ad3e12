"""A pytest plugin (``-p fake_p100``) that makes this process's GPU look like a P100 (compute
capability 6.0). ``FAKE_P100=unloadable`` (the default): each family's first launch fails as
on a GPU that cannot load Triton's kernel images, so every fast path takes the torch path;
``FAKE_P100=capability``: only the capability is faked, so the kernels still run on the real
GPU, with the admission's pre-sm_70 atomics.

Importing the module changes nothing (the suite's doctest collection imports every file under
tests/): the fakes go in at ``pytest_configure``, only where pytest loads it as a plugin."""
import os

import torch

from nbtools.kernels import common

_real = torch.cuda.get_device_capability


def _p100(device=None):
    _real(device)               # (still checks the device)
    return (6, 0)


def _no_image(family, device):
    raise RuntimeError("Triton Error [CUDA]: no kernel image is available for execution on "
                       "the device")


def pytest_configure(config):
    torch.cuda.get_device_capability = _p100
    if os.environ.get("FAKE_P100", "unloadable") == "unloadable":
        common.probe = _no_image
    else:
        _triton_builds_for_the_real_gpu()
    common.forget()


def _triton_builds_for_the_real_gpu():
    """Triton asks torch for the capability it compiles for: told 6.0, it would build sm_60
    kernel images, which this (newer) GPU cannot load, and every family would be off. In
    ``capability`` mode the kernels must run, so Triton keeps the real capability."""
    try:
        from triton.runtime import driver
        driver.active.get_device_capability = _real
    except Exception:                   # noqa: BLE001  (no Triton: no kernels to build)
        pass
