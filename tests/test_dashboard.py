"""The dashboard view, with the fake backend and a fake clock: text fallback, widget updates,
throttling, red-on-exception, the static snapshot, thread mode and history resume."""
import io
import subprocess
import sys
import types

import pytest

import nbtools
from nbtools import dashboard as dashmod
from nbtools.dashboard import Dashboard, DashboardConfig, plot_history, render_html
from nbtools.meters import History, Monitor
from nbtools.testing import FakeBackend, FakeClock

PNG = b"\x89PNG\r\n\x1a\n"


def make(mode="text", unit="rows", backend=None, clock=None, display=True, history=None, **cfg):
    """A dashboard on the fake backend; text mode writes to ``dash.out``."""
    out = io.StringIO()
    config = DashboardConfig(mode=mode, pcie="manual", **{"file": out, **cfg})
    clock = clock or FakeClock()
    mon = Monitor(unit, backend=backend or FakeBackend(clock=clock), clock=clock, config=config,
                  history=history)
    dash = Dashboard(unit, title="test run", config=config, display=display, monitor=mon)
    dash.out, dash.clock = out, clock
    return dash


def run(dash, steps=100, dt=0.1, n=256):
    for _ in range(steps):
        dash.clock.advance(dt)
        dash.step(n)


# --- text fallback -------------------------------------------------------------------------------

def test_text_mode_prints_throttled_lines_and_a_summary():
    dash = make(text_every_s=5.0)
    run(dash, steps=200)               # 20 s of fake time
    lines = dash.out.getvalue().splitlines()
    assert 4 <= len(lines) <= 5        # one line per 5 s, not one per refresh
    assert "2.56k rows/s" in lines[-1] and "GPU 6.0 GiB/80.0 GiB 60% busy" in lines[-1]
    dash.close()
    text = dash.out.getvalue()
    assert "[nbtools] test run: finished after 20 s, 200 steps, 51.2k rows" in text
    assert dash.state == "finished"
    dash.close()                       # idempotent
    assert dash.out.getvalue() == text


def test_text_mode_shows_na_and_prints_each_warning_once():
    b = FakeBackend(gpu_used_bytes=None, gpu_total_bytes=None, gpu_util_percent=None,
                    host_used_bytes=63 << 30)
    dash = make(backend=b)
    run(dash, steps=50)
    dash.close()
    text = dash.out.getvalue()
    assert "GPU" not in text.splitlines()[0]              # no GPU readings: not shown as 0
    assert text.count("warning: host RAM 63.0 GiB of 64.0 GiB") == 2   # when fired + summary
    assert dash.summary()["warnings"] == [w for w in dash.warnings] and len(dash.warnings) == 1


def test_display_false_prints_nothing():
    dash = make(display=False)
    run(dash, steps=30)
    dash.close()
    assert dash.out.getvalue() == "" and dash.record["step"] == 30


def test_tty_rewrites_one_line():
    class Tty(io.StringIO):
        def isatty(self):
            return True
    dash = make(file=(tty := Tty()))
    run(dash, steps=30)
    assert tty.getvalue().count("\r") >= 2 and "\n" not in tty.getvalue()


# --- red on exception ----------------------------------------------------------------------------

@pytest.mark.parametrize("exc", [ValueError("bad batch\nsecond line"), KeyboardInterrupt()])
def test_turns_red_and_reraises(exc):
    dash = make()
    with pytest.raises(type(exc)):
        with dash:
            run(dash, steps=20)
            raise exc
    assert dash.state == "failed"
    name = type(exc).__name__
    assert dash.error.startswith(f"stopped by {name}") and dash.error.endswith("at step 20")
    assert "second line" not in dash.error
    assert f"[nbtools] stopped by {name}" in dash.out.getvalue()
    assert "nbtools-failed" in dash.snapshot_html()


