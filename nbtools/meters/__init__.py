"""Headless meters: what the GPU, host RAM, pinned memory, PCIe and the training loop are doing.

Everything here computes and returns plain dicts with units in the keys (``gpu_used_bytes``,
``pcie_rx_bytes_per_s``, ``step_s``); a reading that cannot be had (no GPU, NVML missing or
failing, psutil absent) is ``None``, shown as ``N/A``, never an exception. Time comes from an
injectable clock and the readings from a backend, so the fakes of
:mod:`nbtools.testing` test all of it without a GPU. :mod:`nbtools.dashboard` only draws what :class:`Monitor` computes.

Facts the design rests on (measured on a data-centre GPU; docs/dashboard.md):

* NVML memory and utilisation queries cost ~0.05 ms: fine once a second from the loop's thread.
* ``nvmlDeviceGetPcieThroughput`` *blocks* ~21 ms per call, and the cumulative PCIe byte counters
  are 32-bit and wrap every 4 GiB (~75 ms at full speed). Neither can be read from the training
  loop at 1 Hz: :class:`PcieSampler` reads them from a background thread (NVML releases the GIL
  inside the C call), polling the counters fast enough to unwrap them, or else the throughput
  query a few times a second.
* Nothing in NVML or /proc reports CUDA-pinned host memory: nbtools counts its own
  (:func:`nbtools.hostmem.pinned_bytes`), torch's caching host allocator reports its own.
* ``utilization.gpu`` reads ~100% during a pure copy: :func:`diagnose` looks at PCIe first.
* Disk tables count their own traffic (:func:`nbtools.disk.disk_counters`), read only once
  ``nbtools.disk`` is imported; the disk tier's rates stay N/A until disk tables are used.

The parts, one file each: :mod:`~nbtools.meters.backends` (where readings come from),
:mod:`~nbtools.meters.samplers` (PCIe, resources, throughput, step timer),
:mod:`~nbtools.meters.monitor` (history, diagnosis, warnings, :class:`Monitor`) and
:mod:`~nbtools.meters.bandwidth` (the machine check); units are formatted by
:mod:`nbtools.units`, and the fakes live in :mod:`nbtools.testing`. Importing this package does
not import torch: a reading that needs it imports it then.

Example (fake backend and clock, as in the tests)::

    >>> from nbtools.testing import FakeBackend, FakeClock
    >>> clock = FakeClock()
    >>> mon = Monitor("words", backend=FakeBackend(), clock=clock)
    >>> for _ in range(20):
    ...     clock.advance(0.1)
    ...     rec = mon.step(1000)
    >>> round(mon.record["samples_per_s"])
    10000
    >>> mon.record["gpu_used_bytes"] > 0, mon.record["unit"]
    (True, 'words')
"""
from __future__ import annotations

from ..units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds
from .backends import (CPU_KEYS, DISK_KEYS, GPU_KEYS, HOST_KEYS, LINK_KEYS, NA, NBTOOLS_KEYS,
                       TORCH_KEYS, SystemBackend)
from .bandwidth import measure_bandwidth
from .monitor import RUN_MEAN_KEYS, History, Monitor, MonitorConfig, RunMeans, Warnings, diagnose
from .samplers import CounterUnwrapper, Meters, PcieSampler, StepTimer, ThroughputMeter

__all__ = ["NA", "GPU_KEYS", "TORCH_KEYS", "HOST_KEYS", "CPU_KEYS", "NBTOOLS_KEYS", "DISK_KEYS",
           "LINK_KEYS", "fmt_bytes", "fmt_rate", "fmt_count", "fmt_seconds", "SystemBackend",
           "CounterUnwrapper", "PcieSampler", "Meters", "ThroughputMeter", "StepTimer",
           "History", "diagnose", "Warnings", "MonitorConfig", "Monitor", "RunMeans", "RUN_MEAN_KEYS",
           "measure_bandwidth"]
