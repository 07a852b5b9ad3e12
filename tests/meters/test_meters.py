"""Headless meters with the fake backend and a fake clock: no GPU, no NVML, no sleeps."""
import json
import math
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

import nbtools
from nbtools import meters
from nbtools.meters import (CounterUnwrapper, History, Meters, Monitor, MonitorConfig, PcieSampler,
                            StepTimer, SystemBackend, ThroughputMeter, Warnings, diagnose)
from nbtools.testing import FakeBackend, FakeClock

MANUAL = MonitorConfig(pcie="manual")


def monitor(unit="samples", backend=None, clock=None, **cfg):
    clock = clock or FakeClock()
    backend = backend or FakeBackend(clock=clock)
    return Monitor(unit, backend=backend, clock=clock,
                   config=MonitorConfig(pcie="manual", **cfg)), backend, clock


# --- readings and N/A ---------------------------------------------------------------------------

def test_meters_read_has_every_key_with_units():
    rec = Meters(FakeBackend(), clock=FakeClock(), pcie="manual").read()
    for keys in (meters.GPU_KEYS, meters.TORCH_KEYS, meters.HOST_KEYS, meters.NBTOOLS_KEYS,
                 meters.LINK_KEYS, meters.CPU_KEYS):
        assert set(keys) <= set(rec)
    assert rec["gpu_used_bytes"] == 6 << 30
    assert rec["pinned_bytes"] == (8 << 30) + 0       # nbtools + torch host allocator
    assert all(k.endswith(("_bytes", "_s", "_per_s", "_percent", "_gen", "_width", "_source",
                           "_rows", "_kernels", "_cores"))
               for k in rec), sorted(rec)


@pytest.mark.parametrize("reader", ["gpu", "torch_memory", "host", "cpu", "nbtools", "disk",
                                    "pcie_counters", "pcie_throughput"],
                         ids=lambda r: f"{r}_reader")  # not the gpu marker
def test_a_failing_reader_reads_as_na(reader):
    b = FakeBackend()
    b.fail.add(reader)
    m = Meters(b, clock=FakeClock(), pcie="manual")
    m.pcie.poll()
    m.pcie.poll()
    rec = m.read()   # never raises
    keys = {"gpu": meters.GPU_KEYS, "torch_memory": meters.TORCH_KEYS, "host": meters.HOST_KEYS,
            "nbtools": meters.NBTOOLS_KEYS, "disk": meters.DISK_KEYS,
            "cpu": meters.CPU_KEYS}.get(reader, ())
    assert all(rec[k] is None for k in keys)
    if reader == "disk":
        assert rec["nbtools_disk_read_bytes_per_s"] is None and rec["host_cache_hit_percent"] is None
    if reader == "cpu":
        assert rec["process_cpu_cores"] is None and rec["host_cpu_busy_cores"] is None
    if reader == "nbtools":
        assert rec["pinned_bytes"] == 0          # torch's part is still there
        assert rec["nbtools_h2d_bytes_per_s"] is None and rec["cache_hit_percent"] is None


def test_link_failure_and_missing_values_are_na():
    b = FakeBackend(gpu_total_bytes=None, pcie_gen=None)
    b.fail.add("link")
    rec = Meters(b, clock=FakeClock(), pcie="off").read()
    assert rec["link_bytes_per_s"] is None and rec["gpu_total_bytes"] is None
    assert rec["pcie_rx_bytes_per_s"] is None and rec["pcie_source"] is None


def test_system_backend_on_cpu_reads_host_and_na_for_gpu():
    b = SystemBackend("cpu")
    rec = Meters(b, clock=FakeClock()).read()
    assert rec["gpu_used_bytes"] is None and rec["torch_allocated_bytes"] is None
    assert rec["host_total_bytes"] > 0 and rec["process_rss_bytes"] > 0
    assert rec["pcie_rx_bytes_per_s"] is None
    assert "gpu" in b.na_reasons


def test_host_readings_without_psutil_come_from_proc(monkeypatch):
    b = SystemBackend("cpu", psutil=False)
    out = b.host()
    assert out["host_total_bytes"] > 0 and out["process_rss_bytes"] > 0
    assert out["host_used_bytes"] == out["host_total_bytes"] - out["host_available_bytes"]


def _fake_pynvml(fail_init=False, field_ret=0, value_type=1):
    """A stand-in for the pynvml module, enough for SystemBackend's NVML paths."""
    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def field_values(handle, ids):
        return [types.SimpleNamespace(nvmlReturn=field_ret, valueType=value_type,
                                      value=types.SimpleNamespace(uiVal=1000 + i, ulVal=0, ullVal=0))
                for i, _ in enumerate(ids)]

    return types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=init, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: "handle",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3 << 30, total=16 << 30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=77),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [],
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 16,
        nvmlDeviceGetFieldValues=field_values, nvmlDeviceGetPcieThroughput=lambda h, c: 2000 + c,
        NVML_FI_DEV_PCIE_COUNT_RX_BYTES=198, NVML_FI_DEV_PCIE_COUNT_TX_BYTES=197,
        NVML_VALUE_TYPE_UNSIGNED_LONG_LONG=3, NVML_VALUE_TYPE_UNSIGNED_LONG=2,
        NVML_PCIE_UTIL_RX_BYTES=1, NVML_PCIE_UTIL_TX_BYTES=0)


