"""Samplers: PCIe rx/tx off the training thread, resource readings into one record, the loop's
throughput and its step-time breakdown. All take an injectable clock.
"""
from __future__ import annotations

import collections
import math
import threading
import time

from .backends import (DISK_KEYS, LINK_KEYS, PCIE_LANE_BYTES_PER_S, READERS, SystemBackend,
                       safe_reading)


# nbtools' cumulative counters that Meters.read turns into per-interval figures
_COUNTERS = ("nbtools_h2d_bytes", "nbtools_d2h_bytes", "nbtools_cache_lookup_rows",
             "nbtools_cache_hit_rows", "nbtools_cache_saved_bytes",
             "nbtools_compiled_kernels", "process_cpu_s", "host_cpu_busy_s") + DISK_KEYS
# the disk counters that say a disk table has been used (time counters do not: they only grow
# while rows move)
_DISK_USE = ("nbtools_disk_lookup_rows", "nbtools_disk_read_bytes", "nbtools_disk_write_bytes")


def _add(*xs):
    """Sum that is N/A only when every term is."""
    xs = [x for x in xs if x is not None]
    return sum(xs) if xs else None



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
        bound = 1.25 * (max_rate or 16 * PCIE_LANE_BYTES_PER_S[6])
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

    @property
    def running(self) -> bool:
        """True while the polling thread is alive (it ends by itself where nothing can be read,
        and at :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Poll on a daemon thread until :meth:`stop` (nothing when started already)."""
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

    nbtools' cumulative counters become rates over the interval since the previous
    :meth:`read`: ``nbtools_h2d_bytes_per_s``, ``cache_hit_percent`` (the GPU cache of hot
    rows), ``process_cpu_cores`` and ``host_cpu_busy_cores`` (cores busy on average: this
    process's threads, and every process on the machine; of ``process_cores`` this process may use
    and the machine's ``host_cores``), and for the disk tier ``nbtools_disk_read_bytes_per_s``,
    ``nbtools_disk_write_bytes_per_s``, ``nbtools_disk_ahead_rows_per_s`` (rows read ahead by
    ``table.prefetch``) and ``host_cache_hit_percent`` (the share of the unique
    rows disk tables looked up that were already in their RAM cache). The disk rates are N/A
    until disk tables have looked up rows or moved bytes since these meters were made
    (:attr:`disk_in_use`), so a run without them shows no disk tier, even in a process where
    ``nbtools.disk`` was imported or used before; :attr:`disk_at_start` holds the disk
    counters as they were when the meters were made.

    Args:
        backend: where readings come from (default :class:`SystemBackend` for ``device``).
        clock: seconds, monotonic (default ``time.monotonic``).
        device: compute device for the default backend (``"auto"``).
        pcie: ``"thread"`` polls PCIe on a daemon thread, ``"manual"`` leaves
            :meth:`PcieSampler.poll` to the caller (tests), ``"off"``; ``"auto"`` (default)
            is ``"thread"`` for the system backend where NVML works, else ``"manual"``.

    >>> from nbtools.testing import FakeBackend, FakeClock
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
        link = safe_reading(self.backend.link, LINK_KEYS)
        self.link = link
        self.pcie = PcieSampler(self.backend, self.clock, max_rate=link["link_bytes_per_s"])
        self._pcie_mode = pcie
        self._last = None   # (t, {counter: value}) for nbtools' rates
        # the disk counters now: a disk tier is shown once they move (N/A: not imported, = 0)
        self.disk_at_start = self._reader("disk", DISK_KEYS)
        self.disk_in_use = False

    def _reader(self, name, keys) -> dict:
        fn = getattr(self.backend, name, None)   # a backend without a reader: N/A
        return dict.fromkeys(keys) if fn is None else safe_reading(fn, keys)

    def read(self) -> dict:
        if self._pcie_mode == "thread" and self.pcie.source != "n/a":
            self.pcie.start()                # once: nothing when it runs already
        now = self.clock()
        rec = {"time_s": now}
        for name, keys in READERS.items():
            if name == "link":
                rec.update(self.link)
            else:
                rec.update(self._reader(name, keys))
        rec["pinned_bytes"] = _add(rec["nbtools_pinned_bytes"], rec["torch_pinned_bytes"])
        # nbtools' cumulative counters as rates since the last reading, and the share of the
        # rows looked up in that interval that the GPU cache of hot rows served
        last, self._last = self._last, (now, {k: rec[k] for k in _COUNTERS})
        dt = now - last[0] if last is not None else 0.0

        def delta(k):
            before = last[1][k] if last is not None else None
            if before is None and k in DISK_KEYS:
                before = 0        # N/A: nbtools.disk was not imported, its counters start at 0
            if dt <= 0 or rec[k] is None or before is None:
                return None
            return rec[k] - before
        for k in ("nbtools_h2d_bytes", "nbtools_d2h_bytes", "nbtools_cache_saved_bytes"):
            d = delta(k)
            rec[f"{k}_per_s"] = None if d is None else d / dt
        # GPU kernels compiled in this interval (their first launches: seconds each)
        rec["compiled_kernels"] = delta("nbtools_compiled_kernels")
        # cores busy on average in this interval: this process's threads, and the machine's
        for k, name in (("process_cpu_s", "process_cpu_cores"),
                        ("host_cpu_busy_s", "host_cpu_busy_cores")):
            d = delta(k)
            rec[name] = None if d is None else max(0.0, d / dt)
        looked, hit = delta("nbtools_cache_lookup_rows"), delta("nbtools_cache_hit_rows")
        rec["cache_hit_percent"] = 100.0 * hit / looked if looked and hit is not None else None
        # the disk tier, once disk tables have been used since these meters started
        if not self.disk_in_use:
            self.disk_in_use = any(rec[k] is not None and rec[k] > (self.disk_at_start[k] or 0)
                                   for k in _DISK_USE)
        use = self.disk_in_use
        for k in ("nbtools_disk_read_bytes", "nbtools_disk_write_bytes",
                  "nbtools_disk_ahead_rows"):
            d = delta(k) if use else None
            rec[f"{k}_per_s"] = None if d is None else d / dt
        looked = delta("nbtools_disk_lookup_rows") if use else None
        hit = delta("nbtools_disk_hit_rows") if use else None
        rec["host_cache_hit_percent"] = (100.0 * hit / looked if looked and hit is not None
                                         else None)
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

    >>> from nbtools.testing import FakeClock
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
        self.last_step_time = None   # clock reading at the end of the latest step

    def update(self, n=1, now: float | None = None) -> None:
        self.total += n
        now = self.clock() if now is None else now
        self.last_step_time = now
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

    @property
    def kept_points(self) -> int:
        """How many (time, total) checkpoints the window holds: about 50 a window whatever
        the step rate (the meter's memory)."""
        return len(self._points)

    @property
    def first_step_time(self):
        """Clock reading at the end of the first step (None before it)."""
        return None if self._first is None else self._first[0]

    def read(self, now: float | None = None, *, whole_run: bool = False) -> dict:
        """The readings at ``now``. With ``whole_run`` (a run's summary, on close) the mean
        rate is over the run's steps, from the end of the first to the end of the last, so
        idle time after the loop does not dilute it; ``run_s`` is that span."""
        now = self.clock() if now is None else now
        end = self.last_step_time if whole_run and self.last_step_time is not None else now
        mean = None
        if self._first is not None and end > self._first[0]:
            mean = (self.total - self._first[1]) / (end - self._first[0])
        out = {"unit": self.unit, "samples_total": self.total,
               "samples_per_s": self.rate_per_s(now), "mean_samples_per_s": mean,
               "elapsed_s": now - self._t0}
        if whole_run:
            out["run_s"] = None if self._first is None else end - self._first[0]
        return out


class _Phase:
    """Context manager timing one phase of a step (see :class:`StepTimer`): ``begin()`` on
    entry, ``end(name, start)`` on exit."""

    __slots__ = ("begin", "end", "name", "_start")

    def __init__(self, begin, end, name):
        self.begin, self.end, self.name = begin, end, name

    def __enter__(self):
        self._start = self.begin()
        return self

    def __exit__(self, *exc):
        self.end(self.name, self._start)
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

    >>> from nbtools.testing import FakeClock
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

    @property
    def pending_events(self) -> int:
        """How many timed phases wait for the GPU to reach their end event (at most
        :attr:`MAX_PENDING`: beyond it a step is not timed)."""
        return len(self._pending)

    @property
    def open_steps(self) -> int:
        """How many timed steps are not folded into the readings yet (the one running now
        counts; the others wait for their phases' events)."""
        return len(self._open)

    # phases ----------------------------------------------------------------------------------
    def transfer(self) -> _Phase:
        """``with timer.transfer():`` around host<->GPU copies."""
        return _Phase(self._begin, self._end, "transfer")

    def compute(self) -> _Phase:
        """``with timer.compute():`` around forward/backward/optimizer step."""
        return _Phase(self._begin, self._end, "compute")

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
        ``data_wait_s``, ``transfer_s``, ``compute_s`` (None where nothing was measured).
        ``whole_run`` adds the run's totals: ``step_total_s``, ``data_wait_total_s``,
        ``transfer_total_s``, ``compute_total_s``."""
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
        if not whole_run:
            return dict(self._last_out)
        # the run's totals: seconds spent in steps, waiting for data, in transfers, in compute
        # (transfer and compute as their share of the timed steps, applied to all steps)
        totals = {"step_total_s": acc["step"] if acc["n_step"] else None,
                  "data_wait_total_s": acc["data_wait"] if acc["n_data_wait"] else None}
        for name in self.PHASES:
            mean = out[f"{name}_s"]
            totals[f"{name}_total_s"] = (mean * acc["n_step"] if mean is not None
                                         and acc["n_step"] else None)
        return {**out, **totals}


