"""The dashboard's record drawn as HTML and as one line of text, and the bandwidth check's bars
and table: pure functions of the plain dicts that :mod:`nbtools.meters` computes, with nothing
to display and no widget, so that tests, the static snapshot and the live view draw the same.

>>> line = render_text({"unit": "rows", "samples_per_s": 2560.0, "step_s": 0.1,
...                     "diagnosis": "compute-bound"})
>>> line.split(" | ")[1], line.split(" | ")[-1]
('2.56k rows/s', 'compute-bound')
"""
from __future__ import annotations

import base64
import html

from ..meters import MonitorConfig
from ..units import fmt_bytes, fmt_count, fmt_rate, fmt_seconds

C = {"gpu": "#1f77b4", "cache": "#9ecae1", "other": "#b0b0b0", "pinned": "#ff7f0e",
      "data": "#9467bd", "transfer": "#ff7f0e", "compute": "#2ca02c", "rate": "#d62728",
      "ok": "#2ca02c", "fail": "#d62728", "run": "#1f77b4", "warn_bg": "#fff4ce",
      "warn": "#7a5b00", "muted": "#666"}
STATE = {"running": ("●", C["run"], "running"), "finished": ("✓", C["ok"], "finished"),
          "failed": ("✗", C["fail"], "stopped")}


def _e(s) -> str:
    return html.escape(str(s))


def _badge(label, value, sub="", title="") -> str:
    return (f'<div class="nbtools-badge" title="{_e(title)}" style="display:inline-block;'
            'box-sizing:border-box;width:calc(20% - 6px);min-width:120px;margin:0 6px 6px 0;'
            'padding:5px 9px;border:1px solid #e2e2e2;border-radius:6px;background:#f7f8fa;'
            'vertical-align:top;white-space:nowrap;overflow:hidden">'
            f'<div style="font-size:11px;color:{C["muted"]}">{_e(label)}</div>'
            f'<div class="nbtools-value" style="font-size:17px;font-weight:600;color:#111">'
            f'{_e(value)}</div>'
            f'<div style="font-size:11px;color:{C["muted"]}">{_e(sub)}</div></div>')


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
    border = C["fail"] if alarm else "#cfcfcf"
    legend = " ".join(f'<span style="color:{c}">■</span>&nbsp;{_e(n)}' for n, v, c in parts
                      if v is not None)
    return ('<div class="nbtools-bar" style="margin:3px 0">'
            f'<div style="font-size:12px;color:#222"><b>{_e(label)}</b> {_e(text)}'
            f'<span style="float:right;font-size:11px;color:{C["muted"]}">{legend}</span></div>'
            f'<div style="height:11px;border:1px solid {border};border-radius:3px;'
            f'background:#fff;overflow:hidden">{segs}</div></div>')


def _pct(part, whole) -> str:
    return f"{100 * part / whole:.0f}%" if part is not None and whole else "N/A"


