"""The dashboard beside an offloaded training loop: its overhead, and its readings checked
against nvidia-smi and torch's own counters.

1. Overhead at the default refresh (1 s), steady state, on the same offloaded loop
   (OffloadedEmbedding + OffloadOptimizer(Adam)) wrapped in ``dash.compute()`` (CUDA events).
   Two paired experiments, one per kind of work the dashboard does (see measure_overhead):
   A, the training thread (text and widget dashboards; widget: display=False, so widgets,
   HTML and PNG plots are made but nothing is shown), and B, the NVML PCIe polling thread.
   Blocks alternate with baseline blocks; each round's block is compared with that round's
   baseline, and the mean over rounds is reported with a 95% confidence interval.
2. Readings. While the loop runs, ``nvidia-smi --query-gpu=memory.used,memory.total,
   utilization.gpu`` is read on a side thread and compared with the meters' NVML readings;
   torch.cuda.memory_allocated/reserved with the meters' torch readings; the pinned bytes with
   the table + optimizer state size; torch's host allocator with a 64 MiB pin_memory tensor;
   NVML's PCIe RX with the bytes nbtools counted.
3. Costs of the parts: Meters.read(), Monitor.step() between refreshes, HTML, plot.

    python benchmarks/bench_dashboard.py              # GPU machine, about 3 minutes
    python benchmarks/bench_dashboard.py --quick      # small, on a CPU in seconds
    python benchmarks/bench_dashboard.py --out DIR    # also DIR/dashboard.json, DIR/dashboard.html

``DIR/dashboard.html`` is the dashboard's static snapshot from the run; for the README:
``python scripts/browser/cdp.py DIR/dashboard.html docs/dashboard.png``.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time

import harness
import torch
from harness import synchronize

import nbtools
from nbtools.dashboard import Dashboard, DashboardConfig, plot_history, render_html
from nbtools.meters import Meters, Monitor, MonitorConfig, PcieSampler, SystemBackend

MiB = 2**20


class Loop:
    """An offloaded embedding training step: lookup, small loss, backward, Adam step."""

    def __init__(self, rows, dim, ids, device):
        self.device, self.rows, self.ids = device, rows, ids
        self.table = nbtools.OffloadedEmbedding(rows, dim, device=device, name="bench")
        self.opt = nbtools.OffloadOptimizer(torch.optim.Adam, [self.table], lr=1e-3)
        self.state_bytes = rows * dim * 4 * 3          # weight + exp_avg + exp_avg_sq

    def step(self):
        # skewed ids, as in real logs: popular rows are small ids
        ids = (torch.rand(self.ids, device=self.device) ** 4 * self.rows).long()
        loss = self.table(ids).pow(2).sum() * 1e-3
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()


def widgets_available() -> bool:
    try:
        import ipywidgets  # noqa: F401
        import matplotlib  # noqa: F401
        return True
    except ImportError:
        return False


# two-sided 95% Student t quantiles by degrees of freedom (a lower df is used between entries:
# wider, so conservative)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 12: 2.18, 15: 2.13, 20: 2.09, 25: 2.06, 30: 2.04, 40: 2.02, 60: 2.00}


def mean_ci(values):
    """Mean and the half-width of its 95% confidence interval (Student t)."""
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return mean, float("inf")
    t = _T95[max(k for k in _T95 if k <= n - 1)]
    return mean, t * statistics.stdev(values) / n ** 0.5


class StitchedClock:
    """Monotonic seconds that stand still between :meth:`resume` and :meth:`pause`: a dashboard
    that only runs in some blocks sees one continuous run, so its refreshes and plots land as
    often as they would in an uninterrupted loop."""

    def __init__(self):
        self._paused_at = time.monotonic()
        self._gap = 0.0

    def resume(self):
        self._gap += time.monotonic() - self._paused_at
        self._paused_at = None

    def pause(self):
        self._paused_at = time.monotonic()

    def __call__(self):
        now = time.monotonic() if self._paused_at is None else self._paused_at
        return now - self._gap


def timed_block(loop, steps, device, dash=None):
    """Seconds for ``steps`` steps, with ``dash`` stepped (as a user would) or without."""
    synchronize(device)
    t0 = time.perf_counter()
    if dash is None:
        for _ in range(steps):
            loop.step()
    else:
        for _ in range(steps):
            with dash.compute():
                loop.step()
            dash.step(loop.ids)
    synchronize(device)
    return time.perf_counter() - t0


def paired(times, base="baseline"):
    """Per mode: mean and 95% CI of (block / same round's baseline block - 1), in percent."""
    out = {}
    for m, ts in times.items():
        if m == base:
            continue
        ratios = [100 * (t / b - 1) for t, b in zip(ts, times[base])]
        mean, half = mean_ci(ratios)
        out[m] = {"overhead_percent": mean, "ci95_percent": half,
                  "median_percent": statistics.median(ratios), "per_round_percent": ratios}
    return out


def _count_plots(dash):
    """Count the dashboard's redraws of its history plot in ``dash.plots``."""
    dash.plots = 0
    if dash._plotter is None:
        return
    render = dash._plotter.render

    def counted(*a, **k):
        dash.plots += 1
        return render(*a, **k)
    dash._plotter.render = counted


def measure_overhead(loop, device, block_s, rounds, modes):
    """Steady-state overhead, in two paired experiments (the dashboard's two kinds of work).

    A. The training thread: one long-lived dashboard per mode (PCIe polling off: that is B),
       stepped only in its own blocks and running on a clock that stands still outside them,
       so it refreshes, draws and re-plots exactly as often as in one continuous run. Blocks
       of baseline / text / widget alternate, the order rotating and reversing each round.
    B. The NVML PCIe polling thread (every 20 ms, shared by both modes): blocks with it
       running against blocks without, alternating.
    Each round's block is compared with the same round's baseline block, which cancels the
    machine's slow drift; the result is the mean over rounds with a 95% confidence interval.
    The total per mode is A + B (the intervals added in quadrature).
    """
    for _ in range(5):                       # warm-up, and the step time
        loop.step()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(20):
        loop.step()
    synchronize(device)
    step_s = (time.perf_counter() - t0) / 20
    steps = max(20, int(block_s / step_s))

    # A: the training thread
    dashes, clocks = {}, {}
    for m in modes:
        if m == "baseline":
            continue
        clocks[m] = StitchedClock()
        cfg = DashboardConfig(mode=m, pcie="off", file=open(os.devnull, "w"))
        mon = Monitor("ids", config=cfg, clock=clocks[m])
        dashes[m] = Dashboard("ids", title=f"bench ({m})", config=cfg, display=False, monitor=mon)
        _count_plots(dashes[m])
        clocks[m].resume()                   # a first refresh (and, for widgets, a first plot)
        timed_block(loop, max(20, steps // 4), device, dashes[m])
        clocks[m].pause()
    times = {m: [] for m in modes}
    for r in range(rounds):
        order = modes[r % len(modes):] + modes[:r % len(modes)]
        if r % 2:
            order = order[::-1]
        for m in order:
            dash = dashes.get(m)
            if dash is not None:
                clocks[m].resume()
            times[m].append(timed_block(loop, steps, device, dash))
            if dash is not None:
                clocks[m].pause()
        print("  round %2d  " % (r + 1) + "  ".join(
            f"{m} {times[m][-1] / steps * 1e3:.3f}" for m in modes) + " ms/step", flush=True)
    a = paired(times)
    own = {}
    for m, dash in dashes.items():
        mon = dash.monitor
        own[m] = {"self_reported_percent": 100 * mon.overhead_s / sum(times[m]),
                  "refreshes": len(mon.history), "plots": dash.plots if dash._plotter else None}
        dash.close()

    # B: the PCIe polling thread
    backend = SystemBackend(device)
    sampler = PcieSampler(backend)
    sampler.poll()
    pcie_times = {"baseline": [], "pcie": []}
    if sampler.source == "counters":
        for r in range(rounds):
            for m in (("baseline", "pcie") if r % 2 == 0 else ("pcie", "baseline")):
                if m == "pcie":
                    sampler.start()
                pcie_times[m].append(timed_block(loop, steps, device))
                if m == "pcie":
                    sampler.stop()
        b = paired(pcie_times)["pcie"]
    else:
        b = None                             # no counters here: no polling thread to measure
    backend.close()

    out = {"design": "paired blocks, steady state (see measure_overhead)", "steps_per_block": steps,
           "rounds": rounds, "step_ms": step_s * 1e3, "refresh_s": DashboardConfig().refresh_s,
           "pcie_source": sampler.source, "training_thread": a, "pcie_thread": b,
           "block_s": times, "pcie_block_s": pcie_times, "modes": {}}
    for m in dashes:
        mean = a[m]["overhead_percent"] + (b["overhead_percent"] if b else 0.0)
        half = (a[m]["ci95_percent"] ** 2 + (b["ci95_percent"] ** 2 if b else 0.0)) ** 0.5
        out["modes"][m] = {"overhead_percent": mean, "ci95_percent": half,
                           "upper95_percent": mean + half, **own[m]}
    return out


def showcase(loop, device, seconds):
    """A plain run with the dashboard at its defaults, for the snapshot (dashboard.html)."""
    mode = "widget" if widgets_available() else "text"
    cfg = DashboardConfig(mode=mode, file=open(os.devnull, "w"))
    with Dashboard("ids", title=f"offloaded Adam, {loop.rows:,} rows ({device})", config=cfg,
                   display=False) as dash:
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            with dash.compute():
                loop.step()
            dash.step(loop.ids)
    return dash


def nvidia_smi():
    """Rows of nvidia-smi's own readings, keyed by GPU UUID; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--query-gpu=uuid,memory.used,memory.total,utilization.gpu",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = {}
    for line in r.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            def num(x):
                try:
                    return float(x)
                except ValueError:
                    return None
            rows[parts[0]] = {"memory_used_mib": num(parts[1]), "memory_total_mib": num(parts[2]),
                              "utilization_percent": num(parts[3])}
    return rows


def check_readings(loop, device, samples=3):
    """Meters against nvidia-smi (read on a side thread while the loop runs) and torch."""
    backend = SystemBackend(device)
    meters = Meters(backend)
    uuid = None
    if backend._nvml is not None:
        try:
            uuid = backend._nvml.nvmlDeviceGetUUID(backend._handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        except Exception:
            pass
    pinned_torch = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True) \
        if device.type == "cuda" else None
    meters.read()
    rows = []
    for _ in range(samples):
        box = {}
        th = threading.Thread(target=lambda: box.update(smi=nvidia_smi()))
        t_start = time.perf_counter()
        th.start()
        while th.is_alive() or time.perf_counter() - t_start < 1.0:
            loop.step()                        # keep the GPU busy while nvidia-smi reads
        th.join()
        rec = meters.read()
        torch_alloc = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        torch_res = torch.cuda.memory_reserved(device) if device.type == "cuda" else None
        smi_all = box.get("smi")
        smi = (smi_all.get(uuid) or next(iter(smi_all.values()), None)) if smi_all else None
        rows.append({"meters": rec, "smi": smi, "torch_allocated_bytes": torch_alloc,
                     "torch_reserved_bytes": torch_res})
    meters.close()
    backend.close()
    last = rows[-1]
    rec, smi = last["meters"], last["smi"] or {}

    def mib(b):
        return None if b is None else b / MiB

    checks = {
        "gpu_used_mib": (mib(rec["gpu_used_bytes"]), smi.get("memory_used_mib")),
        "gpu_total_mib": (mib(rec["gpu_total_bytes"]), smi.get("memory_total_mib")),
        "gpu_util_percent": (rec["gpu_util_percent"], smi.get("utilization_percent")),
        "torch_allocated_mib": (mib(rec["torch_allocated_bytes"]), mib(last["torch_allocated_bytes"])),
        "torch_reserved_mib": (mib(rec["torch_reserved_bytes"]), mib(last["torch_reserved_bytes"])),
        "nbtools_pinned_mib": (mib(rec["nbtools_pinned_bytes"]),
                               mib(loop.state_bytes) if device.type == "cuda" else 0.0),
        "torch_pinned_mib": (mib(rec["torch_pinned_bytes"]), 64.0 if pinned_torch is not None else None),
        "pcie_rx_gb_per_s": (None if rec["pcie_rx_bytes_per_s"] is None else rec["pcie_rx_bytes_per_s"] / 1e9,
                             None if rec["nbtools_h2d_bytes_per_s"] is None
                             else rec["nbtools_h2d_bytes_per_s"] / 1e9),
        "pcie_tx_gb_per_s": (None if rec["pcie_tx_bytes_per_s"] is None else rec["pcie_tx_bytes_per_s"] / 1e9,
                             None if rec["nbtools_d2h_bytes_per_s"] is None
                             else rec["nbtools_d2h_bytes_per_s"] / 1e9),
    }
    del pinned_torch
    return {"checks": checks, "samples": rows, "pcie_source": rec["pcie_source"],
            "pcie_gen": rec["pcie_gen"], "pcie_width": rec["pcie_width"],
            "link_bytes_per_s": rec["link_bytes_per_s"], "na_reasons": dict(backend.na_reasons)}


def part_costs(device, history):
    """Microseconds / milliseconds of each part of a refresh, and of a step between refreshes."""
    out = {}
    meters = Meters(SystemBackend(device), pcie="off")
    meters.read()
    t = []
    for _ in range(50):
        t0 = time.perf_counter()
        meters.read()
        t.append(time.perf_counter() - t0)
    out["meters_read_ms"] = statistics.median(t) * 1e3
    meters.close()
    mon = Monitor("ids", config=MonitorConfig(pcie="off", refresh_s=3600))
    mon.step(1)
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        mon.step(1)
    out["monitor_step_us"] = (time.perf_counter() - t0) / n * 1e6
    mon.close()
    rec = history.records[-1] if history.records else {}
    t0 = time.perf_counter()
    for _ in range(100):
        render_html(rec)
    out["render_html_ms"] = (time.perf_counter() - t0) / 100 * 1e3
    if widgets_available() and len(history) > 1:
        from nbtools.dashboard import Plotter
        p = Plotter("ids")
        p.render(history)
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            p.render(history)
            t.append(time.perf_counter() - t0)
        out["plot_ms"] = statistics.median(t) * 1e3
    return out


def fmt(v, digits=1):
    return "N/A" if v is None else f"{v:,.{digits}f}"


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65_536)
    ap.add_argument("--block-s", type=float, default=None, help="seconds per timed block (2)")
    ap.add_argument("--showcase-s", type=float, default=None,
                    help="seconds of the run shown in dashboard.html (10)")
    ap.add_argument("--rounds", type=int, default=None, help="paired rounds (14)")
    args = ap.parse_args()
    quick = {"block_s": 0.2, "rounds": 2, "showcase_s": 1.0}
    full = {"block_s": 2.0, "rounds": 14, "showcase_s": 10.0}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:       # explicit values win over --quick
            setattr(args, k, v)
    if args.quick:
        args.rows, args.dim, args.ids = 100_000, 32, 1_024
    device = harness.setup(args)
    t_start = time.perf_counter()
    print(f"# {device}  table {args.rows:,} x {args.dim} fp32 + Adam state, {args.ids:,} ids/step",
          flush=True)
    phase_s = {}

    def phase(name, fn, *a):
        t0 = time.perf_counter()
        print(f"{name} ...", flush=True)
        value = fn(*a)
        phase_s[name] = time.perf_counter() - t0
        return value

    loop = phase("setup", Loop, args.rows, args.dim, args.ids, device)
    modes = ["baseline", "text"] + (["widget"] if widgets_available() else [])
    overhead = phase("overhead", measure_overhead, loop, device, args.block_s, args.rounds, modes)
    readings = phase("readings", check_readings, loop, device, 1 if args.quick else 3)
    last = phase("showcase", showcase, loop, device, args.showcase_s)
    costs = phase("costs", part_costs, device, last.history)
    res = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "rows": args.rows, "dim": args.dim, "ids_per_step": args.ids, "quick": args.quick,
           "overhead": overhead, "readings": readings, "costs": costs,
           "final_record": last.record, "diagnosis": last.record.get("diagnosis"),
           "warnings": last.warnings, "phase_s": phase_s, "wall_s": time.perf_counter() - t_start}

    ov = overhead
    print(f"\n## dashboard overhead ({device}, refresh {ov['refresh_s']:g} s, steady state; "
          f"{ov['rounds']} paired rounds of {ov['steps_per_block']} steps, {ov['step_ms']:.2f} ms/step)")
    print(f"{'part':<34}{'mean':>9}{'95% CI':>10}{'median':>9}")
    for m, v in ov["training_thread"].items():
        print(f"{'training thread, ' + m + ' mode':<34}{v['overhead_percent']:>+8.2f}%"
              f"{'±' + format(v['ci95_percent'], '.2f'):>9}%{v['median_percent']:>+8.2f}%")
    b = ov["pcie_thread"]
    if b:
        print(f"{'PCIe polling thread (both modes)':<34}{b['overhead_percent']:>+8.2f}%"
              f"{'±' + format(b['ci95_percent'], '.2f'):>9}%{b['median_percent']:>+8.2f}%")
    else:
        print(f"PCIe polling thread: not run (PCIe source {ov['pcie_source']!r})")
    print(f"{'total':<10}{'mean':>9}{'upper 95%':>11}{'self-reported':>15}{'refreshes':>11}{'plots':>7}")
    for m, v in ov["modes"].items():
        print(f"{m:<10}{v['overhead_percent']:>+8.2f}%{v['upper95_percent']:>+10.2f}%"
              f"{v['self_reported_percent']:>14.2f}%{v['refreshes']:>11}{v['plots'] if v['plots'] is not None else '-':>7}")
    print(f"\n## readings (meters vs reference; PCIe source: {readings['pcie_source'] or 'N/A'}, "
          f"link gen {readings['pcie_gen'] or 'N/A'} x{readings['pcie_width'] or 'N/A'})")
    refs = {"gpu_used_mib": "nvidia-smi", "gpu_total_mib": "nvidia-smi",
            "gpu_util_percent": "nvidia-smi", "torch_allocated_mib": "torch.cuda",
            "torch_reserved_mib": "torch.cuda", "nbtools_pinned_mib": "table + Adam state",
            "torch_pinned_mib": "64 MiB pin_memory", "pcie_rx_gb_per_s": "nbtools counted",
            "pcie_tx_gb_per_s": "nbtools counted"}
    print(f"{'quantity':<22}{'meters':>12}{'reference':>12}  reference is")
    for k, (mine, ref) in readings["checks"].items():
        print(f"{k:<22}{fmt(mine):>12}{fmt(ref):>12}  {refs[k]}")
    print("\n## costs: " + ", ".join(f"{k} {v:.3g}" for k, v in costs.items()))
    print(f"diagnosis: {res['diagnosis']}")
    if readings["na_reasons"]:
        print("N/A because: " + "; ".join(readings["na_reasons"].values()))
    print(f"wall time {res['wall_s']:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in phase_s.items()) + ")")
    harness.save(args, "dashboard.json", res)
    if args.out:
        html = last.snapshot_html()
        if last._png is None and widgets_available():   # text mode: add the history plot
            html = render_html(last.record, state=last.state, title=last.title,
                               warnings_=last.warnings, note=last._note(),
                               image_png=plot_history(last.history).png)
        with open(os.path.join(args.out, "dashboard.html"), "w") as f:
            f.write(f"<!doctype html><meta charset='utf-8'><body style='background:#fff'>{html}")
        print(f"wrote {args.out}/dashboard.json, {args.out}/dashboard.html")


if __name__ == "__main__":
    main()
