"""placement="disk": capacity under a simulated Colab free tier, and steps that run
at the disk's rate. Every figure is measured in this run; ratios are within it.

A table of ``--rows`` x ``--dim`` (bf16 weights, the leanest optimizer state available) lives in
a file under ``--dir`` with a RAM cache of ``--cache-gib``; the GPU is capped at ``--gpu-gib``.
Sections:
  probe         the disk's random-read rate at the layout's read size: RowFile reads of random
                unique rows of the table's own file (O_DIRECT where allowed), 16 to 128 in flight
  warm          the RAM cache loaded with the hottest rows of the Zipf stream (table.warm_cache);
                then each of them trained once (a long run's steady state: every miss
                evicts a dirty row, written back; ``--clean-cache`` skips it)
  zipf          Zipf(1.1) ids, ``--ids`` per step, with and without read-ahead (table.prefetch):
                ms/step, misses/step, RAM hit rate; compared with (a) the same steps on the same
                table in pinned RAM (``--host-compare``, where the machine's RAM allows) and
                (b) misses/step / the disk's random-read rate probed in each round (the
                best of 32, 64 and 128 reads in flight), probed before and after each loop. A
                loop times its steps between the first SETTLE and the last TAIL (a long
                loop's steady state: as many coming reads in flight when the clock stops as
                when it starts). ``--also-ahead``: other read-ahead depths timed in the same
                rounds
  uniform       uniform ids: rows read per second against the probed rate
  gpu cache     with ``--gpu-cache-gib``: the same table given a GPU cache above its RAM cache
                (nbtools.disk.gpu), the GPU warmed with the hottest rows and RAM with the next
                (RAM's rows marked changed: a long run's steady state), ``--gpu-settle`` steps
                run, then the read-ahead loop's rounds again: rows read from disk per step and
                ms/step against the rounds above (RAM cache only), in this run
  memory        RSS + pinned + page cache growth (and the cgroup's memory.current), sampled
                every 0.2 s from outside the training loop; max and a plot (memory.png)

    python benchmarks/bench_disk.py --out DIR                              # GPU machine
    python benchmarks/bench_disk.py --quick            # 100,000 rows, 1 round: any machine
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import harness
from harness import hottest, zipf_ids
import numpy as np
import torch
from harness import synchronize

import nbtools
from nbtools import hostmem

READ_AHEAD = 8                   # steps read ahead (--ahead; nbtools.disk.readahead.AHEAD)
SETTLE = 10                      # steps of a timed loop before its clock starts (run_steps):
                                 # past the burst of a loop's first read-aheads (DEPTH + 2)
TAIL = 8                         # and after it stops (the deepest read-ahead: run_steps)
# reads in flight of the probes (the rate the floor (b) divides by: the best of all but the first)
PROBE_DEPTHS = (16, 32, 64, 128)
def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _cgroup_current() -> int | None:
    for path in ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes"):
        try:
            with open(path) as f:
                return int(f.read())
        except OSError:
            pass
    return None


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class MemorySampler:
    """RSS, nbtools' pinned bytes and the page cache's growth, every ``period`` seconds."""

    def __init__(self, period: float = 0.2):
        self.period, self.samples, self.marks = period, [], []
        self.cached0, self.cg0 = _meminfo("Cached"), _cgroup_current()
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)

    def sample(self):
        rss = _rss()
        cache = max(0, _meminfo("Cached") - self.cached0)
        cg = _cgroup_current()
        self.samples.append((time.perf_counter() - self.t0, rss, hostmem.pinned_bytes(), cache,
                             None if cg is None or self.cg0 is None else cg))

    def mark(self, label: str):
        self.marks.append((time.perf_counter() - self.t0, label))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self.sample()
        arr = np.array([s[:4] for s in self.samples], dtype=np.float64)
        # pinned memory is part of RSS once touched: RSS + page cache is what the host holds
        total = arr[:, 1] + arr[:, 3]
        cg = [s[4] for s in self.samples if s[4] is not None]
        return {"max_rss_bytes": int(arr[:, 1].max()), "max_pinned_bytes": int(arr[:, 2].max()),
                "max_page_cache_growth_bytes": int(arr[:, 3].max()),
                "max_rss_plus_page_cache_bytes": int(total.max()),
                "max_cgroup_bytes": max(cg) if cg else None, "samples": len(self.samples)}

    def plot(self, path: str, budget: int | None):
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        arr = np.array([s[:4] for s in self.samples], dtype=np.float64)
        gib = 1 << 30
        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(arr[:, 0], (arr[:, 1] + arr[:, 3]) / gib, label="RSS + page cache growth")
        ax.plot(arr[:, 0], arr[:, 1] / gib, label="RSS")
        ax.plot(arr[:, 0], arr[:, 2] / gib, label="pinned (nbtools)")
        ax.plot(arr[:, 0], arr[:, 3] / gib, label="page cache growth")
        if budget:
            ax.axhline(budget / gib, color="red", linestyle="--", label="host budget")
        for t, label in self.marks:
            ax.axvline(t, color="grey", linewidth=0.5)
            ax.text(t, ax.get_ylim()[1] * 0.95, label, rotation=90, fontsize=7, va="top")
        ax.set_xlabel("seconds")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, loc="lower right")
        ax.set_title("host memory of a disk table's training, sampled from outside the loop")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


def optimizer_for(name: str):
    if name == "rowwise_adagrad" and hasattr(nbtools, "RowWiseAdagrad"):
        return nbtools.RowWiseAdagrad, {"lr": 0.05}
    if name in ("rowwise_adagrad", "sgd"):
        return torch.optim.SGD, {"lr": 0.05}
    if name == "adagrad":
        return torch.optim.Adagrad, {"lr": 0.05}
    return torch.optim.Adam, {"lr": 1e-3}


def make_table(args, device, placement, **extra):
    table = nbtools.OffloadedEmbedding(args.rows, args.dim, name=f"bench-{placement}",
                                       device=device, placement=placement,
                                       dtype=torch.bfloat16, **extra)
    cls, kw = optimizer_for(args.optimizer)
    opt = nbtools.OffloadOptimizer(cls, table, **kw)
    return table, opt


def run_steps(table, opt, batches, device, prefetch: int, window=None, marks=None,
              stamps=None) -> float:
    """ms per step over ``batches`` (a loop: one synchronisation at the end), reading ahead
    ``prefetch`` steps (0: none; 2: the next two steps' rows in flight at once). With
    ``window=(a, b)``, only steps a..b-1 are timed (a synchronisation before and after), the
    loop going on around them: a long loop's steady state, with as much of the coming steps'
    reads in flight when the clock stops as when it starts (timing to the loop's end would
    leave the window's last steps nothing to share the disk with, and the reads done ahead
    before it starts uncounted). ``marks``: called at a and at b (counters). ``stamps``: a
    list that gets the host clock as each step starts (when the lookup before it had its
    rows: how evenly the reads complete)."""
    head = torch.linspace(-1, 1, table.embedding_dim, device=device)
    a, b = window or (0, len(batches))
    synchronize(device)
    t0 = t1 = time.perf_counter()
    for ids in batches[1:prefetch]:
        table.prefetch(ids)
    for i, ids in enumerate(batches):
        if i in (a, b) and (a, b) != (0, len(batches)):
            synchronize(device)
            if marks is not None:
                marks()
            if i == a:
                t0 = time.perf_counter()
            else:
                t1 = time.perf_counter()
        if stamps is not None:
            stamps.append(time.perf_counter())
        rows = table(ids)
        if prefetch and i + prefetch < len(batches):
            table.prefetch(batches[i + prefetch])
        (rows * head).sum().backward()
        opt.step()
        opt.zero_grad()
    synchronize(device)
    if b == len(batches):
        t1 = time.perf_counter()
    if stamps is not None:
        stamps.append(time.perf_counter())     # the loop's end
    return (t1 - t0) / (b - a) * 1e3


def measure(table, opt, batches, device, prefetch: int) -> dict:
    """ms/step (of the steps between the first SETTLE and the last TAIL, :func:`run_steps`)
    and, per step, the RAM cache's misses and hit rate and the seconds spent in disk reads,
    writes and waiting for the disk on the loop's thread."""
    from nbtools.disk import disk_counters
    snaps = []

    def snapshot():                       # the counters of the timed steps only
        snaps.append((dict(table.disk.stats), disk_counters()))
    window = (SETTLE, len(batches) - TAIL)
    whole0 = disk_counters()
    stamps = []
    ms = run_steps(table, opt, batches, device, prefetch, window=window, marks=snapshot,
                   stamps=stamps)
    # the gaps between the timed steps' starts: read-aheads that complete together make a
    # loop bursty (steps that wait, then several at once); a window must span many bursts
    gaps = np.diff(stamps[window[0]:window[1] + 1]) * 1e3
    (before, c0), (s, c1) = snaps
    whole1 = disk_counters()
    k = window[1] - window[0]

    def rows_read(a, b):          # rows the disk served between two counter snapshots: the
        return ((b["read_bytes"] - b["moved_read_bytes"])       # lookups' and read-aheads'
                - (a["read_bytes"] - a["moved_read_bytes"])) / table.disk.row_bytes
    whole_rows = rows_read(whole0, whole1)
    # rows not in RAM when their step came: missed by its lookup, or brought in by a read-ahead
    # (counted at the lookup, so that the timed steps' own rows are the ones counted)
    ahead = (s["ahead_hits"] - before["ahead_hits"]) / k
    misses = (s["misses"] - before["misses"]) / k + ahead
    looked = (s["lookups"] - before["lookups"]) / k
    return {"ms_per_step": ms, "misses_per_step": misses, "unique_per_step": looked,
            "ram_hit_rate": 1 - misses / looked if looked else None,
            "read_ahead_rows_per_step": ahead,
            # of the misses, rows taken from a queued write-back's copy: not read from disk
            "from_write_back_per_step":
                (s["from_write_back"] - before["from_write_back"]) / k,
            "written_back_per_step": (s["written_back"] - before["written_back"]) / k,
            # the whole loop, its first step to its end: every row it read, over its time
            # (no window to fall between bursts; the start's lone reads make it a bit low)
            "loop_disk_rows_per_s": whole_rows / (stamps[-1] - stamps[0]),
            "step_gap_ms_p10_p50_p90_max": [float(x) for x in np.percentile(
                gaps, [10, 50, 90, 100])] if len(gaps) else None,
            # rows the disk itself served: the table's read bytes (lookups and read-aheads;
            # not a log file's cleaner) over its row size; a cross-check of misses_per_step
            "disk_read_rows_per_step": rows_read(c0, c1) / k,
            **{f"{key}_ms_per_step": (c1[key] - c0[key]) / k * 1e3
               for key in ("read_s", "write_s", "wait_s")}}


def gpu_cache_rounds(args, res, table, opt, device, zipf_batches, mem) -> None:
    """The section ``gpu cache``: the table's read-ahead loop again with a GPU cache above
    its RAM cache (into ``res["gpu_cache"]``)."""
    from nbtools.disk.gpu import attach
    d = table.disk
    level = attach(d, int(args.gpu_cache_gib * (1 << 30)) // d.row_bytes, table.device)
    t0 = time.perf_counter()
    if args.gpu_start == "warm":
        hot = hottest(args.rows, min(args.rows, level.capacity + d.ram.capacity_rows))
        d.warm(hot, level=level, ram_too=True)      # both levels, in one pass over the file
        del hot
        d.ram.dirty[d.ram.id_of >= 0] = True    # as after a long run: RAM's rows came down changed
        level.dirty[level.id_of >= 0] = True
    elif args.gpu_start == "shares":            # the stream's shares, as a model warms it
        table.warm_cache(harness.zipf_shares(args.rows))
    t1 = time.perf_counter()                    # ("cold": the level fills from the steps)
    mem.mark("gpu cache warm")
    if args.gpu_settle:
        run_steps(table, opt, zipf_batches(args.gpu_settle), device, prefetch=args.ahead)
    before = dict(level.counts)
    loops = [measure(table, opt, zipf_batches(SETTLE + args.steps + TAIL), device, args.ahead)
             for _ in range(args.gpu_rounds or args.rounds)]
    mem.mark("gpu cache rounds")
    hits = level.counts["hits"] - before["hits"]
    med = lambda xs: float(np.median(xs))       # noqa: E731
    g = res["gpu_cache"] = {
        "rows": level.capacity, "gib": level.nbytes / 2**30, "warm_s": t1 - t0, "loops": loops,
        "disk_rows_per_step_rounds": [x["disk_read_rows_per_step"] for x in loops],
        "ms_per_step_rounds": [x["ms_per_step"] for x in loops],
        "gpu_hit_rate": hits / max(1, level.counts["lookups"] - before["lookups"]),
        "ram_hit_rate": med([x["ram_hit_rate"] for x in loops])}
    # (nan where RAM alone read nothing from disk: a --quick table small enough to stay in RAM)
    ratio = lambda a, b: a / b if b else float("nan")      # noqa: E731
    g["reads_x"] = ratio(med(g["disk_rows_per_step_rounds"]),
                         res["zipf_read_ahead"]["disk_read_rows_per_step"])
    g["ms_x"] = ratio(med(g["ms_per_step_rounds"]), res["zipf_read_ahead"]["ms_per_step"])
    print(f"GPU cache {level.capacity:,} rows: disk rows/step {g['disk_rows_per_step_rounds']}, "
          f"ms/step {g['ms_per_step_rounds']}, GPU hit rate {g['gpu_hit_rate']:.3f}", flush=True)


def syncs_per_step(table, opt, batches, device) -> float | None:
    """Host synchronisations per step (torch.cuda.set_sync_debug_mode), read-ahead on."""
    if device.type != "cuda":
        return None
    import warnings
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_steps(table, opt, batches, device, prefetch=READ_AHEAD)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught) / len(batches)


def engines() -> list:
    """RowFile's I/O engines on this machine (nbtools.rowfile.fileio.RequestPool)."""
    from nbtools.rowfile.fileio import glibc_aio, native_aio
    return ["threads"] + (["aio"] if glibc_aio.ready() else []) + \
        (["kaio"] if native_aio.ready() else [])


# requests per lio_listio call the probes try (the aio engine), the best counting: the table's
# own (nbtools.rowfile.fileio.AIO_BATCH) and the earlier default, which a lone call may read faster with
PROBE_BATCHES = (1024, 4096)


def probe(table, n: int, threads: int, gen, engine: str | None = None, draw=None) -> float:
    """Rows per second of RowFile random reads (unique, sorted) on the table's own file; the
    best of the engines (and of PROBE_BATCHES for "aio") when ``engine`` is None. ``draw(n)``:
    the file rows (slots) to read (default: uniform over the table's rows)."""
    if engine is None:
        return max(probe(table, n, threads, gen, e, draw) for e in engines())
    from nbtools.rowfile import RowFile
    f = table.disk.file
    out = np.empty((n, f.row_bytes), dtype=np.uint8)
    rf = RowFile.open(f.path, threads=threads, writable=False)
    rf.engine = engine
    best = 0.0
    try:
        for batch in (PROBE_BATCHES if engine == "aio" else (None,)):
            if batch:
                rf._pool.batch = batch
            ids = np.unique(draw(n) if draw else gen.integers(0, table.num_embeddings, n))
            rf.read(ids[: min(2048, len(ids))], out[: min(2048, len(ids))])  # warm the pool
            t0 = time.perf_counter()
            rf.read(ids, out[: len(ids)])
            best = max(best, len(ids) / (time.perf_counter() - t0))
        return best
    finally:
        rf.close()


def probe_steps(table, batch: int, count: int, threads: int, gen,
                engine: str | None = None) -> float:
    """Rows per second of ``count`` back-to-back reads of ``batch`` random unique rows each
    (a loop's reads without its compute): the rate the disk sustains at a step's read size
    over a loop's length, where the short probe above may ride a cloud disk's burst. The best
    of the engines when ``engine`` is None."""
    if engine is None:
        return max(probe_steps(table, batch, count, threads, gen, e) for e in engines())
    from nbtools.rowfile import RowFile
    f = table.disk.file
    rf = RowFile.open(f.path, threads=threads, writable=False)
    rf.engine = engine
    out = np.empty((batch, f.row_bytes), dtype=np.uint8)
    try:
        batches = [np.unique(gen.integers(0, table.num_embeddings, batch)) for _ in range(count)]
        t0 = time.perf_counter()
        for ids in batches:
            rf.read(ids, out[: len(ids)])
        return sum(len(b) for b in batches) / (time.perf_counter() - t0)
    finally:
        rf.close()


def age_by_copy(table, log, gen, go_on, block: int = 1 << 18) -> int:
    """Age a log file as uniform steps would, faster: sequential passes over the rows, a
    random share of each block appended again (unchanged) through the log's own writes, the
    share chosen so that the passes use up the spare slots and make the cleaner clean ~16
    segments. The next block is read while this one's rows are appended (a log's reads may
    run beside its writes). Call with the RAM cache flushed (its rows clean: their bytes do
    not change). Returns the rows moved (no steps: reported as steps of ``block`` rows)."""
    f = table.disk.file
    table.disk.flush()
    want = (f.slots - f.num_rows + 16 * f.seg) / f.num_rows   # of the ids (a spare of 100%:
    passes = max(1, int(np.ceil(want)))                       # more than one pass)
    share = want / passes
    bufs = [np.empty((min(block, f.num_rows), f.file.row_bytes), dtype=np.uint8)
            for _ in range(2)]
    starts = [(p, s) for p in range(passes) for s in range(0, f.num_rows, block)]

    def read(k):
        m = min(block, f.num_rows - starts[k][1])
        f.read_range(starts[k][1], bufs[k % 2][:m])
        return m
    moved, t0 = 0, time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(read, 0)
        for k, (p, start) in enumerate(starts):
            m = ahead.result()
            if k + 1 < len(starts):
                ahead = pool.submit(read, k + 1)
            pick = np.flatnonzero(gen.random(m) < share)
            f.write(pick + start, bufs[k % 2], at=pick)
            moved += len(pick)
            if start == 0 and p:
                print(f"  aging: pass {p + 1} of {passes} at {time.perf_counter() - t0:.0f} s",
                      flush=True)
            if not go_on():
                break
        ahead.result()
    print(f"aged by copying {moved:,} rows ({passes} passes, {share:.1%} of each block) in "
          f"{time.perf_counter() - t0:.0f} s: {log}", flush=True)
    return -(-moved // block)


def main():
    global READ_AHEAD
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--optimizer", default="rowwise_adagrad")
    ap.add_argument("--cache-gib", type=float, default=7.0)
    ap.add_argument("--budget-gib", type=float, default=12.0)
    ap.add_argument("--gpu-gib", type=float, default=15.0)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--host-compare", action="store_true")
    ap.add_argument("--uniform-steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--uniform-rounds", type=int, default=1,
                    help="uniform loops, each between two probes (the median one reported)")
    ap.add_argument("--threads", type=int, default=None, help="RowFile threads (default: "
                    "nbtools' own)")
    ap.add_argument("--ahead", type=int, default=READ_AHEAD,
                    help="steps read ahead (table.prefetch of the next N batches); rounds "
                         "also time 1 step ahead when this is more")
    ap.add_argument("--also-ahead", type=lambda v: [int(x) for x in v.split(",") if x],
                    default=[4, 6], help="other read-ahead depths the rounds time (comma-"
                    "separated; default 4,6; at most nbtools.disk.readahead.DEPTH, 8)")
    ap.add_argument("--clean-cache", dest="dirty", action="store_false",
                    help="skip training every row of the warmed RAM cache once before the "
                    "rounds (by default it is: a long run's steady state, where each miss "
                    "evicts a dirty row; without it the rounds' evictions are clean)")
    ap.add_argument("--dirty", action="store_true", default=True, help=argparse.SUPPRESS)
    ap.add_argument("--age-s", type=float, default=0.0,
                    help="log layout (NBTOOLS_DISK_LAYOUT=log): train uniform steps for up to "
                         "this long before the rounds, until the spare slots are used and the "
                         "cleaner runs (its steady state)")
    ap.add_argument("--gpu-cache-gib", type=float, default=0.0,
                    help="after the rounds: a GPU cache of this size above the RAM cache")
    ap.add_argument("--gpu-settle", type=int, default=40,
                    help="steps trained with the GPU cache before its rounds (the rows both "
                         "levels came down dirty with are written back meanwhile)")
    ap.add_argument("--gpu-start", choices=("warm", "shares", "cold"), default="warm",
                    help="how the GPU cache starts: both levels loaded with the hottest rows, "
                         "marked changed (a long run's steady state); table.warm_cache given "
                         "the Zipf stream's frequencies as shares (what SkipGram and fit do by "
                         "themselves); or empty. With --gpu-settle 0 --gpu-rounds 1 --steps "
                         "200 the rounds are a fresh level's first 200 steps")
    ap.add_argument("--gpu-rounds", type=int, default=0,
                    help="rounds with the GPU cache (default: --rounds)")
    ap.add_argument("--age-copy", action="store_true",
                    help="with --age-s: age by moving randomly chosen rows through the log's own "
                         "appends (one sequential pass over the file, the rows unchanged) "
                         "instead of training uniform steps: the same placement as uniform "
                         "steps' evictions, several times faster on a large table")
    args = ap.parse_args()
    READ_AHEAD = args.ahead
    if args.quick:
        args.rows, args.dim, args.ids, args.steps = 100_000, 32, 2048, 4
        args.cache_gib, args.uniform_steps, args.rounds, args.also_ahead = 0.001, 2, 1, [4]
        args.host_compare = True
        args.gpu_cache_gib = 0.002
    device = harness.setup(args)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_gib * (1 << 30) / total))
    nbtools.set_host_budget(int(args.budget_gib * (1 << 30)))   # every nbtools allocation
    res = {"args": vars(args), "device": str(device),
           "gpu": harness.device_name(device)}
    gen = np.random.default_rng(0)
    mem = MemorySampler()
    t0 = time.perf_counter()
    if args.threads:
        os.environ["NBTOOLS_DISK_THREADS"] = str(args.threads)
    table, opt = make_table(args, device, "disk", disk_dir=args.dir,
                            host_cache_bytes=int(args.cache_gib * (1 << 30)))
    res["create_s"] = time.perf_counter() - t0
    res["row_bytes"] = table.disk.row_bytes
    res["file_bytes"] = table.disk.file_bytes          # rows rounded up to the O_DIRECT block
    res["direct_io"] = bool(getattr(table.disk.file, "direct", False))
    res["cache_rows"] = table.disk.ram.capacity_rows
    log = getattr(table.disk.file, "stats", None)       # a log-structured file (nbtools.disk.log)
    res["layout"] = "log (NBTOOLS_DISK_LAYOUT=log)" if log is not None else "in place"
    mem.mark("created")
    print(f"created {table!r} in {res['create_s']:.1f} s", flush=True)

    t0 = time.perf_counter()      # (the first access writes the initial rows: timed apart)
    table.disk.flush()
    res["init_s"] = time.perf_counter() - t0
    mem.mark("initialised")
    # after the rows are written: unwritten extents of a new file read as zeros, unread
    n_probe = min(args.ids * 2, args.rows)
    res["engine"] = table.disk.file.engine
    for threads in PROBE_DEPTHS:
        for eng in engines():
            res[f"probe_{eng}_rows_per_s_{threads}"] = probe(table, n_probe, threads, gen, eng)
        res[f"probe_rows_per_s_{threads}"] = max(res[f"probe_{e}_rows_per_s_{threads}"]
                                                 for e in engines())
        res[f"probe_small_rows_per_s_{threads}"] = probe(table, 2048, threads, gen)
    probed = max(res[f"probe_rows_per_s_{t}"] for t in PROBE_DEPTHS)
    mem.mark("probed")

    pin = device.type == "cuda"

    def warm():
        t0 = time.perf_counter()
        res["warm_rows"] = table.disk.warm(hottest(args.rows, table.disk.ram.capacity_rows))
        res["warm_s"] = time.perf_counter() - t0
        mem.mark("warm")
    copying = log is not None and args.age_s and args.age_copy
    if copying:
        # Aging by copying moves rows in the file unchanged, under a RAM cache of clean rows:
        # warmed first, while the hot rows still lie in id order (2-3x faster than after)
        warm()
    if log is not None and args.age_s:
        # A log file's steady state: its spare slots used up and the cleaner at work, as after
        # a long run (a fresh file only appends into its spare segments). Uniform steps fill
        # the spare fastest (every id a miss, every eviction a dirty row), until the cleaner
        # has cleaned 8 segments; it then runs in every round below (reported per round)
        t0, aged = time.perf_counter(), 0
        if args.age_copy:
            aged = age_by_copy(table, log, gen, lambda: time.perf_counter() - t0 < args.age_s)
        stepped = False
        while time.perf_counter() - t0 < args.age_s and log["cleaned_segments"] < 8:
            uni = [torch.randint(0, args.rows, (args.ids,)) for _ in range(4)]
            run_steps(table, opt, [b.pin_memory() if pin else b for b in uni], device,
                      prefetch=args.ahead)
            aged, stepped = aged + len(uni), True
        if stepped:
            table.disk.flush(drop=True)       # the uniform rows out of RAM: warmed again below
        res["aged"] = {"steps": aged, "s": time.perf_counter() - t0, **log}
        mem.mark("aged")
        print(f"aged: {aged} steps in {res['aged']['s']:.0f} s, {log}", flush=True)
        copying = copying and not stepped
    if not copying:
        warm()
    print(f"RAM cache warmed: {res['warm_rows']:,} rows in {res['warm_s']:.0f} s", flush=True)
    if args.dirty:
        # A long run's steady state: every row in the RAM cache has been trained since it was
        # read, so each miss evicts a dirty row that must be written back (a fresh cache's
        # victims are warmed rows, clean, and cost no write)
        t0 = time.perf_counter()
        cached = hottest(args.rows, table.disk.ram.capacity_rows)
        chunks = [torch.from_numpy(cached[i:i + args.ids])
                  for i in range(0, len(cached), args.ids)]
        run_steps(table, opt, chunks, device, prefetch=0)
        res["dirty_steps"], res["dirty_s"] = len(chunks), time.perf_counter() - t0
        mem.mark("dirty")
        print(f"every cached row trained once: {len(chunks)} steps, {res['dirty_s']:.1f} s",
              flush=True)

    # ids from the host, as a loader hands them over (pinned): a disk table deduplicates them
    # on the CPU, so its step needs no GPU synchronisation

    def zipf_batches(k):
        out = [torch.from_numpy(zipf_ids(gen, args.rows, args.ids)) for _ in range(k)]
        return [b.pin_memory() if pin else b for b in out]
    batches = zipf_batches(SETTLE + args.steps + TAIL)  # (kept for the host-RAM comparison)
    run_steps(table, opt, zipf_batches(max(3, args.steps // 2)), device, prefetch=0)
    # A cloud disk's rate drifts by tens of percent within seconds (2x between two probes a
    # minute apart on the GPU machine): the disk is probed just before and just after each
    # loop, and the loop's ratio uses the mean of the two.
    def rate_now():
        # the disk's best rate at the moment: 32 or 64 reads in flight (the table keeps
        # 64 per step in flight with glibc's AIO, more while steps' reads overlap)
        return max(probe(table, 8192, t, gen) for t in PROBE_DEPTHS[1:])

    def floor_ms(loop: dict) -> float:            # (b): the rows a step reads from disk
        return (loop["misses_per_step"] - loop["from_write_back_per_step"]) \
            / loop["probe_rows_per_s"] * 1e3

    rounds = []
    for r in range(args.rounds):
        rnd = {}
        before = dict(log) if log is not None else None
        # (steps ahead, key)
        loops = [(0, "zipf"), (args.ahead, "zipf_read_ahead")]
        loops += [(k, f"zipf_read_ahead_{k}") for k in args.also_ahead if k != args.ahead]
        probes = [rate_now()]
        for prefetch, key in loops:
            rnd[key] = measure(table, opt, zipf_batches(SETTLE + args.steps + TAIL), device,
                               prefetch)
            probes.append(rate_now())
            rnd[key]["probe_rows_per_s"] = (probes[-2] + probes[-1]) / 2
        rate = rnd["probe_rows_per_s"] = rnd["zipf_read_ahead"]["probe_rows_per_s"]
        rnd["probes_rows_per_s"] = probes
        rnd["floor_b_ms"] = floor_ms(rnd["zipf_read_ahead"])
        ra = rnd["zipf_read_ahead"]
        per_step = max(1, int(ra["misses_per_step"] - ra["from_write_back_per_step"]))
        rnd["sustained_rows_per_s"] = probe_steps(table, per_step, args.steps, 32, gen)
        rnd["floor_b_sustained_ms"] = per_step / rnd["sustained_rows_per_s"] * 1e3
        rnd["floor_b_ms_no_read_ahead"] = floor_ms(rnd["zipf"])
        if log is not None:
            rnd["log"] = {k: log[k] - before[k] for k in log}
        rounds.append(rnd)
        mem.mark(f"round {r}")
        print(f"round {r}: probes around the loops " + " / ".join(f"{x:,.0f}" for x in probes)
              + f" rows/s (read-ahead loop's: {rate:,.0f}), ms/step "
              f"{rnd['zipf']['ms_per_step']:.1f} / read-ahead "
              f"{rnd['zipf_read_ahead']['ms_per_step']:.1f} ({args.ahead} ahead)"
              + "".join(f", {k} ahead {rnd[f'zipf_read_ahead_{k}']['ms_per_step']:.1f}"
                        for k in args.also_ahead if f"zipf_read_ahead_{k}" in rnd)
              + f", floor (b) {rnd['floor_b_ms']:.1f} (sustained {rnd['sustained_rows_per_s']:,.0f}"
              f" rows/s: {rnd['floor_b_sustained_ms']:.1f}), "
              f"misses {rnd['zipf_read_ahead']['misses_per_step']:,.0f} (from queued write-backs "
              f"{rnd['zipf_read_ahead']['from_write_back_per_step']:,.0f}), written back "
              f"{rnd['zipf_read_ahead']['written_back_per_step']:,.0f}"
              + (f", log: {rnd['log']}" if log is not None else ""), flush=True)
    res["rounds"] = rounds
    med = lambda xs: float(np.median(xs))       # noqa: E731
    for key in rounds[0]:
        if not key.startswith("zipf"):
            continue
        res[key] = {k: med([rnd[key][k] for rnd in rounds]) for k in rounds[0][key]
                    if isinstance(rounds[0][key][k], (int, float))}
    res["syncs_per_step"] = syncs_per_step(table, opt, zipf_batches(4), device)
    floor_b = med([rnd["floor_b_ms"] for rnd in rounds])
    res["zipf_disk_floor_ms"] = floor_b
    if args.gpu_cache_gib:
        gpu_cache_rounds(args, res, table, opt, device, zipf_batches, mem)

    res["uniform_rounds"] = []
    for _ in range(args.uniform_rounds):
        uni = [torch.randint(0, args.rows, (args.ids,))
               for _ in range(SETTLE + args.uniform_steps + TAIL)]
        uni = [b.pin_memory() if pin else b for b in uni]
        around = [rate_now()]
        u = measure(table, opt, uni, device, prefetch=args.ahead)
        around.append(rate_now())
        u["rows_per_s"] = (u["misses_per_step"] - u["from_write_back_per_step"]) \
            / u["ms_per_step"] * 1e3              # rows read from disk a second
        u["disk_rows_per_s"] = u["disk_read_rows_per_step"] / u["ms_per_step"] * 1e3
        u["probes_rows_per_s"] = around           # just before and just after the loop
        u["x_probe"] = u["rows_per_s"] / probed
        u["x_probe_around"] = u["rows_per_s"] / (sum(around) / 2)
        u["loop_x_probe_around"] = u["loop_disk_rows_per_s"] / (sum(around) / 2)
        res["uniform_rounds"].append(u)
        print("uniform", u, flush=True)
    # the round of the median whole-loop rate stands for them (all are in uniform_rounds;
    # --uniform-rounds 0: none, as the GPU-cache comparison runs)
    order = sorted(res["uniform_rounds"], key=lambda x: x["loop_x_probe_around"])
    res["uniform"] = order[len(order) // 2] if order else None
    mem.mark("uniform")
    if log is not None:
        res["log"] = dict(log)
    res["memory"] = mem.stop()
    res["memory"]["budget_bytes"] = int(args.budget_gib * (1 << 30))
    out_dir = args.out or os.path.join("artifacts", "bench_disk")    # (git-ignored)
    os.makedirs(out_dir, exist_ok=True)
    res["memory_plot"] = mem.plot(os.path.join(out_dir, "memory.png"), int(args.budget_gib *
                                                                         (1 << 30)))
    table.close()

    if args.host_compare:
        nbtools.set_host_budget(None)           # (the comparison needs the table in RAM)
        need = args.rows * res["row_bytes"]
        avail = nbtools.devices.host_memory_bytes()["available"] or 0
        if need < 0.6 * avail:
            host, hopt = make_table(args, device, "host")
            run_steps(host, hopt, batches[:3], device, prefetch=0)
            res["host_zipf_ms"] = run_steps(host, hopt, batches, device, prefetch=0,
                                            window=(SETTLE, len(batches) - TAIL))
            res["host_syncs_per_step"] = syncs_per_step(host, hopt, batches[:4], device)
            host.close()
        else:
            res["host_zipf_ms"] = None
            print(f"host comparison skipped: {need / 2**30:.1f} GiB of rows, "
                  f"{avail / 2**30:.1f} GiB available", flush=True)
    host_ms = res.get("host_zipf_ms") or 0.0
    res["zipf_x_bound_rounds"] = [rnd["zipf_read_ahead"]["ms_per_step"] /
                                  max(host_ms, rnd["floor_b_ms"]) for rnd in rounds]
    res["zipf_x_bound"] = med(res["zipf_x_bound_rounds"])
    res["zipf_x_sustained_rounds"] = [rnd["zipf_read_ahead"]["ms_per_step"] /
                                      max(host_ms, rnd["floor_b_sustained_ms"]) for rnd in rounds]
    res["zipf_no_read_ahead_x_sustained_rounds"] = [
        rnd["zipf"]["ms_per_step"] / max(host_ms, rnd["floor_b_sustained_ms"]) for rnd in rounds]
    for k in args.also_ahead:
        if f"zipf_read_ahead_{k}" in rounds[0]:
            res[f"zipf_ahead_{k}_x_bound_rounds"] = [
                rnd[f"zipf_read_ahead_{k}"]["ms_per_step"] /
                max(host_ms, floor_ms(rnd[f"zipf_read_ahead_{k}"])) for rnd in rounds]
    res["zipf_no_read_ahead_x_bound_rounds"] = [
        rnd["zipf"]["ms_per_step"] / max(host_ms, rnd["floor_b_ms_no_read_ahead"])
        for rnd in rounds]

    res["zipf_loop_x_probe_rounds"] = [
        rnd["zipf_read_ahead"]["loop_disk_rows_per_s"] / rnd["zipf_read_ahead"]["probe_rows_per_s"]
        for rnd in rounds]                      # the disk's rate in the loop against alone
    print("\n| measure | value |\n|---|---|")
    rows = [
        ("table", f"{args.rows:,} x {args.dim} bf16, {args.optimizer}, "
                  f"{res['row_bytes']} B/row, file {res['file_bytes'] / 2**30:.1f} GiB"),
        ("RAM cache", f"{res['cache_rows']:,} rows, warmed in {res['warm_s']:.1f} s" + (
            ", each row then trained once: every eviction writes a row back (steady state)"
            if args.dirty else ", never trained before the rounds: evictions clean")),
        ("rows written back per step (read-ahead run)",
         f"{res['zipf_read_ahead']['written_back_per_step']:,.0f}"),
        ("file layout", res["layout"] + (
            f": {res['log']['appended']:,} rows appended, {res['log']['cleaned']:,} moved by "
            f"the cleaner ({res['log']['cleaned'] / max(1, res['log']['appended']):.2f} a row)"
            + (f"; aged {res['aged']['steps']} steps ({res['aged']['s']:.0f} s) first"
               if "aged" in res else "")
            + "; in the rounds: " + ", ".join(
                f"{rnd['log']['cleaned'] / max(1, rnd['log']['appended']):.2f}"
                for rnd in rounds) + " rows moved per row appended"
            if "log" in res else "")),
        ("init (write every row) s", f"{res['init_s']:.1f}"),
        *[(f"probe rows/s, {' / '.join(map(str, PROBE_DEPTHS))} in flight, {e} engine", " / ".join(
            f"{res[f'probe_{e}_rows_per_s_{t}']:,.0f}" for t in PROBE_DEPTHS)) for e in engines()],
        ("the table's engine", res["engine"]),
        (f"probe of 2,048 rows, rows/s, {' / '.join(map(str, PROBE_DEPTHS))}", " / ".join(
            f"{res[f'probe_small_rows_per_s_{t}']:,.0f}" for t in PROBE_DEPTHS)),
        (f"zipf ms/step, median of {args.rounds} rounds (no read-ahead / {args.ahead} ahead)",
         f"{res['zipf']['ms_per_step']:.1f} / {res['zipf_read_ahead']['ms_per_step']:.1f}"),
        ("zipf read / write / wait ms per step (read-ahead)",
         f"{res['zipf_read_ahead']['read_s_ms_per_step']:.1f} / "
         f"{res['zipf_read_ahead']['write_s_ms_per_step']:.1f} / "
         f"{res['zipf_read_ahead']['wait_s_ms_per_step']:.1f}"),
        ("zipf misses/step (of them from queued write-backs), RAM hit rate (read-ahead run)",
         f"{res['zipf_read_ahead']['misses_per_step']:,.0f} "
         f"({res['zipf_read_ahead']['from_write_back_per_step']:,.0f}), "
         f"{res['zipf_read_ahead']['ram_hit_rate']:.3f}"),
        ("(a) host-RAM table ms/step", f"{res.get('host_zipf_ms') or float('nan'):.1f}"),
        ("(b) rows read from disk / probed rate, ms (median of rounds)", f"{floor_b:.1f}"),
        ("zipf read-ahead / max(a, b): median (rounds)",
         f"{res['zipf_x_bound']:.2f} ({', '.join(f'{x:.2f}' for x in res['zipf_x_bound_rounds'])})"),
        ("(b') misses / sustained rate (a loop's reads back to back), ms: rounds", ", ".join(
            f"{rnd['floor_b_sustained_ms']:.1f}" for rnd in rounds)),
        ("zipf read-ahead / max(a, b'): rounds", ", ".join(
            f"{x:.2f}" for x in res["zipf_x_sustained_rounds"])),
        ("zipf without read-ahead / max(a, b'): rounds", ", ".join(
            f"{x:.2f}" for x in res["zipf_no_read_ahead_x_sustained_rounds"])),
        ("zipf without read-ahead / max(a, b): rounds", ", ".join(
            f"{x:.2f}" for x in res["zipf_no_read_ahead_x_bound_rounds"])),
        *[(f"zipf {k} step(s) ahead / max(a, b): rounds", ", ".join(
            f"{x:.2f}" for x in res[f"zipf_ahead_{k}_x_bound_rounds"]))
          for k in args.also_ahead if f"zipf_ahead_{k}_x_bound_rounds" in res],
        ("zipf read-ahead loop: rows the disk read a second, whole loop, x probes around: "
         "rounds", ", ".join(f"{x:.2f}" for x in res["zipf_loop_x_probe_rounds"])),
        ("zipf rows read / misses per step (disk counters, read-ahead run)",
         f"{res['zipf_read_ahead']['disk_read_rows_per_step']:,.0f} / "
         f"{res['zipf_read_ahead']['misses_per_step']:,.0f}"),
        ("zipf steps/s (read-ahead)", f"{1e3 / res['zipf_read_ahead']['ms_per_step']:.1f}"),
        ("host syncs/step: disk / host table", f"{res['syncs_per_step']} / "
                                                f"{res.get('host_syncs_per_step')}"),
        ("max RSS + page cache growth (GiB)",
         f"{res['memory']['max_rss_plus_page_cache_bytes'] / 2**30:.2f} "
         f"(budget {args.budget_gib})"),
        ("max pinned / page cache growth (GiB)",
         f"{res['memory']['max_pinned_bytes'] / 2**30:.2f} / "
         f"{res['memory']['max_page_cache_growth_bytes'] / 2**30:.2f}"),
    ]
    if res["uniform"] is not None:
        u = res["uniform"]
        rows += [
            ("uniform rows/s (x first probe; x probes around the loop)",
             f"{u['rows_per_s']:,.0f} ({u['x_probe']:.2f}; {u['x_probe_around']:.2f})"),
            ("uniform rows the disk read a second (its counters), probes around",
             f"{u['disk_rows_per_s']:,.0f}, " + " / ".join(
                 f"{x:,.0f}" for x in u['probes_rows_per_s'])),
            ("uniform, the whole loop: rows the disk read a second (x probes around), the "
             "median loop; every loop's x probes around",
             f"{u['loop_disk_rows_per_s']:,.0f} ({u['loop_x_probe_around']:.2f}); " + ", ".join(
                 f"{x['loop_x_probe_around']:.2f}" for x in res["uniform_rounds"])),
            ("gaps between step starts, ms p10 / p50 / p90 / max: zipf read-ahead (round 0); "
             "uniform", " / ".join(f"{x:.1f}" for x in rounds[0]["zipf_read_ahead"][
                 "step_gap_ms_p10_p50_p90_max"]) + "; " + " / ".join(
                 f"{x:.1f}" for x in u["step_gap_ms_p10_p50_p90_max"]))]
    if "gpu_cache" in res:
        g = res["gpu_cache"]
        rows += [
            ("GPU cache above RAM: rows, both levels warmed in (s)",
             f"{g['rows']:,} ({g['gib']:.1f} GiB), {g['warm_s']:.0f}"),
            ("GPU cache: rows read from disk a step, rounds (RAM cache only: median)", ", ".join(
                f"{x:,.0f}" for x in g["disk_rows_per_step_rounds"])
             + f" ({res['zipf_read_ahead']['disk_read_rows_per_step']:,.0f})"),
            ("GPU cache: ms/step, rounds (RAM cache only: median)", ", ".join(
                f"{x:.1f}" for x in g["ms_per_step_rounds"])
             + f" ({res['zipf_read_ahead']['ms_per_step']:.1f})"),
            ("GPU cache / RAM cache only: disk reads, step time (medians)",
             f"**{g['reads_x']:.2f}x**, **{g['ms_x']:.2f}x**"),
            ("GPU cache hit rate; RAM hit rate below it", f"{g['gpu_hit_rate']:.3f}; "
                                                          f"{g['ram_hit_rate']:.3f}")]
    for k, v in rows:
        print(f"| {k} | {v} |")
    harness.save(args, "bench_disk.json", res)


if __name__ == "__main__":
    main()
