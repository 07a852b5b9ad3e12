"""The Colab profile's table: each timing both runs of benchmarks/colab_profile.sh wrote, as
full / colab / colab over full, one row per figure (the scripts' JSON, flattened).

    python benchmarks/colab/compare.py DIR      # DIR/full/*.json beside DIR/colab/*.json
"""
import json
import math
import os
import re
import sys

# timings and rates: milliseconds, seconds, per-second rates, and the scripts' own ratios
FIGURE = re.compile(r"(^|_)(ms|s|per_s|x)$|ms_per_step|_ms_")
SKIP = re.compile(r"(^|\.)(args|probe[^.]*|command)(\.|$)|_all$|rounds$")


def flat(value, prefix: str = "") -> dict:
    """Every numeric leaf of ``value`` as {"a.b.c": number}."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return {prefix: float(value)}
    return {}


def figures(folder: str) -> dict:
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name)) as f:
            try:
                got = flat(json.load(f))
            except ValueError:
                continue
        for key, v in got.items():
            # a timing's own name, or the table it is in ({"ms": {"<case>": 0.47}})
            parts = key.split(".")
            if any(FIGURE.search(p) for p in parts[-2:]) and not SKIP.search(key):
                out[f"{name[:-5]}: {key}"] = v
    return out


def main(root: str) -> int:
    full, colab = figures(os.path.join(root, "full")), figures(os.path.join(root, "colab"))
    keys = [k for k in full if k in colab]
    if not keys:
        print(f"no figure in both {root}/full and {root}/colab")
        return 1
    width = max(len(k) for k in keys)
    print(f"{'figure':<{width}}  {'full':>12}  {'colab':>12}  colab/full")
    for k in keys:
        ratio = colab[k] / full[k] if full[k] else float("nan")
        print(f"{k:<{width}}  {full[k]:>12.4g}  {colab[k]:>12.4g}  {ratio:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "artifacts/colab"))