def _cores(busy, of) -> str:
    """``1.8 of 2 cores``: cores busy on average, of how many."""
    if busy is None:
        return "N/A"
    return f"{busy:.1f} of {of} cores" if of else f"{busy:.1f} cores"


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
    mark, colour, word = STATE[state]
    elapsed = fmt_seconds(r.get("elapsed_s"))
    head = (f'<div style="font-size:14px;margin-bottom:6px"><span style="color:{colour}">{mark}'
            f'</span> <b>{_e(title or "nbtools dashboard")}</b> <span style="color:{C["muted"]}">'
            f'· {word} · {elapsed} · step {r.get("step", 0):,}'
            f' · {fmt_count(r.get("samples_total"))} {_e(unit)}</span></div>')
    if error:
        head += (f'<div class="nbtools-error" style="color:#fff;background:{C["fail"]};'
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
        _badge("CPU busy", _cores(r.get("process_cpu_cores"), r.get("process_cores")),
               "machine " + _cores(r.get("host_cpu_busy_cores"), r.get("host_cores")),
               "cores busy on average" + (" over the run" if run else "") + ": this "
               "process's threads, of the cores it may use; below, every process on the "
               "machine, of its cores"),
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
    bars = "" if gt is None else _bar("GPU memory", gt, [("torch allocated", ta, C["gpu"]),
                                   ("torch cache", _sub(tr, ta), C["cache"]),
                                   ("other", _sub(gu, tr) if tr is not None else gu, C["other"])],
                f"{fmt_bytes(gu)} / {fmt_bytes(gt)} ({_pct(gu, gt)})",
                alarm=bool(gu and gt and gu >= cfg.gpu_warn_fraction * gt))
    ht, hu, pin = r.get("host_total_bytes"), r.get("host_used_bytes"), r.get("pinned_bytes")
    bars += _bar("host RAM", ht, [("pinned", pin, C["pinned"]),
                                  ("other used", _sub(hu, pin) if pin is not None else hu,
                                   C["other"])],
                 f"{fmt_bytes(hu)} / {fmt_bytes(ht)} ({_pct(hu, ht)}), {fmt_bytes(pin)} pinned",
                 alarm=bool(hu and ht and hu >= cfg.host_warn_fraction * ht))
    phases = [("data wait", r.get("data_wait_s"), C["data"]),
              ("transfer", r.get("transfer_s"), C["transfer"]),
              ("compute", r.get("compute_s"), C["compute"])]
    if any(v is not None for _, v, _ in phases):
        bars += _bar("step", step, phases, fmt_seconds(step) + ": " + " · ".join(
            f"{n} {_pct(v, step)}" for n, v, _ in phases if v is not None)
            + (f" · {run_summary_text(r)}" if run and run_summary_text(r) else ""))
    diag = (f'<div class="nbtools-diagnosis" style="margin:6px 0 2px;font-size:13px">'
            f'<b>⚑ {_e(r.get("diagnosis", ""))}</b></div>')
    warn = "".join(f'<div class="nbtools-warning" style="background:{C["warn_bg"]};'
                   f'color:{C["warn"]};padding:3px 8px;margin:3px 0;border-radius:4px;'
                   f'font-size:12px">⚠ {_e(w)}</div>' for w in warnings_)
    img = ""
    if image_png:
        img = ('<img class="nbtools-plot" alt="nbtools history plot" style="max-width:100%" '
               f'src="data:image/png;base64,{base64.b64encode(image_png).decode()}"/>')
    over = r.get("overhead_percent")
    foot = (f'<div style="font-size:11px;color:{C["muted"]};margin-top:4px">'
            f'refreshed at {fmt_seconds(r.get("time_s"))} · dashboard overhead '
            f'{"N/A" if over is None else f"{over:.2f}%"}{(" · " + _e(note)) if note else ""}'
            '</div>')
    box = (f"border:2px solid {frame_colour(state)};border-radius:8px;padding:8px 10px;"
           if frame else "")
    return (f'<div class="nbtools-dashboard nbtools-{state}" style="font-family:system-ui,'
            f'-apple-system,Segoe UI,Roboto,sans-serif;color:#222;background:#fff;{box}'
            f'max-width:900px">{head}<div>{badges}</div>{bars}{diag}{warn}{img}{foot}</div>')


def frame_colour(state: str) -> str:
    return C["fail"] if state == "failed" else "#d0d0d0"


def render_text(rec: dict, *, state: str = "running", title: str = "") -> str:
    """One status line for logs and terminals."""
    r = rec
    unit = r.get("unit", "samples")
    step = r.get("step_s")
    run = bool(r.get("whole_run"))    # the summary on close: means over the run
    parts = [f"[{title or 'nbtools'} {STATE[state][2]} {fmt_seconds(r.get('elapsed_s'))}]",
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
    if r.get("process_cpu_cores") is not None:
        parts.append(f"CPU {_cores(r['process_cpu_cores'], r.get('process_cores'))}")
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
        colour = C["pinned"] if key.startswith("pinned") else (
            C["gpu"] if key.startswith("zero") else C["other"])
        extra = f" (gather of {res.get('row_bytes')} B rows)" if key.startswith("zero") else ""
        status = "measuring…" if key == measuring else fmt_rate(rate)
        rows += _bar(label, scale, [(label, rate, colour)],
                     f"{status}{'' if rate is None or not link else f' of {fmt_rate(link)} ({rate / link:.0%})'}{extra}")
    head = (f'<div style="font-size:14px;margin-bottom:4px"><b>host ↔ GPU bandwidth</b> '
            f'<span style="color:{C["muted"]}">{fmt_bytes(res.get("nbytes"))} per copy · link '
            f'{fmt_rate(link) if link else "N/A"} theoretical</span></div>')
    note = res.get("note")
    foot = f'<div style="font-size:11px;color:{C["muted"]}">{_e(note)}</div>' if note else ""
    return (f'<div class="nbtools-bandwidth" style="font-family:system-ui,sans-serif;color:#222;'
            f'background:#fff;border:2px solid #d0d0d0;border-radius:8px;padding:8px 10px;'
            f'max-width:900px">{head}{rows}{foot}</div>')


def bandwidth_text(res: dict) -> str:
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