def test_system_backend_nvml_paths_with_a_fake_pynvml(monkeypatch):
    b = SystemBackend("cpu", nvml=_fake_pynvml())
    gpu = b.gpu()
    assert gpu["gpu_used_bytes"] == 3 << 30 and gpu["gpu_util_percent"] == 77.0
    assert gpu["gpu_process_bytes"] is None            # our pid is not in the list: N/A
    assert b.link()["link_bytes_per_s"] == pytest.approx(16 * 1969.2e6)
    assert b.pcie_counters() == (1000, 1001)
    assert b.pcie_throughput("rx") == (2000 + 1) * 1024.0


def test_gpu_memory_prefers_nvml_v2_which_leaves_out_the_driver_reserve():
    nv = _fake_pynvml()
    reserve = 480 << 20

    def memory_info(h, version=None):   # v1: used = total - free, the reserve counted as used
        if version is None:
            return types.SimpleNamespace(used=(3 << 30) + reserve, total=16 << 30)
        if version == "v2":
            return types.SimpleNamespace(used=3 << 30, reserved=reserve, total=16 << 30)
        raise nv.NVMLError("Function Not Found")

    nv.nvmlDeviceGetMemoryInfo, nv.nvmlMemory_v2 = memory_info, "v2"
    b = SystemBackend("cpu", nvml=nv)
    assert b.gpu()["gpu_used_bytes"] == 3 << 30          # what nvidia-smi shows
    nv.nvmlMemory_v2 = "v3"                                # the driver refuses this version
    assert b.gpu()["gpu_used_bytes"] == (3 << 30) + reserve   # falls back to version 1
    del nv.nvmlMemory_v2                                   # an old binding without v2
    assert b.gpu()["gpu_used_bytes"] == (3 << 30) + reserve


def test_unsupported_pcie_counters_stop_being_asked():
    nv = _fake_pynvml(field_ret=3)                               # NVML_ERROR_NOT_SUPPORTED
    asked = []
    nv.nvmlDeviceGetFieldValues = lambda h, ids, ask=nv.nvmlDeviceGetFieldValues: \
        asked.append(ids) or ask(h, ids)
    b = SystemBackend("cpu", nvml=nv)
    assert b.pcie_counters() is None and len(asked) == 1
    assert "pcie_counters" in b.na_reasons
    assert b.pcie_counters() is None and len(asked) == 1       # not asked again


def test_nvml_missing_or_failing_is_na_not_a_crash(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "pynvml", None)          # not installed
    b = SystemBackend("cpu", nvml=True)
    assert "nvidia-ml-py" in b.na_reasons["gpu"] and not b.has_pcie
    assert b.gpu() == dict.fromkeys(meters.GPU_KEYS) and b.pcie_counters() is None
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=True))
    b = SystemBackend("cpu", nvml=True)
    assert b.na_reasons["gpu"].startswith("NVML failed") and not b.has_pcie
    assert b.gpu() == dict.fromkeys(meters.GPU_KEYS) and b.pcie_counters() is None
    assert b.link() == dict.fromkeys(meters.LINK_KEYS)


# --- PCIe counters ------------------------------------------------------------------------------

def test_unwrap_32bit_counter_across_many_wraps():
    u = CounterUnwrapper(bits=32, max_rate=126e9)
    total, value, t = 0, 2**32 - 1000, 0.0
    u.update(value, t)
    for _ in range(100):          # 1.5 GiB per 20 ms: wraps every ~3 reads
        t += 0.02
        value = (value + 1_500_000_000) % 2**32
        total += u.update(value, t)
    assert total == 100 * 1_500_000_000


def test_unwrap_drops_gaps_that_may_hide_wraps():
    u = CounterUnwrapper(bits=32, max_rate=126e9)   # safe gap: 2**32 / 126e9 = 34 ms
    u.update(0, 0.0)
    assert u.update(100, 0.05) is None              # 50 ms: could have wrapped: not trusted
    assert u.update(300, 0.06) == 200


def test_unwrap_widens_when_the_counter_is_64bit():
    u = CounterUnwrapper(bits=32)
    u.update(2**33, 0.0)
    assert u.bits == 64 and u.update(2**33 + 5, 1.0) == 5


def test_pcie_sampler_rates_from_wrapping_counters():
    clock = FakeClock()
    b = FakeBackend()
    s = PcieSampler(b, clock, max_rate=63e9)
    s.poll()
    for _ in range(50):           # 1 s at 48 GB/s in, 12 GB/s out: the rx counter wraps 11 times
        clock.advance(0.02)
        b.move(rx_bytes=int(48e9 * 0.02), tx_bytes=int(12e9 * 0.02))
        s.poll()
    r = s.read()
    assert r["pcie_source"] == "counters"
    assert r["pcie_rx_bytes_per_s"] == pytest.approx(48e9, rel=1e-6)
    assert r["pcie_tx_bytes_per_s"] == pytest.approx(12e9, rel=1e-6)
    # a stalled poller (one 0.5 s gap) loses that interval, not the rate
    clock.advance(0.5)
    b.move(rx_bytes=int(48e9 * 0.5))
    s.poll()
    for _ in range(10):
        clock.advance(0.02)
        b.move(rx_bytes=int(10e9 * 0.02))
        s.poll()
    assert s.read()["pcie_rx_bytes_per_s"] == pytest.approx(10e9, rel=1e-6)


