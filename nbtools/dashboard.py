"""Live dashboard for a training loop in Jupyter and Colab: a thin view over :mod:`nbtools.meters`.

It draws what :class:`~nbtools.meters.Monitor` computes: number badges, memory bars against
their limits, a one-line diagnosis, one-shot warnings and a history plot (matplotlib Agg ->
PNG -> ``Image`` widget, the one kind of live plot that works in Colab). It uses core ipywidgets
only (Colab ships 7.7, JupyterLab users have 8.x) and is updated from the loop's own thread,
throttled, as ``tqdm.notebook`` is (widget updates from other threads do not show in Colab and
broke in ipykernel 7.0.0). Outside a notebook it prints a text line instead.

On close it replaces itself with a static snapshot (HTML + PNG), so a saved notebook shows the
result in any viewer, with or without the kernel or widget state. If the loop raises, it turns
red, says why, and the exception goes on.

Usage::

    with nbtools.Dashboard("words", history="ckpt/meters.jsonl") as dash:
        for batch in dash.data(loader):      # data() is optional: it times the loader
            with dash.compute():             # optional: step-time breakdown
                loss = model(batch); loss.backward(); opt.step()
            dash.step(len(batch))

In tests (no notebook, no GPU)::

    >>> from nbtools.meters import Monitor
    >>> from nbtools.testing import FakeBackend, FakeClock
    >>> import io
    >>> clock, out = FakeClock(), io.StringIO()
    >>> cfg = DashboardConfig(mode="text", file=out)
    >>> mon = Monitor("rows", backend=FakeBackend(), clock=clock, config=cfg)
    >>> with Dashboard("rows", config=cfg, monitor=mon) as dash:
    ...     for _ in range(50):
    ...         clock.advance(0.1); dash.step(256)
    >>> "2.56k rows/s" in out.getvalue()
    True
"""
from __future__ import annotations

import base64
import dataclasses
import html
import io
import math
import os
import sys
import threading
import time
import typing
import warnings

from .meters import History, Monitor, MonitorConfig, measure_bandwidth
from .units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds

_EXTRA = "pip install 'nbtools-offload[notebook]'"


def _widgets():
    try:
        import ipywidgets
    except ImportError as e:
        raise ImportError(f"nbtools.Dashboard draws with ipywidgets in a notebook, which is not "
                          f"installed: {_EXTRA} (or pass DashboardConfig(mode='text'))") from e
    return ipywidgets


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"the dashboard's history plot needs matplotlib: {_EXTRA}") from e
    return matplotlib, Figure, FigureCanvasAgg


def _show(widget):
    """Display a widget under a display id, so that it can later be replaced in place.

    ``display(widget, display_id=True)`` loses the id on ipywidgets 7 (its ``_ipython_display_``
    displays the view itself), so the widget-view bundle is displayed here directly; ipywidgets
    7.7 and 8.x render the same bundle."""
    from IPython.display import display
    bundle = {"application/vnd.jupyter.widget-view+json": {
                  "version_major": 2, "version_minor": 0, "model_id": widget.model_id},
              "text/plain": f"{type(widget).__name__}(...)"}
    return display(bundle, raw=True, display_id=True)


