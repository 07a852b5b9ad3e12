"""Experiment (GPU machine): zero-copy gather of narrow rows in random vs address order, row-size
sweep, NVML memory info v1/v2 against nvidia-smi, NVML call costs. Figures in benchmarks/RESULTS.md.

    python3 benchmarks/experiments/narrow_gather.py
"""
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from nbtools import hostmem

dev = torch.device("cuda")

def t_cuda(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(reps):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

def t_wall(fn, reps=20):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3

N = 100_000_000
g = torch.Generator().manual_seed(0)
pairs = torch.randint(0, 1_000_000, (N, 2), generator=g)
h = hostmem.pin_tensor(pairs, name="pairs")
view = hostmem.cuda_alias(pairs, dev)
print("pinned", h.pinned, view.shape, view.dtype)
for B in (32768, 131072, 524288):
    idx = torch.randperm(N, device=dev)[:B]
    idx32 = idx.to(torch.int32)
    sidx, order = torch.sort(idx)
    out = torch.empty(B, 2, dtype=torch.int64, device=dev)
    r = {}
    r["index_select i64"] = t_cuda(lambda: view.index_select(0, idx))
    r["index_select i32"] = t_cuda(lambda: view.index_select(0, idx32))
    r["fancy view[idx]"] = t_cuda(lambda: view[idx])
    c128 = view.view(torch.complex128).view(N)
    r["as complex128 (1x16B)"] = t_cuda(lambda: c128.index_select(0, idx))
    r["sorted idx only"] = t_cuda(lambda: view.index_select(0, sidx))
    def sorted_unperm():
        s, o = torch.sort(idx32)
        rows = c128.index_select(0, s)
        out.view(torch.complex128).view(B).index_copy_(0, o, rows)
    r["sort+gather+unpermute"] = t_cuda(sorted_unperm)
    # CPU gather into pinned staging + H2D
    stage = torch.empty(B, 2, dtype=torch.int64).pin_memory()
    hidx = idx.cpu()
    def cpu_path():
        torch.index_select(pairs, 0, hidx, out=stage)
        out.copy_(stage, non_blocking=True)
    r["CPU index_select+H2D (wall)"] = t_wall(cpu_path)
    r["CPU index_select only (wall)"] = t_wall(lambda: torch.index_select(pairs, 0, hidx, out=stage))
    # small table: TLB reach effect
    small = view[: 1 << 20]
    sidx_small = torch.randint(0, 1 << 20, (B,), device=dev)
    r["16MB table random"] = t_cuda(lambda: small.index_select(0, sidx_small))
    for k, v in r.items():
        print(f"B={B:>7} {k:32s} {v:8.3f} ms  {B / v / 1e3:8.1f} M rows/s")
    sys.stdout.flush()
print("torch threads", torch.get_num_threads())

# row-size sweep on a ~1.6 GB pinned buffer
for rb in (16, 32, 64, 128, 256, 512):
    v = hostmem.cuda_alias(pairs, dev).view(torch.int64).view(-1, rb // 8)
    n = v.shape[0]
    idx = torch.randint(0, n, (131072,), device=dev)
    ms = t_cuda(lambda: v.index_select(0, idx))
    print(f"row {rb:4d} B: {ms:7.3f} ms  {131072 / ms / 1e3:7.1f} M rows/s  {131072 * rb / ms / 1e6:6.2f} GB/s")

# NVML memory
import pynvml as nv
nv.nvmlInit()
hd = nv.nvmlDeviceGetHandleByIndex(0)
x = torch.empty(3 << 30, dtype=torch.uint8, device=dev)
torch.cuda.synchronize()
m1 = nv.nvmlDeviceGetMemoryInfo(hd)
try:
    m2 = nv.nvmlDeviceGetMemoryInfo(hd, version=nv.nvmlMemory_v2)
    print("v2 used/reserved/total MiB", m2.used >> 20, m2.reserved >> 20, m2.total >> 20, "free", m2.free >> 20)
except Exception as e:
    print("v2 failed", e)
print("v1 used/total MiB", m1.used >> 20, m1.total >> 20, "free", m1.free >> 20)
print(subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total,memory.reserved", "--format=csv"], capture_output=True, text=True).stdout)
print(subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv"], capture_output=True, text=True).stdout)
for p in nv.nvmlDeviceGetComputeRunningProcesses(hd):
    print("proc", p.pid, p.usedGpuMemory)
print("torch reserved MiB", torch.cuda.memory_reserved() >> 20)
print("nvml version", nv.nvmlSystemGetDriverVersion(), getattr(nv, "__version__", "?"))
# NVML call costs
for name, fn in [("mem v1", lambda: nv.nvmlDeviceGetMemoryInfo(hd)),
                 ("mem v2", lambda: nv.nvmlDeviceGetMemoryInfo(hd, version=nv.nvmlMemory_v2)),
                 ("util", lambda: nv.nvmlDeviceGetUtilizationRates(hd)),
                 ("procs", lambda: nv.nvmlDeviceGetComputeRunningProcesses(hd)),
                 ("pcie tx counter", lambda: nv.nvmlDeviceGetFieldValues(hd, [nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES]) if hasattr(nv, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES") else None)]:
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    print(f"nvml {name}: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms")
