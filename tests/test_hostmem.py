"""The one pinning mechanism of nbtools.hostmem, on the CPU with CUDA registration faked:
registration per address range, shared by its holders, counted once, undone by the last."""
import ctypes
import gc
import mmap

import pytest
import torch

from nbtools import hostmem
from nbtools.hostmem import HostTensor, page_aligned, pin_tensor, pinned_bytes, pinned_regions


@pytest.fixture
def fake_cuda(monkeypatch):
    """cudaHostRegister / Unregister recorded instead of done; nothing reads as pinned."""
    calls = {"register": [], "unregister": []}
    real_unregister = hostmem.cuda_unregister
    # Memory earlier tests really registered may be let go while the fakes are in place: it
    # must really be unregistered, or CUDA keeps the range registered after numpy frees it and
    # a later registration of reused addresses fails (cudaErrorHostMemoryAlreadyRegistered)
    gc.collect()

    def unregister(ptr):
        if ptr in {p for p, _ in calls["register"]}:
            calls["unregister"].append(ptr)
        else:
            real_unregister(ptr)
    monkeypatch.setattr(hostmem, "cuda_ok", lambda: True)
    monkeypatch.setattr(hostmem, "cuda_register", lambda ptr, n: calls["register"].append((ptr, n)))
    monkeypatch.setattr(hostmem, "cuda_unregister", unregister)
    monkeypatch.setattr(hostmem, "whole_range_pinned", lambda t: False)
    before = pinned_bytes()
    yield calls
    gc.collect()
    assert pinned_bytes() == before


def test_page_aligned_gives_whole_pages_of_its_own():
    for n in (0, 1, mmap.PAGESIZE, mmap.PAGESIZE + 1, 5 * mmap.PAGESIZE - 3):
        a = page_aligned(n)
        assert a.ctypes.data % mmap.PAGESIZE == 0
        assert a.nbytes == max(1, -(-n // mmap.PAGESIZE)) * mmap.PAGESIZE


def test_two_holders_of_one_range_share_one_registration(fake_cuda):
    t = torch.zeros(1000)                               # 4,000 bytes
    base = pinned_bytes()
    a, b = pin_tensor(t, name="a"), pin_tensor(t, name="b")
    assert a.pinned and b.pinned
    assert fake_cuda["register"] == [(t.data_ptr(), 4000)]
    assert pinned_bytes() - base == 4000 and ("a", 4000) in pinned_regions()
    a.close()
    a.close()                                           # idempotent
    assert fake_cuda["unregister"] == [] and pinned_bytes() - base == 4000
    del b
    gc.collect()                                        # the last holder went away
    assert fake_cuda["unregister"] == [t.data_ptr()] and pinned_bytes() == base


def test_a_range_let_go_during_a_capture_is_unregistered_before_the_next_registration(
        fake_cuda, monkeypatch):
    """A garbage collection inside a CUDA graph capture must not synchronise or unregister
    (that would invalidate the capture, and a failed unregister left freed memory registered:
    the next registration of those addresses failed with 'already registered'). The range is
    unregistered before the next registration instead."""
    capturing = [True]
    monkeypatch.setattr(hostmem, "capturing", lambda: capturing[0])
    a = pin_tensor(torch.zeros(1000), name="a")
    ptr = fake_cuda["register"][0][0]
    a.close()                                           # let go while "capturing"
    assert fake_cuda["unregister"] == [] and ("a", 4000) not in pinned_regions()
    capturing[0] = False
    b = pin_tensor(torch.zeros(2000), name="b")         # the next registration
    assert fake_cuda["unregister"] == [ptr] and len(fake_cuda["register"]) == 2
    b.close()


def test_host_tensor_registers_its_pages_and_close_undoes_it(fake_cuda):
    base = pinned_bytes()
    h = HostTensor((10, 3), torch.float32, name="table")
    assert h.pinned and h.nbytes == 120
    ptr, n = fake_cuda["register"][0]
    assert ptr == h.tensor.data_ptr() and n == mmap.PAGESIZE     # whole pages
    assert pinned_bytes() - base == mmap.PAGESIZE
    # a pin_tensor over exactly those pages shares the registration
    pages = torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=torch.uint8)
    p = pin_tensor(pages, name="pages")
    assert len(fake_cuda["register"]) == 1 and pinned_bytes() - base == mmap.PAGESIZE
    h.close()
    assert not h.pinned and fake_cuda["unregister"] == []
    p.close()
    assert fake_cuda["unregister"] == [ptr] and pinned_bytes() == base
    assert h.tensor.sum().item() == 0.0                 # the memory stays valid, unpinned


def test_memory_pinned_by_someone_else_is_used_as_it_is(fake_cuda, monkeypatch):
    monkeypatch.setattr(hostmem, "whole_range_pinned", lambda t: True)
    p = pin_tensor(torch.zeros(10), name="torch-pinned")
    assert p.pinned and fake_cuda["register"] == []
    p.close()
    assert fake_cuda["unregister"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_refused_registration_leaves_later_cuda_calls_working():
    """Registering a range twice is refused by CUDA (already registered); the error is raised as a
    PinningError and cleared, so the next kernel torch launches does not report it."""
    buf = page_aligned(1 << 16)
    ptr = buf.ctypes.data
    hostmem.cuda_register(ptr, buf.nbytes)
    try:
        with pytest.raises(hostmem.PinningError, match="cudaHostRegister"):
            hostmem.cuda_register(ptr, buf.nbytes)
        x = torch.ones(8, device="cuda") * 2          # a launch checked for errors
        torch.cuda.synchronize()
        assert x.sum().item() == 16
    finally:
        hostmem.cuda_unregister(ptr)


# --- the cores this process may use ------------------------------------------------------------

def _cgroup(tmp_path, files: dict):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "200000 100000\n"}, 2.0),                       # cgroup v2: 2 cores
    ({"cpu.max": "max 100000\n"}, None),                         # v2, no quota
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),   # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu,cpuacct/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     0.5),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_a_containers_cpu_quota_is_read(tmp_path, files, quota):
    from nbtools import devices
    assert devices.cgroup_cpu_quota(_cgroup(tmp_path, files)) == quota


@pytest.mark.parametrize("quota, cores", [(None, None), (1.5, 2), (0.5, 1), (1000.0, None)])
def test_usable_cores_take_the_affinity_and_the_quota(monkeypatch, quota, cores):
    import os
    from nbtools import devices
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(devices, "cgroup_cpu_quota", lambda root="": quota)
    assert devices.usable_cores() == (affinity if cores is None else min(affinity, cores))