def test_pcie_sampler_falls_back_to_the_throughput_query():
    b = FakeBackend()
    b.fail.add("pcie_counters")
    b.throughput = [30e9, 5e9]
    s = PcieSampler(b, FakeClock())
    s.poll()
    s.poll()
    assert s.read() == {"pcie_rx_bytes_per_s": 30e9, "pcie_tx_bytes_per_s": 5e9,
                        "pcie_source": "throughput"}


def test_pcie_sampler_na_when_nothing_is_available():
    b = FakeBackend()
    b.fail.update({"pcie_counters", "pcie_throughput"})
    s = PcieSampler(b, FakeClock())
    s.poll()
    s.poll()
    assert s.source == "n/a"
    assert s.read() == {"pcie_rx_bytes_per_s": None, "pcie_tx_bytes_per_s": None,
                        "pcie_source": None}
    s.start()                 # the thread sees nothing to read and ends by itself
    deadline = time.monotonic() + 2
    while s.running and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not s.running
    s.stop()


def test_pcie_sampler_thread_polls_in_the_background():
    b = FakeBackend()
    s = PcieSampler(b, poll_s=0.001)
    s.start()
    try:
        deadline = time.monotonic() + 5
        while b.calls["pcie_counters"] < 5 and time.monotonic() < deadline:
            time.sleep(0.005)
    finally:
        s.stop()
    assert b.calls["pcie_counters"] >= 5 and not s.running


def test_nbtools_transfer_rates():
    clock = FakeClock()
    b = FakeBackend()
    m = Meters(b, clock=clock, pcie="manual")
    m.read()
    clock.advance(2.0)
    b.move(rx_bytes=10 << 30, tx_bytes=2 << 30, nbtools=True)
    rec = m.read()
    assert rec["nbtools_h2d_bytes_per_s"] == (10 << 30) / 2
    assert rec["nbtools_d2h_bytes_per_s"] == (2 << 30) / 2


def test_cache_hit_share_and_saved_bytes_per_interval():
    clock = FakeClock()
    b = FakeBackend()
    m = Meters(b, clock=clock, pcie="manual")
    rec = m.read()
    assert rec["cache_hit_percent"] is None and rec["nbtools_cache_saved_bytes_per_s"] is None
    clock.advance(2.0)
    b.serve(lookups=1000, hits=800, saved_bytes=4 << 20)
    rec = m.read()
    assert rec["cache_hit_percent"] == 80.0 and rec["nbtools_cache_lookup_rows"] == 1000
    assert rec["nbtools_cache_saved_bytes_per_s"] == (4 << 20) / 2
    clock.advance(1.0)
    b.serve(lookups=1000, hits=500, saved_bytes=-(1 << 20))    # the interval's share, not the run's
    rec = m.read()
    assert rec["cache_hit_percent"] == 50.0 and rec["nbtools_cache_saved_bytes_per_s"] == -(1 << 20)
    clock.advance(1.0)
    rec = m.read()                                               # no training lookup: N/A, not 0%
    assert rec["cache_hit_percent"] is None and rec["nbtools_cache_saved_bytes_per_s"] == 0


def test_system_backend_reads_the_process_wide_cache_counters():
    from nbtools import hostmem
    b = SystemBackend("cpu")
    before = b.nbtools()
    hostmem.count_cache(10, 7, 3 << 10)
    after = b.nbtools()
    assert after["nbtools_cache_lookup_rows"] - before["nbtools_cache_lookup_rows"] == 10
    assert after["nbtools_cache_hit_rows"] - before["nbtools_cache_hit_rows"] == 7
    assert after["nbtools_cache_saved_bytes"] - before["nbtools_cache_saved_bytes"] == 3 << 10


# --- the disk tier (issue 25, item 6) -----------------------------------------------------------

def test_disk_rates_ram_hit_share_per_interval():
    clock = FakeClock()
    b = FakeBackend()
    m = Meters(b, clock=clock, pcie="manual")
    m.read()
    clock.advance(2.0)
    b.disk_io(read_bytes=6 << 20, write_bytes=2 << 20, read_s=0.5, write_s=0.1,
              lookup_rows=1000, hit_rows=900, wait_s=0.3)
    rec = m.read()
    assert rec["nbtools_disk_read_bytes_per_s"] == (6 << 20) / 2
    assert rec["nbtools_disk_write_bytes_per_s"] == (2 << 20) / 2
    assert rec["host_cache_hit_percent"] == 90.0 and rec["nbtools_disk_wait_s"] == 0.3
    clock.advance(0.5)
    b.disk_io(read_bytes=1 << 20, lookup_rows=400, hit_rows=100)   # the interval's, not the run's
    rec = m.read()
    assert rec["nbtools_disk_read_bytes_per_s"] == (1 << 20) / 0.5
    assert rec["nbtools_disk_write_bytes_per_s"] == 0.0 and rec["host_cache_hit_percent"] == 25.0
    clock.advance(1.0)
    rec = m.read()                               # no lookup: 0 B/s, hit share N/A (not 0%)
    assert rec["nbtools_disk_read_bytes_per_s"] == 0.0 and rec["host_cache_hit_percent"] is None


