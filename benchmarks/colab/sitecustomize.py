"""Makes every Python process started with this folder on PYTHONPATH see a GPU of at most
``NBTOOLS_GPU_CAP_GIB`` GiB (torch.cuda.set_per_process_memory_fraction), as on a Colab T4 (15
GiB): benchmarks/colab_profile.sh puts it there, so the scripts' own child processes are capped
too. Without the variable it does nothing and imports nothing."""
import os

_cap = os.environ.get("NBTOOLS_GPU_CAP_GIB")
if _cap:
    import torch

    if torch.cuda.is_available():
        _total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, float(_cap) * 2**30 / _total))
