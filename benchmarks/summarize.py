"""The summary table at the end of benchmarks/gpu_suite.sh: one row per script that ran (its exit
status and seconds, from DIR/status.tsv) with its headline figures (from its JSON in DIR or a
folder of DIR), and the CUDA tests' last line.

    python benchmarks/summarize.py DIR
"""
import json
import os
import sys


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _x(v):
    return None if v is None else f"{v:.2f}x"


def _gbs(v):
    return None if v is None else f"{v / 1e9:.2f} GB/s"


def headlines(name, r):
    """(label, value) pairs: the figures a reader of the script's section looks for first."""
    if name == "step":
        return [(k, _x(v)) for k, v in r.get("ratios", {}).items() if "target" in k]
    if name == "tables":
        s = r.get("step_ms", {})
        base = s.get("offload_adam")
        return [("offload Adam ms/step", f"{base:.2f}" if base else None)] + [
            (f"{k} / offload_adam", _x(v / base)) for k, v in s.items()
            if k != "offload_adam" and base]
    if name in ("cache", "cache_seed"):
        return [(k, _x(v)) for k, v in {**r.get("targets", {}), **r.get("ratios", {})}.items()
                if "target" in k]
    if name == "word2vec":
        return [(k, _x(v)) for k, v in r.get("ratios", {}).items()]
    if name == "recommender":
        figures = [("ranking HR@10, nbtools MF", _get(r, "ml100k_ranking", "nbtools MF (BCE)", "hr@10")),
                   ("ratings RMSE, nbtools MF", _get(r, "ml100k_ratings", "nbtools MF", "rmse")),
                   ("large: offloaded steps/s", _get(r, "large", "offload_steps_per_s"))]
        return [(k, None if v is None else f"{v:.4f}") for k, v in figures]
    if name == "rowwise":
        return [(v.split(" (target")[0], v.rsplit(": ", 1)[-1]) for v in r.get("verdicts", [])]
    if name == "loader":
        return [(f"{k}: PinnedLoader / {w}", _x(_get(r, k, f"pinned_vs_{key}")))
                for k in ("images", "pairs")
                for w, key in (("ceiling", "ceiling"), ("best DataLoader", "best_dataloader"))]
    if name == "dashboard":
        return [(f"overhead, {m} mode", f"{v['overhead_percent']:+.2f}%")
                for m, v in _get(r, "overhead", "modes").items()]
    if name == "checkpoint":
        return [(k, _gbs(r.get(f"{k}_bytes_per_s"))) for k in ("save", "restore", "dd_read")]
    if name == "pretrained":
        return [(f"{p} load / dd read", _x(_get(r, p, "x_dd_read"))) for p in ("host", "disk")]
    if name == "distributed":
        return [(f"{w} rank(s) step ms", f"{v['step_ms']:.2f}") for w, v in r["worlds"].items()]
    if name == "disk":
        return [("zipf read-ahead / max(host, disk floor)", _x(r.get("zipf_x_bound"))),
                ("max RSS + page cache GiB", _get(r, "memory", "max_rss_plus_page_cache_bytes")
                 and f"{r['memory']['max_rss_plus_page_cache_bytes'] / 2**30:.2f}")]
    return []


def main(d):
    status = {}
    if os.path.exists(os.path.join(d, "status.tsv")):
        with open(os.path.join(d, "status.tsv")) as f:
            for line in f:
                name, rc, seconds = line.split("\t")
                status[name] = ("ok" if rc == "0" else f"FAILED ({rc})", f"{float(seconds):.0f} s")
    found = {}       # label -> JSON path: DIR/x.json, and DIR/sub/x.json as "sub/x"
    for sub in ["", *sorted(e.name for e in os.scandir(d) if e.is_dir())]:
        for f in sorted(os.listdir(os.path.join(d, sub))):
            if f.endswith(".json"):
                found[os.path.join(sub, f[:-5].removeprefix("bench_"))] = os.path.join(d, sub, f)
    rows = []
    for name in sorted(set(status) | set(found)):
        try:
            with open(found[name]) as f:
                figures = headlines(os.path.basename(name), json.load(f))
        except (KeyError, OSError, ValueError, TypeError, AttributeError):
            figures = []
        state, seconds = status.get(name, ("", ""))
        figures = [(k, v) for k, v in figures if v is not None] or [("", "")]
        rows += [[name if i == 0 else "", state if i == 0 else "", seconds if i == 0 else "",
                  k, str(v)] for i, (k, v) in enumerate(figures)]
    widths = [max(len(r[i]) for r in rows + [["script", "status", "time", "figure", "value"]])
              for i in range(5)]
    print(f"\n## summary ({d})")
    for r in [["script", "status", "time", "figure", "value"], *rows]:
        print("  ".join(c.ljust(w) if i != 4 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))).rstrip())
    log = os.path.join(d, "pytest.log")
    if os.path.exists(log):
        with open(log) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        print(f"CUDA tests: {lines[-1] if lines else 'no output'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "artifacts/gpu")