def test_disk_readings_are_na_without_disk_tables():
    clock = FakeClock()
    b = FakeBackend()                            # nbtools.disk never imported: N/A
    m = Meters(b, clock=clock, pcie="manual")
    for _ in range(3):
        clock.advance(1.0)
        rec = m.read()
        assert all(rec[k] is None for k in meters.DISK_KEYS)
    b.disk_io()                                  # imported (describe() does), no disk table: 0
    for _ in range(3):
        clock.advance(1.0)
        rec = m.read()
        assert rec["nbtools_disk_read_bytes"] == 0 and not m.disk_in_use
        assert rec["nbtools_disk_read_bytes_per_s"] is None
        assert rec["host_cache_hit_percent"] is None
    # a disk table used earlier in the process, before these meters: still no disk tier
    b2 = FakeBackend()
    b2.disk_io(read_bytes=1 << 30, lookup_rows=10 ** 6, hit_rows=10 ** 5, wait_s=50.0)
    mon, _, _ = monitor(backend=b2, clock=clock)
    for _ in range(30):
        clock.advance(0.1)
        mon.step(10)
    r = mon.record
    assert r["nbtools_disk_read_bytes_per_s"] is None and r["host_cache_hit_percent"] is None
    assert r["disk_wait_s"] is None and "disk" not in mon.diagnosis


def test_system_backend_reads_the_disk_counters_only_once_imported(monkeypatch):
    import nbtools.disk
    fake = {"read_bytes": 0, "write_bytes": 0, "read_s": 0.0, "write_s": 0.0,
            "lookup_rows": 0, "hit_rows": 0, "wait_s": 0.0}
    monkeypatch.setattr(nbtools.disk, "disk_counters", lambda: dict(fake))
    clock = FakeClock()
    m = Meters(SystemBackend("cpu"), clock=clock, pcie="manual")
    m.read()
    clock.advance(4.0)
    fake.update(read_bytes=400 << 20, write_bytes=100 << 20, lookup_rows=2000, hit_rows=1500,
                wait_s=1.0)
    rec = m.read()
    assert rec["nbtools_disk_read_bytes_per_s"] == (100 << 20)
    assert rec["nbtools_disk_write_bytes_per_s"] == (25 << 20)
    assert rec["host_cache_hit_percent"] == 75.0 and rec["nbtools_disk_wait_s"] == 1.0
    monkeypatch.delitem(sys.modules, "nbtools.disk")     # not imported: N/A, and not imported
    assert SystemBackend("cpu").disk() == dict.fromkeys(meters.DISK_KEYS)
    assert "nbtools.disk" not in sys.modules


def _disk_steps(mon, b, clock, steps, wait, data=0.0, step=0.010, reads=1 << 20):
    """``steps`` steps of ``step`` seconds (host clock), of which ``data`` wait for the loader
    and ``wait`` for the disk (inside compute, where the lookups run)."""
    def batches():
        for i in range(steps):
            clock.advance(data)
            yield i
    for _ in mon.timer.data(batches()):
        with mon.timer.compute():
            clock.advance(step - data)
            b.disk_io(read_bytes=reads, lookup_rows=100, hit_rows=80, wait_s=wait)
        mon.step(256)


def test_monitor_disk_wait_per_step_and_the_disk_bound_verdict():
    clock = FakeClock()
    b = FakeBackend(gpu_util_percent=None)
    b.disk_io()
    mon, _, _ = monitor(backend=b, clock=clock)
    _disk_steps(mon, b, clock, 500, wait=0.006)          # 6 of 10 ms waiting for the disk
    r = mon.record
    assert r["disk_wait_s"] == pytest.approx(0.006) and r["step_s"] == pytest.approx(0.010)
    assert r["nbtools_disk_read_bytes_per_s"] == pytest.approx((1 << 20) / 0.010)
    assert r["host_cache_hit_percent"] == pytest.approx(80.0)
    assert mon.diagnosis.startswith("disk-bound: 60% of each step waits for the disk (reads "
                                    "104.9 MB/s, RAM cache hits 80%)")
    _disk_steps(mon, b, clock, 500, wait=0.003)          # 30%: the rest (70%) is larger
    assert mon.record["disk_wait_s"] == pytest.approx(0.003)
    assert mon.diagnosis.startswith("no GPU readings")
    _disk_steps(mon, b, clock, 500, wait=0.003, data=0.004)   # data 40% > disk 30%
    assert mon.diagnosis.startswith("data-bound: 40%")


@pytest.mark.parametrize("rec, start", [
    ({"disk_wait_s": 0.005, "step_s": 0.01, "gpu_util_percent": 99}, "disk-bound: 50%"),
    ({"disk_wait_s": 0.003, "data_wait_s": 0.003, "transfer_s": 0.003, "step_s": 0.01},
     "disk-bound: 30%"),                                 # the largest of four (rest 10%)
    ({"disk_wait_s": 0.004, "step_s": 0.01, "gpu_util_percent": 99}, "compute-bound"),
    ({"disk_wait_s": 0.004, "data_wait_s": 0.005, "step_s": 0.01}, "data-bound: 50%"),
    ({"disk_wait_s": 0.0, "step_s": 0.01}, "no GPU readings"),
    ({"disk_wait_s": 0.02, "step_s": None}, "warming up"),
])
def test_diagnose_disk_bound_when_the_disk_wait_is_the_largest_share(rec, start):
    assert diagnose(rec).startswith(start)


# --- throughput and step time -------------------------------------------------------------------

