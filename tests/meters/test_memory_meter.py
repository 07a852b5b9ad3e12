"""nbtools.meters.memory: host memory sampled off the training thread, and a file's page cache.

References: /proc/self/status (VmRSS) for the RSS reading, nbtools' own counters for its share,
hand-made readings for the summary, and for the page cache a file whose pages were just written
(resident) and then dropped with posix_fadvise (not resident).
"""
import os
import sys
import time

import pytest

from nbtools import devices, hostmem
from nbtools.meters.memory import MemorySampler, file_cache_bytes, read_memory
from nbtools.testing import FakeClock

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")


@linux
def test_read_memory_agrees_with_proc_status():
    got = read_memory()
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(got["rss_bytes"] - vmrss) < 64 << 20
    assert got["nbtools_held_bytes"] == devices.held_host_bytes()
    assert got["nbtools_pinned_bytes"] == hostmem.pinned_bytes()
    assert got["page_cache_bytes"] > 0


def _fake(readings):
    it = iter(readings)

    def read():
        rss, held, cache = next(it)
        return {"rss_bytes": rss, "nbtools_held_bytes": held, "nbtools_pinned_bytes": held // 2,
                "page_cache_bytes": cache, "cgroup_bytes": None}
    return read


def test_summary_takes_maxima_and_growth():
    clock = FakeClock()
    s = MemorySampler(read=_fake([(100, 10, 1000), (180, 40, 1030), (150, 30, None),
                                  (120, 20, 1010)]), clock=clock, budget_bytes=50)
    for _ in range(4):
        s.sample()
        clock.advance(0.5)
    out = s.summary()
    assert out["rss_start_bytes"] == 100 and out["max_rss_bytes"] == 180
    assert out["max_rss_growth_bytes"] == 80 and out["max_nbtools_held_bytes"] == 40
    assert out["max_nbtools_pinned_bytes"] == 20
    assert out["max_page_cache_growth_bytes"] == 30          # the N/A reading left out
    assert out["max_rss_plus_page_cache_bytes"] == 210       # 180 + 30, in one sample
    assert out["max_cgroup_bytes"] is None and out["samples"] == 4
    assert out["duration_s"] == 1.5 and out["budget_bytes"] == 50
    assert "within its 50 B budget" in s.report()


def test_report_says_over_when_nbtools_passed_the_budget():
    s = MemorySampler(read=_fake([(100, 60, 0)]), clock=FakeClock(), budget_bytes=50)
    s.sample()
    assert "OVER its 50 B budget" in s.report()
    assert "budget" not in MemorySampler(read=_fake([(1, 1, 0)]), clock=FakeClock(),
                                         budget_bytes=None).report()


def test_the_thread_samples_until_stopped():
    with MemorySampler(period_s=0.01) as s:
        time.sleep(0.15)
        s.mark("halfway")
    n = len(s.samples)
    assert n >= 3 and s.marks[0][1] == "halfway" and not s.running
    time.sleep(0.05)
    assert len(s.samples) == n                    # nothing after stop
    assert s.budget_bytes == devices.host_budget()
    with pytest.raises(ValueError, match="period_s must be a positive number"):
        MemorySampler(period_s=0)


def _fs_type(path) -> str:
    """The filesystem type of the mount that holds ``path`` (/proc/mounts)."""
    path, best = os.path.realpath(path), ("", "")
    with open("/proc/mounts") as f:
        for line in f:
            point, kind = line.split()[1:3]
            if (path == point or path.startswith(point.rstrip("/") + "/")) \
                    and len(point) > len(best[0]):
                best = (point, kind)
    return best[1]


@linux
def test_file_cache_bytes_sees_written_pages_and_dropped_ones(tmp_path):
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is in RAM ({_fs_type(tmp_path)}): its pages cannot be dropped")
    path = tmp_path / "pages.bin"
    data = os.urandom(4 << 20)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    assert file_cache_bytes(path) >= 3 << 20                  # just written: in the cache
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    assert file_cache_bytes(path) <= 256 << 10
    with open(path, "rb") as f:
        f.read(1 << 20)
    assert file_cache_bytes(path, chunk_bytes=64 << 10) >= 1 << 20   # read back, chunk by chunk
    assert file_cache_bytes(tmp_path / "missing") is None


def test_plot_draws_the_series_and_the_budget():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    clock = FakeClock()
    s = MemorySampler(read=_fake([(1 << 20, 1 << 19, 0), (2 << 20, 1 << 20, 1 << 20)]),
                      clock=clock, budget_bytes=3 << 20)
    s.sample()
    s.mark("step")
    clock.advance(1.0)
    s.sample()
    ax = s.plot()
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels[:4] == ["RSS + page cache growth", "RSS (process)",
                          "nbtools (what the budget counts)", "pinned (nbtools)"]
    assert "host budget (3.0 MiB)" in labels and ax.get_ylabel() == "MiB"
    assert list(ax.get_lines()[0].get_ydata()) == [1.0, 3.0]
    matplotlib.pyplot.close("all")
