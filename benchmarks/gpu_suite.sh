#!/usr/bin/env bash
# Everything that needs a GPU, in one call: the CUDA test run and every benchmark script.
#   bash benchmarks/gpu_suite.sh [tests|tests1|tests2|bench|all] [bench name filter]
#   bash benchmarks/gpu_suite.sh lean    # issue 23: every storage combination against its floor, with and
#     without table.prefetch, where the row-wise steps' host time goes, and the row-wise steps
#     with session 24's changes off and on (one call, ~5 minutes)
#   bash benchmarks/gpu_suite.sh disk [timeline|100m|steady|sizes]   # the disk tier's runs (one call each):
#     timeline: where a disk-bound loop's time goes (10M rows, dim 16: the CPU machine's
#     like-for-like run of session 16) and 20M rows at bench_disk's setting; 100m: bench_disk
#     at 100M rows under the simulated Colab free tier (~9 minutes; each round also times
#     a loop handing each load to glibc in one lio_listio, and one on Linux's native AIO); steady:
#     100M rows after the log file's spare slots are used up (aged by copying rows), its cleaner
#     at work in the rounds (~9 minutes, no host comparison: (a) is ~1 ms); sizes: the same at 1M and 10M
#     rows (the step against its floor does not grow with the table)
# The CUDA tests take ~9 minutes on the H100 (session 14: 540 s of a call's 600): "tests1" and
# "tests2" run each half of the test files (and the doctests with the second), one call each.
# The log ends with the 15 slowest tests. Where pytest-xdist is importable (carry its wheel and
# execnet's in .whl/) the tests run in GPU_TEST_WORKERS processes (default 4; 1: one process):
# session 15, H100, 4 workers: the whole CUDA suite in 212 s (1345 passed).
# On the lent GPU machine (no network) carry pure-Python wheels in .whl/ (see benchmarks/RESULTS.md);
# they are installed into /tmp/site, never over the machine's own torch.
set -u
what=${1:-all}
filter=${2:-}
out=${OUT:-artifacts/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c "import nbtools; nbtools.describe()"
status=0
files=(tests/test_*.py)
half=$(( (${#files[@]} + 1) / 2 ))
case "$what" in
  tests1) TESTS=${TESTS:-"${files[*]:0:$half}"}; what=tests ;;
  tests2) TESTS=${TESTS:-"${files[*]:$half} nbtools/"}; what=tests ;;
esac
if [ "$what" = tests ] || [ "$what" = all ]; then
  echo "=== CUDA tests"
  # notebooks and the browser test are CPU smoke tests (CI runs them); everything else on CUDA
  workers=()
  if [ "${GPU_TEST_WORKERS:-4}" != 1 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${GPU_TEST_WORKERS:-4}" --dist loadgroup)
  fi
  python3 -m pytest -q -p no:cacheprovider -m "not slow" --durations=15 "${workers[@]}" --ignore=tests/test_notebooks.py \
    ${TESTS:-tests/ nbtools/} 2>&1 | tee "$out/pytest.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = disk ]; then
  dir=${DISK_DIR:-/tmp/nbtools-disk}
  case "${filter:-timeline}" in
    timeline)
      python3 benchmarks/experiments/disk_timeline.py --rows 10000000 --dim 16 --ids 65536 \
        --cache-gib 0.02 --ahead 8 --steps 48 --age-steps 16 --dir "$dir" 2>&1 \
        | grep --line-buffered -v Warn | tee "$out/disk_timeline_10m.log" | head -40; rm -rf "$dir"
      python3 benchmarks/experiments/disk_timeline.py --rows 20000000 --cache-gib 1.4 --ahead 8 \
        --steps 64 --age-steps 32 --dir "$dir" 2>&1 | grep --line-buffered -v Warn \
        | tee "$out/disk_timeline_20m.log" | head -40; rm -rf "$dir" ;;
    100m)
      python3 benchmarks/bench_disk.py --rows 100000000 --steps 96 --rounds 5 --cache-gib 7 \
        --host-compare --dir "$dir" --age-s 60 --also-ahead "" --also-batch 4096 --also-engine kaio \
        --uniform-steps 32 --uniform-rounds 2 --out "$out/disk100m" 2>&1 | grep --line-buffered -v "^uniform {\|Warn" \
        | tee "$out/bench_disk_100m.log" | tail -45; rm -rf "$dir" ;;
    steady)  # 100M rows once the log's spare slots are used up and its cleaner runs
      python3 benchmarks/bench_disk.py --rows 100000000 --steps 96 --rounds 3 --cache-gib 7 \
        --dir "$dir" --age-s 270 --age-copy --also-ahead "" --uniform-steps 12 \
        --uniform-rounds 1 --out "$out/disk100m_steady" 2>&1 \
        | grep --line-buffered -v "^uniform {\|Warn" | tee "$out/bench_disk_100m_steady.log" | tail -45
      rm -rf "$dir" ;;
    sizes)   # the step against its floor at 1M and 10M rows, the 100M run's RAM share (29%)
      for rows in 1000000 10000000; do
        python3 benchmarks/bench_disk.py --rows $rows --steps 96 --rounds 3 \
          --cache-gib "$(python3 -c "print(round(7 * $rows / 1e8, 4))")" --host-compare \
          --dir "$dir" --age-s 30 --also-ahead "" --uniform-steps 12 --uniform-rounds 1 \
          --out "$out/disk$rows" 2>&1 | grep --line-buffered -v "^uniform {\|Warn" \
          | tee "$out/bench_disk_$rows.log" | grep "round \|/ max(a, b)\|misses/step\|steps/s"
        rm -rf "$dir"
      done ;;
  esac