def test_throughput_window_follows_a_rate_change():
    clock = FakeClock()
    tm = ThroughputMeter("words", clock=clock, window_s=10)
    for _ in range(200):
        clock.advance(0.1)
        tm.update(100)            # 1000 words/s
    for _ in range(200):
        clock.advance(0.1)
        tm.update(300)            # 3000 words/s
    r = tm.read()
    assert r["samples_per_s"] == pytest.approx(3000, rel=1e-6)
    assert r["mean_samples_per_s"] == pytest.approx((80_000 - 100) / 39.9, rel=1e-9)
    assert r["samples_total"] == 80_000 and r["unit"] == "words"
    assert tm.kept_points <= 60  # bounded memory


def test_throughput_ignores_the_wait_before_the_first_step():
    clock = FakeClock()
    tm = ThroughputMeter(clock=clock)
    clock.advance(30.0)           # building the model, the first batch, ...
    for _ in range(20):
        clock.advance(0.5)
        tm.update(50)
    r = tm.read()
    assert r["samples_per_s"] == pytest.approx(100) and r["mean_samples_per_s"] == pytest.approx(100)
    assert r["elapsed_s"] == pytest.approx(40.0)


def test_throughput_before_any_time_passes_is_na():
    tm = ThroughputMeter(clock=FakeClock())
    assert tm.read()["samples_per_s"] is None and tm.read()["mean_samples_per_s"] is None


def test_step_timer_on_the_host_clock():
    clock = FakeClock()
    st = StepTimer(clock=clock)
    batches = iter(range(5))

    def loader():
        for b in batches:
            clock.advance(0.003)   # the loader makes us wait 3 ms
            yield b

    for _ in st.data(loader()):
        with st.transfer():
            clock.advance(0.001)
        with st.compute():
            clock.advance(0.006)
        st.step()
    r = st.read()
    assert r["step_s"] == pytest.approx(0.010)
    assert r["data_wait_s"] == pytest.approx(0.003)
    assert r["transfer_s"] == pytest.approx(0.001)
    assert r["compute_s"] == pytest.approx(0.006)
    assert st.read() == r        # nothing new: the last reading stays
    with st.compute():
        clock.advance(0.026)
    st.step()
    assert st.read()["compute_s"] == pytest.approx(0.026)
    assert st.read(whole_run=True)["compute_s"] == pytest.approx((4 * 0.006 + 0.026) / 5)   # (the first step is warm-up)


def test_step_timer_cuda_events_resolve_lazily_without_sync():
    clock = FakeClock()
    b = FakeBackend(clock=clock)
    st = StepTimer(clock=clock, event_factory=b.event)

    def steps(n):
        for _ in range(n):
            with st.transfer():
                clock.advance(0.002)
            with st.compute():
                clock.advance(0.005)
            st.step()

    steps(4)
    r = st.read()
    assert r["step_s"] == pytest.approx(0.007)
    assert r["compute_s"] is None            # the GPU has not reached the events: no waiting
    steps(2)
    b.gpu_done()                             # now it has
    r = st.read()
    assert r["transfer_s"] == pytest.approx(0.002) and r["compute_s"] == pytest.approx(0.005)
    assert st.pending_events == 0 and st.open_steps == 1      # only the step running now
    n = len(b.events)
    steps(1)
    assert len(b.events) == n                # resolved events are reused


def test_step_timer_times_at_most_one_step_per_interval():
    clock = FakeClock()
    b = FakeBackend(clock=clock)
    st = StepTimer(clock=clock, event_factory=b.event, min_interval_s=0.01)
    for _ in range(100):        # 1 ms steps: about one in ten is timed
        with st.compute():
            clock.advance(0.001)
        st.step()
    assert 9 <= st.pending_events <= 11


def test_step_timer_never_queues_without_bound():
    clock = FakeClock()
    b = FakeBackend(clock=clock)
    st = StepTimer(clock=clock, event_factory=b.event)
    for _ in range(StepTimer.MAX_PENDING + 50):
        with st.compute():
            clock.advance(0.001)
        st.step()
    assert st.pending_events == StepTimer.MAX_PENDING and st.open_steps <= StepTimer.MAX_PENDING


# --- the monitor: throttling, overhead, history -------------------------------------------------

def test_monitor_refreshes_at_most_once_per_refresh_s():
    mon, b, clock = monitor()
    refreshes = 0
    for _ in range(1000):         # 10 s of 10 ms steps
        clock.advance(0.01)
        refreshes += mon.step(64) is not None
    assert 10 <= refreshes <= 11
    assert b.calls["gpu"] == refreshes and len(mon.history) == refreshes
    assert mon.record["samples_per_s"] == pytest.approx(6400)
    assert mon.record["step_s"] == pytest.approx(0.01)


def test_monitor_backs_off_when_refreshing_is_expensive():
    mon, b, clock = monitor(refresh_s=1.0, max_overhead=0.01)
    mon.step()
    mon.add_overhead(0.05)        # a 50 ms refresh may only run every 5 s
    nxt = mon.next_refresh        # (plus what the refresh itself cost)
    assert clock() + 5.0 <= nxt < clock() + 6.0
    before = mon.overhead_s
    mon.add_overhead(1.0, reschedule=False)   # the plot schedules itself
    assert mon.next_refresh == nxt and mon.overhead_s == pytest.approx(before + 1.0)


