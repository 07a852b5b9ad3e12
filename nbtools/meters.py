"""Headless meters: what the GPU, host RAM, pinned memory, PCIe and the training loop are doing.

Everything here computes and returns plain dicts with units in the keys (``gpu_used_bytes``,
``pcie_rx_bytes_per_s``, ``step_s``); a reading that cannot be had (no GPU, NVML missing or
failing, psutil absent) is ``None``, shown as ``N/A``, never an exception. Time comes from an
injectable clock and the readings from a backend, so :class:`FakeBackend` + :class:`FakeClock`
test all of it without a GPU. :mod:`nbtools.dashboard` only draws what :class:`Monitor` computes.

Facts the design rests on (measured on an H100, see ``shared/DESIGN.md``):

* NVML memory and utilisation queries cost ~0.05 ms: fine once a second from the loop's thread.
* ``nvmlDeviceGetPcieThroughput`` *blocks* ~21 ms per call, and the cumulative PCIe byte counters
  are 32-bit and wrap every 4 GiB (~75 ms at full speed). Neither can be read from the training
  loop at 1 Hz: :class:`PcieSampler` reads them from a background thread (NVML releases the GIL
  inside the C call), polling the counters fast enough to unwrap them, or else the throughput
  query a few times a second.
* Nothing in NVML or /proc reports CUDA-pinned host memory: nbtools counts its own
  (:func:`nbtools.hostmem.pinned_bytes`), torch's caching host allocator reports its own.
* ``utilization.gpu`` reads ~100% during a pure copy: :func:`diagnose` looks at PCIe first.

Example (fake backend and clock, as in the tests)::

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

import collections
import dataclasses
import json
import math
import os
import threading
import time

from .devices import human_bytes

NA = None   # a reading that cannot be had

# Usable bytes/s per lane and direction after line encoding, by PCIe generation.
_PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 984.6e6, 4: 1969.2e6, 5: 3938.5e6, 6: 7877e6}

# The keys each reader fills (None when N/A), so that every record has the same columns.
GPU_KEYS = ("gpu_used_bytes", "gpu_total_bytes", "gpu_process_bytes", "gpu_util_percent")
TORCH_KEYS = ("torch_allocated_bytes", "torch_reserved_bytes", "torch_peak_bytes",
              "torch_pinned_bytes")
HOST_KEYS = ("host_total_bytes", "host_used_bytes", "host_available_bytes", "process_rss_bytes")
NBTOOLS_KEYS = ("nbtools_pinned_bytes", "nbtools_h2d_bytes", "nbtools_d2h_bytes")
LINK_KEYS = ("pcie_gen", "pcie_width", "link_bytes_per_s")
_READERS = {"gpu": GPU_KEYS, "torch_memory": TORCH_KEYS, "host": HOST_KEYS,
            "nbtools": NBTOOLS_KEYS, "link": LINK_KEYS}


# --- formatting ---------------------------------------------------------------------------------

def fmt_bytes(n) -> str:
    """``12.3 GiB``, or ``N/A`` for a missing reading.

    >>> fmt_bytes(3 * 2**30), fmt_bytes(None)
    ('3.0 GiB', 'N/A')
    """
    return human_bytes(n)


def fmt_rate(bytes_per_s) -> str:
    """Link rates in decimal GB/s, as PCIe is specified.

    >>> fmt_rate(48.2e9), fmt_rate(None)
    ('48.2 GB/s', 'N/A')
    """
    if bytes_per_s is None:
        return "N/A"
    if bytes_per_s >= 1e9 or bytes_per_s == 0:
        return f"{bytes_per_s / 1e9:.1f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def fmt_count(x) -> str:
    """``12.3k``, ``4.56M``.

    >>> fmt_count(12345), fmt_count(4.56e6), fmt_count(None)
    ('12.3k', '4.56M', 'N/A')
    """
    if x is None:
        return "N/A"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            v = x / div
            return f"{v:.3g}{suffix}" if v < 100 else f"{v:.0f}{suffix}"
    return f"{x:.3g}" if x != int(x) else f"{int(x)}"


def fmt_seconds(s) -> str:
    """Durations: ``850 µs``, ``5.1 ms``, ``2.35 s``, ``1:02:03``.

    >>> fmt_seconds(0.0051), fmt_seconds(3723), fmt_seconds(None)
    ('5.1 ms', '1:02:03', 'N/A')
    """
    if s is None:
        return "N/A"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 60:
        return f"{s:.3g} s"
    s = int(s)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def _frac(part, whole):
    """part / whole, or None when either is missing or whole is 0."""
    if part is None or not whole:
        return None
    return part / whole


def _add(*xs):
    """Sum that is N/A only when every term is."""
    xs = [x for x in xs if x is not None]
    return sum(xs) if xs else None


# --- clocks and backends ------------------------------------------------------------------------

class FakeClock:
    """A clock the test moves by hand: ``clock()`` returns seconds, ``clock.advance(dt)``."""

    def __init__(self, start: float = 0.0):
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeBackend:
    """Deterministic readings for tests and docs, no GPU needed.

    Every reading is an attribute in ``values`` (set it to ``None`` for N/A); the raw PCIe
    counters are ``counter_bits`` wide and wrap like NVML's. Put a reader's name in ``fail``
    (``"gpu"``, ``"host"``, ``"pcie_counters"`` ...) to make it raise.

    >>> b = FakeBackend(gpu_used_bytes=1 << 30)
    >>> b.move(rx_bytes=5 << 30)          # 5 GiB into the GPU: the 32-bit counter wrapped
    >>> b.pcie_counters()[0] == (5 << 30) % 2**32
    True
    """

    DEFAULTS = {
        "gpu_used_bytes": 6 << 30, "gpu_total_bytes": 80 << 30, "gpu_process_bytes": 5 << 30,
        "gpu_util_percent": 60.0,
        "torch_allocated_bytes": 4 << 30, "torch_reserved_bytes": 5 << 30,
        "torch_peak_bytes": 4 << 30, "torch_pinned_bytes": 0,
        "host_total_bytes": 64 << 30, "host_used_bytes": 20 << 30,
        "host_available_bytes": 44 << 30, "process_rss_bytes": 12 << 30,
        "nbtools_pinned_bytes": 8 << 30, "nbtools_h2d_bytes": 0, "nbtools_d2h_bytes": 0,
        "pcie_gen": 5, "pcie_width": 16, "link_bytes_per_s": 16 * _PCIE_LANE_BYTES_PER_S[5],
    }

    has_pcie = True

    def __init__(self, counter_bits: int = 32, clock=None, **values):
        unknown = set(values) - set(self.DEFAULTS)
        if unknown:
            raise TypeError(f"FakeBackend got unknown readings {sorted(unknown)}; "
                            f"known: {sorted(self.DEFAULTS)}")
        self.values = {**self.DEFAULTS, **values}
        self.counter_bits = counter_bits
        self.raw = [0, 0]                  # PCIe rx, tx counters as NVML would show them
        self.throughput = [None, None]     # what the blocking throughput query returns (B/s)
        self.fail: set[str] = set()
        self.calls = collections.Counter()
        self.clock = clock              # times FakeEvent.record() when given
        self.events: list[FakeEvent] = []

    def gpu_done(self) -> None:
        """The fake GPU catches up: every event recorded so far completes."""
        for e in self.events:
            e.done = True

    def move(self, rx_bytes: int = 0, tx_bytes: int = 0, nbtools: bool = False) -> None:
        """Pretend bytes crossed PCIe (rx: into the GPU); ``nbtools=True`` counts them as moved
        by nbtools too."""
        m = 1 << self.counter_bits
        self.raw = [(self.raw[0] + rx_bytes) % m, (self.raw[1] + tx_bytes) % m]
        if nbtools:
            self.values["nbtools_h2d_bytes"] += rx_bytes
            self.values["nbtools_d2h_bytes"] += tx_bytes

    def _read(self, name, keys):
        self.calls[name] += 1
        if name in self.fail:
            raise RuntimeError(f"fake {name} failure")
        return {k: self.values[k] for k in keys}

    def gpu(self):
        return self._read("gpu", GPU_KEYS)

    def torch_memory(self):
        return self._read("torch_memory", TORCH_KEYS)

    def host(self):
        return self._read("host", HOST_KEYS)

    def nbtools(self):
        return self._read("nbtools", NBTOOLS_KEYS)

    def link(self):
        return self._read("link", LINK_KEYS)

    def pcie_counters(self):
        self._read("pcie_counters", ())
        return tuple(self.raw)

    def pcie_throughput(self, direction: str):
        self._read("pcie_throughput", ())
        return self.throughput[0 if direction == "rx" else 1]

    def event(self):
        """A :class:`FakeEvent` when the backend has a clock (fake GPU timing), else None
        (phases are timed with the host clock, as on a CPU)."""
        if self.clock is None:
            return None
        e = FakeEvent(self.clock)
        self.events.append(e)
        return e

    def close(self):
        pass


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: records the fake clock's time; ``query()`` is False
    until the test calls :meth:`FakeBackend.gpu_done` (the GPU has caught up)."""

    def __init__(self, clock):
        self.clock = clock
        self.done = False
        self.t = None

    def record(self, stream=None):
        self.t = self.clock()
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