def in_notebook() -> bool:
    """True inside a Jupyter/Colab kernel (not a terminal IPython, not a script)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def thread_mode_supported() -> tuple[bool, str]:
    """Whether widgets may be updated from a background thread here, and if not why.

    >>> ok, why = thread_mode_supported()
    >>> isinstance(ok, bool)
    True
    """
    if "google.colab" in sys.modules:
        return False, "Colab does not show widget updates made from other threads"
    try:
        from importlib.metadata import version
        if version("ipykernel") == "7.0.0":
            return False, "ipykernel 7.0.0 breaks widget updates from other threads"
    except Exception:
        pass
    return True, ""


@dataclasses.dataclass
class DashboardConfig(MonitorConfig):
    """:class:`~nbtools.meters.MonitorConfig` plus how the dashboard draws."""
    mode: str = "auto"             # "widget" in a notebook, "text" elsewhere; or force either
    # Redraw the history plot at most this often, and less often if drawing costs more than
    # plot_budget of the wall time (a redraw took ~140 ms on the H100 machine's CPU; at 2 s and
    # 1% the widget mode measured +3.7% there, see benchmarks/RESULTS.md).
    plot_every_s: float = 5.0
    plot_budget: float = 0.005
    thread: bool = False           # refresh from a background thread (not Colab, not ipykernel 7.0.0)
    freeze: bool = True            # on close, replace the widget with a static HTML snapshot
    text_every_s: float = 10.0     # text mode, not a terminal: one line at most this often
    width_px: int = 860            # plot width
    file: typing.Any = None        # text mode output (default sys.stderr)


# --- HTML --------------------------------------------------------------------------------------

_C = {"gpu": "#1f77b4", "cache": "#9ecae1", "other": "#b0b0b0", "pinned": "#ff7f0e",
      "data": "#9467bd", "transfer": "#ff7f0e", "compute": "#2ca02c", "rate": "#d62728",
      "ok": "#2ca02c", "fail": "#d62728", "run": "#1f77b4", "warn_bg": "#fff4ce",
      "warn": "#7a5b00", "muted": "#666"}
_STATE = {"running": ("●", _C["run"], "running"), "finished": ("✓", _C["ok"], "finished"),
          "failed": ("✗", _C["fail"], "stopped")}


def _e(s) -> str:
    return html.escape(str(s))


def _badge(label, value, sub="", title="") -> str:
    return (f'<div class="nbtools-badge" title="{_e(title)}" style="display:inline-block;'
            'box-sizing:border-box;width:calc(20% - 6px);min-width:120px;margin:0 6px 6px 0;'
            'padding:5px 9px;border:1px solid #e2e2e2;border-radius:6px;background:#f7f8fa;'
            'vertical-align:top;white-space:nowrap;overflow:hidden">'
            f'<div style="font-size:11px;color:{_C["muted"]}">{_e(label)}</div>'
            f'<div class="nbtools-value" style="font-size:17px;font-weight:600;color:#111">'
            f'{_e(value)}</div>'
            f'<div style="font-size:11px;color:{_C["muted"]}">{_e(sub)}</div></div>')


def _bar(label, total, parts, text, alarm=False) -> str:
    """A stacked bar: ``parts`` = [(name, bytes_or_seconds, colour)] against ``total``."""
    segs = ""
    if total:
        room = 100.0     # segments never add up to more than the bar
        for name, v, colour in parts:
            if v and v > 0:
                w = min(room, 100.0 * v / total)
                room -= w
                segs += (f'<div title="{_e(name)}" style="width:{w:.2f}%;background:{colour};'
                         'height:100%;float:left"></div>')
    border = _C["fail"] if alarm else "#cfcfcf"
    legend = " ".join(f'<span style="color:{c}">■</span>&nbsp;{_e(n)}' for n, v, c in parts
                      if v is not None)
    return ('<div class="nbtools-bar" style="margin:3px 0">'
            f'<div style="font-size:12px;color:#222"><b>{_e(label)}</b> {_e(text)}'
            f'<span style="float:right;font-size:11px;color:{_C["muted"]}">{legend}</span></div>'
            f'<div style="height:11px;border:1px solid {border};border-radius:3px;'
            f'background:#fff;overflow:hidden">{segs}</div></div>')


def _pct(part, whole) -> str:
    return f"{100 * part / whole:.0f}%" if part is not None and whole else "N/A"


def _cache_in_use(r: dict) -> bool:
    """Whether a table's GPU cache of hot rows has served a training lookup in this run."""
    return bool(r.get("nbtools_cache_lookup_rows"))


def _disk_in_use(r: dict) -> bool:
    """Whether disk tables have been used since the dashboard opened (the meters leave the
    disk tier's readings N/A until then): only then is there a disk row."""
    return any(r.get(k) is not None for k in ("nbtools_disk_read_bytes_per_s",
                                              "host_cache_hit_percent", "disk_wait_s"))


def _sub(a, b):
    return None if a is None or b is None else max(0, a - b)


_PHASES = (("data", "data_wait_s"), ("xfer", "transfer_s"), ("compute", "compute_s"))


def _breakdown(r: dict) -> str:
    """``data 10% · xfer 40% · compute 50%`` of the mean step, for the phases measured."""
    step = r.get("step_s")
    return " · ".join(f"{n} {_pct(r.get(k), step)}" for n, k in _PHASES if r.get(k) is not None)


def run_summary_text(r: dict) -> str:
    """Where a run's time went, from its summary record (``whole_run``): ``"in steps 1.7 min:
    waiting for data 5.0 s (5%), transfers 40 s (40%), compute 50 s (50%)"``, and with disk
    tables ``"; of it waiting for the disk 30 s (30%)"`` (that wait is part of whichever phase
    looked the rows up, usually compute); empty when the step timer measured nothing."""
    total = r.get("step_total_s")
    if total is None:
        return ""
    parts = [f"{name} {fmt_seconds(r.get(key))} ({_pct(r.get(key), total)})"
             for name, key in (("waiting for data", "data_wait_total_s"),
                               ("transfers", "transfer_total_s"), ("compute", "compute_total_s"))
             if r.get(key) is not None]
    disk = r.get("disk_wait_total_s")
    of_it = (f"; of it waiting for the disk {fmt_seconds(disk)} ({_pct(disk, total)})"
             if disk is not None else "")
    return f"in steps {fmt_seconds(total)}" + (": " + ", ".join(parts) if parts else "") + of_it


