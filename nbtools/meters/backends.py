"""Where readings come from: NVML, torch's CUDA allocator, psutil or /proc, and nbtools' own
counters (:class:`SystemBackend`). Each reader returns a dict with a fixed set of keys (units in
the names), ``None`` where a reading cannot be had. Fakes for tests live in :mod:`nbtools.testing`.
"""
from __future__ import annotations

import os
import sys

NA = None   # a reading that cannot be had

# Usable bytes/s per lane and direction after line encoding, by PCIe generation.
PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 984.6e6, 4: 1969.2e6, 5: 3938.5e6, 6: 7877e6}

# The keys each reader fills (None when N/A), so that every record has the same columns.
GPU_KEYS = ("gpu_used_bytes", "gpu_total_bytes", "gpu_process_bytes", "gpu_util_percent")
TORCH_KEYS = ("torch_allocated_bytes", "torch_reserved_bytes", "torch_peak_bytes",
              "torch_pinned_bytes")
HOST_KEYS = ("host_total_bytes", "host_used_bytes", "host_available_bytes", "process_rss_bytes")
NBTOOLS_KEYS = ("nbtools_pinned_bytes", "nbtools_h2d_bytes", "nbtools_d2h_bytes",
                "nbtools_cache_lookup_rows", "nbtools_cache_hit_rows", "nbtools_cache_saved_bytes",
                "nbtools_compiled_kernels")
LINK_KEYS = ("pcie_gen", "pcie_width", "link_bytes_per_s")
# the cores this process may use and the machine's; CPU seconds so far, this process's (all its
# threads) and the whole machine's busy time (every process, summed over cores)
CPU_KEYS = ("process_cores", "host_cores", "process_cpu_s", "host_cpu_busy_s")
# nbtools.disk.disk_counters(), every disk table's cumulative traffic, under these names
DISK_COUNTERS = ("read_bytes", "write_bytes", "read_s", "write_s", "lookup_rows", "hit_rows",
                 "wait_s", "ahead_rows")
DISK_KEYS = tuple(f"nbtools_disk_{k}" for k in DISK_COUNTERS)
READERS = {"gpu": GPU_KEYS, "torch_memory": TORCH_KEYS, "host": HOST_KEYS, "cpu": CPU_KEYS,
            "nbtools": NBTOOLS_KEYS, "disk": DISK_KEYS, "link": LINK_KEYS}