class SystemBackend:
    """Real readings: NVML (``nvidia-ml-py``), torch's CUDA allocator, psutil (or /proc) and
    nbtools' own pinned-memory and transfer counters. Any part that is missing reads as N/A;
    :attr:`na_reasons` says why."""

    def __init__(self, device="auto"):
        from .devices import resolve_device   # torch import: keep it out of module import
        self.device = resolve_device(device)
        self.na_reasons: dict[str, str] = {}
        self._nvml = self._handle = None
        self.has_pcie = False
        self._counters_ok = True
        self._process = None
        try:
            import psutil
            self._psutil = psutil
            self._process = psutil.Process()
        except ImportError:
            self._psutil = None
            self.na_reasons["psutil"] = "psutil not installed: host readings from /proc"
        if self.device.type == "cuda":
            self._init_nvml()
        else:
            self.na_reasons["gpu"] = "no CUDA device"

    # NVML ------------------------------------------------------------------------------------
    def _init_nvml(self):
        try:
            import pynvml
        except ImportError:
            self.na_reasons["gpu"] = "NVML unavailable: pip install nvidia-ml-py"
            return
        try:
            pynvml.nvmlInit()
            self._handle = self._find_handle(pynvml)
            self._nvml = pynvml
            self.has_pcie = True
        except Exception as e:   # NVMLError, driver/library mismatch, no device
            self.na_reasons["gpu"] = f"NVML failed: {e}"

    def _find_handle(self, nv):
        """The NVML handle of the torch device: by UUID, then PCI bus id, then index (the CUDA
        index differs from NVML's under CUDA_VISIBLE_DEVICES)."""
        import torch
        index = self.device.index or 0
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "")
        for u in ([uuid, f"GPU-{uuid}"] if uuid else []):
            try:
                return nv.nvmlDeviceGetHandleByUUID(u)
            except Exception:
                pass
        if hasattr(props, "pci_bus_id"):
            bus = (f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:"
                   f"{getattr(props, 'pci_device_id', 0):02X}.0")
            try:
                return nv.nvmlDeviceGetHandleByPciBusId(bus)
            except Exception:
                pass
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
        if index < len(visible) and visible[index].strip().isdigit():
            index = int(visible[index])
        return nv.nvmlDeviceGetHandleByIndex(index)

    def gpu(self):
        out = dict.fromkeys(GPU_KEYS)
        nv, h = self._nvml, self._handle
        if nv is None:
            return out
        try:
            mem = self._memory_info(nv, h)
            out["gpu_used_bytes"], out["gpu_total_bytes"] = int(mem.used), int(mem.total)
        except Exception:
            pass
        try:
            out["gpu_util_percent"] = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
        except Exception:
            pass
        try:   # in a container the PIDs NVML reports are the host's: then N/A
            pid = os.getpid()
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    out["gpu_process_bytes"] = int(p.usedGpuMemory)
        except Exception:
            pass
        return out

    @staticmethod
    def _memory_info(nv, h):
        """NVML's memory info, version 2 where the library has it: its ``used`` leaves out the
        memory the driver reserves for itself (480 MiB on an H100) and so equals nvidia-smi's
        "memory.used"; version 1's ``used`` (total - free) counts that reserve as used."""
        v2 = getattr(nv, "nvmlMemory_v2", None)
        if v2 is not None:
            try:
                return nv.nvmlDeviceGetMemoryInfo(h, version=v2)
            except Exception:   # older driver or binding: fall back to version 1
                pass
        return nv.nvmlDeviceGetMemoryInfo(h)

    def link(self):
        out = dict.fromkeys(LINK_KEYS)
        if self._nvml is None:
            return out
        nv, h = self._nvml, self._handle
        # the maximum the GPU *and* the slot allow: an idle link drops to gen 1 to save power
        out["pcie_gen"] = int(nv.nvmlDeviceGetMaxPcieLinkGeneration(h))
        out["pcie_width"] = int(nv.nvmlDeviceGetMaxPcieLinkWidth(h))
        lane = _PCIE_LANE_BYTES_PER_S.get(out["pcie_gen"])
        out["link_bytes_per_s"] = lane * out["pcie_width"] if lane else None
        return out

    def pcie_counters(self):
        """Raw cumulative (rx, tx) bytes from the GPU's point of view (rx: into the GPU), as
        NVML keeps them (they wrap); None where the driver does not have them."""
        if self._nvml is None or not self._counters_ok:
            return None
        nv = self._nvml
        vals = nv.nvmlDeviceGetFieldValues(
            self._handle, [nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES])
        out = []
        for v in vals:
            if int(v.nvmlReturn) != 0:
                self._counters_ok = False     # not supported here: stop asking
                self.na_reasons["pcie_counters"] = f"NVML PCIe byte counters: error {int(v.nvmlReturn)}"
                return None
            t = int(v.valueType)
            out.append(int(v.value.ullVal if t == nv.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG else
                           v.value.ulVal if t == nv.NVML_VALUE_TYPE_UNSIGNED_LONG else v.value.uiVal))
        return tuple(out)

    def pcie_throughput(self, direction: str):
        """NVML's PCIe throughput over a 20 ms window, bytes/s. Blocks ~21 ms: never call this
        from the training loop's thread."""
        if self._nvml is None:
            return None
        nv = self._nvml
        which = nv.NVML_PCIE_UTIL_RX_BYTES if direction == "rx" else nv.NVML_PCIE_UTIL_TX_BYTES
        return nv.nvmlDeviceGetPcieThroughput(self._handle, which) * 1024.0   # KiB/s -> B/s

    # torch, host, nbtools ----------------------------------------------------------------------
    def torch_memory(self):
        out = dict.fromkeys(TORCH_KEYS)
        if self.device.type != "cuda":
            return out
        import torch
        if not torch.cuda.is_initialized():   # asking would create a CUDA context (~500 MB)
            return dict.fromkeys(TORCH_KEYS, 0)
        d = self.device
        out["torch_allocated_bytes"] = torch.cuda.memory_allocated(d)
        out["torch_reserved_bytes"] = torch.cuda.memory_reserved(d)
        out["torch_peak_bytes"] = torch.cuda.max_memory_allocated(d)
        try:   # torch's caching host allocator (pin_memory=True tensors), torch >= 2.5
            stats = torch.cuda.host_memory_stats()
            out["torch_pinned_bytes"] = int(stats.get("allocated_bytes.current",
                                                      stats.get("reserved_bytes.current", 0)))
        except Exception:
            pass
        return out

    def host(self):
        out = dict.fromkeys(HOST_KEYS)
        if self._psutil is not None:
            vm = self._psutil.virtual_memory()
            out["host_total_bytes"], out["host_available_bytes"] = int(vm.total), int(vm.available)
            out["process_rss_bytes"] = int(self._process.memory_info().rss)
        else:
            from .devices import host_memory_bytes
            mem = host_memory_bytes()
            out["host_total_bytes"], out["host_available_bytes"] = mem["total"], mem["available"]
            try:
                with open("/proc/self/statm") as f:
                    out["process_rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                pass
        if out["host_total_bytes"] is not None and out["host_available_bytes"] is not None:
            # "used" = what cannot be handed to a new allocation (includes pinned pages)
            out["host_used_bytes"] = out["host_total_bytes"] - out["host_available_bytes"]
        return out

    def nbtools(self):
        from . import hostmem
        c = hostmem.transfer_counters()
        return {"nbtools_pinned_bytes": hostmem.pinned_bytes(),
                "nbtools_h2d_bytes": c["h2d_bytes"], "nbtools_d2h_bytes": c["d2h_bytes"]}

    def event(self):
        """A CUDA timing event, or None on the CPU (the host clock times phases then)."""
        if self.device.type != "cuda":
            return None
        import torch
        return torch.cuda.Event(enable_timing=True)

    def close(self):
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def _safe(fn, keys, *args):
    """Call a reader; any failure reads as N/A for its keys (never a crash)."""
    try:
        got = fn(*args)
    except Exception:
        return dict.fromkeys(keys)
    out = dict.fromkeys(keys)
    out.update(got or {})
    return out


# --- PCIe ---------------------------------------------------------------------------------------

class CounterUnwrapper:
    """Turns a wrapping hardware counter into a running 64-bit total.

    A delta is only trusted when the gap since the last read is short enough that the counter
    cannot have wrapped more than once: ``gap < 2**bits / max_rate``. Longer gaps are dropped
    (their bytes *and* their time), so rates stay right, just averaged over fewer intervals.

    >>> u = CounterUnwrapper(bits=8, max_rate=100.0)   # wraps at 256; safe gap < 2.56 s
    >>> u.update(250, t=0.0), u.update(10, t=1.0)       # 250 -> 256+10: 16 bytes moved
    (None, 16)
    >>> u.update(100, t=10.0) is None                   # 9 s gap: could have wrapped 3 times
    True
    """

    def __init__(self, bits: int = 32, max_rate: float | None = None):
        self.bits = bits
        self.max_rate = max_rate
        self._last = None   # (value, t)

    def safe_gap_s(self) -> float:
        return (1 << self.bits) / self.max_rate if self.max_rate else math.inf

    def update(self, value: int, t: float):
        """Feed a raw reading at time t; returns the bytes since the previous reading, or None
        (first reading, or a gap too long to unwrap)."""
        if value >= (1 << self.bits):      # the counter is wider than assumed
            self.bits = 64
        last, self._last = self._last, (value, t)
        if last is None:
            return None
        if t - last[1] >= self.safe_gap_s():
            return None
        return (value - last[0]) % (1 << self.bits)


class PcieSampler:
    """PCIe rx/tx bytes/s, read off the training thread.

    With NVML's cumulative byte counters it polls every ``poll_s`` (20 ms: well inside the
    ~70 ms a 32-bit counter takes to wrap at Gen5 x16 speed) and averages over the intervals it
    could unwrap. Without them it falls back to the throughput query (which blocks ~21 ms),
    alternating rx and tx a few times a second. :meth:`poll` is one step of that loop;
    :meth:`start` runs it on a daemon thread; tests call :meth:`poll` by hand.
    """

    def __init__(self, backend, clock=time.monotonic, *, poll_s: float = 0.02,
                 bits: int = 32, max_rate: float | None = None):
        self.backend = backend
        self.clock = clock
        self.poll_s = poll_s
        # the counters cannot grow faster than the link; 25% margin (protocol bytes, rounding):
        # at Gen5 x16 a poll gap up to ~54 ms can be unwrapped
        bound = 1.25 * (max_rate or 16 * _PCIE_LANE_BYTES_PER_S[6])
        self._unwrap = (CounterUnwrapper(bits, bound), CounterUnwrapper(bits, bound))
        self._lock = threading.Lock()
        self._acc = [0, 0]          # bytes over trusted intervals since the last read()
        self._acc_t = [0.0, 0.0]    # seconds of trusted intervals since the last read()
        self._last_t = [None, None]
        self._latest = [None, None]
        self.source = None          # "counters", "throughput" or None (N/A)
        self._direction = 0
        self._thread = None
        self._stop = threading.Event()

    def poll(self) -> None:
        if self.source in (None, "counters"):
            try:
                raw = self.backend.pcie_counters()
            except Exception:
                raw = None
            if raw is not None:
                self.source = "counters"
                now = self.clock()
                with self._lock:
                    for i in (0, 1):
                        last_t = self._last_t[i]
                        delta = self._unwrap[i].update(raw[i], now)
                        self._last_t[i] = now
                        if delta is not None:
                            self._acc[i] += delta
                            self._acc_t[i] += now - last_t
                return
        # fall back on the blocking throughput query, one direction per poll
        i = self._direction
        self._direction ^= 1
        try:
            rate = self.backend.pcie_throughput("rx" if i == 0 else "tx")
        except Exception:
            rate = None
        if rate is not None:
            self.source = "throughput"
            with self._lock:
                self._latest[i] = float(rate)
        elif self.source is None and i == 1:
            self.source = "n/a"

    def read(self) -> dict:
        """Average rx/tx bytes/s since the previous read (counters) or the latest reading
        (throughput query); N/A when neither is available."""
        with self._lock:
            if self.source == "counters":
                for i in (0, 1):
                    if self._acc_t[i] > 0:
                        self._latest[i] = self._acc[i] / self._acc_t[i]
                    self._acc[i], self._acc_t[i] = 0, 0.0
            rx, tx = self._latest
        src = self.source if self.source in ("counters", "throughput") else None
        return {"pcie_rx_bytes_per_s": rx, "pcie_tx_bytes_per_s": tx, "pcie_source": src}

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nbtools-pcie", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.poll()
            if self.source == "n/a":
                return                       # nothing to read on this machine
            # the throughput query already spent ~21 ms; a few readings a second are plenty
            self._stop.wait(self.poll_s if self.source == "counters" else 0.2)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None


# --- resource meters ----------------------------------------------------------------------------

class Meters:
    """Samples GPU, torch, host, pinned-memory and PCIe readings into one flat dict.

    Args:
        backend: where readings come from (default :class:`SystemBackend` for ``device``).
        clock: seconds, monotonic (default ``time.monotonic``).
        device: compute device for the default backend (``"auto"``).
        pcie: ``"thread"`` polls PCIe on a daemon thread, ``"manual"`` leaves
            :meth:`PcieSampler.poll` to the caller (tests), ``"off"``; ``"auto"`` (default)
            is ``"thread"`` for the system backend where NVML works, else ``"manual"``.

    >>> m = Meters(FakeBackend(), clock=FakeClock())
    >>> r = m.read()
    >>> r["gpu_total_bytes"] == 80 << 30, r["pinned_bytes"] == 8 << 30
    (True, True)
    """

    def __init__(self, backend=None, *, clock=None, device="auto", pcie: str = "auto"):
        if pcie not in ("auto", "thread", "manual", "off"):
            raise ValueError(f"pcie={pcie!r}: expected 'auto', 'thread', 'manual' or 'off'")
        self.backend = backend if backend is not None else SystemBackend(device)
        if pcie == "auto":
            system = isinstance(self.backend, SystemBackend) and self.backend.has_pcie
            pcie = "thread" if system else "manual"
        self.clock = clock or time.monotonic
        link = _safe(self.backend.link, LINK_KEYS)
        self.link = link
        self.pcie = PcieSampler(self.backend, self.clock, max_rate=link["link_bytes_per_s"])
        self._pcie_mode = pcie
        self._last = None   # (t, h2d, d2h) for nbtools' rates

    def read(self) -> dict:
        if self._pcie_mode == "thread" and self.pcie._thread is None and self.pcie.source != "n/a":
            self.pcie.start()
        now = self.clock()
        rec = {"time_s": now}
        for name, keys in _READERS.items():
            if name == "link":
                rec.update(self.link)
            else:
                rec.update(_safe(getattr(self.backend, name), keys))
        rec["pinned_bytes"] = _add(rec["nbtools_pinned_bytes"], rec["torch_pinned_bytes"])
        h2d, d2h = rec["nbtools_h2d_bytes"], rec["nbtools_d2h_bytes"]
        rec["nbtools_h2d_bytes_per_s"] = rec["nbtools_d2h_bytes_per_s"] = None
        if self._last is not None and now > self._last[0]:
            dt = now - self._last[0]
            if h2d is not None and self._last[1] is not None:
                rec["nbtools_h2d_bytes_per_s"] = (h2d - self._last[1]) / dt
            if d2h is not None and self._last[2] is not None:
                rec["nbtools_d2h_bytes_per_s"] = (d2h - self._last[2]) / dt
        self._last = (now, h2d, d2h)
        if self._pcie_mode == "off":
            rec.update(pcie_rx_bytes_per_s=None, pcie_tx_bytes_per_s=None, pcie_source=None)
        else:
            rec.update(self.pcie.read())
        return rec

    def close(self) -> None:
        self.pcie.stop()


# --- loop meters --------------------------------------------------------------------------------

class ThroughputMeter:
    """Samples (words, rows, ...) per second over a sliding window.

    ``update(n)`` is cheap enough to call every step; :meth:`read` returns
    ``{"unit", "samples_total", "samples_per_s", "mean_samples_per_s", "elapsed_s"}``. Rates
    count from the end of the first step (the time before it, spent building the model or
    waiting for the first batch, is not throughput); ``elapsed_s`` counts from the start.

    >>> clock = FakeClock()
    >>> tm = ThroughputMeter("rows", clock=clock, window_s=10)
    >>> for _ in range(30):
    ...     clock.advance(1.0); tm.update(500)
    >>> tm.read()["samples_per_s"], tm.read()["samples_total"]
    (500.0, 15000)
    """

    def __init__(self, unit: str = "samples", *, clock=None, window_s: float = 10.0):
        self.unit = unit
        self.clock = clock or time.monotonic
        self.window_s = window_s
        self.reset()

    def reset(self) -> None:
        self.total = 0
        self._t0 = self.clock()
        # (t, total) checkpoints from the first step on, at most ~50 per window: memory stays
        # small at any step rate
        self._points = collections.deque()
        self._first = None   # (t, total) at the end of the first step

    def update(self, n=1, now: float | None = None) -> None:
        self.total += n
        now = self.clock() if now is None else now
        if self._first is None:
            self._first = (now, self.total)
            self._points.append(self._first)
        elif now - self._points[-1][0] >= self.window_s / 50:
            self._points.append((now, self.total))
            while len(self._points) > 2 and now - self._points[1][0] >= self.window_s:
                self._points.popleft()

    def rate_per_s(self, now: float | None = None):
        now = self.clock() if now is None else now
        if not self._points:
            return None
        t_old, n_old = self._points[0]
        if now - t_old >= self.window_s and len(self._points) > 1:
            # interpolate to exactly one window back, so the rate does not lag by a checkpoint
            t1, n1 = self._points[1]
            t_w = now - self.window_s
            if t1 > t_old and t_w > t_old:
                n_old += (n1 - n_old) * min(1.0, (t_w - t_old) / (t1 - t_old))
                t_old = min(t_w, t1)
        if now <= t_old:
            return None
        return (self.total - n_old) / (now - t_old)

    def read(self, now: float | None = None) -> dict:
        now = self.clock() if now is None else now
        mean = None
        if self._first is not None and now > self._first[0]:
            mean = (self.total - self._first[1]) / (now - self._first[0])
        return {"unit": self.unit, "samples_total": self.total,
                "samples_per_s": self.rate_per_s(now), "mean_samples_per_s": mean,
                "elapsed_s": now - self._t0}


class _Phase:
    """Context manager timing one phase of a step (see :class:`StepTimer`)."""

    __slots__ = ("timer", "name", "_start")

    def __init__(self, timer, name):
        self.timer, self.name = timer, name

    def __enter__(self):
        self._start = self.timer._begin()
        return self

    def __exit__(self, *exc):
        self.timer._end(self.name, self._start)
        return False


class StepTimer:
    """Step time, and how much of it goes to data wait, host<->GPU transfer and compute.

    Data wait is host time spent in ``next()`` of the loader (wrap it with :meth:`data`).
    Transfer and compute are GPU time between CUDA events recorded around the ``with
    timer.transfer():`` / ``with timer.compute():`` blocks. The events are resolved lazily with
    ``event.query()`` when later steps end: there is no device sync, ever. On the CPU the host
    clock times the phases. Only steps at least ``min_interval_s`` apart are timed, which bounds
    the cost at any step rate; a phase's share is taken over the timed steps' own wall time and
    applied to the mean step, so the sample does not bias it. The first step is warm-up and not
    measured.

    >>> clock = FakeClock()
    >>> st = StepTimer(clock=clock)
    >>> for _ in range(5):
    ...     clock.advance(0.002)          # waiting for data
    ...     with st.compute():
    ...         clock.advance(0.008)
    ...     st.step()
    >>> r = st.read()
    >>> round(r["step_s"], 4), round(r["compute_s"], 4), r["data_wait_s"]
    (0.01, 0.008, None)
    """

    PHASES = ("transfer", "compute")
    MAX_PENDING = 256   # unresolved event pairs kept; beyond this a step is not timed

    def __init__(self, *, clock=None, event_factory=None, min_interval_s: float = 0.0):
        self.clock = clock or time.monotonic
        self.event_factory = event_factory   # None: host clock; else () -> event
        self.min_interval_s = min_interval_s
        self._pending = collections.deque()  # (phase, start event, end event, step record)
        self._pool = []                      # resolved events, reused
        self._open = collections.deque()     # records of timed steps not yet folded in
        self._cur = None                     # record of the step running now, if timed
        self._last_timed = -math.inf
        self._t_step = None
        self._last_out = dict.fromkeys(("step_s", "data_wait_s", "transfer_s", "compute_s"))
        self._all = self._zeros()            # sums over the whole run
        self._win = self._zeros()            # sums since the last read()

    @staticmethod
    def _zeros() -> dict:
        return {"step": 0.0, "n_step": 0, "data_wait": 0.0, "n_data_wait": 0,
                "timed_step": 0.0, "transfer": 0.0, "n_transfer": 0, "compute": 0.0,
                "n_compute": 0}

    def _add(self, sums: dict) -> None:
        for acc in (self._win, self._all):
            for k, v in sums.items():
                acc[k] += v

    # phases ----------------------------------------------------------------------------------
    def transfer(self) -> _Phase:
        """``with timer.transfer():`` around host<->GPU copies."""
        return _Phase(self, "transfer")

    def compute(self) -> _Phase:
        """``with timer.compute():`` around forward/backward/optimizer step."""
        return _Phase(self, "compute")

    def data(self, iterable):
        """Yield from ``iterable``, timing each ``next()`` as data wait."""
        it = iter(iterable)
        while True:
            t0 = self.clock()
            try:
                item = next(it)
            except StopIteration:
                return
            if self._t_step is not None:     # not the first (warm-up) step
                self._add({"data_wait": self.clock() - t0, "n_data_wait": 1})
            yield item

    def _begin(self):
        rec = self._cur
        if rec is None:
            return None
        if self.event_factory is None:
            return self.clock()
        if len(self._pending) >= self.MAX_PENDING:
            rec["complete"] = False          # a phase is missing: leave this step out
            return None
        ev = self._pool.pop() if self._pool else self.event_factory()
        ev.record()
        return ev

    def _end(self, name, start):
        if start is None:
            return
        rec = self._cur
        if self.event_factory is None:
            rec[name] = rec.get(name, 0.0) + self.clock() - start
            return
        end = self._pool.pop() if self._pool else self.event_factory()
        end.record()
        rec["pending"] += 1
        self._pending.append((name, start, end, rec))

    def _resolve(self):
        """Collect GPU timings the device has already reached (no sync), and fold steps whose
        phases are all known into the sums."""
        while self._pending:
            name, start, end, rec = self._pending[0]
            if not end.query():
                break
            self._pending.popleft()
            rec[name] = rec.get(name, 0.0) + start.elapsed_time(end) / 1e3
            rec["pending"] -= 1
            self._pool += (start, end)
        while self._open and self._open[0]["pending"] == 0 and "wall" in self._open[0]:
            rec = self._open.popleft()
            if rec["complete"]:
                sums = {"timed_step": rec["wall"]}
                for name in self.PHASES:
                    if name in rec:
                        sums[name], sums["n_" + name] = rec[name], 1
                self._add(sums)

    def step(self, now: float | None = None) -> None:
        """Mark the end of a step."""
        now = self.clock() if now is None else now
        if self._t_step is not None:
            self._add({"step": now - self._t_step, "n_step": 1})
            if self._cur is not None:
                self._cur["wall"] = now - self._t_step
        self._t_step = now
        self._cur = None
        if (now - self._last_timed >= self.min_interval_s       # time the next step
                and len(self._pending) < self.MAX_PENDING):
            self._last_timed = now
            self._cur = {"pending": 0, "complete": True}
            self._open.append(self._cur)
        if self._pending or len(self._open) > 1:
            self._resolve()

    def read(self, whole_run: bool = False) -> dict:
        """Mean seconds per step since the previous read (or over the whole run): ``step_s``,
        ``data_wait_s``, ``transfer_s``, ``compute_s`` (None where nothing was measured)."""
        self._resolve()
        acc = self._all if whole_run else self._win
        step = acc["step"] / acc["n_step"] if acc["n_step"] else None
        out = {"step_s": step,
               "data_wait_s": acc["data_wait"] / acc["n_data_wait"] if acc["n_data_wait"] else None}
        for name in self.PHASES:
            if not acc["n_" + name]:
                out[f"{name}_s"] = None
            elif step is not None and acc["timed_step"] > 0:
                out[f"{name}_s"] = acc[name] / acc["timed_step"] * step
            else:
                out[f"{name}_s"] = acc[name] / acc["n_" + name]
        if acc["n_step"] or acc["n_data_wait"]:   # else keep the last reading (no step ended)
            self._last_out = out
        self._win = self._zeros()
        return dict(self._last_out)


# --- history ------------------------------------------------------------------------------------

class History:
    """Records (dicts) in memory, optionally appended as JSON lines to ``path`` as they come, so
    that the history survives a disconnect and can be re-plotted after resuming.

    Loading skips a torn last line (a write cut off by the disconnect). Memory stays bounded:
    past ``max_records`` every other old record is dropped (the plot does not need them all).

    >>> import tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "meters.jsonl")
    >>> h = History(p)
    >>> h.append({"time_s": 0.0, "gpu_used_bytes": 1}); h.append({"time_s": 1.0, "gpu_used_bytes": None})
    >>> h.close()
    >>> History.load(p).column("gpu_used_bytes")
    [1, None]
    """

    def __init__(self, path=None, *, max_records: int = 20_000):
        self.path = os.fspath(path) if path is not None else None
        self.max_records = max_records
        self.records: list[dict] = []
        self.skipped_lines = 0
        self._file = None

    def append(self, record: dict) -> None:
        self.records.append(record)
        if len(self.records) > self.max_records:
            half = len(self.records) // 2
            self.records[:half] = self.records[:half:2]
        if self.path is not None:
            if self._file is None:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            self._file.write(_dumps(record) + "\n")
            self._file.flush()

    def column(self, key: str) -> list:
        return [r.get(key) for r in self.records]

    def __len__(self):
        return len(self.records)

    def save(self, path) -> None:
        """Write all records to ``path`` atomically: a temporary name in the same folder, then a
        rename there (``os.replace`` across file systems, e.g. into a Drive mount, fails)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            for r in self.records:
                f.write(_dumps(r) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path, *, append: bool = False) -> "History":
        """Read a JSONL history; ``append=True`` keeps writing new records to the same file."""
        h = cls(path if append else None)
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    h.records.append(json.loads(line))
                except json.JSONDecodeError:
                    h.skipped_lines += 1
        if append:
            # a torn last line would glue onto the next record: start on a fresh line
            with open(path, "rb+") as f:
                if f.seek(0, os.SEEK_END) > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
        return h

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _dumps(record: dict) -> str:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in record.items()}
    return json.dumps(clean, separators=(",", ":"))


# --- diagnosis and warnings ---------------------------------------------------------------------

_FEWER_BYTES = "fewer bytes per row help (bf16 tables, an optimizer with less state)"


def diagnose(record: dict, *, link_bytes_per_s: float | None = None) -> str:
    """One line saying what bounds the run, from one record.

    The checks, in order: the loader (data wait), the PCIe link (NVML rates, or the bytes nbtools
    moved, against the link's speed; nbtools' zero-copy reads plus writes against it), the step
    timer's transfer share, then GPU utilisation.
    PCIe comes before utilisation because ``utilization.gpu`` reads ~100% during pure copies.

    >>> diagnose({"pcie_rx_bytes_per_s": 48e9, "link_bytes_per_s": 55e9, "step_s": 0.005})
    'transfer-bound: PCIe RX at 48 of 55 GB/s; fewer bytes per row help (bf16 tables, an optimizer with less state)'
    >>> diagnose({"nbtools_h2d_bytes_per_s": 18e9, "nbtools_d2h_bytes_per_s": 18e9,
    ...           "link_bytes_per_s": 63e9, "gpu_util_percent": 88})[:58]
    'transfer-bound: nbtools moves 36 GB/s of rows (18 in, 18 o'
    >>> diagnose({"gpu_util_percent": 97.0, "step_s": 0.005})
    'compute-bound: GPU busy 97%; a larger batch or mixed precision helps'
    """
    r = record
    link = link_bytes_per_s or r.get("link_bytes_per_s")
    step = r.get("step_s")
    data_frac = _frac(r.get("data_wait_s"), step)
    if data_frac is not None and data_frac >= 0.3:
        return (f"data-bound: {data_frac:.0%} of each step waits for the next batch; "
                "use PinnedLoader, more loader workers or a larger batch")
    rx = _max(r.get("pcie_rx_bytes_per_s"), r.get("nbtools_h2d_bytes_per_s"))
    tx = _max(r.get("pcie_tx_bytes_per_s"), r.get("nbtools_d2h_bytes_per_s"))
    if link:
        name, rate = ("RX", rx) if (rx or 0) >= (tx or 0) else ("TX", tx)
        if rate is not None and rate >= 0.6 * link:
            return (f"transfer-bound: PCIe {name} at {rate / 1e9:.0f} of {link / 1e9:.0f} GB/s; "
                    f"{_FEWER_BYTES}")
        # Zero-copy reads and writes of table rows share the link (measured on an H100: they do
        # not overlap), and their kernels read as "GPU busy": judge them by their sum.
        h2d, d2h = r.get("nbtools_h2d_bytes_per_s"), r.get("nbtools_d2h_bytes_per_s")
        if h2d is not None and d2h is not None and h2d + d2h >= 0.5 * link:
            return (f"transfer-bound: nbtools moves {(h2d + d2h) / 1e9:.0f} GB/s of rows "
                    f"({h2d / 1e9:.0f} in, {d2h / 1e9:.0f} out) over a {link / 1e9:.0f} GB/s link, "
                    f"and zero-copy reads and writes share it; {_FEWER_BYTES}")
    xfer_frac = _frac(r.get("transfer_s"), step)
    if xfer_frac is not None and xfer_frac >= 0.4:
        return (f"transfer-bound: host<->GPU copies take {xfer_frac:.0%} of each step; "
                "pin the source memory and copy with non_blocking=True, or cache hot rows")
    util = r.get("gpu_util_percent")
    if util is not None:
        if util >= 85:
            return f"compute-bound: GPU busy {util:.0f}%; a larger batch or mixed precision helps"
        if step is not None and util < 50:
            return (f"host-bound: GPU busy only {util:.0f}%; Python or CPU work between kernels "
                    "(larger batches amortise it)")
        pcie = f", PCIe RX {fmt_rate(rx)}" if rx is not None else ""
        return f"balanced: GPU busy {util:.0f}%{pcie}"
    if step is None:
        return "warming up: no steps measured yet"
    return "no GPU readings: CPU run (step time and throughput only)"


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


class Warnings:
    """One-shot warnings before trouble: each kind fires once per run.

    Kinds: ``gpu_memory`` (GPU memory used, or reserved by torch, near its total),
    ``host_memory`` (host RAM, pinned pages included, near the machine's total) and
    ``throughput_drop`` (rate below ``drop_fraction`` of the best seen after a warm-up).

    >>> w = Warnings()
    >>> w.check({"gpu_used_bytes": 79 << 30, "gpu_total_bytes": 80 << 30})
    ['GPU memory 79.0 GiB of 80.0 GiB (99%): the next allocation may fail; use a smaller batch or offload more (nbtools.plan)']
    >>> w.check({"gpu_used_bytes": 79 << 30, "gpu_total_bytes": 80 << 30})
    []
    """

    def __init__(self, *, gpu_fraction: float = 0.92, host_fraction: float = 0.90,
                 drop_fraction: float = 0.5, warmup_s: float = 10.0):
        self.gpu_fraction = gpu_fraction
        self.host_fraction = host_fraction
        self.drop_fraction = drop_fraction
        self.warmup_s = warmup_s
        self.fired: dict[str, str] = {}
        self._best_rate = None

    def check(self, r: dict) -> list[str]:
        """New warnings for this record (each kind at most once per run)."""
        new = []
        total = r.get("gpu_total_bytes")
        used = _max(r.get("gpu_used_bytes"), r.get("torch_reserved_bytes"))
        f = _frac(used, total)
        if f is not None and f >= self.gpu_fraction:
            new += self._fire("gpu_memory", f"GPU memory {fmt_bytes(used)} of {fmt_bytes(total)} "
                              f"({f:.0%}): the next allocation may fail; use a smaller batch or "
                              "offload more (nbtools.plan)")
        total = r.get("host_total_bytes")
        used = r.get("host_used_bytes")
        f = _frac(used, total)
        if f is not None and f >= self.host_fraction:
            pinned = r.get("pinned_bytes")
            of_it = f", {fmt_bytes(pinned)} of it pinned (cannot be swapped)" if pinned else ""
            new += self._fire("host_memory", f"host RAM {fmt_bytes(used)} of {fmt_bytes(total)} "
                              f"used ({f:.0%}){of_it}: the kernel may kill the process; "
                              "free memory or use a smaller table / fewer state tensors")
        rate = r.get("samples_per_s")
        if rate is not None and (r.get("elapsed_s") or 0) >= self.warmup_s:
            if self._best_rate is not None and rate < self.drop_fraction * self._best_rate:
                unit = r.get("unit", "samples")
                new += self._fire("throughput_drop",
                                  f"throughput dropped to {fmt_count(rate)} {unit}/s from "
                                  f"{fmt_count(self._best_rate)} {unit}/s; see the diagnosis line")
            self._best_rate = _max(self._best_rate, rate)
        return new

    def _fire(self, kind, message):
        if kind in self.fired:
            return []
        self.fired[kind] = message
        return [message]


# --- the loop's model ---------------------------------------------------------------------------

@dataclasses.dataclass
class MonitorConfig:
    """Settings of :class:`Monitor` (and of the dashboard that draws it)."""
    refresh_s: float = 1.0            # at most one sample per this many seconds
    max_overhead: float = 0.01        # refresh less often if sampling costs more than this share
    window_s: float = 10.0            # throughput is averaged over this window
    pcie: str = "auto"                # "auto", "thread", "manual" (tests) or "off"
    history_path: str | None = None   # append every record here as JSON lines (next to checkpoints)
    link_bytes_per_s: float | None = None   # measured ceiling (e.g. from bandwidth_check)
    gpu_warn_fraction: float = 0.92
    host_warn_fraction: float = 0.90
    drop_warn_fraction: float = 0.5
    warmup_s: float = 10.0            # no throughput-drop warning before this
    timer_min_interval_s: float = 0.01   # CUDA-event timing of at most ~100 steps per second


class Monitor:
    """The headless model behind :class:`nbtools.Dashboard`: counts steps, and at most once per
    ``refresh_s`` samples every meter into a record, appends it to the history, checks warnings
    and writes the diagnosis.

    Args:
        unit: what a sample is (``"words"``, ``"rows"``); shown as ``words/s``.
        backend: readings (default :class:`SystemBackend`); :class:`FakeBackend` in tests.
        clock: monotonic seconds (default ``time.monotonic``).
        config: :class:`MonitorConfig`.
        history: a :class:`History` to continue (after resuming); its time axis is continued.
    """

    def __init__(self, unit: str = "samples", *, backend=None, clock=None, config=None,
                 history: History | None = None):
        self.config = config or MonitorConfig()
        cfg = self.config
        self.clock = clock or time.monotonic
        self.meters = Meters(backend, clock=self.clock, pcie=cfg.pcie)
        self.throughput = ThroughputMeter(unit, clock=self.clock, window_s=cfg.window_s)
        events = self._event_factory()
        self.timer = StepTimer(clock=self.clock, event_factory=events,   # the host clock is
                               min_interval_s=cfg.timer_min_interval_s if events else 0.0)  # cheap
        self.warnings = Warnings(gpu_fraction=cfg.gpu_warn_fraction,
                                 host_fraction=cfg.host_warn_fraction,
                                 drop_fraction=cfg.drop_warn_fraction, warmup_s=cfg.warmup_s)
        if history is None:
            history = History(cfg.history_path)
        elif cfg.history_path is not None and history.path is None:
            history.path = os.fspath(cfg.history_path)
        self.history = history
        # continue the time axis of a resumed history, one refresh after its last record
        last = next((r["time_s"] for r in reversed(history.records) if "time_s" in r), None)
        self._t_offset = (last + cfg.refresh_s) if last is not None else 0.0
        self._resumed = last is not None
        self._t0 = self.clock()
        self._next = self._t0     # the first step samples at once
        self.steps = 0
        self.record: dict = {}
        self.diagnosis = "warming up: no steps measured yet"
        self.new_warnings: list[str] = []
        self.overhead_s = 0.0
        self._cost = 0.0

    def _event_factory(self):
        b = self.meters.backend
        if not hasattr(b, "event"):
            return None
        try:
            probe = b.event()
        except Exception:
            return None
        return b.event if probe is not None else None

    @property
    def unit(self) -> str:
        return self.throughput.unit

    def step(self, n=1):
        """Count one step of ``n`` samples. Returns the new record when a refresh was due (at
        most once per ``refresh_s``), else None. Costs about a microsecond otherwise."""
        now = self.count(n)
        if now < self._next:
            return None
        return self.refresh(now)

    def count(self, n=1) -> float:
        """Count one step of ``n`` samples without ever refreshing (for a view that refreshes
        from its own thread); returns the clock reading."""
        now = self.clock()
        self.steps += 1
        self.throughput.update(n, now)
        self.timer.step(now)
        return now

    def refresh(self, now: float | None = None, *, final: bool = False) -> dict:
        """Sample every meter now (the view calls this from its thread, and on close with
        ``final=True``: the step-time breakdown is then the whole run's mean)."""
        t_start = time.perf_counter()
        now = self.clock() if now is None else now
        self._cost = 0.0
        rec = self.meters.read()
        rec.update(self.throughput.read(now))
        rec.update(self.timer.read(whole_run=final))
        rec["time_s"] = now - self._t0 + self._t_offset
        rec["step"] = self.steps
        rec["unix_time"] = time.time()
        if self._resumed:
            rec["resumed"] = True
            self._resumed = False
        rec["overhead_percent"] = (100.0 * self.overhead_s / rec["elapsed_s"]
                                   if rec.get("elapsed_s") else None)
        link = self.config.link_bytes_per_s
        self.diagnosis = diagnose(rec, link_bytes_per_s=link)
        rec["diagnosis"] = self.diagnosis
        self.new_warnings = self.warnings.check(rec)
        self.history.append(rec)
        self.record = rec
        self.add_overhead(time.perf_counter() - t_start, now)
        return rec

    def add_overhead(self, seconds: float, now: float | None = None, *,
                     reschedule: bool = True) -> None:
        """Charge time spent on monitoring. With ``reschedule`` (sampling, drawing badges) the
        next refresh moves out so that a refresh costs at most ``max_overhead`` of the time
        between refreshes; the plot, which a view schedules itself, passes False."""
        self.overhead_s += seconds
        if not reschedule:
            return
        self._cost += seconds
        now = self.clock() if now is None else now
        self._next = now + max(self.config.refresh_s, self._cost / self.config.max_overhead)

    def close(self) -> None:
        self.meters.close()
        self.history.close()


# --- machine check ------------------------------------------------------------------------------

def measure_bandwidth(nbytes: int = 256 << 20, *, row_bytes: int = 512, device="auto",
                      repeat: int = 5, progress=None) -> dict:
    """Host<->GPU bandwidth of this machine: pinned and pageable copies both ways, and the
    zero-copy gather rate of random ``row_bytes`` rows from pinned memory (what an offloaded
    table does every step), in bytes/s, with the link's theoretical maximum.

    Without CUDA every rate is N/A. ``progress(name, results_so_far)`` is called before each
    measurement.

    >>> r = measure_bandwidth(1 << 20, device="cpu")
    >>> r["pinned_h2d_bytes_per_s"] is None, r["note"]
    (True, 'no CUDA device: host<->GPU bandwidth is N/A')
    """
    import torch

    from .devices import resolve_device
    from .hostmem import HostTensor, gather_rows

    names = ("pinned_h2d", "pinned_d2h", "pageable_h2d", "pageable_d2h", "zero_copy_gather")
    out = {f"{n}_bytes_per_s": None for n in names}
    out.update(nbytes=int(nbytes), row_bytes=int(row_bytes), link_bytes_per_s=None, note="")
    dev = resolve_device(device)
    if dev.type != "cuda":
        out["note"] = "no CUDA device: host<->GPU bandwidth is N/A"
        return out
    backend = SystemBackend(dev)
    out["link_bytes_per_s"] = _safe(backend.link, LINK_KEYS)["link_bytes_per_s"]
    backend.close()
    dim = max(1, row_bytes // 4)
    rows = max(1, nbytes // (dim * 4))
    host = None
    try:
        host = HostTensor((rows, dim), torch.float32, name="bandwidth-check", device=dev)
        flat = host.tensor.view(-1).view(torch.uint8)
        pageable = torch.zeros_like(flat)     # touched, so page faults are not timed
        gpu = torch.empty(flat.numel(), dtype=torch.uint8, device=dev)

        def timed(fn, moved):
            fn()                                    # warm-up
            torch.cuda.synchronize(dev)             # note: a sync point, fine in a one-off check
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            return moved * repeat / (start.elapsed_time(end) / 1e3)

        nb = flat.numel()
        tests = {
            "pinned_h2d": (lambda: gpu.copy_(flat, non_blocking=True), nb),
            "pinned_d2h": (lambda: flat.copy_(gpu, non_blocking=True), nb),
            "pageable_h2d": (lambda: gpu.copy_(pageable), nb),
            "pageable_d2h": (lambda: pageable.copy_(gpu), nb),
        }
        if host.pinned:
            view = host.view()
            idx = torch.randint(0, rows, (max(1, rows // 4),), device=dev)
            tests["zero_copy_gather"] = (lambda: gather_rows(view, idx), idx.numel() * dim * 4)
        for name, (fn, moved) in tests.items():
            if progress is not None:
                progress(name, dict(out))
            out[f"{name}_bytes_per_s"] = timed(fn, moved)
        if not host.pinned:
            out["note"] = "memory could not be pinned here: pinned and zero-copy rates are N/A"
            out["pinned_h2d_bytes_per_s"] = out["pinned_d2h_bytes_per_s"] = None
    except Exception as e:   # out of memory, pinning refused: report, never crash
        out["note"] = f"measurement failed: {type(e).__name__}: {e}"
    finally:
        if host is not None:
            host.close()
    return out