def test_a_failing_notebook_cell_turns_it_red(monkeypatch):
    ipython = pytest.importorskip("IPython")
    hooks = {}
    events = types.SimpleNamespace(register=lambda name, f: hooks.setdefault(name, []).append(f),
                                   unregister=lambda name, f: hooks[name].remove(f))
    monkeypatch.setattr(dashmod, "in_notebook", lambda: True)      # a kernel's IPython
    monkeypatch.setattr(ipython, "get_ipython", lambda: types.SimpleNamespace(events=events))
    dash = make()
    run(dash, steps=5)
    after_cell, = hooks["post_run_cell"]
    after_cell(types.SimpleNamespace(error_in_exec=None))
    assert dash.state == "running"
    after_cell(types.SimpleNamespace(error_in_exec=ZeroDivisionError("x")))
    assert dash.state == "failed" and "ZeroDivisionError" in dash.error
    assert hooks["post_run_cell"] == []            # closed: the hook is gone


# --- widget view ---------------------------------------------------------------------------------

widgets = pytest.importorskip("ipywidgets")


def test_widget_updates_throttled_with_badges_bars_and_plot():
    # max_overhead=1: the refreshes follow refresh_s alone; at the default 1% a refresh that
    # took over 10 ms of real time (a busy CI machine) put the next one off by its cost / 1%
    dash = make(mode="widget", display=False, plot_every_s=2.0, max_overhead=1.0)
    values = []
    text, image = dash.widget.children            # the HTML above the plot
    text.observe(lambda ch: values.append(ch["new"]), "value")
    run(dash, steps=100, dt=0.05)       # 5 s of fake time: 5-6 refreshes
    assert 5 <= len(values) <= 6
    html = text.value
    assert html.count('class="nbtools-badge"') == 11 and "5.12k" in html
    assert "GPU memory</b> 6.0 GiB / 80.0 GiB (8%)" in html
    assert "⚑" in html and "border:2px" not in html          # the VBox draws the frame
    assert bytes(image.value).startswith(PNG) and image.layout.display == ""
    assert "#d0d0d0" in dash.widget.layout.border
    dash.close()
    assert dash.state == "finished"


def test_widget_turns_red_on_failure():
    dash = make(mode="widget", display=False)
    with pytest.raises(RuntimeError):
        with dash:
            run(dash, steps=10)
            raise RuntimeError("CUDA out of memory")
    assert "#d62728" in dash.widget.layout.border
    assert "stopped by RuntimeError: CUDA out of memory at step 10" in dash.widget.children[0].value


class FakeHandle:
    def __init__(self):
        self.updates = []

    def update(self, obj, **kw):
        self.updates.append((obj, kw))


def test_close_leaves_a_static_snapshot(monkeypatch):
    shown = []
    handle = FakeHandle()
    ipd = pytest.importorskip("IPython.display")
    monkeypatch.setattr(ipd, "display", lambda obj, **kw: shown.append((obj, kw)) or handle)
    dash = make(mode="widget")
    (bundle, kw), = shown        # the widget view, under a display id (ipywidgets 7 and 8)
    view = bundle["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == dash.widget.model_id and kw == {"raw": True, "display_id": True}
    run(dash, steps=40)
    dash.close()
    (bundle, kw), = handle.updates
    assert kw == {"raw": True}
    assert 'class="nbtools-dashboard nbtools-finished"' in bundle["text/html"]
    assert 'src="data:image/png;base64,' in bundle["text/html"]
    assert "[test run finished" in bundle["text/plain"]
    assert dash.widget.comm is None           # the live widgets are closed


def test_freeze_false_keeps_the_widget(monkeypatch):
    handle = FakeHandle()
    ipd = pytest.importorskip("IPython.display")
    monkeypatch.setattr(ipd, "display", lambda obj, **kw: handle)
    dash = make(mode="widget", freeze=False)
    run(dash, steps=20)
    dash.close()
    assert handle.updates == [] and dash.widget.comm is not None


def test_missing_ipywidgets_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(ImportError, match=r"pip install ipywidgets"):
        make(mode="widget", display=False)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="mode='html'"):
        Dashboard(config=DashboardConfig(mode="html"))


# --- thread mode ---------------------------------------------------------------------------------