def render_html(rec: dict, *, state: str = "running", title: str = "", warnings_=(),
                error: str = "", note: str = "", image_png: bytes | None = None,
                frame: bool = True, config: MonitorConfig | None = None) -> str:
    """The whole dashboard as one HTML string (badges, bars, diagnosis, warnings); with
    ``image_png`` the plot is inlined (the static snapshot). ``frame=False`` leaves out the
    border, which the widget view draws around the HTML and the plot together. ``config``
    (default :class:`~nbtools.meters.MonitorConfig`) gives the throughput window and the memory
    fractions at which a bar turns red (the same as the warnings')."""
    r = rec
    cfg = config or MonitorConfig()
    unit = r.get("unit", "samples")
    mark, colour, word = _STATE[state]
    elapsed = fmt_seconds(r.get("elapsed_s"))
    head = (f'<div style="font-size:14px;margin-bottom:6px"><span style="color:{colour}">{mark}'
            f'</span> <b>{_e(title or "nbtools dashboard")}</b> <span style="color:{_C["muted"]}">'
            f'· {word} · {elapsed} · step {r.get("step", 0):,}'
            f' · {fmt_count(r.get("samples_total"))} {_e(unit)}</span></div>')
    if error:
        head += (f'<div class="nbtools-error" style="color:#fff;background:{_C["fail"]};'
                 f'padding:4px 8px;border-radius:4px;margin-bottom:6px">{_e(error)}</div>')
    link = r.get("link_bytes_per_s")
    of_link = f"of {fmt_rate(link)} link" if link else "link N/A"
    step = r.get("step_s")
    run = bool(r.get("whole_run"))    # the summary on close: means over the run
    badges = "".join([
        _badge(f"{unit}/s", fmt_count(r.get("samples_per_s")),
               f"mean over {fmt_seconds(r.get('run_s'))} of steps" if run
               else f"mean {fmt_count(r.get('mean_samples_per_s'))}",
               "mean throughput from the first step to the last" if run
               else f"throughput, last {cfg.window_s:g} s"),
        _badge("step", fmt_seconds(step), _breakdown(r) or "no breakdown",
               "mean wall time per step over the run" if run else
               "mean wall time per step since the last refresh; data wait, transfer, compute"),
        _badge("GPU memory", fmt_bytes(r.get("gpu_used_bytes")),
               f"of {fmt_bytes(r.get('gpu_total_bytes'))}",
               f"NVML; this process {fmt_bytes(r.get('gpu_process_bytes'))}"),
        _badge("torch", fmt_bytes(r.get("torch_allocated_bytes")),
               f"reserved {fmt_bytes(r.get('torch_reserved_bytes'))}",
               f"allocated / reserved; peak {fmt_bytes(r.get('torch_peak_bytes'))}"),
        _badge("GPU busy", "N/A" if r.get("gpu_util_percent") is None
               else f"{r['gpu_util_percent']:.0f}%",
               "mean over the run" if run else "utilization.gpu",
               "NVML; reads ~100% during pure copies too"),
        _badge("PCIe → GPU", fmt_rate(r.get("pcie_rx_bytes_per_s")), of_link,
               f"NVML RX ({r.get('pcie_source') or 'N/A'})"),
        _badge("PCIe → host", fmt_rate(r.get("pcie_tx_bytes_per_s")), of_link,
               f"NVML TX ({r.get('pcie_source') or 'N/A'})"),
        _badge("nbtools moved", fmt_rate(r.get("nbtools_h2d_bytes_per_s")),
               f"back {fmt_rate(r.get('nbtools_d2h_bytes_per_s'))}",
               "bytes the nbtools tables moved host→GPU / GPU→host per second"),
        _badge("cache hits", _pct(r.get("cache_hit_percent"), 100),
               f"saved {fmt_rate(r.get('nbtools_cache_saved_bytes_per_s'))}",
               "GPU cache of hot rows: share of the rows looked up since the last refresh that "
               "were on the GPU, and the PCIe bytes per second it spared")
        if _cache_in_use(r) else "",
        _badge("host RAM", fmt_bytes(r.get("host_used_bytes")),
               f"of {fmt_bytes(r.get('host_total_bytes'))}",
               f"process RSS {fmt_bytes(r.get('process_rss_bytes'))}"),
        _badge("pinned", fmt_bytes(r.get("pinned_bytes")),
               f"nbtools {fmt_bytes(r.get('nbtools_pinned_bytes'))}",
               f"torch host allocator {fmt_bytes(r.get('torch_pinned_bytes'))}"),
    ])
    if _disk_in_use(r):   # the disk tier: its own row, only while disk tables are in use
        per = "mean over the run" if run else "since the last refresh"
        badges = f"<div>{badges}</div><div>" + "".join([
            _badge("disk read", fmt_rate(r.get("nbtools_disk_read_bytes_per_s")),
                   f"write {fmt_rate(r.get('nbtools_disk_write_bytes_per_s'))}",
                   f"bytes the disk tables read from and wrote to their files per second, {per}"),
            _badge("RAM cache hits", _pct(r.get("host_cache_hit_percent"), 100),
                   "rows already in RAM",
                   "disk tables: share of the unique rows looked up that their host RAM cache "
                   f"held, so that no disk read was needed; {per}"),
            _badge("disk wait", fmt_seconds(r.get("disk_wait_s")),
                   f"{_pct(r.get('disk_wait_s'), step)} of a step",
                   "mean time per step the training loop waited for the disk: reads, write-backs "
                   f"of evicted rows, a read-ahead still in flight; {per}"),
        ]) + "</div>"
    gt, gu = r.get("gpu_total_bytes"), r.get("gpu_used_bytes")
    ta, tr = r.get("torch_allocated_bytes"), r.get("torch_reserved_bytes")
    bars = "" if gt is None else _bar("GPU memory", gt, [("torch allocated", ta, _C["gpu"]),
                                   ("torch cache", _sub(tr, ta), _C["cache"]),
                                   ("other", _sub(gu, tr) if tr is not None else gu, _C["other"])],
                f"{fmt_bytes(gu)} / {fmt_bytes(gt)} ({_pct(gu, gt)})",
                alarm=bool(gu and gt and gu >= cfg.gpu_warn_fraction * gt))
    ht, hu, pin = r.get("host_total_bytes"), r.get("host_used_bytes"), r.get("pinned_bytes")
    bars += _bar("host RAM", ht, [("pinned", pin, _C["pinned"]),
                                  ("other used", _sub(hu, pin) if pin is not None else hu,
                                   _C["other"])],
                 f"{fmt_bytes(hu)} / {fmt_bytes(ht)} ({_pct(hu, ht)}), {fmt_bytes(pin)} pinned",
                 alarm=bool(hu and ht and hu >= cfg.host_warn_fraction * ht))
    phases = [("data wait", r.get("data_wait_s"), _C["data"]),
              ("transfer", r.get("transfer_s"), _C["transfer"]),
              ("compute", r.get("compute_s"), _C["compute"])]
    if any(v is not None for _, v, _ in phases):
        bars += _bar("step", step, phases, fmt_seconds(step) + ": " + " · ".join(
            f"{n} {_pct(v, step)}" for n, v, _ in phases if v is not None)
            + (f" · {run_summary_text(r)}" if run and run_summary_text(r) else ""))
    diag = (f'<div class="nbtools-diagnosis" style="margin:6px 0 2px;font-size:13px">'
            f'<b>⚑ {_e(r.get("diagnosis", ""))}</b></div>')
    warn = "".join(f'<div class="nbtools-warning" style="background:{_C["warn_bg"]};'
                   f'color:{_C["warn"]};padding:3px 8px;margin:3px 0;border-radius:4px;'
                   f'font-size:12px">⚠ {_e(w)}</div>' for w in warnings_)
    img = ""
    if image_png:
        img = ('<img class="nbtools-plot" alt="nbtools history plot" style="max-width:100%" '
               f'src="data:image/png;base64,{base64.b64encode(image_png).decode()}"/>')
    over = r.get("overhead_percent")
    foot = (f'<div style="font-size:11px;color:{_C["muted"]};margin-top:4px">'
            f'refreshed at {fmt_seconds(r.get("time_s"))} · dashboard overhead '
            f'{"N/A" if over is None else f"{over:.2f}%"}{(" · " + _e(note)) if note else ""}'
            '</div>')
    box = (f"border:2px solid {_frame_colour(state)};border-radius:8px;padding:8px 10px;"
           if frame else "")
    return (f'<div class="nbtools-dashboard nbtools-{state}" style="font-family:system-ui,'
            f'-apple-system,Segoe UI,Roboto,sans-serif;color:#222;background:#fff;{box}'
            f'max-width:900px">{head}<div>{badges}</div>{bars}{diag}{warn}{img}{foot}</div>')


