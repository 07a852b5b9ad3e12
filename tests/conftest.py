import pytest
import torch

from nbtools.devices import cuda_ok


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
