#!/usr/bin/env bash
# The README's main job: run notebooks/word2vec.ipynb end to end, as Colab's "Run all" would, in
# its smoke setting (the bundled sample; a CPU is enough), and keep the executed notebook.
# On a fresh machine it sets itself up first: a .venv with torch, nbtools and its dev extras.
#
#   bash scripts/main.sh                # notebooks/word2vec.ipynb
#   bash scripts/main.sh recommender    # notebooks/recommender.ipynb
#   bash scripts/main.sh dashboard      # notebooks/dashboard.ipynb
#   bash scripts/main.sh disk           # notebooks/disk.ipynb
#
# Output: artifacts/<name>.ipynb (with every cell's output, plots included), each plot also as
# artifacts/<name>-figures/cell-<n>.png, the dashboard's final image as
# artifacts/<name>-dashboard.png, checkpoints under artifacts/runs/, and the "Google Drive"
# copies under artifacts/drive/ (outside Colab, a local folder). The smoke setting trains on
# small samples bundled with nbtools (made-up text and ratings): its scores show that the
# pipeline works and are not comparable with published figures.
set -euo pipefail
cd "$(dirname "$0")/.."
name="${1:-word2vec}"
if [ ! -f "notebooks/$name.ipynb" ]; then
  echo "no notebooks/$name.ipynb; try one of: word2vec, recommender, dashboard, disk" >&2
  exit 2
fi
. scripts/setup.sh

mkdir -p artifacts
# A fresh run each time: an earlier run's checkpoints would be restored and training skipped.
rm -rf "artifacts/runs/$name-smoke" "artifacts/drive/nbtools/$name-smoke"
export NBTOOLS_DRIVE_DIR="${NBTOOLS_DRIVE_DIR:-$PWD/artifacts/drive}"
# The kernel draws plots into the notebook, as Jupyter and Colab do (Agg would draw them nowhere).
export MPLBACKEND=module://matplotlib_inline.backend_inline

python - "$name" <<'EOF'
import base64
import re
import sys
import time
from pathlib import Path

import nbclient
import nbformat

name = sys.argv[1]
src, out = Path(f"notebooks/{name}.ipynb"), Path(f"artifacts/{name}.ipynb")
nb = nbformat.read(src, as_version=4)
nb.metadata.pop("nbtools", None)    # the shipped full-size run's record: not this smoke run's
print(f"executing {src} (smoke setting) ...", flush=True)
t0 = time.perf_counter()
client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                 resources={"metadata": {"path": "artifacts"}})
try:
    client.execute()
finally:
    nbformat.write(nb, out)         # also when a cell failed: the error is in the notebook
seconds = time.perf_counter() - t0
# What the notebook printed (each cell's last lines; not the install and set-up cells).
code = [c for c in nb.cells if c.cell_type == "code"]
for cell in code[2:]:
    text = "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")
    lines = [l for l in text.splitlines() if l.strip()]
    if lines:
        print("\n".join(lines[-12:]))
print(f"\nexecuted {src} in {seconds:.1f} s -> {out.resolve()}")

# Every plot as a PNG file too, and the dashboard's final image: the history plot inlined in the
# static snapshot the dashboard leaves when it closes.
figures = Path(f"artifacts/{name}-figures")
figures.mkdir(exist_ok=True)
for old in figures.glob("*.png"):
    old.unlink()
saved, dashboard = [], None
for i, cell in enumerate(nb.cells):
    for k, o in enumerate(cell.get("outputs", [])):
        bundle = o.get("data", {})
        if "image/png" in bundle:
            path = figures / f"cell-{i:02d}{'' if k == 0 else f'-{k}'}.png"
            path.write_bytes(base64.b64decode(bundle["image/png"]))
            saved.append(path)
        snap = re.search(r'class="nbtools-plot"[^>]*src="data:image/png;base64,([^"]+)"',
                         bundle.get("text/html", ""))
        if snap:
            dashboard = base64.b64decode(snap.group(1))
if dashboard is None:     # no widget snapshot (text mode): draw the saved history instead
    from nbtools.dashboard import plot_history
    history = sorted(Path("artifacts/drive").glob(f"**/{name}-smoke/meters.jsonl"))
    if history:
        dashboard = plot_history(history[0]).png
if dashboard is not None:
    Path(f"artifacts/{name}-dashboard.png").write_bytes(dashboard)
print(f"{len(saved)} plot(s) -> {figures}/; dashboard image -> "
      f"{f'artifacts/{name}-dashboard.png' if dashboard is not None else 'none found'}")
if not saved or dashboard is None:
    sys.exit(f"expected the notebook's plots and the dashboard's image; found {len(saved)} "
             f"plot(s) and {'a' if dashboard is not None else 'no'} dashboard image")
EOF