def _frame_colour(state: str) -> str:
    return _C["fail"] if state == "failed" else "#d0d0d0"


def render_text(rec: dict, *, state: str = "running", title: str = "") -> str:
    """One status line for logs and terminals."""
    r = rec
    unit = r.get("unit", "samples")
    step = r.get("step_s")
    run = bool(r.get("whole_run"))    # the summary on close: means over the run
    parts = [f"[{title or 'nbtools'} {_STATE[state][2]} {fmt_seconds(r.get('elapsed_s'))}]",
             f"{fmt_count(r.get('samples_per_s'))} {unit}/s"
             + (f" mean over {fmt_seconds(r.get('run_s'))} of steps" if run else ""),
             f"step {fmt_seconds(step)}" + (f" ({_breakdown(r)})" if run and _breakdown(r) else "")]
    gu, gt = r.get("gpu_used_bytes"), r.get("gpu_total_bytes")
    if gt is not None:
        util = r.get("gpu_util_percent")
        parts.append(f"GPU {fmt_bytes(gu)}/{fmt_bytes(gt)}"
                     + (f" {util:.0f}% busy" + (" (mean)" if run else "")
                        if util is not None else ""))
    parts.append(f"host {fmt_bytes(r.get('host_used_bytes'))}/{fmt_bytes(r.get('host_total_bytes'))}"
                 f" pinned {fmt_bytes(r.get('pinned_bytes'))}")
    if r.get("pcie_rx_bytes_per_s") is not None or r.get("pcie_tx_bytes_per_s") is not None:
        parts.append(f"PCIe RX {fmt_rate(r.get('pcie_rx_bytes_per_s'))} "
                     f"TX {fmt_rate(r.get('pcie_tx_bytes_per_s'))}")
    if r.get("nbtools_h2d_bytes_per_s"):
        parts.append(f"moved {fmt_rate(r.get('nbtools_h2d_bytes_per_s'))}")
    if _cache_in_use(r):
        parts.append(f"cache {_pct(r.get('cache_hit_percent'), 100)} hits, saved "
                     f"{fmt_rate(r.get('nbtools_cache_saved_bytes_per_s'))}")
    if _disk_in_use(r):
        parts.append(f"disk read {fmt_rate(r.get('nbtools_disk_read_bytes_per_s'))} write "
                     f"{fmt_rate(r.get('nbtools_disk_write_bytes_per_s'))}, RAM hits "
                     f"{_pct(r.get('host_cache_hit_percent'), 100)}, wait "
                     f"{_pct(r.get('disk_wait_s'), step)} of step")
    parts.append(r.get("diagnosis", ""))
    return " | ".join(parts)


