"""Host memory over a run, sampled off the training thread: does a table bigger than RAM stay
inside its budget?

:class:`MemorySampler` reads, every ``period_s`` on a daemon thread, the process's RSS, the
host bytes nbtools holds (what :func:`nbtools.set_host_budget` bounds: tables, disk tables' RAM
caches and row maps, loader slabs), the part of it pinned for CUDA, the growth of the page cache
since the sampler started and, where there is one, the container's memory (cgroup). Pinned pages
are part of RSS once touched, so RSS plus the page cache's growth is what the run holds in RAM.
:func:`file_cache_bytes` counts the page cache one file holds (``mincore``): a disk table's
file, read and written with ``O_DIRECT``, should hold none.

Readings come from ``/proc`` (Linux); where one cannot be had it is ``None``, never an error.
Readers and clock are injectable for tests.

>>> from nbtools.testing import FakeClock
>>> clock, rss = FakeClock(), iter([100, 150, 120])
>>> read = lambda: {"rss_bytes": next(rss), "nbtools_held_bytes": 10,
...                 "nbtools_pinned_bytes": 0, "page_cache_bytes": 5, "cgroup_bytes": None}
>>> s = MemorySampler(read=read, clock=clock, budget_bytes=64)
>>> s.sample(); clock.advance(1.0); s.sample(); clock.advance(1.0); s.sample()
>>> out = s.summary()
>>> out["rss_start_bytes"], out["max_rss_bytes"], out["max_rss_growth_bytes"], out["duration_s"]
(100, 150, 50, 2.0)
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

from ..units import human_bytes

_KEYS = ("rss_bytes", "nbtools_held_bytes", "nbtools_pinned_bytes", "page_cache_bytes",
         "cgroup_bytes")


def _proc_int(path: str, field: int = 0, scale: int = 1) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[field]) * scale
    except (OSError, ValueError, IndexError):
        return None


def _page_cache() -> int | None:
    """The page cache, bytes (/proc/meminfo's ``Cached``: file pages and shared memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def read_memory() -> dict:
    """One reading: ``rss_bytes`` (this process), ``nbtools_held_bytes`` (what the host budget
    counts), ``nbtools_pinned_bytes``, ``page_cache_bytes`` (the whole machine's) and
    ``cgroup_bytes`` (the container's ``memory.current``); ``None`` where N/A."""
    from .. import hostmem
    from ..devices import held_host_bytes
    cgroup = _proc_int("/sys/fs/cgroup/memory.current")
    if cgroup is None:
        cgroup = _proc_int("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    return {"rss_bytes": _proc_int("/proc/self/statm", 1, os.sysconf("SC_PAGE_SIZE")),
            "nbtools_held_bytes": held_host_bytes(),
            "nbtools_pinned_bytes": hostmem.pinned_bytes(),
            "page_cache_bytes": _page_cache(), "cgroup_bytes": cgroup}


_libc = None


def file_cache_bytes(path, chunk_bytes: int = 1 << 30) -> int | None:
    """Bytes of ``path`` in the page cache now (``mincore`` over a map of the file, a chunk at
    a time: ~1 s per 60 GB file). ``None`` where the file or ``mincore`` cannot be had."""
    global _libc
    import numpy as np
    try:
        if _libc is None:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.mmap.restype = ctypes.c_void_p
            lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_long]
            lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc = lib
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    chunk_bytes = max(page, chunk_bytes // page * page)
    vec = (ctypes.c_ubyte * (chunk_bytes // page))()
    total = 0
    try:
        size = os.fstat(fd).st_size
        for offset in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - offset)
            addr = _libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                if _libc.mincore(ctypes.c_void_p(addr), n, vec) != 0:
                    return None
                resident = np.frombuffer(vec, dtype=np.uint8)[: -(-n // page)] & 1
                total += int(np.count_nonzero(resident)) * page
            finally:
                _libc.munmap(ctypes.c_void_p(addr), n)
    finally:
        os.close(fd)
    return total


class MemorySampler:
    """Host memory every ``period_s`` seconds, from a daemon thread, until :meth:`stop`.

    Args:
        period_s: seconds between readings.
        budget_bytes: the budget to compare with (default: :func:`nbtools.devices.host_budget`
            when the sampler is made).
        read, clock: the reader (:func:`read_memory`) and the clock, for tests.

    Use it as a context manager around the training (``with MemorySampler(...) as memory:``),
    or call :meth:`start` and :meth:`stop`. :meth:`mark` labels a moment on the plot.
    """

    def __init__(self, period_s: float = 0.2, *, budget_bytes: int | None = None, read=None,
                 clock=time.monotonic):
        if not period_s > 0:
            raise ValueError(f"period_s must be a positive number of seconds, got {period_s!r}")
        if budget_bytes is None:
            from ..devices import host_budget
            budget_bytes = host_budget()
        self.period_s, self.budget_bytes = period_s, budget_bytes
        self._read, self._clock = read or read_memory, clock
        self.samples: list[dict] = []       # each reading with "t_s", seconds since the first
        self.marks: list[tuple[float, str]] = []
        self._t0 = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    # --- sampling ---------------------------------------------------------------------------
    def sample(self) -> None:
        """Take one reading now."""
        got = dict.fromkeys(_KEYS)
        got.update(self._read())
        now = self._clock()
        with self._lock:
            if self._t0 is None:
                self._t0 = now
            got["t_s"] = now - self._t0
            self.samples.append(got)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period_s)

    @property
    def running(self) -> bool:
        """True while the sampling thread is alive (from :meth:`start` to :meth:`stop`)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "MemorySampler":
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nbtools-memory", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> dict:
        """Stop sampling (after one last reading); returns :meth:`summary`."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.sample()
        return self.summary()

    def mark(self, label: str) -> None:
        """Label this moment (a vertical line on the plot)."""
        with self._lock:
            t = 0.0 if self._t0 is None else self._clock() - self._t0
            self.marks.append((t, label))

    def __enter__(self) -> "MemorySampler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- results ----------------------------------------------------------------------------
    def _column(self, key: str) -> list:
        return [s[key] for s in self.samples if s[key] is not None]

    def _growth(self, key: str) -> list:
        """``key`` minus its first reading, per sample (readings where it is N/A left out)."""
        values = self._column(key)
        return [v - values[0] for v in values]

    def summary(self) -> dict:
        """Maxima over the samples, with units in the keys (``None`` where N/A):
        ``rss_start_bytes``, ``max_rss_bytes``, ``max_rss_growth_bytes``,
        ``max_nbtools_held_bytes``, ``max_nbtools_pinned_bytes``,
        ``max_page_cache_growth_bytes``, ``max_rss_plus_page_cache_bytes`` (RSS + the page
        cache's growth, per sample), ``max_cgroup_bytes``, ``budget_bytes``, ``samples``,
        ``duration_s``."""
        def top(values):
            return max(values) if values else None
        rss = self._column("rss_bytes")
        cache0 = next((s["page_cache_bytes"] for s in self.samples
                       if s["page_cache_bytes"] is not None), None)
        both = [s["rss_bytes"] + max(0, s["page_cache_bytes"] - cache0) for s in self.samples
                if s["rss_bytes"] is not None and s["page_cache_bytes"] is not None]
        return {"rss_start_bytes": rss[0] if rss else None, "max_rss_bytes": top(rss),
                "max_rss_growth_bytes": top(self._growth("rss_bytes")),
                "max_nbtools_held_bytes": top(self._column("nbtools_held_bytes")),
                "max_nbtools_pinned_bytes": top(self._column("nbtools_pinned_bytes")),
                "max_page_cache_growth_bytes": top(self._growth("page_cache_bytes")),
                "max_rss_plus_page_cache_bytes": top(both),
                "max_cgroup_bytes": top(self._column("cgroup_bytes")),
                "budget_bytes": self.budget_bytes, "samples": len(self.samples),
                "duration_s": self.samples[-1]["t_s"] if self.samples else 0.0}

    def report(self) -> str:
        """The summary in words: nbtools' share against the budget, then the whole process."""
        s = self.summary()
        budget, held = s["budget_bytes"], s["max_nbtools_held_bytes"]
        lines = []
        if budget is not None and held is not None:
            verdict = "within" if held <= budget else "OVER"
            lines.append(f"nbtools held at most {human_bytes(held)} of host RAM (RAM caches, "
                         f"row maps, tables): {verdict} its {human_bytes(budget)} budget")
        lines.append(f"process RSS {human_bytes(s['rss_start_bytes'])} at the start, "
                     f"{human_bytes(s['max_rss_bytes'])} at most; page cache "
                     f"+{human_bytes(s['max_page_cache_growth_bytes'])} at most; RSS + page "
                     f"cache growth {human_bytes(s['max_rss_plus_page_cache_bytes'])} at most"
                     + (f" ({s['samples']} readings over {s['duration_s']:.1f} s)"))
        return "\n".join(lines)

    def plot(self, ax=None, title: str | None = None):
        """Plot RSS, RSS + page-cache growth, nbtools' held and pinned bytes (GiB or MiB
        against seconds), the budget as a dashed line and the marks; returns the matplotlib axes."""
        import matplotlib.pyplot as plt      # only when asked: import nbtools stays light
        if ax is None:
            _, ax = plt.subplots(figsize=(8, 3.2))
        top = max([self.budget_bytes or 0] + self._column("rss_bytes"))
        unit, scale = ("GiB", float(1 << 30)) if top >= 2 << 30 else ("MiB", float(1 << 20))
        cache0 = next((s["page_cache_bytes"] for s in self.samples
                       if s["page_cache_bytes"] is not None), None)
        series = {
            "RSS + page cache growth": lambda s: None if s["rss_bytes"] is None
            or s["page_cache_bytes"] is None else s["rss_bytes"] + s["page_cache_bytes"] - cache0,
            "RSS (process)": lambda s: s["rss_bytes"],
            "nbtools (what the budget counts)": lambda s: s["nbtools_held_bytes"],
            "pinned (nbtools)": lambda s: s["nbtools_pinned_bytes"],
        }
        for label, get in series.items():
            points = [(s["t_s"], get(s)) for s in self.samples if get(s) is not None]
            if points:
                ax.plot([t for t, _ in points], [v / scale for _, v in points], label=label)
        if self.budget_bytes is not None:
            ax.axhline(self.budget_bytes / scale, color="red", linestyle="--",
                       label=f"host budget ({human_bytes(self.budget_bytes)})")
        for t, label in self.marks:
            ax.axvline(t, color="grey", linewidth=0.5)
            ax.annotate(label, (t, 1.0), xycoords=("data", "axes fraction"), rotation=90,
                        fontsize=7, va="top", ha="right")
        ax.set(xlabel="seconds", ylabel=unit,
               title=title or "host memory, sampled off the training thread")
        ax.legend(fontsize=7, loc="best")
        return ax


__all__ = ["MemorySampler", "read_memory", "file_cache_bytes"]
