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

The package: this file holds the live view (:class:`Dashboard`, its config, the notebook
checks, :func:`bandwidth_check`); :mod:`~nbtools.dashboard.render` draws a record as HTML or
text, :mod:`~nbtools.dashboard.plot` the history plot.

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

import dataclasses
import math
import os
import sys
import threading
import time
import typing
import warnings

from ..files import write_private
from ..meters import History, Monitor, MonitorConfig, measure_bandwidth
from ..units import fmt_count, fmt_seconds
from .plot import INSTALL, HistoryPlot, Plotter, plot_history  # noqa: F401  (re-exported)
from .render import (STATE, bandwidth_text, frame_colour, render_bandwidth_html, render_html,
                     render_text, run_summary_text)


def _widgets():
    try:
        import ipywidgets
    except ImportError as e:
        raise ImportError(f"nbtools.Dashboard draws with ipywidgets in a notebook, which is not "
                          f"installed: {INSTALL} (or pass DashboardConfig(mode='text'))") from e
    return ipywidgets


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
    # plot_budget of the wall time: a redraw takes a good fraction of a second of CPU, and
    # more frequent redraws measurably slowed training (benchmarks/RESULTS.md, "Dashboard").
    plot_every_s: float = 5.0
    plot_budget: float = 0.005
    thread: bool = False           # refresh from a background thread (not Colab, not ipykernel 7.0.0)
    freeze: bool = True            # on close, replace the widget with a static HTML snapshot
    text_every_s: float = 10.0     # text mode, not a terminal: one line at most this often
    width_px: int = 860            # plot width
    file: typing.Any = None        # text mode output (default sys.stderr)


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

    @property
    def thread_running(self) -> bool:
        """True while the background thread refreshes the dashboard (``DashboardConfig(thread=
        True)`` where :func:`thread_mode_supported`; it ends at :meth:`close`)."""
        return self._thread is not None and self._thread.is_alive()

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
        self._plotter = Plotter(self.monitor.unit, self.config.width_px)
        self._plotter.render(History())   # the first render is ~5x slower (fonts, layout caches)
        self._html = W.HTML(value=render_html({"unit": self.monitor.unit}, title=self.title,
                                              note="waiting for the first step", frame=False,
                                              config=self.config))
        self._image = W.Image(format="png")
        self._image.layout.display = "none"   # until there is a plot
        # the frame goes around the HTML and the plot together (Layout works in 7.7 and 8.x)
        self.widget = W.VBox([self._html, self._image], layout=W.Layout(
            border=f"2px solid {frame_colour('running')}", padding="6px 10px",
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
            self.widget.layout.border = f"2px solid {frame_colour(self.state)}"
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
        before the first plot), to ``path`` as PNG; returns the path. The file is made new
        (mode 0600) and renamed over ``path``: a link or FIFO someone put at ``path`` is
        replaced, never written through or blocked on."""
        png = self._png
        if png is None:
            png = Plotter(self.monitor.unit, self.config.width_px).render(
                self.monitor.history, self.config.link_bytes_per_s)
        path = os.fspath(path)
        write_private(path, png)
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
        lines = ["", f"[nbtools] {self.title}: {STATE[self.state][2]} after "
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
                       "text/plain": bandwidth_text(res)}, raw=True)
        box.close()
    elif display:
        print(bandwidth_text(res), file=file or sys.stdout)
    return res