class SystemBackend:
    """Real readings: NVML (``nvidia-ml-py``), torch's CUDA allocator, psutil (or /proc) and
    nbtools' own pinned-memory and transfer counters. Any part that is missing reads as N/A;
    :attr:`na_reasons` says why.

    Args:
        device: the compute device whose GPU is read (``"auto"``).
        nvml: ``None`` (default) reads NVML on a CUDA device; ``True`` tries ``pynvml`` on any
            device, ``False`` never; or a module standing in for ``pynvml`` (tests), used on
            any device (device 0's handle where the device is not CUDA).
        psutil: False reads the host from /proc even where psutil is installed.
    """

    def __init__(self, device="auto", *, nvml=None, psutil: bool = True):
        from ..devices import resolve_device   # torch import: keep it out of module import
        self.device = resolve_device(device)
        self.na_reasons: dict[str, str] = {}
        self._nvml = self._handle = None
        self.has_pcie = False
        self._counters_ok = True
        self._process = self._psutil = None
        if psutil:
            try:
                import psutil as ps
                self._psutil = ps
                self._process = ps.Process()
            except ImportError:
                self.na_reasons["psutil"] = "psutil not installed: host readings from /proc"
        if nvml is None:
            nvml = self.device.type == "cuda"
        if nvml is not False:
            self._init_nvml(None if nvml is True else nvml)
        else:
            self.na_reasons["gpu"] = ("no CUDA device" if self.device.type != "cuda"
                                      else "NVML not read (nvml=False)")

    # NVML ------------------------------------------------------------------------------------
    def _init_nvml(self, nv=None):
        if nv is None:
            try:
                import pynvml as nv
            except ImportError:
                self.na_reasons["gpu"] = "NVML unavailable: pip install nvidia-ml-py"
                return
        try:
            nv.nvmlInit()
            self._handle = self._find_handle(nv)
            self._nvml = nv
            self.has_pcie = True
        except Exception as e:   # NVMLError, driver/library mismatch, no device
            self.na_reasons["gpu"] = f"NVML failed: {e}"

    def _find_handle(self, nv):
        """The NVML handle of the torch device: by UUID, then PCI bus id, then index (the CUDA
        index differs from NVML's under CUDA_VISIBLE_DEVICES); device 0's off a CUDA device."""
        if self.device.type != "cuda":
            return nv.nvmlDeviceGetHandleByIndex(0)
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
        memory the driver reserves for itself (hundreds of MiB on a large GPU) and so equals
        nvidia-smi's "memory.used"; version 1's ``used`` (total - free) counts that reserve as used."""
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
        lane = PCIE_LANE_BYTES_PER_S.get(out["pcie_gen"])
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
            from ..devices import host_memory_bytes
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

    def cpu(self):
        """The cores this process may run on (``taskset``, a container's share) and the
        machine's; this process's CPU seconds so far (user + system, every thread), and the
        machine's busy seconds summed over its cores (``/proc/stat``; psutil elsewhere)."""
        from ..devices import usable_cores
        times = os.times()
        out = {"process_cores": usable_cores(), "host_cores": os.cpu_count(),
               "process_cpu_s": times.user + times.system, "host_cpu_busy_s": None}
        try:
            with open("/proc/stat") as f:
                ticks = [int(x) for x in f.readline().split()[1:]]
            # user nice system idle iowait irq softirq steal (guest time is in user already)
            out["host_cpu_busy_s"] = (sum(ticks[:8]) - ticks[3] - ticks[4]) / \
                os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            if self._psutil is not None:
                t = self._psutil.cpu_times()
                out["host_cpu_busy_s"] = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        return out

    def nbtools(self):
        from .. import hostmem
        c = hostmem.transfer_counters()
        cache = hostmem.cache_counters()
        return {"nbtools_pinned_bytes": hostmem.pinned_bytes(),
                "nbtools_h2d_bytes": c["h2d_bytes"], "nbtools_d2h_bytes": c["d2h_bytes"],
                "nbtools_cache_lookup_rows": cache["lookup_rows"],
                "nbtools_cache_hit_rows": cache["hit_rows"],
                "nbtools_cache_saved_bytes": cache["saved_bytes"],
                # the Triton kernels compiled so far (seconds each, at a first launch)
                "nbtools_compiled_kernels": _kernels_compiled()}

    def disk(self):
        """The disk tier's cumulative counters (:func:`nbtools.disk.disk_counters`): bytes read
        and written, seconds in file reads and writes, unique rows looked up and how many were
        in RAM, seconds the loop's thread waited for the disk. N/A while ``nbtools.disk`` is not
        imported: no disk table can exist then, and importing it (and torch) to read zeros is
        not worth it."""
        module = sys.modules.get("nbtools.disk")
        if module is None:
            return dict.fromkeys(DISK_KEYS)
        c = module.disk_counters()
        return {f"nbtools_disk_{k}": c.get(k) for k in DISK_COUNTERS}

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


def _kernels_compiled() -> int:
    """:func:`nbtools.kernels.common.compiled` (0 while the kernels were never imported)."""
    module = sys.modules.get("nbtools.kernels.common")
    return module.compiled() if module is not None else 0


def safe_reading(fn, keys, *args):
    """Call a reader; any failure reads as N/A for its keys (never a crash)."""
    try:
        got = fn(*args)
    except Exception:
        return dict.fromkeys(keys)
    out = dict.fromkeys(keys)
    out.update(got or {})
    return out

