"""The GPU cache of hot rows: step time against the cache's byte budget, every figure
a ratio within one run, and the seed-sized tables under a 16 GiB GPU cap.

Sweep (the default run). Table 4,000,000 x 128, Adam, 65,536 ids per step, ids uniform and
Zipf(0.8, 1.1, 1.3):
  torch sparse            nn.Embedding(sparse=True) on the GPU + torch.optim.SparseAdam
  nbtools fp32 cache off  OffloadedEmbedding(placement="host"): rows and Adam state in pinned
                          host RAM, zero-copy, no cache
  nbtools fp32 cache 5%   the same with cache_bytes = 5% of the fp32 table + Adam state bytes
                          (1%, 5%, 20%, 50%: the same GPU bytes for fp32 and bf16 storage)
  nbtools bf16 ...        dtype=torch.bfloat16 (with --state-dtype, --rounding)
Zipf(s): harness.IdStream, rank r (1 = hottest) drawn with probability proportional to 1 / r^s
and mapped to a row id through a fixed random permutation, so hot rows lie scattered through
the table as in real data (bench_step's Zipf uses id = rank: not comparable one to one).

Warm-up. Before a cached system is timed on a distribution, its cache is emptied and its row
counts zeroed (warm_cache with zero counts), then it trains on fresh batches, 25 steps at a
time, until the hit rate of two successive chunks differs by at most 1 point (at least 50 and
at most 600 steps): the cache has filled, and LFU has settled on the hot rows. The JSON keeps
each case's warm-up steps, why it stopped and how full the cache was. Systems without a cache
warm up for 10 steps (CUDA graph capture needs a batch size seen twice).

Timing. 5 loops of 30 fresh batches each (never batches seen before: a repeated batch would hit
a cache it has just filled), each loop timed with one synchronisation at its end (bench_step's
harness.loop_ms); the median loop. Hit rates are the timed steps' own (unique rows that were cache hits).
Each system runs in a process of its own; every system sees the same timed batches.

Seed tables (--seed-tables): 2,829,853 x 400 and 14,886,544 x 188, Adam, 65,536 ids per step,
Zipf(1.1) and uniform, the process's GPU memory capped at 16 GiB
(torch.cuda.set_per_process_memory_fraction): steps/s, peak GPU memory, pinned memory, with
  nbtools cache          the cache the cap leaves room for (cap - headroom for the step's
                         buffers; placement="auto" would size it from torch.cuda.mem_get_info,
                         which does not see the cap)
  nbtools no cache       the same table without a cache
  torch sparse           GPU-resident SparseAdam, where table + state fit under the cap

    python benchmarks/bench_cache.py --out DIR                 # GPU machine: the sweep, ~5 min
    python benchmarks/bench_cache.py --seed-tables --no-sweep --out DIR   # the seed tables
    python benchmarks/bench_cache.py --quick      # small, fp32 only, one budget: on a CPU
    python benchmarks/bench_cache.py --plot DIR                # DIR/cache.png from DIR/cache.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import harness
import torch
from harness import IdStream, loop_ms, nbtools_step, torch_sparse_step

from nbtools import hostmem
from nbtools.units import human_bytes

DISTS = ("uniform", "zipf0.8", "zipf1.1", "zipf1.3")
FRACTIONS = (0.01, 0.05, 0.20, 0.50)
SEED_TABLES = {"2,829,853 x 400": (2_829_853, 400), "14,886,544 x 188": (14_886_544, 188)}
SEED_DISTS = ("zipf1.1", "uniform")
SEED_SYSTEMS = ("nbtools cache", "nbtools no cache", "torch sparse")
ADAM_WIDTH = 3          # weight, exp_avg, exp_avg_sq per row


# --- one system, in its own process -------------------------------------------------------------

def warm_up(step, table, stream, args) -> dict:
    """Train until the cache has filled and its hit rate is steady (see the module docs)."""
    if table is None or not table.cache_stats():
        for _ in range(10):
            step(stream.next())
        return {"steps": 10, "stop": "no cache"}
    chunk, done, prev = args.warmup_chunk, 0, None
    s0 = table.cache_stats()
    held0 = s0["admitted"] - s0["evicted"]
    stop = f"at most {args.warmup_max} steps"
    while done < args.warmup_max:
        a = table.cache_stats()
        for _ in range(chunk):
            step(stream.next())
        done += chunk
        b = table.cache_stats()          # as of the last step: read with its own sync
        hr = (b["hits"] - a["hits"]) / max(1, b["lookups"] - a["lookups"])
        if done >= args.warmup_min and prev is not None and abs(hr - prev) <= 0.01:
            stop = "hit rate steady"
            break
        prev = hr
    b = table.cache_stats()
    return {"steps": done, "stop": stop,
            "cache_full": (b["admitted"] - b["evicted"] - held0) / b["capacity_rows"]}


def time_case(step, table, dist, args, device, index) -> dict:
    """Warm up on one stream, then time fresh batches of another (the same in every process)."""
    if table is not None and table.cache is not None:     # empty cache, zero counts
        table.warm_cache(torch.zeros(args.rows, dtype=torch.long))
    warm = warm_up(step, table, IdStream(args.rows, dist, args.ids, device, 100 + index), args)
    stream = IdStream(args.rows, dist, args.ids, device, 200 + index)
    s0 = table.cache_stats() if table is not None else {}
    loops = [loop_ms(step, [stream.next() for _ in range(args.steps)], device, repeats=1,
                     warmup=0) for _ in range(args.repeats)]
    out = {"ms": statistics.median(loops), "warmup": warm}
    if s0:
        s1 = table.cache_stats()
        looked = s1["lookups"] - s0["lookups"]
        out["hit_rate"] = (s1["hits"] - s0["hits"]) / looked if looked else None
        out["bytes_saved_per_step"] = (s1["bytes_saved"] - s0["bytes_saved"]) / (
            args.steps * args.repeats)
    return out


def build(spec: dict | None, n: int, dim: int, device):
    """(step, table or None) for a system (``spec`` None: torch's SparseAdam); the step holds
    the model and optimizer."""
    if spec is None:
        return torch_sparse_step(n, dim, device)[0], None
    step, (table, _) = nbtools_step(n, dim, device, **spec)
    return step, table


def describe_table(table) -> dict:
    if table is None:
        return {}
    cfg = table.config
    layout = getattr(table, "layout", None)        # where the table has low-precision storage
    state = layout.unit if layout is not None and layout.states else cfg.dtype
    out = {"dtype": str(cfg.dtype).replace("torch.", ""),
           "state_dtype": str(state).replace("torch.", ""),
           "rounding": getattr(cfg, "rounding", None), "placement": table.placement,
           "row_bytes": table.rows.row_bytes}
    stats = table.cache_stats()
    if stats:
        out.update(capacity_rows=stats["capacity_rows"], cache_bytes=stats["cache_bytes"])
    return out


def run_system(name, args, device) -> dict:
    """One system's figures over every distribution of its part (sweep or seed tables)."""
    if args.part == "seed":
        return run_seed_system(name, args, device)
    spec = sweep_systems(args)[name]
    t0 = time.perf_counter()
    step, table = build(spec, args.rows, args.dim, device)
    out = {"setup_s": time.perf_counter() - t0, "pinned_bytes": hostmem.pinned_bytes(),
           "config": describe_table(table), "cases": {}}
    for i, dist in enumerate(args.dists):
        out["cases"][dist] = time_case(step, table, dist, args, device, i)
        print(f"{name} | {dist}: {out['cases'][dist]}", flush=True)
    out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {name: out}


def run_seed_system(name, args, device) -> dict:
    """A seed-sized table under the GPU cap; the cache gets what the cap leaves, less headroom
    for the step's buffers (doubled and retried if that runs out of memory)."""
    label, system = name.split(" | ")
    n, dim = SEED_TABLES[label] if not args.quick else quick_seed(label)
    args.rows = n
    cap = args.gpu_cap_gib * 2**30
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    headroom = args.headroom_gib * 2**30
    out = {"rows": n, "dim": dim, "gpu_cap_bytes": cap, "tries": []}
    for _ in range(3):
        spec = None if system == "torch sparse" else dict(placement="host")
        if system == "nbtools cache":
            room = (cap - headroom if device.type == "cuda" else
                    ADAM_WIDTH * n * dim * 4 // 2)    # CPU smoke run: half the table
            spec["cache_bytes"] = int(room)
        try:
            t0 = time.perf_counter()
            step, table = build(spec, n, dim, device)
            out.update(setup_s=time.perf_counter() - t0, pinned_bytes=hostmem.pinned_bytes(),
                       config=describe_table(table), cases={})
            for i, dist in enumerate(args.dists):
                c = out["cases"][dist] = time_case(step, table, dist, args, device, i)
                c["steps_per_s"] = 1e3 / c["ms"]
                print(f"{name} | {dist}: {c}", flush=True)
            break
        except RuntimeError as e:        # torch.cuda.OutOfMemoryError is one
            if "out of memory" not in str(e):
                raise
            out["tries"].append(f"headroom {human_bytes(headroom)}: {str(e).splitlines()[0]}")
            print(f"{name}: out of memory with {human_bytes(headroom)} headroom", flush=True)
        # out of the except block: its traceback no longer holds the table
        step = table = None
        gc.collect()
        torch.cuda.empty_cache()
        if system != "nbtools cache":
            break
        headroom *= 2
    out["headroom_bytes"] = headroom
    out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {name: out}


# --- which systems ------------------------------------------------------------------------------

def table_state_bytes(n: int, dim: int) -> int:
    """fp32 rows + Adam state: what the budgets are fractions of."""
    return ADAM_WIDTH * n * dim * 4


def sweep_systems(args) -> dict:
    """name -> table options (None: torch's own SparseAdam), baseline first."""
    full = table_state_bytes(args.rows, args.dim)
    out = {"torch sparse": None}
    for storage in args.storage:
        kw = dict(placement="host")
        if storage == "bf16":
            kw.update(dtype=torch.bfloat16)
            if args.state_dtype:
                kw["state_dtype"] = getattr(torch, args.state_dtype)
            if args.rounding:
                kw["rounding"] = args.rounding
        for frac in (None, *args.fractions):
            budget = "off" if frac is None else f"{frac:.0%}"
            out[f"nbtools {storage} cache {budget}"] = dict(
                kw, cache_bytes=None if frac is None else int(frac * full))
    return out


def seed_systems(args) -> dict:
    """name -> None, or why it is skipped (SparseAdam where table + state exceed the cap)."""
    out = {}
    for label, (n, dim) in SEED_TABLES.items():
        for system in SEED_SYSTEMS:
            why = None
            need = table_state_bytes(n, dim) + args.headroom_gib * 2**30
            if system == "torch sparse" and not args.quick and need > args.gpu_cap_gib * 2**30:
                why = (f"table + Adam state {human_bytes(table_state_bytes(n, dim))} (+ "
                       f"{args.headroom_gib:g} GiB for the step) exceed the {args.gpu_cap_gib:g} "
                       "GiB cap")
            out[f"{label} | {system}"] = why
    return out


def quick_seed(label: str) -> tuple[int, int]:
    n, dim = SEED_TABLES[label]
    return n // 1000, dim // 10


# --- figures ------------------------------------------------------------------------------------

def ratios(res: dict) -> dict:
    """Ratios to SparseAdam: the issue's targets and each distribution's best cache."""
    systems = res["systems"]
    base = systems.get("torch sparse", {}).get("cases", {})
    out = {}

    def ms(name, dist):
        return systems.get(name, {}).get("cases", {}).get(dist, {}).get("ms")
    for dist in res["dists"]:
        if not base.get(dist):
            continue
        b = base[dist]["ms"]
        for storage in res["storage"]:
            off = ms(f"nbtools {storage} cache off", dist)
            if off:
                out[f"{dist}, {storage} cache off / SparseAdam"] = off / b
            cached = [(ms(k, dist), k) for k in systems if k.startswith(f"nbtools {storage} cache ")
                      and not k.endswith(" off") and ms(k, dist)]
            if cached:
                best, name = min(cached)
                hr = systems[name]["cases"][dist].get("hit_rate")
                out[f"{dist}, {storage} best cache ({name.split()[-1]}, hits "
                    f"{100 * (hr or 0):.0f}%) / SparseAdam"] = best / b
    targets = res.setdefault("targets", {})
    z = [v for k, v in out.items() if k.startswith("zipf1.1, fp32 best")]
    if z:
        targets["zipf1.1 fp32 with cache / SparseAdam (target <= 0.5)"] = z[0]
    u = [v for k, v in out.items() if k.startswith("uniform, bf16")]
    if u:
        targets["uniform bf16 storage / SparseAdam, best (target <= 1.5)"] = min(u)
    return out


def seed_ratios(res: dict) -> dict:
    out = {}
    for label in SEED_TABLES:
        cases = {s: res["systems"].get(f"{label} | {s}", {}).get("cases", {}) for s in SEED_SYSTEMS}
        for num, den in (("nbtools cache", "torch sparse"), ("nbtools no cache", "torch sparse"),
                         ("nbtools cache", "nbtools no cache")):
            for dist, c in cases[num].items():
                if cases[den].get(dist):
                    target = " (target <= 2)" if (num, den, dist) == (
                        "nbtools cache", "torch sparse", "zipf1.1") else ""
                    out[f"{label} {dist}, {num} / {den}{target}"] = c["ms"] / cases[den][dist]["ms"]
    return out


def print_sweep(res: dict) -> None:
    systems = res["systems"]
    print(f"\n## ms/step (x SparseAdam, hit rate), {res['rows']:,} x {res['dim']} Adam, "
          f"{res['ids_per_step']:,} ids/step ({res['device']})")
    print(f"{'system':<26}" + "".join(f"{d:>24}" for d in res["dists"]))
    base = systems.get("torch sparse", {}).get("cases", {})
    for name, r in systems.items():
        cells = []
        for d in res["dists"]:
            c = r["cases"].get(d)
            if c is None:
                cells.append(f"{'-':>24}")
                continue
            extra = [f"{c['ms'] / base[d]['ms']:.2f}x"] if d in base and name != "torch sparse" else []
            if c.get("hit_rate") is not None:
                extra.append(f"{100 * c['hit_rate']:.0f}%")
            cells.append(f"{c['ms']:.3f}" + (f" ({', '.join(extra)})" if extra else ""))
        print(f"{name:<26}" + "".join(f"{x:>24}" for x in cells))
    for k, v in {**res.get("ratios", {}), **res.get("targets", {})}.items():
        print(f"{k:<66}{v:8.2f}x")


def print_seed(res: dict) -> None:
    print(f"\n## seed tables, Adam, {res['ids_per_step']:,} ids/step, GPU capped at "
          f"{res['gpu_cap_gib']:g} GiB ({res['device']})"
          + (" [--quick: 1/1000 of the rows, 1/10 of dim]" if res.get("quick") else ""))
    print(f"{'table | system':<36}{'ids':>10}{'steps/s':>10}{'hits':>7}{'peak GPU':>12}"
          f"{'pinned':>12}{'setup':>8}")
    for name, r in res["systems"].items():
        if "skipped" in r:
            print(f"{name:<36}  skipped: {r['skipped']}")
            continue
        for d, c in r.get("cases", {}).items():
            hr = c.get("hit_rate")
            print(f"{name:<36}{d:>10}{c['steps_per_s']:10.1f}"
                  f"{'-' if hr is None else f'{100 * hr:.0f}%':>7}"
                  f"{_bytes(r['peak_gpu_bytes']):>12}{_bytes(r['pinned_bytes']):>12}"
                  f"{r['setup_s']:7.1f}s")
    for k, v in res.get("ratios", {}).items():
        print(f"{k:<66}{v:8.2f}x")


def _bytes(n) -> str:
    return "N/A" if n is None else human_bytes(n)


def plot(res: dict, path: str) -> None:
    """ms/step against the cache budget, one colour per distribution (fp32 solid, bf16 dashed),
    SparseAdam as dotted horizontal lines; hit rates below."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 6.5), dpi=110, facecolor="white")
    FigureCanvasAgg(fig)
    ax, hx = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    budgets = ["off"] + [f"{f:.0%}" for f in res["fractions"]]
    full = res["table_state_bytes"]
    labels = ["off"] + [f"{b}\n{human_bytes(int(f * full))}" for b, f in
                        zip(budgets[1:], res["fractions"])]
    colours = dict(zip(DISTS, ("#1f77b4", "#2ca02c", "#d62728", "#9467bd")))
    systems = res["systems"]
    for dist in res["dists"]:
        col = colours.get(dist, "black")
        for storage, style, mark in (("fp32", "-", "o"), ("bf16", "--", "s")):
            cases = [systems.get(f"nbtools {storage} cache {b}", {}).get("cases", {}) for b in budgets]
            pts = [(i, c[dist]) for i, c in enumerate(cases) if dist in c]
            if not pts:
                continue
            ax.plot([i for i, _ in pts], [c["ms"] for _, c in pts], style, marker=mark,
                    color=col, label=f"{dist} {storage}")
            hits = [(i, 100 * c["hit_rate"]) for i, c in pts if c.get("hit_rate") is not None]
            if hits:
                hx.plot(*zip(*hits), style, marker=mark, color=col)
        base = systems.get("torch sparse", {}).get("cases", {}).get(dist)
        if base:
            ax.axhline(base["ms"], color=col, linestyle=":", linewidth=1.2,
                       label=f"{dist} SparseAdam")
    ax.set_ylabel("ms / step")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{res['rows']:,} x {res['dim']} Adam, {res['ids_per_step']:,} ids/step: "
                 f"nbtools host table + GPU cache ({res['device']})", fontsize=10)
    ax.legend(fontsize=7, ncol=3, loc="best")
    ax.grid(alpha=0.3)
    hx.set_ylabel("cache hits %")
    hx.set_ylim(0, 100)
    hx.grid(alpha=0.3)
    hx.set_xticks(range(len(budgets)))
    hx.set_xticklabels(labels, fontsize=8)
    hx.set_xlabel("cache budget (share of the fp32 table + Adam state bytes; GPU bytes)")
    fig.tight_layout()
    fig.savefig(path)


# --- the parent ---------------------------------------------------------------------------------

def save(res: dict, path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def run_part(part, names, args, device, res, t_start, path, figures, show) -> None:
    """Run each system in a child process (unless the time budget is spent), saving ``res`` to
    ``path`` after each, so a run cut short keeps what it measured; then its ratios
    (``figures(res)``), printed by ``show(res)``."""
    res.update(systems={}, skipped=[], failed=[])
    for name, skipped in names.items():
        if skipped:
            res["systems"][name] = {"skipped": skipped}
            print(f"{name:<40} skipped: {skipped}", flush=True)
            continue
        left = args.budget_s - (time.monotonic() - t_start)
        if left < 20:
            res["skipped"].append(name)
            print(f"{name:<40} skipped: the {args.budget_s:.0f} s budget is spent", flush=True)
            continue
        cmd = [sys.executable, __file__, "--child", part, "--system", name, *args.child_args]
        got = harness.run_child(name, cmd, timeout=left)
        if got is None:
            res["failed"].append(name)
            continue
        res["systems"].update(got)
        print(f"{name:<40} done ({time.monotonic() - t_start:.0f} s)", flush=True)
        save(res, path)
    res["ratios"] = figures(res)
    res["elapsed_s"] = time.monotonic() - t_start
    show(res)
    save(res, path)


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65536, help="ids per step")
    ap.add_argument("--steps", type=int, default=30, help="steps per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops (the median is kept)")
    ap.add_argument("--warmup-min", type=int, default=50)
    ap.add_argument("--warmup-max", type=int, default=600)
    ap.add_argument("--warmup-chunk", type=int, default=25, help="warm-up steps between checks")
    ap.add_argument("--dists", default=",".join(DISTS))
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS),
                    help="cache budgets, as shares of the fp32 table + Adam state bytes")
    ap.add_argument("--storage", default="fp32,bf16")
    ap.add_argument("--state-dtype", choices=("float32", "bfloat16"), default=None,
                    help="bf16 tables' optimizer state (TableConfig.state_dtype)")
    ap.add_argument("--rounding", choices=("nearest", "stochastic"), default=None,
                    help="bf16 tables' rounding (TableConfig.rounding)")
    ap.add_argument("--seed-tables", action="store_true",
                    help="also the 2.83M x 400 and 14.9M x 188 tables under the GPU cap")
    ap.add_argument("--no-sweep", action="store_true", help="skip the 4M x 128 sweep")
    ap.add_argument("--gpu-cap-gib", type=float, default=16.0)
    ap.add_argument("--headroom-gib", type=float, default=2.0,
                    help="GPU memory under the cap left for the step's buffers (seed tables)")
    ap.add_argument("--budget-s", type=float, default=400.0,
                    help="start no system after this many seconds (gpu_suite.sh stops at 420)")
    ap.add_argument("--plot", default=None, metavar="DIR", help="only draw DIR/cache.png")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)    # sweep | seed
    ap.add_argument("--system", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plot:
        with open(os.path.join(args.plot, "cache.json")) as f:
            plot(json.load(f), os.path.join(args.plot, "cache.png"))
        return
    args.child_args = [a for a in sys.argv[1:] if a not in ("--seed-tables", "--no-sweep")]
    if args.quick:
        args.rows, args.dim, args.ids, args.steps, args.repeats = 20_000, 16, 512, 4, 2
        args.warmup_min, args.warmup_max, args.warmup_chunk = 4, 12, 4
        for flag, value in (("--fractions", "0.05"), ("--dists", "uniform,zipf1.1"),
                            ("--storage", "fp32")):
            if flag not in sys.argv:
                setattr(args, flag[2:], value)
    args.dists = args.dists.split(",")
    args.fractions = [float(f) for f in args.fractions.split(",")]
    args.storage = args.storage.split(",")
    device = harness.setup(args)
    if args.child:
        args.part = args.child
        if args.part == "seed":
            args.dists = list(SEED_DISTS)
        harness.report(run_system(args.system, args, device))
        return

    dev_name = harness.device_name(device)
    t_start = time.monotonic()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    common = {"device": dev_name, "torch": torch.__version__, "ids_per_step": args.ids,
              "steps": args.steps, "repeats": args.repeats,
              "warmup": {"min": args.warmup_min, "max": args.warmup_max, "chunk": args.warmup_chunk,
                         "stop": "hit rate of two successive chunks within 1 point"}}
    if not args.no_sweep:
        res = dict(common, rows=args.rows, dim=args.dim, dists=args.dists,
                   fractions=args.fractions, storage=args.storage,
                   table_state_bytes=table_state_bytes(args.rows, args.dim), quick=args.quick)
        print(f"# {dev_name}  table {args.rows:,} x {args.dim}, Adam, {args.ids:,} ids/step; "
              "each system in a process of its own", flush=True)
        path = os.path.join(args.out, "cache.json") if args.out else None
        run_part("sweep", dict.fromkeys(sweep_systems(args)), args, device, res, t_start, path,
                 ratios, print_sweep)
        if args.out:
            try:
                plot(res, os.path.join(args.out, "cache.png"))
                print(f"plot: {os.path.join(args.out, 'cache.png')}")
            except ImportError as e:
                print(f"no plot ({e}); draw it elsewhere: python benchmarks/bench_cache.py "
                      f"--plot {args.out}")
    if args.seed_tables:
        res = dict(common, gpu_cap_gib=args.gpu_cap_gib, headroom_gib=args.headroom_gib,
                   quick=args.quick, dists=list(SEED_DISTS))
        path = os.path.join(args.out, "cache_seed.json") if args.out else None
        run_part("seed", seed_systems(args), args, device, res, t_start, path, seed_ratios,
                 print_seed)
    print(f"\n{time.monotonic() - t_start:.0f} s in all")


if __name__ == "__main__":
    main()