# --- plot --------------------------------------------------------------------------------------

class _Plotter:
    """Memory, PCIe and throughput on one time axis, drawn with Agg into PNG bytes. The figure
    and its lines are made once and updated, which keeps a redraw to a few tens of ms."""

    def __init__(self, unit: str, width_px: int = 860):
        _, Figure, FigureCanvasAgg = _matplotlib()
        from matplotlib import ticker
        dpi = 100
        self.fig = Figure(figsize=(width_px / dpi, 4.6), dpi=dpi, facecolor="white")
        FigureCanvasAgg(self.fig)
        self.ax = self.fig.subplots(3, 1, sharex=True)
        series = (
            (0, "gpu_used_bytes", 2**30, "GPU used", _C["gpu"], "-"),
            (0, "torch_reserved_bytes", 2**30, "torch reserved", _C["cache"], "-"),
            (0, "host_used_bytes", 2**30, "host used", _C["other"], "-"),
            (0, "pinned_bytes", 2**30, "pinned", _C["pinned"], "-"),
            (1, "pcie_rx_bytes_per_s", 1e9, "PCIe → GPU", _C["gpu"], "-"),
            (1, "pcie_tx_bytes_per_s", 1e9, "PCIe → host", _C["compute"], "-"),
            (1, "nbtools_h2d_bytes_per_s", 1e9, "nbtools → GPU", _C["pinned"], "--"),
            (1, "nbtools_d2h_bytes_per_s", 1e9, "nbtools → host", _C["data"], "--"),
            (2, "samples_per_s", 1.0, f"{unit}/s", _C["rate"], "-"),
        )
        self.lines = []
        for i, key, scale, label, colour, style in series:
            (line,) = self.ax[i].plot([], [], style, color=colour, lw=1.4, label=label)
            self.lines.append((i, key, scale, line))
        for a, ylabel in zip(self.ax, ("memory (GiB)", "PCIe (GB/s)", f"{unit}/s")):
            a.set_ylabel(ylabel, fontsize=8)
            a.tick_params(labelsize=7)
            a.grid(True, lw=0.4, alpha=0.5)
            a.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: fmt_count(v)))
        self._extra = []
        self.fig.subplots_adjust(left=0.075, right=0.99, top=0.98, bottom=0.09, hspace=0.12)

    def render(self, history: History, link_bytes_per_s=None) -> bytes:
        # a run's summary (written on close) holds means over the run, not a point in time
        recs = [r for r in history.records if not r.get("whole_run")]
        t = [r.get("time_s", math.nan) for r in recs]
        minutes = bool(t) and (t[-1] - t[0]) > 600
        div = 60.0 if minutes else 1.0
        x = [v / div for v in t]
        shown = [[], [], []]
        for i, key, scale, line in self.lines:
            y = [math.nan if r.get(key) is None else r[key] / scale for r in recs]
            line.set_data(x, y)
            if any(v == v for v in y):     # a legend entry only for series with readings
                shown[i].append(line)
        for a, lines in zip(self.ax, shown):
            if lines:
                a.legend(handles=lines, loc="upper left", fontsize=7, frameon=False, ncol=4)
            elif a.get_legend() is not None:
                a.get_legend().remove()
        for artist in self._extra:
            artist.remove()
        self._extra = [self.ax[k].axvline(r["time_s"] / div, color="#888", ls=":", lw=1)
                       for r in recs if r.get("resumed") for k in range(3)]
        link = link_bytes_per_s or next((r.get("link_bytes_per_s") for r in reversed(recs)
                                         if r.get("link_bytes_per_s")), None)
        if link:
            self._extra.append(self.ax[1].axhline(link / 1e9, color="#444", ls=":", lw=1))
        for a in self.ax:
            a.relim()
            a.autoscale(enable=True, axis="y")   # set_ylim below turns it off each time
            a.autoscale_view()
            lo, hi = a.get_ylim()
            a.set_ylim(0, max(hi, 1e-9) * 1.3)   # headroom for the legend row
        if x:
            span = (x[-1] - x[0]) or 1.0
            self.ax[2].set_xlim(x[0], x[-1] + 0.02 * span)
        self.ax[2].set_xlabel("time (min)" if minutes else "time (s)", fontsize=8)
        buf = io.BytesIO()
        self.fig.savefig(buf, format="png", dpi=self.fig.dpi, facecolor="white")
        return buf.getvalue()


class HistoryPlot:
    """A rendered history plot: ``.png`` bytes; shows itself in a notebook."""

    def __init__(self, png: bytes):
        self.png = png

    def _repr_png_(self):
        return self.png

    def __repr__(self):
        return f"HistoryPlot({len(self.png):,} bytes of PNG)"


