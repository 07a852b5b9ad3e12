#!/usr/bin/env bash
# Everything that needs a GPU, in one call, ending with a summary table (benchmarks/summarize.py):
#   bash benchmarks/gpu_suite.sh [all|tests|tests1|tests2|testsKofM|bench|lean|disk] [filter]
#     all      the CUDA tests, then every benchmarks/bench_*.py at its full size (the default)
#     tests    the test suite on CUDA; tests1 / tests2: each half of the test files; testsKofM:
#              the K-th of M parts (tests1of3 ...). On a fresh machine every worker compiles
#              the kernels first: the whole suite took more than 10 minutes with 6 workers and
#              the second half 73 s, so where a call's 10 minutes are tight use thirds
#     bench    every benchmarks/bench_*.py whose name contains [filter] (each stopped at 420 s)
#     lean     bench_step.py: every storage combination and its prefetching twin against its own
#              traffic floor, and the GPU-placed row-wise step (~5 minutes)
#     disk     bench_disk.py under a simulated Colab free tier; [filter] picks the run:
#              100m (the default: 100M rows, ~9 minutes), steady (100M rows once the log
#              file's spare slots are used up and its cleaner runs, ~9 minutes), tiers (a
#              10 GiB GPU cache above the 7 GiB RAM cache against RAM alone, in one run,
#              ~8 minutes: make it a call of its own), sizes (1M and 10M rows: the step
#              against its floor does not grow with the table), colab (a fresh 20M-row disk
#              table's GPU level warmed from the stream's shares against starting cold, its
#              first 182 steps, on 2 cores as on Colab's free tier: ~2 x 4 minutes)
# Results go to $OUT (default artifacts/gpu): logs, each script's JSON, status.tsv.
# The machine's own torch is used, never replaced: pure-Python wheels carried in .whl/ (e.g.
# pytest-xdist and execnet on a machine without network) are installed into /tmp/site with
# --no-deps; a torch wheel there is skipped. Where pytest-xdist is importable the tests run in
# GPU_TEST_WORKERS processes (default 4; 1: one process).
set -u
what=${1:-all}
filter=${2:-}
out=${OUT:-artifacts/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
wheels=$(ls .whl/*.whl 2>/dev/null | grep -v '/torch-' || true)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c "import nbtools; nbtools.describe()"
status=0

# run NAME TIMEOUT_S COMMAND...: the command's output to $out/NAME.log (its tail shown), its exit
# status and seconds to $out/status.tsv
run() {
  local name=$1 limit=$2 start rc
  shift 2
  echo "=== $name: $*"
  start=$(date +%s)
  mkdir -p "$(dirname "$out/$name")"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v Warn | tee "$out/$name.log" | tail -40
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$out/status.tsv"
  [ "$rc" = 0 ] || status=$rc
}

mapfile -t files < <(find tests -name 'test_*.py' | sort)   # (tests/<wing>/ too)
case "$what" in tests1) what=tests1of2 ;; tests2) what=tests2of2 ;; esac
if [[ "$what" =~ ^tests([0-9]+)of([0-9]+)$ ]]; then
  k=${BASH_REMATCH[1]} m=${BASH_REMATCH[2]}
  if [ "$k" -lt 1 ] || [ "$k" -gt "$m" ]; then echo "gpu_suite.sh: $what: no such part" >&2; exit 2; fi
  part=$(( (${#files[@]} + m - 1) / m ))            # files a part (the last takes nbtools/ too)
  extra=""; [ "$k" = "$m" ] && extra=" nbtools/"
  TESTS=${TESTS:-"${files[*]:$(( (k - 1) * part )):$part}$extra"}
  what=tests
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  # the notebooks are CPU smoke tests (CI runs them); everything else on CUDA
  workers=()
  if [ "${GPU_TEST_WORKERS:-4}" != 1 ] && python3 -c "import xdist" 2>/dev/null; then
    workers=(-n "${GPU_TEST_WORKERS:-4}" --dist loadgroup)
  fi
  echo "=== CUDA tests"
  python3 -m pytest -q -p no:cacheprovider -m "not slow" --durations=15 "${workers[@]}" \
    --ignore=tests/test_notebooks.py ${TESTS:-tests/ nbtools/} 2>&1 | tee "$out/pytest.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in benchmarks/bench_*.py; do
    case "$b" in *"$filter"*) ;; *) continue ;; esac
    name=$(basename "$b" .py)
    run "${name#bench_}" 420 python3 "$b" --out "$out"
  done
fi
if [ "$what" = lean ]; then
  only="floor,nbtools gpu bf16 rowwise"
  for n in "nbtools host" "nbtools host rowwise" "nbtools host bf16" "nbtools host bf16 rowwise" \
           "nbtools host bf16+bf16 state" "nbtools host bf16 rowwise+bf16 state"; do
    only="$only,$n,$n prefetch"
  done
  run step 580 python3 benchmarks/bench_step.py --own-floors --only "$only" --out "$out"
fi
if [ "$what" = disk ]; then
  dir=${DISK_DIR:-/tmp/nbtools-disk}
  case "${filter:-100m}" in
    100m)
      run disk100m/disk 580 python3 benchmarks/bench_disk.py --rows 100000000 --steps 96 \
        --rounds 5 --cache-gib 7 --host-compare --dir "$dir" --age-s 60 --also-ahead "" \
        --uniform-steps 32 --uniform-rounds 2 --out "$out/disk100m" ;;
    steady)
      run steady/disk 580 python3 benchmarks/bench_disk.py --rows 100000000 --steps 96 \
        --rounds 3 --cache-gib 7 --dir "$dir" --age-s 270 --age-copy --also-ahead "" \
        --uniform-steps 12 --uniform-rounds 1 --out "$out/steady" ;;
    tiers)   # a 10 GiB GPU cache above the 7 GiB RAM cache, against RAM alone, in one run
      run tiers/disk 580 env NBTOOLS_DISK_SPARE=0.25 python3 benchmarks/bench_disk.py \
        --rows 100000000 --steps 32 --rounds 2 --cache-gib 7 --gpu-cache-gib 10 --dir "$dir" \
        --age-s 90 --age-copy --also-ahead "" --uniform-rounds 0 --gpu-rounds 3 \
        --gpu-settle 300 \
        --out "$out/tiers" ;;
    sizes)   # the cache the 100M run has (7 GiB of 100M rows), scaled with the rows
      for rows in 1000000 10000000; do
        run "rows$rows/disk" 290 python3 benchmarks/bench_disk.py --rows $rows --steps 96 \
          --rounds 3 --cache-gib "$(python3 -c "print(round(7 * $rows / 1e8, 4))")" \
          --host-compare --dir "$dir" --age-s 30 --also-ahead "" --uniform-steps 12 \
          --uniform-rounds 1 --out "$out/rows$rows"
        rm -rf "$dir"
      done ;;
    colab)   # warm from the start: the GPU level's first steps, counts known, against cold
      for start in shares cold; do
        run "colab-$start/disk" 290 taskset -c 0,1 python3 benchmarks/bench_disk.py \
          --rows 20000000 --cache-gib 1.4 --gpu-cache-gib 2 --gpu-start $start --gpu-settle 0 \
          --gpu-rounds 1 --steps 182 --uniform-rounds 0 --also-ahead "" --dir "$dir" \
          --out "$out/colab-$start"
        rm -rf "$dir"
      done ;;
  esac
  rm -rf "$dir"
fi
python3 benchmarks/summarize.py "$out"
exit $status
