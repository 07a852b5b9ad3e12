"""A pytest plugin (``-p fake_p100``) that makes this process's GPU look like a P100 (compute
capability 6.0). ``FAKE_P100=unloadable`` (the default): each family's first launch fails as
on a GPU that cannot load Triton's kernel images, so every fast path takes the torch path;
``FAKE_P100=capability``: only the capability is faked, so the kernels still run on the real
GPU, with the admission's pre-sm_70 atomics."""
import os

import torch

from nbtools.kernels import _common

_real = torch.cuda.get_device_capability


def _p100(device=None):
    _real(device)               # (still checks the device)
    return (6, 0)


def _no_image(family, device):
    raise RuntimeError("Triton Error [CUDA]: no kernel image is available for execution on "
                       "the device")


torch.cuda.get_device_capability = _p100
if os.environ.get("FAKE_P100", "unloadable") == "unloadable":
    _common.probe = _no_image
_common.forget()