def plot_history(history, unit: str | None = None, *, width_px: int = 860) -> HistoryPlot:
    """Re-plot a saved history (a JSONL path or a :class:`~nbtools.meters.History`), e.g. after
    resuming from a disconnect; dotted lines mark where a run was resumed."""
    if not isinstance(history, History):
        history = History.load(history)
    if unit is None:
        unit = next((r["unit"] for r in reversed(history.records) if r.get("unit")), "samples")
    return HistoryPlot(_Plotter(unit, width_px).render(history))


# --- the dashboard -----------------------------------------------------------------------------

class Dashboard:
    """Live memory and throughput dashboard for a training loop.

    Args:
        unit: what one sample is, for ``words/s`` (``"words"``, ``"rows"``, ``"samples"``).
        title: heading (default ``"nbtools dashboard"``).
        history: a JSONL path next to the checkpoints (continued if it exists, so the plot
            spans a disconnect) or a :class:`~nbtools.meters.History`.
        config: :class:`DashboardConfig` (refresh rate, thread mode, thresholds, text mode).
        display: False builds everything but shows nothing (tests).
        monitor: a ready :class:`~nbtools.meters.Monitor` (tests inject a fake backend/clock).

    Call :meth:`step` once per step (it is throttled; the cost is ~1 µs between refreshes), or
    pass :meth:`step` as a callback. Use it as a context manager so that it turns red when the
    loop raises; without one, :meth:`close` leaves the final summary (a failing notebook cell
    still turns it red).
    """

    def __init__(self, unit: str = "samples", *, title: str | None = None, history=None,
                 config: DashboardConfig | None = None, display: bool = True,
                 monitor: Monitor | None = None):
        self.config = cfg = config or DashboardConfig()
        if cfg.mode not in ("auto", "widget", "text"):
            raise ValueError(f"DashboardConfig.mode={cfg.mode!r}: expected 'auto', 'widget' or 'text'")
        if isinstance(history, (str, os.PathLike)):
            path = os.fspath(history)
            history = History.load(path, append=True) if os.path.exists(path) else History(path)
        self.monitor = monitor or Monitor(unit, config=cfg, history=history)
        self.title = title or "nbtools dashboard"
        self.mode = ("widget" if in_notebook() else "text") if cfg.mode == "auto" else cfg.mode
        self.display = display
        self.state = "running"
        self.error = ""
        self.warnings: list[str] = []
        self.widget = None
        self._handle = None
        self._closed = False
        self._plotter = None
        self._png = None
        self._next_plot = -math.inf
        self._last_text = -math.inf
        self._lock = threading.RLock()
        self._thread = None
        self._stop = threading.Event()
        self._file = cfg.file or sys.stderr
        if self.mode == "widget":
            self._build_widget()
        self._hook_cell_errors()
        if cfg.thread:
            ok, why = thread_mode_supported()
            if ok:
                self._start_thread()
            else:
                warnings.warn(f"DashboardConfig(thread=True) ignored: {why}; the dashboard "
                              "refreshes from the loop's thread instead", stacklevel=2)

    # loop API ---------------------------------------------------------------------------------
    def step(self, n=1) -> None:
        """One training step of ``n`` samples."""
        if self._thread is not None:
            with self._lock:       # the thread reads the meters this updates
                self.monitor.count(n)
            return
        rec = self.monitor.step(n)
        if rec is not None:
            self._draw(rec)

    __call__ = step   # usable directly as a per-step callback

    def data(self, iterable):
        """Iterate over a loader, timing the wait for each batch (the "data" share)."""
        return self.monitor.timer.data(iterable)

    def transfer(self):
        """``with dash.transfer():`` around host<->GPU copies (CUDA events, no sync)."""
        return self.monitor.timer.transfer()

    def compute(self):
        """``with dash.compute():`` around forward/backward/optimizer (CUDA events, no sync)."""
        return self.monitor.timer.compute()

    @property
    def record(self) -> dict:
        """The latest record (a plain dict, units in the keys)."""
        return self.monitor.record

    @property
    def history(self) -> History:
        return self.monitor.history

    def save_history(self, path) -> None:
        """Write the whole history as JSONL (atomically) next to the checkpoints."""
        self.monitor.history.save(path)

    def summary(self) -> dict:
        """The final (or latest) record with state, diagnosis and warnings."""
        return {**self.monitor.record, "state": self.state, "error": self.error,
                "warnings": list(self.warnings)}

    # drawing ----------------------------------------------------------------------------------
    def _build_widget(self):
        W = _widgets()
        # the figure is made now, before the loop runs: making it (~0.4 s, fonts) is not a
        # per-step cost, and charging it would push the second plot far out
        self._plotter = _Plotter(self.monitor.unit, self.config.width_px)
        self._plotter.render(History())   # the first render is ~5x slower (fonts, layout caches)
        self._html = W.HTML(value=render_html({"unit": self.monitor.unit}, title=self.title,
                                              note="waiting for the first step", frame=False,
                                              config=self.config))
        self._image = W.Image(format="png")
        self._image.layout.display = "none"   # until there is a plot
        # the frame goes around the HTML and the plot together (Layout works in 7.7 and 8.x)
        self.widget = W.VBox([self._html, self._image], layout=W.Layout(
            border=f"2px solid {_frame_colour('running')}", padding="6px 10px",
            max_width="924px"))
        if self.display:
            self._handle = _show(self.widget)

    def _note(self) -> str:
        b = self.monitor.meters.backend
        reasons = getattr(b, "na_reasons", {})
        return "N/A: " + "; ".join(reasons.values()) if reasons else ""

    def _plot(self, force: bool = False) -> None:
        now = self.monitor.clock()
        if not force and now < self._next_plot:
            return
        t0 = time.perf_counter()
        self._png = self._plotter.render(self.monitor.history, self.config.link_bytes_per_s)
        if self.mode == "widget":
            self._image.value = self._png
            self._image.layout.display = ""
        cost = time.perf_counter() - t0
        self._next_plot = now + max(self.config.plot_every_s, cost / self.config.plot_budget)
        self.monitor.add_overhead(cost, reschedule=False)

    def _draw(self, rec: dict, final: bool = False) -> None:
        t0 = time.perf_counter()
        self.warnings += self.monitor.new_warnings
        if self.mode == "widget":
            self._html.value = render_html(rec, state=self.state, title=self.title,
                                           warnings_=self.warnings, error=self.error,
                                           note=self._note(), frame=False,
                                           config=self.config)
            self.widget.layout.border = f"2px solid {_frame_colour(self.state)}"
        else:
            self._draw_text(rec, final)
        self.monitor.add_overhead(time.perf_counter() - t0)
        if self.mode == "widget" and len(self.monitor.history) > 1:
            self._plot(force=final)

    def _draw_text(self, rec: dict, final: bool) -> None:
        if not self.display:
            return
        f = self._file
        tty = getattr(f, "isatty", lambda: False)()
        for w in self.monitor.new_warnings:
            print(("\n" if tty else "") + f"[nbtools] warning: {w}", file=f)
        line = render_text(rec, state=self.state, title=self.title)
        now = self.monitor.clock()
        if tty:   # one status line, rewritten in place
            try:
                width = os.get_terminal_size(f.fileno()).columns - 1
            except (OSError, ValueError, AttributeError):
                width = 200
            print("\r" + line[:width].ljust(width), end="", file=f, flush=True)
        elif final or now - self._last_text >= self.config.text_every_s:
            print(line, file=f, flush=True)
            self._last_text = now

    # background thread (opt-in) ---------------------------------------------------------------
    def _start_thread(self):
        def run():   # the loop only counts (step -> Monitor.count); this thread refreshes
            while not self._stop.wait(self.config.refresh_s):
                with self._lock:
                    if self._closed:
                        return
                    self._draw(self.monitor.refresh())
        self._thread = threading.Thread(target=run, name="nbtools-dashboard", daemon=True)
        self._thread.start()

    # ending -----------------------------------------------------------------------------------
    def _hook_cell_errors(self):
        """Turn red when a notebook cell fails while the dashboard is open (no ``with``)."""
        self._ip = None
        if not in_notebook():
            return
        from IPython import get_ipython
        self._ip = get_ipython()
        self._ip.events.register("post_run_cell", self._after_cell)

    def _after_cell(self, result=None):
        err = getattr(result, "error_in_exec", None)
        if err is not None and not self._closed:
            self.fail(err)

    def fail(self, exc: BaseException) -> None:
        """Turn red, say why, and close (the caller re-raises)."""
        if self._closed:
            return
        self.state = "failed"
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        self.error = (f"stopped by {type(exc).__name__}{': ' + msg if msg else ''} "
                      f"at step {self.monitor.steps:,}")
        self.close()

    def close(self) -> None:
        """Final refresh; leave a static snapshot (widget) or a summary (text). Idempotent."""
        if self._closed:
            return
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.state == "running":
                self.state = "finished"
            rec = self.monitor.refresh(final=True)
            self._draw(rec, final=True)
            if self.mode == "widget":
                self._freeze(rec)
            elif self.display:
                self._print_summary(rec)
            self.monitor.close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._ip is not None:
            try:
                self._ip.events.unregister("post_run_cell", self._after_cell)
            except ValueError:
                pass

    def snapshot_html(self) -> str:
        """The dashboard as static HTML with the plot inlined (what a saved notebook shows)."""
        return render_html(self.monitor.record, state=self.state, title=self.title,
                           warnings_=self.warnings, error=self.error, note=self._note(),
                           image_png=self._png, config=self.config)

    def save_png(self, path) -> str:
        """Write the history plot, as the dashboard last drew it (drawn now in text mode or
        before the first plot), to ``path`` as PNG; returns the path."""
        png = self._png
        if png is None:
            png = _Plotter(self.monitor.unit, self.config.width_px).render(
                self.monitor.history, self.config.link_bytes_per_s)
        path = os.fspath(path)
        with open(path, "wb") as f:
            f.write(png)
        return path

    def _freeze(self, rec: dict) -> None:
        if not (self.config.freeze and self._handle is not None):
            return
        text = render_text(rec, state=self.state, title=self.title)
        self._handle.update({"text/html": self.snapshot_html(), "text/plain": text}, raw=True)
        self.widget.close()
        self._html.close()
        self._image.close()

    def _print_summary(self, rec: dict) -> None:
        f = self._file
        lines = ["", f"[nbtools] {self.title}: {_STATE[self.state][2]} after "
                 f"{fmt_seconds(rec.get('elapsed_s'))}, {rec.get('step', 0):,} steps, "
                 f"{fmt_count(rec.get('samples_total'))} {self.monitor.unit} "
                 f"({fmt_count(rec.get('mean_samples_per_s'))}/s mean)"]
        if self.error:
            lines.append(f"[nbtools] {self.error}")
        if run_summary_text(rec):
            lines.append(f"[nbtools] {run_summary_text(rec)}")
        lines.append(f"[nbtools] {rec.get('diagnosis', '')}")
        lines += [f"[nbtools] warning: {w}" for w in self.warnings]
        print("\n".join(lines), file=f, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            self.fail(exc)
        else:
            self.close()
        return False   # the exception, if any, goes on

    def __repr__(self):
        return (f"Dashboard(unit={self.monitor.unit!r}, mode={self.mode!r}, state={self.state!r}, "
                f"steps={self.monitor.steps})")


# --- machine check -----------------------------------------------------------------------------

_BW_ROWS = (("pinned_h2d", "pinned host → GPU"), ("pinned_d2h", "pinned GPU → host"),
            ("pageable_h2d", "pageable host → GPU"), ("pageable_d2h", "pageable GPU → host"),
            ("zero_copy_gather", "zero-copy row gather"))


def render_bandwidth_html(res: dict, measuring: str = "") -> str:
    """Bars of each measured rate against the link's theoretical maximum."""
    link = res.get("link_bytes_per_s")
    rates = [res.get(f"{k}_bytes_per_s") for k, _ in _BW_ROWS]
    scale = link or max([r for r in rates if r] or [1.0])
    rows = ""
    for (key, label), rate in zip(_BW_ROWS, rates):
        colour = _C["pinned"] if key.startswith("pinned") else (
            _C["gpu"] if key.startswith("zero") else _C["other"])
        extra = f" (gather of {res.get('row_bytes')} B rows)" if key.startswith("zero") else ""
        status = "measuring…" if key == measuring else fmt_rate(rate)
        rows += _bar(label, scale, [(label, rate, colour)],
                     f"{status}{'' if rate is None or not link else f' of {fmt_rate(link)} ({rate / link:.0%})'}{extra}")
    head = (f'<div style="font-size:14px;margin-bottom:4px"><b>host ↔ GPU bandwidth</b> '
            f'<span style="color:{_C["muted"]}">{fmt_bytes(res.get("nbytes"))} per copy · link '
            f'{fmt_rate(link) if link else "N/A"} theoretical</span></div>')
    note = res.get("note")
    foot = f'<div style="font-size:11px;color:{_C["muted"]}">{_e(note)}</div>' if note else ""
    return (f'<div class="nbtools-bandwidth" style="font-family:system-ui,sans-serif;color:#222;'
            f'background:#fff;border:2px solid #d0d0d0;border-radius:8px;padding:8px 10px;'
            f'max-width:900px">{head}{rows}{foot}</div>')


def bandwidth_check(nbytes: int = 256 << 20, *, row_bytes: int = 512, device="auto",
                    display: bool = True, file=None) -> dict:
    """Measure this machine's host<->GPU bandwidth (:func:`nbtools.meters.measure_bandwidth`)
    and show it as bars against the link's maximum: a widget while it measures, then a static
    snapshot; a text table outside a notebook. Returns the measurements (bytes/s)."""
    notebook = display and in_notebook()
    box = handle = None
    if notebook:
        W = _widgets()
        blank = dict(nbytes=nbytes, row_bytes=row_bytes)
        box = W.HTML(value=render_bandwidth_html(blank, measuring="pinned_h2d"))
        handle = _show(box)

    def progress(name, so_far):
        if box is not None:
            box.value = render_bandwidth_html(so_far, measuring=name)

    res = measure_bandwidth(nbytes, row_bytes=row_bytes, device=device, progress=progress)
    if notebook:
        handle.update({"text/html": render_bandwidth_html(res),
                       "text/plain": _bandwidth_text(res)}, raw=True)
        box.close()
    elif display:
        print(_bandwidth_text(res), file=file or sys.stdout)
    return res


def _bandwidth_text(res: dict) -> str:
    link = res.get("link_bytes_per_s")
    lines = [f"host <-> GPU bandwidth ({fmt_bytes(res.get('nbytes'))} per copy, link "
             f"{fmt_rate(link)} theoretical)"]
    for key, label in _BW_ROWS:
        rate = res.get(f"{key}_bytes_per_s")
        share = f" ({rate / link:.0%})" if rate and link else ""
        lines.append(f"  {label:<22} {fmt_rate(rate):>10}{share}")
    if res.get("note"):
        lines.append(f"  {res['note']}")
    return "\n".join(lines)