def test_thread_mode_refreshes_while_the_loop_is_stalled():
    import time
    dash = make(display=False, thread=True, refresh_s=0.01)
    assert dash.thread_running
    dash.step(10)                        # the loop only counts ...
    deadline = time.monotonic() + 5
    while len(dash.history) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)                 # ... the thread refreshes although no step comes
    assert len(dash.history) >= 3
    dash.config.refresh_s = 3600         # the thread's next wait is long ...
    time.sleep(0.1)
    calls = dash.monitor.meters.backend.calls["gpu"]
    for _ in range(50):
        dash.clock.advance(10.0)
        dash.step(1)                     # ... and the loop's thread never samples
    assert dash.monitor.meters.backend.calls["gpu"] == calls
    dash.close()
    assert not dash.thread_running


def test_thread_mode_is_refused_in_colab(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert dashmod.thread_mode_supported()[0] is False
    with pytest.warns(UserWarning, match="Colab"):
        dash = make(display=False, thread=True)
    assert not dash.thread_running
    dash.close()


def test_thread_mode_is_refused_on_ipykernel_7_0_0(monkeypatch):
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "7.0.0" if name == "ipykernel" else "1")
    ok, why = dashmod.thread_mode_supported()
    assert not ok and "7.0.0" in why


# --- history ---------------------------------------------------------------------------------------

def test_history_path_continues_after_a_disconnect(tmp_path):
    path = tmp_path / "meters.jsonl"
    first = make(history=History(str(path)))
    run(first, steps=30)
    first.close()
    n = len(History.load(path))
    # "reconnected": a new dashboard given the same path continues it
    config = DashboardConfig(mode="text", pcie="manual", file=io.StringIO())
    clock = FakeClock()
    mon = Monitor("rows", backend=FakeBackend(), clock=clock, config=config,
                  history=History.load(path, append=True))
    second = Dashboard("rows", config=config, monitor=mon, display=False)
    for _ in range(20):
        clock.advance(0.1)
        second.step(1)
    second.close()
    h = History.load(path)
    assert len(h) > n and sum(bool(r.get("resumed")) for r in h.records) == 1
    times = h.column("time_s")
    assert times == sorted(times)
    png = plot_history(path)
    assert png.png.startswith(PNG) and png._repr_png_() is png.png


def test_history_argument_as_a_path(tmp_path):
    path = tmp_path / "runs" / "m.jsonl"
    dash = Dashboard("rows", history=str(path), config=DashboardConfig(mode="text"), display=False)
    dash.step(1)
    dash.close()
    assert path.exists() and Dashboard("rows", history=path, display=False,
                                       config=DashboardConfig(mode="text")).history.records


def test_save_history(tmp_path):
    dash = make(display=False)
    run(dash, steps=25)
    dash.save_history(tmp_path / "h.jsonl")
    assert len(History.load(tmp_path / "h.jsonl")) == len(dash.history)


def test_cache_of_hot_rows_shows_only_when_in_use():
    b = FakeBackend()
    dash = make(backend=b, text_every_s=1.0)
    run(dash, steps=20)
    assert "cache" not in dash.out.getvalue()
    assert 'cache hits' not in render_html(dash.monitor.record)
    for _ in range(20):
        b.serve(lookups=1000, hits=750, saved_bytes=300 << 20)
        run(dash, steps=1)
    last = dash.out.getvalue().splitlines()[-1]
    assert "cache 75% hits, saved 3.1 GB/s" in last          # 300 MiB per 0.1 s step
    html = render_html(dash.monitor.record)
    assert ">cache hits</div>" in html and ">75%</div>" in html and html.count('class="nbtools-badge"') == 12
    dash.close()


# --- rendering, machine check, import cost -------------------------------------------------------

def test_render_html_escapes_and_handles_an_empty_record():
    html = render_html({}, title="<script>", error="x < y")
    assert "<script>" not in html and "&lt;script&gt;" in html and "x &lt; y" in html
    assert html.count("N/A") >= 8


def test_bandwidth_check_text_on_cpu():
    out = io.StringIO()
    res = dashmod.bandwidth_check(1 << 16, device="cpu", file=out)
    assert res["pinned_h2d_bytes_per_s"] is None
    assert "pinned host → GPU" in out.getvalue() and "N/A" in out.getvalue()
    html = dashmod.render_bandwidth_html({**res, "link_bytes_per_s": 63e9,
                                          "pinned_h2d_bytes_per_s": 50e9})
    assert html.count('class="nbtools-bar"') == 5 and "50.0 GB/s of 63.0 GB/s (79%)" in html


