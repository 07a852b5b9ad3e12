"""The dashboard's history plot: memory, PCIe and throughput (with the CPU cores busy) on one
time axis, drawn with matplotlib's Agg backend into PNG bytes (the one kind of live plot that
works in Colab), and :func:`plot_history` to re-plot a saved history. matplotlib is imported
when a plot is made, never by ``import nbtools.dashboard``.
"""
from __future__ import annotations

import io
import math

from ..meters import History
from ..units import fmt_count
from .render import C

INSTALL = "pip install ipywidgets matplotlib"   # what the widget dashboard and its plots need


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"the dashboard's history plot needs matplotlib: {INSTALL}") from e
    return matplotlib, Figure, FigureCanvasAgg


class Plotter:
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
            (0, "gpu_used_bytes", 2**30, "GPU used", C["gpu"], "-"),
            (0, "torch_reserved_bytes", 2**30, "torch reserved", C["cache"], "-"),
            (0, "host_used_bytes", 2**30, "host used", C["other"], "-"),
            (0, "pinned_bytes", 2**30, "pinned", C["pinned"], "-"),
            (1, "pcie_rx_bytes_per_s", 1e9, "PCIe → GPU", C["gpu"], "-"),
            (1, "pcie_tx_bytes_per_s", 1e9, "PCIe → host", C["compute"], "-"),
            (1, "nbtools_h2d_bytes_per_s", 1e9, "nbtools → GPU", C["pinned"], "--"),
            (1, "nbtools_d2h_bytes_per_s", 1e9, "nbtools → host", C["data"], "--"),
            (2, "samples_per_s", 1.0, f"{unit}/s", C["rate"], "-"),
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
        # the CPU cores this process keeps busy, on the throughput's panel (its own axis on the
        # right): a rate that drops while the cores are full is waiting for the host
        self.cpu_ax = self.ax[2].twinx()
        (self.cpu_line,) = self.cpu_ax.plot([], [], ":", color=C["muted"], lw=1.2,
                                            label="CPU cores busy (right)")
        self.cpu_ax.set_ylabel("CPU cores", fontsize=8)
        self.cpu_ax.tick_params(labelsize=7)
        self._extra = []
        self.fig.subplots_adjust(left=0.075, right=0.95, top=0.98, bottom=0.09, hspace=0.12)

    def render(self, history: History, link_bytes_per_s=None) -> bytes:
        # a run's summary (written on close) holds means over the run, not a point in time
        recs = [r for r in history.records if not r.get("whole_run")]
        t = [r.get("time_s", math.nan) for r in recs]
        minutes = bool(t) and (t[-1] - t[0]) > 600
        div = 60.0 if minutes else 1.0
        x = [v / div for v in t]
        shown = [[], [], []]
        seen = [False, False, False]        # a panel with a nonzero reading
        for i, key, scale, line in self.lines:
            y = [math.nan if r.get(key) is None else r[key] / scale for r in recs]
            line.set_data(x, y)
            finite = sum(v == v for v in y)
            line.set_marker("o" if 0 < finite <= 3 else "")   # a short run: its few readings
            line.set_markersize(3)
            if finite:                     # a legend entry only for series with readings
                shown[i].append(line)
                seen[i] = seen[i] or any(v == v and v != 0 for v in y)
        cores = [math.nan if r.get("process_cpu_cores") is None else r["process_cpu_cores"]
                 for r in recs]
        finite = [v for v in cores if v == v]
        self.cpu_line.set_data(x, cores)
        self.cpu_line.set_marker("o" if 0 < len(finite) <= 3 else "")
        self.cpu_line.set_markersize(3)
        of = max([r.get("process_cores") or 0 for r in recs] + [0])
        self.cpu_ax.set_ylim(0, max([of, 1] + finite) * 1.3)
        if finite:
            shown[2].append(self.cpu_line)
        for a, lines in zip(self.ax, shown):
            if lines:
                a.legend(handles=lines, loc="upper left", fontsize=7, frameon=False, ncol=4)
            elif a.get_legend() is not None:
                a.get_legend().remove()
        for artist in self._extra:
            artist.remove()
        self._extra = [self.ax[k].axvline(r["time_s"] / div, color="#888", ls=":", lw=1)
                       for r in recs if r.get("resumed") for k in range(3)]
        no_gpu = bool(recs) and not any(r.get("gpu_used_bytes") is not None for r in recs)
        notes = {1: "N/A: no GPU here (a CPU run moves nothing over PCIe)" if no_gpu else
                    "no PCIe traffic measured yet",
                 2: "no throughput yet: it takes two readings (refresh_s apart)"}
        for k, note in notes.items():
            if not seen[k]:
                self._extra.append(self.ax[k].text(0.5, 0.5, note, transform=self.ax[k].transAxes,
                                                   ha="center", va="center", fontsize=8,
                                                   color="#777"))
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
    return HistoryPlot(Plotter(unit, width_px).render(history))