fi
if [ "$what" = lean ]; then   # issue 23 in one call (~5 minutes): every storage combination
  # and its prefetching variant against their own floors, the GPU-placed row-wise step (what
  # the host alone takes), then where the row-wise steps' host and GPU time goes
  combos="nbtools host,nbtools host rowwise,nbtools host bf16,nbtools host bf16 rowwise,nbtools host bf16+bf16 state,nbtools host bf16 rowwise+bf16 state"
  only="floor,nbtools gpu bf16 rowwise"
  IFS=, read -ra names <<< "$combos"
  for n in "${names[@]}"; do only="$only,$n,$n prefetch"; done
  python3 benchmarks/bench_step.py --own-floors --out "$out" --only "$only" 2>&1 \
    | grep --line-buffered -v Warn | tee "$out/bench_step_lean.log" | grep -A12 "storage combinations"
  grep "gpu bf16 rowwise | 65,536 uniform" "$out/bench_step_lean.log"
  rowwise="nbtools host bf16 rowwise,nbtools host bf16 rowwise prefetch"
  python3 benchmarks/experiments/host_costs.py --ids 65536 --steps 200 --systems "$rowwise" 2>&1 \
    | grep -v Warn | tee "$out/host_costs_lean.log" | grep -A14 "^==="
  # session 24's changes (the take kernel, the sum's inf/nan check, the step wrapper) off and
  # on, every row-wise combination
  python3 benchmarks/experiments/prefetch_overlap.py --toggle session24 --rounds 4 \
    --systems "nbtools host bf16 rowwise,nbtools host bf16 rowwise prefetch,nbtools host rowwise,nbtools host rowwise prefetch,nbtools host bf16 rowwise+bf16 state,nbtools host bf16 rowwise+bf16 state prefetch" \
    2>&1 | grep -v Warn | tee "$out/session24_lean.log" | tail -8
  # the host's share: torch's wrappers, the user's backward, autograd on the calling thread
  python3 benchmarks/experiments/host_wrappers.py --rounds 2 2>&1 | grep -v Warn \
    | tee "$out/host_wrappers_lean.log" | tail -18
  # (sessions 20-23 also ran here: step_events.py --systems "$rowwise", prefetch_overlap.py
  # --toggle update_waits, stream_calls.py, --toggle fast_streams and --toggle vector_views;
  # their figures are in benchmarks/RESULTS.md)
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in benchmarks/bench_*.py; do
    case "$b" in *"$filter"*) ;; *) continue ;; esac
    echo "=== $b"
    timeout 420 python3 "$b" --out "$out" 2>&1 | tee "$out/$(basename "$b" .py).log" | tail -30
  done
fi
python3 benchmarks/summarize.py "$out"
exit $status
