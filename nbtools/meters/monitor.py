"""The loop's model: :class:`Monitor` samples every meter into a record, keeps the
:class:`History`, writes the one-line :func:`diagnose` and fires one-shot :class:`Warnings`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from ..files import make_folder, open_append_private, open_regular, write_private
from ..units import fmt_bytes, fmt_count, fmt_rate
from .samplers import Meters, StepTimer, ThroughputMeter


def _frac(part, whole):
    """part / whole, or None when either is missing or whole is 0."""
    if part is None or not whole:
        return None
    return part / whole



# --- history ------------------------------------------------------------------------------------

class History:
    """Records (dicts) in memory, optionally appended as JSON lines to ``path`` as they come, so
    that the history survives a disconnect and can be re-plotted after resuming.

    Loading skips a torn last line (a write cut off by the disconnect). Memory stays bounded:
    past ``max_records`` every other old record is dropped (the plot does not need them all).

    >>> import os, tempfile
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
                # (the user's alone, never through a link, never blocking on a FIFO)
                make_folder(os.path.dirname(os.path.abspath(self.path)))
                self._file = open(open_append_private(self.path, "history file"), "a",
                                  encoding="utf-8")
            self._file.write(_dumps(record) + "\n")
            self._file.flush()

    def column(self, key: str) -> list:
        return [r.get(key) for r in self.records]

    def __len__(self):
        return len(self.records)

    def save(self, path) -> None:
        """Write all records to ``path`` atomically: a new file (mode 0600) in the same folder,
        then a rename there (``os.replace`` across file systems, e.g. into a Drive mount,
        fails); a link at ``path`` is replaced, never written through."""
        write_private(path, "".join(_dumps(r) + "\n" for r in self.records).encode(),
                      fsync=True)

    @classmethod
    def load(cls, path, *, append: bool = False) -> "History":
        """Read a JSONL history; ``append=True`` keeps writing new records to the same file.
        A history from someone else is data: a FIFO or a device at ``path`` raises ValueError
        at once (nothing waits on it). A link to a regular file is followed to read it, not to
        append to it (``append=True`` refuses a link: pass the file's real path)."""
        h = cls(path if append else None)
        fd = open_regular(path, follow=not append, what="history file", error=ValueError)
        with open(fd, encoding="utf-8") as f:
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
            with open(open_regular(path, os.O_RDWR, what="history file", error=ValueError),
                      "rb+") as f:
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


def _disk_share(r: dict):
    """The share of the mean step that the loop's thread waited for the disk, when it is the
    largest share (see :func:`diagnose`), else None."""
    step = r.get("step_s")
    disk = _frac(r.get("disk_wait_s"), step)
    if disk is None:
        return None
    disk = min(disk, 1.0)
    data = _frac(r.get("data_wait_s"), step) or 0.0
    xfer = _frac(r.get("transfer_s"), step) or 0.0
    rest = 1.0 - disk - data - xfer      # compute and everything else (the lookups' own CPU work)
    return disk if disk > 0 and disk >= max(data, xfer, rest) else None


def _cpu_full(r: dict) -> str | None:
    """Why the CPU is full, where it is: this process keeps 90% of the cores it may use busy,
    or the machine 90% of its own (other processes: a data loader's workers, another
    notebook); else None."""
    mine, cores = r.get("process_cpu_cores"), r.get("process_cores")
    busy, count = r.get("host_cpu_busy_cores"), r.get("host_cores")
    machine = (f"; the machine {busy:.1f} of {count}" if busy is not None and count else "")
    if mine is not None and cores and mine >= 0.9 * cores:
        return f"this process keeps {mine:.1f} of its {cores} cores busy{machine}"
    if busy is not None and count and busy >= 0.9 * count:
        share = f", this process {mine:.1f}" if mine is not None else ""
        return f"the machine keeps {busy:.1f} of its {count} cores busy{share}"
    return None