def test_monitor_diagnosis_and_warnings_in_the_record():
    clock = FakeClock()
    b = FakeBackend(clock=clock, gpu_used_bytes=78 << 30)
    mon, _, _ = monitor(backend=b, clock=clock)
    clock.advance(0.5)
    rec = mon.step(10)
    assert rec["diagnosis"] == mon.diagnosis
    assert mon.new_warnings and "GPU memory" in mon.new_warnings[0]
    clock.advance(2)
    mon.step(10)
    assert mon.new_warnings == []             # fired once


def test_history_jsonl_round_trip(tmp_path):
    path = tmp_path / "ckpt" / "meters.jsonl"
    mon, b, clock = monitor(history_path=str(path))
    for _ in range(50):
        clock.advance(0.1)
        mon.step(8)
    mon.close()
    h = History.load(path)
    assert len(h) == len(mon.history.records) == 5
    assert h.records == json.loads(json.dumps(mon.history.records))
    assert h.column("samples_total")[-1] == mon.history.records[-1]["samples_total"]


def test_history_survives_a_torn_last_line_and_resumes(tmp_path):
    path = tmp_path / "meters.jsonl"
    mon, b, clock = monitor(history_path=str(path))
    for _ in range(30):
        clock.advance(0.1)
        mon.step(8)
    mon.close()
    last_t = mon.history.records[-1]["time_s"]
    with open(path, "a") as f:
        f.write('{"time_s": 99, "gpu_us')           # the disconnect cut this write off
    h = History.load(path, append=True)
    assert h.skipped_lines == 1 and len(h) == 3
    # a new run (new process, new clock) continues the time axis and marks the resume
    clock2 = FakeClock(start=1000.0)
    mon2 = Monitor("samples", backend=FakeBackend(), clock=clock2, config=MANUAL, history=h)
    clock2.advance(0.5)
    rec = mon2.step(8)
    assert rec["resumed"] is True and rec["time_s"] == pytest.approx(last_t + 1.0 + 0.5)
    clock2.advance(1.5)
    assert "resumed" not in mon2.step(8)
    mon2.close()
    again = History.load(path)
    assert again.skipped_lines == 1 and len(again) == 5


def test_history_save_is_atomic_and_bounded(tmp_path):
    h = History(max_records=100)
    for i in range(250):
        h.append({"time_s": float(i), "x": math.inf if i == 3 else i})
    assert len(h) <= 100 and h.records[-1]["time_s"] == 249.0
    p = tmp_path / "h.jsonl"
    h.save(p)
    assert not list(tmp_path.glob("*.tmp-*"))
    assert History.load(p).records[-1] == {"time_s": 249.0, "x": 249}


# --- diagnosis and warnings ---------------------------------------------------------------------

@pytest.mark.parametrize("rec, start", [
    ({"data_wait_s": 0.004, "step_s": 0.01, "gpu_util_percent": 20}, "data-bound: 40%"),
    ({"pcie_rx_bytes_per_s": 48e9, "link_bytes_per_s": 55e9, "gpu_util_percent": 100},
     "transfer-bound: PCIe RX at 48 of 55 GB/s; fewer bytes per row help"),
    ({"nbtools_h2d_bytes_per_s": 18e9, "nbtools_d2h_bytes_per_s": 18e9, "link_bytes_per_s": 63e9,
      "gpu_util_percent": 88}, "transfer-bound: nbtools moves 36 GB/s of rows (18 in, 18 out)"),
    ({"pcie_tx_bytes_per_s": 40e9, "pcie_rx_bytes_per_s": 1e9, "link_bytes_per_s": 63e9},
     "transfer-bound: PCIe TX at 40 of 63"),
    ({"nbtools_h2d_bytes_per_s": 50e9, "link_bytes_per_s": 63e9}, "transfer-bound: PCIe RX at 50"),
    ({"transfer_s": 0.006, "step_s": 0.01}, "transfer-bound: host<->GPU copies take 60%"),
    ({"gpu_util_percent": 95, "pcie_rx_bytes_per_s": 2e9, "link_bytes_per_s": 63e9},
     "compute-bound: GPU busy 95%"),
    ({"gpu_util_percent": 30, "step_s": 0.01}, "host-bound: GPU busy only 30%"),
    ({"gpu_util_percent": 70, "step_s": 0.01}, "balanced: GPU busy 70%"),
    ({"step_s": 0.01}, "no GPU readings"),
    ({}, "warming up"),
])
def test_diagnose(rec, start):
    assert diagnose(rec).startswith(start)


def test_diagnose_uses_a_measured_link_ceiling():
    rec = {"pcie_rx_bytes_per_s": 40e9, "link_bytes_per_s": 126e9, "gpu_util_percent": 99}
    assert diagnose(rec).startswith("compute-bound")
    assert diagnose(rec, link_bytes_per_s=50e9).startswith("transfer-bound: PCIe RX at 40 of 50")


def test_warnings_fire_once_each():
    w = Warnings(warmup_s=5)
    host = {"host_used_bytes": 60 << 30, "host_total_bytes": 64 << 30, "pinned_bytes": 40 << 30}
    first = w.check(host)
    assert len(first) == 1 and "40.0 GiB of it pinned" in first[0]
    assert w.check(host) == []
    gpu = {"gpu_used_bytes": 10 << 30, "torch_reserved_bytes": 75 << 30,
           "gpu_total_bytes": 80 << 30}
    assert "GPU memory 75.0 GiB" in w.check(gpu)[0] and w.check(gpu) == []
    assert set(w.fired) == {"host_memory", "gpu_memory"}


