import os

import pytest
import torch

from nbtools.devices import cuda_ok

# Without a GPU, Triton's interpreter runs the fused kernels on CPU tensors (tests/test_step.py):
# set before anything imports triton.
if not cuda_ok():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def devices():
    """Devices every behaviour test runs on: the CPU always, CUDA where there is one."""
    return ["cpu", "cuda"] if cuda_ok() else ["cpu"]


def pytest_collection_modifyitems(config, items):
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `bash benchmarks/gpu_suite.sh` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=devices())
def device(request):
    return torch.device(request.param)


@pytest.fixture
def slow_write_backs(monkeypatch):
    """Every write-back behind a step (RowStore.write_behind) held ~5 ms on its CUDA stream
    before it writes: work queued after it that read host rows without waiting or patching
    would read rows it has not written yet. (On the CPU write-backs run at once: no-op.)"""
    from nbtools import kernels
    put = kernels.put_rows

    def slow_put(*args, **kwargs):
        if args[0].is_cuda:
            torch.cuda._sleep(10_000_000)       # GPU cycles (~5 ms), on the current stream
        put(*args, **kwargs)
    monkeypatch.setattr(kernels, "put_rows", slow_put)
