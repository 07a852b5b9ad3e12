#!/usr/bin/env bash
# Every benchmark script's --quick run, one after the other, on any machine (a CPU is enough):
# tiny sizes, the same code paths and tables as a full run. Fails at the first script that fails.
#   bash benchmarks/smoke.sh [DIR]     # DIR (default: a temporary folder) gets each script's JSON
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
out=${1:-$(mktemp -d)}
mkdir -p "$out"
: > "$out/status.tsv"
for script in benchmarks/bench_*.py; do
  name=$(basename "$script" .py)
  echo "=== $script --quick"
  start=$(date +%s.%N)
  python "$script" --quick --out "$out" > "$out/$name.log" 2>&1 || {
    tail -40 "$out/$name.log"; echo "smoke: $script --quick failed (log: $out/$name.log)"; exit 1; }
  seconds=$(python -c "import time; print(round(time.time() - $start, 1))")
  printf '%s\t0\t%s\n' "${name#bench_}" "$seconds" >> "$out/status.tsv"
  echo "    ok, ${seconds} s"
done
echo "=== benchmarks/regress.sh (this tree against itself, --quick)"
OUT=$out ARGS=--quick bash benchmarks/regress.sh . "nbtools host" > "$out/regress.log" 2>&1 || {
  tail -40 "$out/regress.log"; echo "smoke: benchmarks/regress.sh failed"; exit 1; }
echo "=== benchmarks/profile_step.py and sample_threads.py (this tree against itself, tiny)"
{ python benchmarks/profile_step.py --rows 2000 --steps 3 --ids 64 --system "nbtools host" --out "$out/profile/a.json" &&
  python benchmarks/profile_step.py --rows 2000 --steps 3 --ids 64 --system "nbtools host" --out "$out/profile/b.json" &&
  python benchmarks/profile_step.py --diff "$out/profile/a.json" "$out/profile/b.json" &&
  python benchmarks/sample_threads.py --within main/run_steps --out "$out/profile/threads.txt" benchmarks/bench_disk.py \
    --rows 20000 --cache-gib 0.001 --steps 3 --uniform-rounds 0 --rounds 1 --also-ahead "" --out "$out/profile" &&
  grep -q "inside main/run_steps" "$out/profile/threads.txt" &&
  ! grep -q "^0 sampling moments" "$out/profile/threads.txt"; } > "$out/profile.log" 2>&1 || {
  tail -40 "$out/profile.log"; echo "smoke: the profiling tools failed"; exit 1; }
python benchmarks/summarize.py "$out"