def test_throughput_drop_warns_after_warmup_only():
    w = Warnings(warmup_s=10, drop_fraction=0.5)
    assert w.check({"samples_per_s": 10.0, "elapsed_s": 1}) == []
    assert w.check({"samples_per_s": 1000.0, "elapsed_s": 2}) == []      # warm-up: not counted
    assert w.check({"samples_per_s": 1000.0, "elapsed_s": 11}) == []
    assert w.check({"samples_per_s": 600.0, "elapsed_s": 12}) == []
    msg = w.check({"samples_per_s": 400.0, "elapsed_s": 13, "unit": "words"})
    assert msg == ["throughput dropped to 400 words/s from 1k words/s; see the diagnosis line"]
    assert w.check({"samples_per_s": 100.0, "elapsed_s": 14}) == []


def test_warnings_with_na_readings_stay_quiet():
    assert Warnings().check(dict.fromkeys(["gpu_used_bytes", "gpu_total_bytes", "host_used_bytes",
                                           "host_total_bytes", "samples_per_s"])) == []


# --- formatting and the machine check -----------------------------------------------------------

def test_formatting():
    assert meters.fmt_rate(512e6) == "512.0 MB/s" and meters.fmt_rate(0) == "0.0 GB/s"
    assert meters.fmt_count(999) == "999" and meters.fmt_count(123456) == "123k"
    assert meters.fmt_seconds(0.0004) == "400 µs" and meters.fmt_seconds(75) == "1:15"


def test_measure_bandwidth_on_cpu_is_na():
    r = meters.measure_bandwidth(1 << 16, device="cpu")
    assert all(r[k] is None for k in r if k.endswith("_per_s"))


# --- on the GPU machine (bash benchmarks/gpu_suite.sh) ------------------------------------------

@pytest.mark.gpu
def test_system_backend_reads_the_cuda_device():
    import torch
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    m = Meters(SystemBackend("cuda"), pcie="manual")
    rec = m.read()
    assert rec["torch_allocated_bytes"] == torch.cuda.memory_allocated()
    assert rec["torch_reserved_bytes"] == torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    assert rec["gpu_total_bytes"] == pytest.approx(total, rel=0.03)   # the same GPU as torch's
    assert rec["gpu_used_bytes"] >= rec["torch_reserved_bytes"]
    assert rec["gpu_util_percent"] is not None and rec["link_bytes_per_s"] > 1e9
    del x
    m.close()


@pytest.mark.gpu
def test_pcie_sampler_sees_pinned_copies():
    import time as _time

    import torch
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    b = SystemBackend("cuda")
    s = PcieSampler(b, max_rate=Meters(b, pcie="off").link["link_bytes_per_s"])
    s.start()
    t_end = _time.monotonic() + 1.5
    while _time.monotonic() < t_end:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    s.stop()
    r = s.read()
    assert r["pcie_source"] in ("counters", "throughput")
    assert r["pcie_rx_bytes_per_s"] > 1e9, r     # GB/s of host-to-GPU copies
    b.close()


@pytest.mark.gpu
def test_step_timer_cuda_events_without_sync():
    import torch
    st = StepTimer(event_factory=lambda: torch.cuda.Event(enable_timing=True))
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):
        with st.compute():
            a = (a @ a).tanh()
        st.step()
    torch.cuda.synchronize()                      # the test waits, the timer never does
    st.step()
    r = st.read()
    assert r["compute_s"] > 0 and r["step_s"] > 0


@pytest.mark.gpu
def test_measure_bandwidth_on_cuda():
    r = meters.measure_bandwidth(64 << 20)
    assert r["note"] == "" and r["pinned_h2d_bytes_per_s"] > 1e9
    assert r["zero_copy_gather_bytes_per_s"] > 1e8 and r["link_bytes_per_s"] > 1e9