def diagnose(record: dict, *, link_bytes_per_s: float | None = None) -> str:
    """One line saying what bounds the run, from one record.

    First, **compiling** while GPU kernels compiled since the last reading
    (``compiled_kernels``): a session's first launches pause for seconds each, and the rates of
    that interval say nothing about the run. Then the disk tier: **disk-bound** when
    ``disk_wait_s`` (mean seconds per step that the training loop's thread waited for disk
    tables: their reads, write-backs of evicted rows, and the wait for a read-ahead still in
    flight) is the largest of the four parts a step is split into: that wait, ``data_wait_s``,
    ``transfer_s``, and the rest of ``step_s`` (compute and everything else: ``compute_s`` is
    not used, as the lookups that wait usually run inside the compute block). Ties go to the
    disk. Over a refresh interval these are means over its steps; in the summary on close, over
    the run's steps. The other checks, in order: the loader (data wait), the PCIe link (NVML
    rates, or the bytes nbtools moved, against the link's speed; nbtools' zero-copy reads plus
    writes against it), the step timer's transfer share, then GPU utilisation. A GPU busy under
    half the time while the CPU is full (this process keeps 90% of the cores it may use busy,
    or the machine 90% of its own) is **CPU-bound**.
    PCIe comes before utilisation because ``utilization.gpu`` reads ~100% during pure copies.

    >>> diagnose({"pcie_rx_bytes_per_s": 48e9, "link_bytes_per_s": 55e9, "step_s": 0.005})
    'transfer-bound: PCIe RX at 48 of 55 GB/s; fewer bytes per row help (bf16 tables, an optimizer with less state)'
    >>> diagnose({"nbtools_h2d_bytes_per_s": 18e9, "nbtools_d2h_bytes_per_s": 18e9,
    ...           "link_bytes_per_s": 63e9, "gpu_util_percent": 88})[:58]
    'transfer-bound: nbtools moves 36 GB/s of rows (18 in, 18 o'
    >>> diagnose({"compiled_kernels": 3, "gpu_util_percent": 2.0})[:49]
    'compiling GPU kernels: 3 compiled since the last '
    >>> diagnose({"gpu_util_percent": 97.0, "step_s": 0.005})
    'compute-bound: GPU busy 97%; a larger batch or mixed precision helps'
    >>> diagnose({"gpu_util_percent": 30.0, "step_s": 0.005, "process_cpu_cores": 1.9,
    ...           "process_cores": 2, "host_cpu_busy_cores": 2.0, "host_cores": 2}).split("; ")[0]
    'CPU-bound: GPU busy only 30% and the CPU is full (this process keeps 1.9 of its 2 cores busy'
    >>> diagnose({"disk_wait_s": 0.006, "step_s": 0.010, "host_cache_hit_percent": 91.0,
    ...           "nbtools_disk_read_bytes_per_s": 200e6, "gpu_util_percent": 40})[:86]
    'disk-bound: 60% of each step waits for the disk (reads 200.0 MB/s, RAM cache hits 91%)'
    >>> diagnose({"disk_wait_s": 0.006, "step_s": 0.010, "nbtools_disk_ahead_rows_per_s": 9e4,
    ...           "nbtools_disk_read_bytes_per_s": 200e6}).split("; ")[1]
    'a larger host_cache_bytes or a faster disk helps (read-ahead is on)'
    """
    r = record
    link = link_bytes_per_s or r.get("link_bytes_per_s")
    step = r.get("step_s")
    if r.get("compiled_kernels"):
        return (f"compiling GPU kernels: {r['compiled_kernels']} compiled since the last "
                "reading, each at its first launch in this session (seconds each, once); the "
                "steps after them run at full speed")
    disk = _disk_share(r)
    if disk is not None:
        hits = r.get("host_cache_hit_percent")
        ahead = r.get("nbtools_disk_ahead_rows_per_s")
        helps = ("a larger host_cache_bytes or a faster disk helps (read-ahead is on)"
                 if ahead else "a larger host_cache_bytes, table.prefetch(next_ids) for the "
                 "next eight steps to read ahead while a step computes, or a faster disk helps")
        return (f"disk-bound: {disk:.0%} of each step waits for the disk (reads "
                f"{fmt_rate(r.get('nbtools_disk_read_bytes_per_s'))}, RAM cache hits "
                f"{'N/A' if hits is None else f'{hits:.0f}%'}); {helps}")
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
        # Zero-copy reads and writes of table rows share the link (measured: they do not
        # overlap), and their kernels read as "GPU busy": judge them by their sum.
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
            full = _cpu_full(r)
            if full:
                return (f"CPU-bound: GPU busy only {util:.0f}% and the CPU is full ({full}); "
                        "keep other CPU work out of the loop (loader workers, logging) and use "
                        "larger batches")
            return (f"host-bound: GPU busy only {util:.0f}%; Python or CPU work between kernels "
                    "(larger batches amortise it)")
        pcie = f", PCIe RX {fmt_rate(rx)}" if rx is not None else ""
        return f"balanced: GPU busy {util:.0f}%{pcie}"
    if step is None:
        return "warming up: no steps measured yet"
    mine, cores = r.get("process_cpu_cores"), r.get("process_cores")
    if mine is not None and cores:
        return f"no GPU readings: CPU run, this process keeps {mine:.1f} of its {cores} cores busy"
    return "no GPU readings: CPU run (step time and throughput only)"


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