def test_import_stays_light():
    # (pynvml is not in the list: `import torch` itself imports it when it is installed)
    code = ("import sys, nbtools, nbtools.meters, nbtools.dashboard; "
            "nbtools.Dashboard, nbtools.ThroughputMeter; "
            "print(sorted(m for m in ('ipywidgets', 'matplotlib', 'psutil', 'IPython') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=nbtools.__path__[0] + "/..")
    assert out.stdout.strip() == "[]"


def test_bar_alarms_and_the_throughput_window_come_from_the_config():
    # GPU 60% and host 70% full: red borders only where the configured fraction is exceeded
    rec = {"gpu_total_bytes": 100, "gpu_used_bytes": 60, "host_total_bytes": 100,
           "host_used_bytes": 70}
    red = "border:1px solid #d62728"

    def bars(html):
        return [chunk for chunk in html.split('class="nbtools-bar"')[1:]]

    default = bars(render_html(rec))
    assert [red in b for b in default] == [False, False]
    cfg = DashboardConfig(gpu_warn_fraction=0.5, host_warn_fraction=0.8, window_s=30)
    html = render_html(rec, config=cfg)
    assert [red in b for b in bars(html)] == [True, False]
    assert "throughput, last 30 s" in html and "last 10 s" in render_html(rec)


def test_save_png_writes_the_plot_the_snapshot_shows(tmp_path):
    clock = FakeClock()
    cfg = DashboardConfig(mode="text", file=io.StringIO(), pcie="manual")
    mon = Monitor("rows", backend=FakeBackend(), clock=clock, config=cfg)
    with Dashboard("rows", config=cfg, monitor=mon) as dash:
        for _ in range(30):
            clock.advance(0.1)
            dash.step(64)
    path = dash.save_png(tmp_path / "dash.png")          # text mode: drawn from the history
    png = (tmp_path / "dash.png").read_bytes()
    assert str(path).endswith("dash.png") and png[:8] == b"\x89PNG\r\n\x1a\n"
    assert png == plot_history(dash.history, "rows").png   # the same drawing as a re-plot


# --- the final verdict sums up the run (issue 26) ------------------------------------------------

def _loop(dash, backend, steps=2000, rx=0, tx=0):
    """10 ms steps: 1 ms waiting for data, 9 ms of compute moving ``rx``/``tx`` bytes by
    zero-copy (no transfer phase: the rows cross PCIe inside the kernels)."""
    def batches():
        for i in range(steps):
            dash.clock.advance(0.001)
            yield i
    for _ in dash.data(batches()):
        with dash.compute():
            dash.clock.advance(0.009)
            backend.move(rx_bytes=rx, tx_bytes=tx, nbtools=True)
        dash.step(256)


def _idle_then_close(dash, backend, seconds=60.0):
    # the loop is over: an evaluation runs with the GPU idle, then the cell closes the dashboard
    backend.values["gpu_util_percent"] = 0.0
    dash.clock.advance(seconds)
    dash.close()


def test_final_verdict_of_a_transfer_bound_run_is_not_the_idle_moment_after_it():
    b = FakeBackend(gpu_util_percent=46.0)      # no clock: phases timed on the host clock
    dash = make(backend=b)
    _loop(dash, b, rx=250_000_000, tx=150_000_000)    # 25 GB/s in, 15 GB/s out
    assert dash.record["diagnosis"].startswith("transfer-bound: nbtools moves 40 GB/s")
    _idle_then_close(dash, b)
    r = dash.record
    assert r["whole_run"] and r["diagnosis"].startswith("over the run: transfer-bound: nbtools "
                                                         "moves 40 GB/s of rows (25 in, 15 out)")
    assert r["gpu_util_percent"] == pytest.approx(46.0)                 # not the idle 0%
    assert r["nbtools_h2d_bytes_per_s"] == pytest.approx(25e9)
    assert r["samples_per_s"] == pytest.approx(25_600) == r["mean_samples_per_s"]   # no idle tail
    assert r["run_s"] == pytest.approx(19.99) and r["elapsed_s"] == pytest.approx(80.0)
    assert r["data_wait_total_s"] == pytest.approx(1.999) and r["compute_total_s"] == pytest.approx(17.991)
    assert r["step_s"] == pytest.approx(0.010) and r["data_wait_s"] == pytest.approx(0.001)
    text = dash.out.getvalue()
    last = text.rstrip().splitlines()
    assert "0% busy" not in text and "GPU busy only 0%" not in text
    assert last[-1].startswith("[nbtools] over the run: transfer-bound")
    assert last[-2] == "[nbtools] in steps 20 s: waiting for data 2 s (10%), compute 18 s (90%)"
    final = next(line for line in last if line.startswith("[test run finished 1:20]"))
    assert "25.6k rows/s mean over 20 s of steps" in final and "46% busy (mean)" in final
    assert "step 10 ms (data 10% · compute 90%)" in final and "over the run: transfer" in final
    html = dash.snapshot_html()
    assert "over the run: transfer-bound" in html and "mean over the run" in html
    assert dash.summary()["diagnosis"] == r["diagnosis"]
    assert dash.warnings == []                  # the idle tail is no "throughput drop"
    # the history keeps the summary, flagged; the plot leaves it out (it is not a point in time)
    assert dash.history.records[-1]["whole_run"] and not dash.history.records[-2].get("whole_run")


def test_final_verdict_of_a_host_bound_run_keeps_its_busy_share():
    b = FakeBackend(gpu_util_percent=30.0)
    dash = make(backend=b)
    _loop(dash, b, steps=500)
    assert dash.record["diagnosis"].startswith("host-bound: GPU busy only 30%")
    _idle_then_close(dash, b)
    assert dash.record["diagnosis"].startswith("over the run: host-bound: GPU busy only 30%")
    assert dash.record["samples_per_s"] == pytest.approx(25_600)


def test_run_means_weigh_readings_by_the_time_steps_were_made():
    b = FakeBackend(gpu_util_percent=90.0)
    dash = make(backend=b)
    dash.clock.advance(30.0)                    # building the model: not part of the run
    run(dash, steps=100, dt=0.1)                # 10 s at 90%
    b.values["gpu_util_percent"] = 40.0
    run(dash, steps=300, dt=0.1)                # 30 s at 40%
    dash.clock.advance(100.0)                   # idle, at 40%: not part of the run either
    dash.close()
    assert dash.record["gpu_util_percent"] == pytest.approx((10 * 90 + 30 * 40) / 40, abs=1.5)
    assert dash.record["run_s"] == pytest.approx(39.9)


def test_a_run_shorter_than_one_refresh_uses_the_readings_at_close():
    b = FakeBackend(gpu_util_percent=97.0)
    dash = make(backend=b)
    run(dash, steps=5, dt=0.1)
    dash.close()
    assert dash.record["gpu_util_percent"] == 97.0
    assert dash.record["diagnosis"].startswith("over the run: compute-bound: GPU busy 97%")


def test_a_run_without_steps_says_so():
    dash = make()
    dash.close()
    assert dash.record["diagnosis"] == "no steps were made"


# --- the disk tier (issue 25, item 6) -------------------------------------------------------------

def _disk_loop(dash, backend, steps=2000, wait=0.006, reads=400 << 10, writes=100 << 10):
    """10 ms steps: 1 ms waiting for data, 9 ms of compute in which the lookups wait ``wait``
    for the disk, reading ``reads`` and writing back ``writes`` bytes; 90% of rows in RAM."""
    def batches():
        for i in range(steps):
            dash.clock.advance(0.001)
            yield i
    for _ in dash.data(batches()):
        with dash.compute():
            dash.clock.advance(0.009)
            backend.disk_io(read_bytes=reads, write_bytes=writes, lookup_rows=1000,
                            hit_rows=900, wait_s=wait)
        dash.step(256)


def test_no_disk_row_without_disk_tables():
    b = FakeBackend()
    b.disk_io()                            # nbtools.disk imported (describe() does), no table
    dash = make(backend=b, text_every_s=1.0)
    _loop(dash, b, steps=300)
    html = render_html(dash.record)
    assert "disk" not in dash.out.getvalue() and "disk" not in html.lower()
    assert html.count('class="nbtools-badge"') == 11
    dash.close()
    assert "disk" not in dash.out.getvalue() and "disk" not in dash.snapshot_html().lower()


def test_disk_row_rates_and_the_disk_bound_verdict():
    b = FakeBackend(gpu_util_percent=30.0)
    dash = make(backend=b, text_every_s=1.0)
    _disk_loop(dash, b, steps=500)                         # 6 of 10 ms waiting for the disk
    r = dash.record
    assert r["nbtools_disk_read_bytes_per_s"] == pytest.approx((400 << 10) / 0.010)
    assert r["nbtools_disk_write_bytes_per_s"] == pytest.approx((100 << 10) / 0.010)
    assert r["host_cache_hit_percent"] == pytest.approx(90.0)
    assert r["disk_wait_s"] == pytest.approx(0.006)
    assert r["diagnosis"].startswith("disk-bound: 60% of each step waits for the disk "
                                     "(reads 41.0 MB/s, RAM cache hits 90%)")
    last = dash.out.getvalue().splitlines()[-1]
    assert "disk read 41.0 MB/s write 10.2 MB/s, RAM hits 90%, wait 60% of step" in last
    html = render_html(r)
    assert html.count('class="nbtools-badge"') == 14
    assert ">disk read</div>" in html and ">41.0 MB/s</div>" in html and ">90%</div>" in html
    assert "60% of a step" in html and "disk-bound: 60%" in html
    # the disk stops being the wait: the rest of the step (host work) is the largest share
    _disk_loop(dash, b, steps=500, wait=0.002)
    assert dash.record["disk_wait_s"] == pytest.approx(0.002)
    assert dash.record["diagnosis"].startswith("host-bound: GPU busy only 30%")
    assert ">disk read</div>" in render_html(dash.record)     # the row stays, the verdict not


def test_final_verdict_sums_the_disk_wait_over_the_run():
    b = FakeBackend(gpu_util_percent=30.0)
    dash = make(backend=b)
    _disk_loop(dash, b, steps=1000, wait=0.008)            # 10 s disk-bound (80%)
    _disk_loop(dash, b, steps=1000, wait=0.002)            # 10 s host-bound (disk 20%)
    assert dash.record["diagnosis"].startswith("host-bound")
    _idle_then_close(dash, b)                              # idle: no disk traffic
    r = dash.record
    assert r["disk_wait_total_s"] == pytest.approx(1999 * 0.005, rel=2e-3)   # step 1 left out
    assert r["disk_wait_s"] == pytest.approx(0.005, rel=2e-3)
    assert r["nbtools_disk_read_bytes_per_s"] == pytest.approx((400 << 10) / 0.010, rel=1e-3)
    assert r["host_cache_hit_percent"] == pytest.approx(90.0)
    assert r["diagnosis"].startswith("over the run: disk-bound: 50% of each step waits")
    text = dash.out.getvalue()
    assert "[nbtools] in steps 20 s: waiting for data 2 s (10%), compute 18 s (90%); of it " \
           "waiting for the disk 9.99 s (50%)" in text
    assert text.rstrip().splitlines()[-1].startswith("[nbtools] over the run: disk-bound: 50%")


def test_a_disk_table_trained_on_cpu_shows_its_reads(tmp_path):
    import torch

    from nbtools.meters import SystemBackend
    n, d = 4_000, 8
    table = nbtools.OffloadedEmbedding(n, d, device="cpu", name="on-disk", placement="disk",
                                       disk_dir=str(tmp_path), host_cache_bytes=256 * 3 * d * 4)
    opt = nbtools.OffloadOptimizer(torch.optim.Adam, [table], lr=0.1)
    clock = FakeClock()
    out = io.StringIO()
    config = DashboardConfig(mode="text", pcie="manual", file=out, text_every_s=0.0)
    mon = Monitor("rows", backend=SystemBackend("cpu"), clock=clock, config=config)
    gen = torch.Generator().manual_seed(0)
    with Dashboard("rows", config=config, monitor=mon) as dash:
        for _ in range(12):
            ids = torch.randint(0, n, (128,), generator=gen)
            with dash.compute():
                opt.zero_grad()
                table(ids).sum().backward()
                opt.step()
            clock.advance(1.0)
            dash.step(len(ids))
            live = dash.record
    assert live["nbtools_disk_read_bytes_per_s"] > 0 and live["nbtools_disk_write_bytes_per_s"] > 0
    assert 0 <= live["host_cache_hit_percent"] < 100 and live["disk_wait_s"] > 0
    r = dash.record
    assert r["whole_run"] and r["nbtools_disk_read_bytes_per_s"] > 0 and r["disk_wait_total_s"] > 0
    assert "disk read" in out.getvalue() and ">disk read</div>" in dash.snapshot_html()
    table.close()


def test_a_pause_while_gpu_kernels_compile_is_named_and_not_warned_of_as_a_drop():
    """A fresh session's first launches compile the kernels, seconds each: mid-run (a kernel
    first launched at step 600) the dashboard says so, instead of "throughput dropped"."""
    b = FakeBackend(gpu_util_percent=90.0)
    dash = make(backend=b)
    _loop(dash, b, steps=1500)                  # 15 s at full speed: the best rate is known
    b.compile(3)
    dash.clock.advance(9.0)                     # one step waits for three compiles
    dash.step(256)
    assert dash.record["diagnosis"].startswith("compiling GPU kernels: 3 compiled")
    assert dash.warnings == []
    assert "compiling GPU kernels" in dash.out.getvalue()
    _loop(dash, b, steps=500)
    assert dash.record["diagnosis"].startswith("compute-bound")
    assert dash.warnings == []
    # the same pause without a compile is a drop
    b2 = FakeBackend(gpu_util_percent=90.0)
    other = make(backend=b2)
    _loop(other, b2, steps=1500)
    other.clock.advance(9.0)
    other.step(256)
    assert other.warnings and other.warnings[0].startswith("throughput dropped")


def test_the_cpu_badge_and_line_show_cores_busy():
    from nbtools.dashboard.render import render_text
    rec = {"process_cpu_cores": 1.8, "process_cores": 2, "host_cpu_busy_cores": 1.9,
           "host_cores": 4}
    html = render_html(rec)
    assert ">CPU busy</div>" in html and ">1.8 of 2 cores</div>" in html
    assert ">machine 1.9 of 4 cores</div>" in html
    assert "CPU 1.8 of 2 cores" in render_text(rec)
    empty = render_html({})
    assert ">CPU busy</div>" in empty and ">machine N/A</div>" in empty
    assert not any(p.startswith("CPU") for p in render_text({}).split(" | "))


def test_the_plot_draws_the_cpu_beside_the_throughput():
    from nbtools.dashboard.plot import Plotter
    from nbtools.meters import History
    h = History()
    for t in range(5):
        h.append({"time_s": float(t), "samples_per_s": 100.0 * t, "process_cpu_cores": 0.5 * t,
                  "process_cores": 2})
    p = Plotter("rows")
    assert p.render(h)[:4] == b"\x89PNG"
    assert list(p.cpu_line.get_ydata()) == [0.0, 0.5, 1.0, 1.5, 2.0]
    labels = [t.get_text() for t in p.ax[2].get_legend().get_texts()]
    assert labels == ["rows/s", "CPU cores busy (right)"]
    assert p.cpu_ax.get_ylim()[1] >= 2.0 and p.cpu_line.get_marker() in ("", "None")
    few = History()
    few.append({"time_s": 0.0, "process_cpu_cores": 1.0, "process_cores": 2})
    p = Plotter("rows")
    p.render(few)
    assert p.cpu_line.get_marker() == "o"           # a short run: its readings as points
    bare = History()
    bare.append({"time_s": 0.0, "samples_per_s": 1.0})
    bare.append({"time_s": 1.0, "samples_per_s": 2.0})
    p = Plotter("rows")
    p.render(bare)
    assert [t.get_text() for t in p.ax[2].get_legend().get_texts()] == ["rows/s"]