def test_meters_and_dashboard_import_torch_only_when_a_reading_needs_it():
    # A fresh interpreter: the fake-backed monitor and the text dashboard run without torch;
    # the system backend (a real reading) is what brings it in.
    code = "\n".join([
        "import io, sys",
        "import nbtools.meters, nbtools.dashboard, nbtools.units",
        "from nbtools.testing import FakeBackend, FakeClock",
        "clock = FakeClock()",
        "cfg = nbtools.dashboard.DashboardConfig(mode='text', file=io.StringIO(), pcie='manual')",
        "mon = nbtools.meters.Monitor('rows', backend=FakeBackend(), clock=clock, config=cfg)",
        "with nbtools.dashboard.Dashboard('rows', config=cfg, monitor=mon) as dash:",
        "    for _ in range(20):",
        "        clock.advance(0.1); dash.step(10)",
        "print('torch' in sys.modules, round(mon.record['samples_per_s']))",
        "nbtools.meters.SystemBackend('cpu').host()",
        "print('torch' in sys.modules)",
        "nbtools.meters.SystemBackend('cpu').disk()",           # no disk table: not imported
        "print('nbtools.disk' in sys.modules)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(Path(nbtools.__file__).parents[1]))
    assert out.stdout.split() == ["False", "100", "True", "False"]


def test_a_table_with_a_cache_counts_for_the_meters():
    import torch
    from nbtools.store.cache import RowCache
    from nbtools.hostmem import cache_counters
    n, d = 200, 4
    room = RowCache.overhead_bytes(n) + 64 * RowCache.slot_bytes(12 * d)   # 64 rows + Adam state
    table = nbtools.OffloadedEmbedding(n, d, device="cpu", name="cached", cache_bytes=room)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, [table], lr=0.1)
    before = cache_counters()
    for _ in range(5):
        opt.zero_grad()
        table(torch.arange(10)).sum().backward()
        opt.step()
    got = {k: v - before[k] for k, v in cache_counters().items()}
    s = table.cache_stats()
    assert got == {"lookup_rows": s["lookups"], "hit_rows": s["hits"],
                   "saved_bytes": s["bytes_saved"]}
    assert got["lookup_rows"] == 50 and got["hit_rows"] == 40


def test_whole_run_readings_leave_out_the_idle_tail_and_add_totals():
    clock = FakeClock()
    tm = ThroughputMeter("rows", clock=clock, window_s=10)
    st = StepTimer(clock=clock)
    for _ in range(11):
        clock.advance(0.5)
        with st.compute():
            clock.advance(0.5)
        tm.update(100)
        st.step()
    clock.advance(50.0)                           # idle after the loop
    live, run = tm.read(), tm.read(whole_run=True)
    assert live["mean_samples_per_s"] == pytest.approx(1000 / 60)     # diluted by the idle tail
    assert run["mean_samples_per_s"] == pytest.approx(100.0) and run["run_s"] == pytest.approx(10.0)
    assert "run_s" not in live
    r = st.read(whole_run=True)
    assert r["step_total_s"] == pytest.approx(10.0) and r["compute_total_s"] == pytest.approx(5.0)
    assert r["data_wait_total_s"] is None and r["transfer_total_s"] is None
    assert "step_total_s" not in st.read()                             # live reads: no totals


# --- the CPU ------------------------------------------------------------------------------------

def test_cpu_seconds_become_cores_busy_over_the_interval():
    b, clock = FakeBackend(process_cores=2, host_cores=4), FakeClock()
    m = Meters(b, clock=clock, pcie="manual")
    first = m.read()
    assert first["process_cpu_cores"] is None and first["host_cpu_busy_cores"] is None
    clock.advance(2.0)
    b.use_cpu(process_s=3.6, host_s=5.0)          # 1.8 and 2.5 cores busy over 2 s
    rec = m.read()
    assert rec["process_cpu_cores"] == pytest.approx(1.8)
    assert rec["host_cpu_busy_cores"] == pytest.approx(2.5)
    assert (rec["process_cores"], rec["host_cores"]) == (2, 4)


def test_the_system_reads_this_processs_cpu_and_the_machines():
    import os
    from nbtools import devices
    b = SystemBackend("cpu", nvml=False)
    before = b.cpu()
    assert before["process_cores"] == devices.usable_cores()
    assert before["host_cores"] == os.cpu_count()
    t = time.process_time()
    while time.process_time() - t < 0.3:          # 0.3 s of this process's CPU
        sum(range(1000))
    after = b.cpu()
    spent = after["process_cpu_s"] - before["process_cpu_s"]
    assert 0.25 <= spent <= 1.0
    # the machine's busy seconds include this process's (to the kernel's 10 ms ticks)
    assert after["host_cpu_busy_s"] - before["host_cpu_busy_s"] >= 0.5 * spent


@pytest.mark.parametrize("rec, verdict", [
    ({"process_cpu_cores": 1.9, "process_cores": 2, "host_cpu_busy_cores": 2.0, "host_cores": 2},
     "CPU-bound: GPU busy only 30% and the CPU is full (this process keeps 1.9 of its 2 cores"),
    ({"process_cpu_cores": 0.4, "process_cores": 2, "host_cpu_busy_cores": 1.9, "host_cores": 2},
     "CPU-bound: GPU busy only 30% and the CPU is full (the machine keeps 1.9 of its 2 cores "
     "busy, this process 0.4)"),
    ({"process_cpu_cores": 1.0, "process_cores": 2, "host_cpu_busy_cores": 1.1, "host_cores": 2},
     "host-bound: GPU busy only 30%; Python or CPU work"),
    ({"process_cpu_cores": 3.0, "process_cores": 16, "host_cpu_busy_cores": 15.0,
      "host_cores": 16}, "CPU-bound: GPU busy only 30% and the CPU is full (the machine"),
])
def test_diagnose_says_cpu_bound_where_the_cpu_is_full(rec, verdict):
    assert diagnose({"gpu_util_percent": 30.0, "step_s": 0.005, **rec}).startswith(verdict)


def test_a_cpu_run_says_how_busy_its_cores_are():
    assert diagnose({"step_s": 0.01, "process_cpu_cores": 1.5, "process_cores": 2}) == \
        "no GPU readings: CPU run, this process keeps 1.5 of its 2 cores busy"


def test_the_run_summary_averages_the_cores_busy():
    mon, b, clock = monitor()
    for busy in (1.0, 2.0):
        for _ in range(10):
            clock.advance(0.1)
            b.use_cpu(process_s=0.1 * busy)
            mon.step(10)
    summary = mon.refresh(final=True)
    assert 1.0 < summary["process_cpu_cores"] < 2.0