class Warnings:
    """One-shot warnings before trouble: each kind fires once per run.

    Kinds: ``gpu_memory`` (GPU memory used, or reserved by torch, near its total),
    ``host_memory`` (host RAM, pinned pages included, near the machine's total) and
    ``throughput_drop`` (rate below ``drop_fraction`` of the best seen after a warm-up; not
    within ``warmup_s`` of GPU kernels compiling, a first launch's pause of seconds).

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
        self._compiled_at = None      # elapsed_s when kernels last compiled

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
        elapsed = r.get("elapsed_s") or 0
        if r.get("compiled_kernels"):
            self._compiled_at = elapsed
        if self._compiled_at is not None and elapsed - self._compiled_at < self.warmup_s:
            rate = None         # a window with a first launch's compile in it: not a drop
        if rate is not None and elapsed >= self.warmup_s:
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


# --- the run's summary --------------------------------------------------------------------------

# Readings that a summary of the whole run averages over the time steps were made.
RUN_MEAN_KEYS = ("gpu_util_percent", "pcie_rx_bytes_per_s", "pcie_tx_bytes_per_s",
                 "nbtools_h2d_bytes_per_s", "nbtools_d2h_bytes_per_s",
                 "nbtools_cache_saved_bytes_per_s", "cache_hit_percent",
                 "nbtools_disk_read_bytes_per_s", "nbtools_disk_write_bytes_per_s",
                 "nbtools_disk_ahead_rows_per_s", "host_cache_hit_percent",
                 "process_cpu_cores", "host_cpu_busy_cores")


class RunMeans:
    """Time-weighted means of :data:`RUN_MEAN_KEYS` over the refresh intervals in which steps
    were made, each weighted by its seconds between the end of the first and of the last step.
    Time before the first step (building the model) and after the last (evaluation, a cell left
    open) does not count: a run's verdict is about the run, not the idle moment that follows.

    >>> m = RunMeans()
    >>> m.add({"gpu_util_percent": 90.0}, 3.0); m.add({"gpu_util_percent": 30.0}, 1.0)
    >>> m.read()["gpu_util_percent"], m.read()["pcie_rx_bytes_per_s"]
    (75.0, None)
    """

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def add(self, record: dict, seconds: float) -> None:
        if seconds <= 0:
            return
        for k in RUN_MEAN_KEYS:
            v = record.get(k)
            if v is not None:
                self.sums[k] = self.sums.get(k, 0.0) + v * seconds
                self.seconds[k] = self.seconds.get(k, 0.0) + seconds

    def __bool__(self) -> bool:
        return bool(self.seconds)

    def read(self) -> dict:
        return {k: self.sums[k] / self.seconds[k] if k in self.seconds else None
                for k in RUN_MEAN_KEYS}


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
        backend: readings (default :class:`SystemBackend`); :class:`~nbtools.testing.FakeBackend` in tests.
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
        self.run_means = RunMeans()
        self._last_refresh = (self._t0, 0)   # (clock, steps) at the previous refresh
        # (steps, the disk counters' cumulative wait_s) at the previous refresh, the run's
        # (seconds waited, steps) from the end of the first step on, and the latest per-step wait
        self._disk_mark = (0, self.meters.disk_at_start["nbtools_disk_wait_s"])
        self._disk_run = [0.0, 0]
        self._disk_wait = None

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

    @property
    def next_refresh(self) -> float:
        """The clock reading from which :meth:`step` refreshes again (moved out by
        :meth:`add_overhead` when refreshing is expensive)."""
        return self._next

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
        """Sample every meter now (the view calls this from its thread).

        On close the view calls it with ``final=True``, and the record sums up the whole run
        (``whole_run: True``): ``samples_per_s`` is the mean rate from the end of the first step
        to the end of the last (the window's rate at close is ``last_samples_per_s``),
        ``run_s`` that span; the step-time breakdown is the run's mean per step, with totals
        (``data_wait_total_s``, ``transfer_total_s``, ``compute_total_s``, ``step_total_s``,
        and ``disk_wait_total_s`` with disk tables: see :meth:`_add_disk_wait`); GPU
        utilisation, PCIe, nbtools' and the disk tier's rates and both cache hit rates are the
        means of :class:`RunMeans` over the time steps were made; and the diagnosis, prefixed
        ``over the run:``, is made from these, never from the idle moment after the loop.
        Memory readings are those at close."""
        t_start = time.perf_counter()
        now = self.clock() if now is None else now
        self._cost = 0.0
        rec = self.meters.read()
        rec.update(self.throughput.read(now, whole_run=final))
        rec.update(self.timer.read(whole_run=final))
        rec["time_s"] = now - self._t0 + self._t_offset
        rec["step"] = self.steps
        rec["unix_time"] = time.time()
        if self._resumed:
            rec["resumed"] = True
            self._resumed = False
        rec["overhead_percent"] = (100.0 * self.overhead_s / rec["elapsed_s"]
                                   if rec.get("elapsed_s") else None)
        self._add_disk_wait(rec, final)
        if final:
            self._summarise(rec)
        else:
            self._add_to_run(rec, now)
        link = self.config.link_bytes_per_s
        diagnosis = diagnose(rec, link_bytes_per_s=link)
        if final:
            diagnosis = ("over the run: " + diagnosis) if self.steps else "no steps were made"
        self.diagnosis = diagnosis
        rec["diagnosis"] = self.diagnosis
        self.new_warnings = self.warnings.check(rec)
        self.history.append(rec)
        self.record = rec
        self.add_overhead(time.perf_counter() - t_start, now)
        return rec

    def _add_to_run(self, rec: dict, now: float) -> None:
        """Count this refresh's readings in the run's means when steps were made since the
        previous one, weighted by the part of the interval between the first and last step.
        The reading on close is not counted: it is taken after the loop has stopped."""
        t_prev, steps_prev = self._last_refresh
        self._last_refresh = (now, self.steps)
        first, last = self.throughput.first_step_time, self.throughput.last_step_time
        if self.steps > steps_prev and first is not None:
            self.run_means.add(rec, min(now, last) - max(t_prev, first))

    def _add_disk_wait(self, rec: dict, final: bool) -> None:
        """``disk_wait_s``: mean seconds per step that the loop's thread waited for disk tables
        (the disk counters' ``wait_s``) over the steps since the previous refresh; kept from the
        last interval with steps when none was made, like the step timer's readings; N/A
        without a disk tier in use. On close it is the mean over the run's steps, and
        ``disk_wait_total_s`` their total: counted from the first refresh after the first
        step on (the end of the first step unless the view refreshes from a thread), which,
        like the step timer, leaves the first step out (it fills the empty RAM cache)."""
        steps_prev, wait_prev = self._disk_mark
        wait = rec.get("nbtools_disk_wait_s")
        self._disk_mark = (self.steps, wait)
        made = self.steps - steps_prev
        if self.meters.disk_in_use and wait is not None and made > 0:
            waited = wait - (wait_prev or 0.0)    # N/A before: not imported yet, so it was 0
            self._disk_wait = waited / made
            if steps_prev >= 1:
                self._disk_run[0] += waited
                self._disk_run[1] += made
        rec["disk_wait_s"] = self._disk_wait
        if final:
            total, n = self._disk_run
            rec["disk_wait_total_s"] = total if n else None
            if n:
                rec["disk_wait_s"] = total / n

    def _summarise(self, rec: dict) -> None:
        """Turn the record taken on close into the run's summary (see :meth:`refresh`)."""
        rec["whole_run"] = True
        rec["last_samples_per_s"] = rec["samples_per_s"]
        rec["samples_per_s"] = rec["mean_samples_per_s"]
        if self.run_means:   # else the run was shorter than one refresh: the readings at close
            rec.update(self.run_means.read())

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


