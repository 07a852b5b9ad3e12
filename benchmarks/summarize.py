"""The short table at the end of benchmarks/gpu_suite.sh: key figures from DIR/*.json.

    python benchmarks/summarize.py DIR
"""
import json
import os
import sys


def load(d, name):
    try:
        with open(os.path.join(d, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def row(what, value, unit=""):
    print(f"{what:<58}{value:>14}{unit}")


def fmt(x, spec=".2f"):
    return "N/A" if x is None else format(x, spec)


def main(d):
    print(f"\n## summary ({d})")
    t = load(d, "tables.json")
    if t:
        s = t["step_ms"]
        base = s["offload_adam"]
        row(f"tables: offload Adam step, {t['rows']:,} x {t['dim']} ({t['device']})", fmt(base), " ms")
        for k in ("gpu_sparse_adam", "manual_offload", "cpu_sparse_adam", "gpu_dense_adam"):
            if k in s:
                row(f"  {k} / offload_adam", fmt(s[k] / base), "x")
        sweep = {int(k): v for k, v in t["sweep_ms"].items() if v}
        if sweep:
            lo, hi = min(sweep), max(sweep)
            row(f"  step at {hi:,} rows / at {lo:,} rows", fmt(sweep[hi] / sweep[lo]), "x")
    st = load(d, "step.json")
    if st:
        row(f"step: {st['rows']:,} x {st['dim']} Adam ({st['device']})", "", "")
        for k, v in st.get("ratios", {}).items():
            row(f"  {k}", fmt(v), "x")
        for k, v in st.get("syncs", {}).items():
            row(f"  host syncs per step, {k}", fmt(v, ".1f"), "")
    ca = load(d, "cache.json")
    if ca:
        row(f"cache: {ca['rows']:,} x {ca['dim']} Adam, {ca['ids_per_step']:,} ids ({ca['device']})",
            "", "")
        for k, v in ca.get("targets", {}).items():
            row(f"  {k}", fmt(v), "x")
        for k, v in ca.get("ratios", {}).items():
            if "best cache" in k:
                row(f"  {k}", fmt(v), "x")
        if ca.get("skipped") or ca.get("failed"):
            row("  systems not run (time budget) / failed",
                f"{len(ca.get('skipped', []))} / {len(ca.get('failed', []))}", "")
    cs = load(d, "cache_seed.json")
    if cs:
        row(f"cache, seed tables under a {cs['gpu_cap_gib']:g} GiB GPU cap ({cs['device']})", "", "")
        for name, r in cs.get("systems", {}).items():
            if "skipped" in r:
                row(f"  {name}", "skipped", "")
            for dist, c in r.get("cases", {}).items():
                peak = r.get("peak_gpu_bytes")
                row(f"  {name}, {dist}: steps/s, peak GPU GiB",
                    f"{c['steps_per_s']:.1f}  {fmt(None if peak is None else peak / 2**30, '.1f')}", "")
        for k, v in cs.get("ratios", {}).items():
            row(f"  {k}", fmt(v), "x")
    wv = load(d, "word2vec.json")
    if wv:
        row(f"word2vec: {wv.get('tokens', 0):,} tokens x {wv['epochs']} epochs ({wv['device']})", "", "")
        for k, v in wv.get("ratios", {}).items():
            row(f"  {k}", fmt(v), "x")
        for name, sysres in wv.get("systems", {}).items():
            q = sysres.get("quality", {})
            row(f"  {name}: M words/s, WS353 / SimLex / analogy",
                f"{sysres['words_per_s'] / 1e6:.2f}  {q.get('ws353', {}).get('spearman', float('nan')):.3f} / "
                f"{q.get('simlex', {}).get('spearman', float('nan')):.3f} / "
                f"{100 * q.get('analogy', {}).get('accuracy', float('nan')):.1f}%", "")
    ld = load(d, "loader.json")
    if ld:
        for k in ("images", "pairs"):
            if k in ld:
                row(f"loader {k}: PinnedLoader / all-on-GPU ceiling", fmt(ld[k].get("pinned_vs_ceiling")), "x")
                row(f"loader {k}: PinnedLoader / best stock DataLoader",
                    fmt(ld[k].get("pinned_vs_best_dataloader")), "x")
                if ld[k].get("best_tuned"):
                    row(f"loader {k}: PinnedLoader / best tuned DataLoader",
                        fmt(ld[k].get("pinned_vs_best_tuned")), "x")
        for bs, r in sorted((ld.get("pair_sweep") or {}).items(), key=lambda kv: int(kv[0])):
            row(f"loader pairs, batch {int(bs):,}: PinnedLoader / ceiling", fmt(r.get("pinned_vs_ceiling")), "x")
    db = load(d, "dashboard.json")
    if db:
        modes = db["overhead"]["modes"]
        for m in ("text", "widget"):
            if m in modes:
                row(f"dashboard overhead, {m} mode (refresh {db['overhead']['refresh_s']} s)",
                    fmt(modes[m].get("overhead_percent"), "+.2f"), " %")
                if modes[m].get("upper95_percent") is not None:
                    row("  upper end of its 95% confidence interval",
                        fmt(modes[m]["upper95_percent"], "+.2f"), " %")
        row("dashboard diagnosis", "", "")
        print(f"  {db.get('diagnosis')}")
    ck = load(d, "checkpoint.json")
    if ck:
        gb = 1e9
        for k in ("save", "restore", "dd_write", "dd_read", "torch_save", "torch_load"):
            v = ck.get(f"{k}_bytes_per_s")
            row(f"checkpoint {k} ({ck.get('save_bytes', 0) / gb:.1f} GB, {ck['device']})",
                fmt(None if v is None else v / gb), " GB/s")
    dt = load(d, "distributed.json")
    if dt:
        row(f"distributed: {dt['rows']:,} x {dt['dim']} Adam, {dt['batch']:,} ids/rank "
            f"({dt['device']}, gloo)", "", "")
        for world, r in sorted(dt["worlds"].items(), key=lambda kv: int(kv[0])):
            row(f"  {world} rank(s): step ms (slowest) / lookup ms / MB sent",
                f"{r['step_ms']:.2f} / {r['lookup_ms']:.2f} / {r['sent_MB']:.1f}", "")
    p = os.path.join(d, "pytest.log")
    if os.path.exists(p):
        with open(p) as f:
            lines = [l.strip() for l in f if l.strip()]
        print(f"CUDA tests: {lines[-1] if lines else 'no output'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "artifacts/gpu")
