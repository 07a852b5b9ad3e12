#!/usr/bin/env bash
# Run the four notebooks at full size on a GPU machine, then word2vec and the recommender past a
# 16 GB GPU, with scripts/run_notebook.py (no Jupyter needed), and write the executed notebooks
# into $OUT with a summary: per notebook the seconds, the GPU, and what its tables and optimizer
# state take.
#
#   OUT=/tmp/out bash benchmarks/notebooks_gpu.sh        # on a GPU machine: full size
#   SMOKE=1 OUT=/tmp/out bash benchmarks/notebooks_gpu.sh  # the same commands, smoke setting (CPU)
#   ONLY="disk word2vec-past_t4" OUT=... bash benchmarks/notebooks_gpu.sh   # only these outputs
#
# No network is needed when the data sets are in $NBTOOLS_OFFLINE (default .scratch/offline, made
# by hand: docs/performance.md, "Past a 16 GB GPU"): corpus.txt.zip (an English corpus; text8 itself, as
# text8.zip, is used instead where present), eval/ (WS353, SimLex-999, the analogy questions) and
# ml-100k/ml-100k.inter (MovieLens-100K). Without them the notebooks download what they need.
#
# Every notebook runs under `timeout`, within a total of $BUDGET_S seconds (default 530): the
# full-size four first, then the two past the GPU; one that would start with less than 30 s left
# is skipped. Files in $OUT: <name>.ipynb for the full-size runs (what notebooks/ ships),
# <name>-past_t4.ipynb, summary.txt and run.log. The exit status is that of the first failure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-artifacts/notebooks-gpu}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
BUDGET_S="${BUDGET_S:-530}"
OFFLINE="$(cd "${NBTOOLS_OFFLINE:-.scratch/offline}" 2>/dev/null && pwd || true)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NBTOOLS_DRIVE_DIR="${NBTOOLS_DRIVE_DIR:-$PWD/artifacts/notebooks-gpu-drive}"   # "Drive"
export MPLBACKEND=Agg
# as a user's machine runs them: Triton's interpreter is for the kernel tests on a CPU only
unset TRITON_INTERPRET
# the commit, where this tree is not a git checkout (a copy of one): NBTOOLS_COMMIT=...
export NBTOOLS_COMMIT="${NBTOOLS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}"

SETS=()
if [ "${SMOKE:-0}" = 1 ]; then
  label=smoke
else
  label=full
  SETS+=(--set SMOKE=False)
fi
text=() ratings=()
if [ -n "$OFFLINE" ] && [ "$label" = full ]; then     # the smoke setting uses bundled samples
  for f in text8.zip corpus.txt.zip; do
    if [ -f "$OFFLINE/$f" ]; then text=(--set "DATA_PATH='$OFFLINE/$f'"); break; fi
  done
  [ -f "$OFFLINE/ml-100k/ml-100k.inter" ] && ratings=(--set "DATA_PATH='$OFFLINE/ml-100k/ml-100k.inter'")
  [ -d "$OFFLINE/eval" ] && export NBTOOLS_EVAL_DIR="$OFFLINE/eval"
fi
# The disk notebook's table is 5x a host budget: at full size 5x the machine's RAM, more than a
# GPU machine's local disk holds in a few minutes, so here 5x a 2 GiB budget (a 10 GiB file).
disk=()
[ "$label" = full ] && disk=(--set "BUDGET=2 << 30" --set RAM=BUDGET --set STEPS=300)

#   name          output                 cap (s)  settings
RUNS=(
  "word2vec     word2vec               120"
  "recommender  recommender            120"
  "dashboard    dashboard               90"
  "disk         disk                   240"
  "word2vec     word2vec-past_t4       150"
  "recommender  recommender-past_t4    200"
)
start=$(date +%s)
status=0
: > "$OUT/run.log"
echo "notebooks ($label) -> $OUT; budget ${BUDGET_S} s; offline data: ${OFFLINE:-none}" | tee "$OUT/summary.txt"
for run in "${RUNS[@]}"; do
  read -r name out cap <<< "$run"
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $out "* ]]; then continue; fi
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  if [ "$left" -lt 30 ]; then
    echo "$out: skipped, ${left} s of the budget left" | tee -a "$OUT/summary.txt"
    [ "$status" = 0 ] && status=3
    continue
  fi
  limit=$(( cap < left ? cap : left ))
  args=("${SETS[@]}")
  case "$name" in
    word2vec) args+=("${text[@]}") ;;
    recommender) args+=("${ratings[@]}") ;;
    disk) args+=("${disk[@]}") ;;
  esac
  case "$out" in *-past_t4) args+=(--set "SIZE='past_t4'") ;; esac
  # past a 16 GB GPU as on one: "auto" would put word2vec's 19.6 GiB on an 80 GB GPU; on a T4 it
  # takes pinned host RAM, so that is where this run puts them (the recommender's default is host)
  case "$out" in word2vec-past_t4) args+=(--set "PLACEMENT='host'") ;; esac
  # a fresh run each time: an earlier run's checkpoints would be restored and training skipped
  rm -rf notebooks/runs "$NBTOOLS_DRIVE_DIR"
  echo "=== $out (limit ${limit} s): ${args[*]}" >> "$OUT/run.log"
  t0=$(date +%s)
  timeout --signal=INT --kill-after=15 "$limit" \
    "$PY" scripts/run_notebook.py "notebooks/$name.ipynb" -o "$OUT/$out.ipynb" --label "$label" \
      "${args[@]}" >> "$OUT/run.log" 2>&1
  rc=$?
  seconds=$(( $(date +%s) - t0 ))
  "$PY" - "$OUT/$out.ipynb" "$out" "$rc" "$seconds" <<'EOF' | tee -a "$OUT/summary.txt"
import json, re, sys
path, name, rc, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
why = {0: "ok", 124: "TIMED OUT", 137: "TIMED OUT (killed)",
       1: "FAILED (a cell raised; see run.log)"}.get(rc, f"exit {rc}")
try:
    nb = json.load(open(path))
except (OSError, ValueError):
    print(f"{name}: {why}, {seconds} s, no notebook written")
    sys.exit()
meta = nb["metadata"].get("nbtools", {})
text = "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
               for o in c.get("outputs", []) if o.get("output_type") == "stream")
# what the tables take: nbtools.plan's line, and sizing.against_gpu's
sizes = re.findall(r"^(\s+table .* = .*|\S.* of (?:tables|rows)[^\n]*: [\d.]+x a 16 GB T4.*)$",
                   text, re.M)
figures = sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []))
print(f"{name}: {why}, {seconds} s, GPU {meta.get('gpu')} ({meta.get('gpu_memory_gib')} GiB), "
      f"{figures} figure(s), {len(open(path, 'rb').read()) / 2**20:.2f} MiB")
for line in sizes[:3]:
    print(f"    {line.strip()}")
EOF
  [ "$rc" != 0 ] && [ "$status" = 0 ] && status=$rc
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
exit "$status"
