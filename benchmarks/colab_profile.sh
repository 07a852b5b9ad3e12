#!/usr/bin/env bash
# The benchmarks as on Colab's free tier, beside the same runs unrestricted, in one call:
#   bash benchmarks/colab_profile.sh [--quick]
# "colab": 2 cores (taskset -c 0,1; COLAB_CORES=2,3 picks others: 0 and 1 may serve the
# machine's interrupts), a 12 GiB host budget (NBTOOLS_HOST_BUDGET) and a GPU capped at
# 15 GiB (NBTOOLS_GPU_CAP_GIB, through benchmarks/colab/sitecustomize.py, child processes too);
# "full": the machine as it is. Runs: the step (a host table and a GPU-placed one), word2vec
# (host and placement="auto", one epoch of CORPUS, default .scratch/offline/corpus.txt.zip, the
# first 5M tokens), a fresh 20M-row disk table whose GPU level is warmed from the stream's
# shares, its first 182 steps, training beside a checkpoint's copy to a slow mirror
# (bench_mirror.py: a 3 GB checkpoint copied at 100 MB/s, as to Drive), and a plain PinnedLoader
# loop over such a table with its GPU level against explicit read-ahead (bench_ahead.py), and what
# a read-ahead's dedup costs the step thread's host work beside it (bench_beside.py, CPU only).
# Results: $OUT (default artifacts/colab), one JSON folder per run, and a table of colab / full
# per figure at the end (benchmarks/colab/compare.py).
# --quick: the scripts' smoke sizes (any machine, a CPU included). Limits per run (seconds):
# DISK_S, STEP_S, WORD2VEC_S, MIRROR_S, AHEAD_S, BESIDE_S; DISK_ROUNDS (the RAM cache's rounds, default 4), WORD2VEC_TOKENS;
# STEP_ARGS: more bench_step.py flags (e.g. --backward-on-loop-thread).
# ONLY="disk step": these runs only; PROFILES="colab": that profile only.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/colab}
quick=${1:-}
mkdir -p "$out"
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi   # (this machine's; a GPU machine has its own)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=$(command -v python3 || command -v python)
corpus=${CORPUS:-.scratch/offline/corpus.txt.zip}
status=0

# one NAME LIMIT_S COMMAND...: run COMMAND as "full" and as "colab", output under $out/<profile>/NAME
one() {
  local name=$1 limit=$2 profile rc
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  for profile in ${PROFILES:-colab full}; do
    mkdir -p "$out/$profile"
    rm -rf /tmp/nbtools-colab-disk              # (a fresh disk table for each run)
    echo "=== $profile $name"
    if [ $profile = colab ]; then
      timeout "$limit" env NBTOOLS_HOST_BUDGET=12GiB NBTOOLS_GPU_CAP_GIB=15 \
        PYTHONPATH="$PWD/benchmarks/colab:$PYTHONPATH" taskset -c "${COLAB_CORES:-0,1}" "$@" --out "$out/$profile" \
        > "$out/$profile/$name.log" 2>&1
    else
      timeout "$limit" "$@" --out "$out/$profile" > "$out/$profile/$name.log" 2>&1
    fi
    rc=$?
    tail -4 "$out/$profile/$name.log"
    [ $rc = 0 ] || { echo "    exit $rc"; status=$rc; }
  done
}

# the disk runs at small sizes: --quick's runs, and the untimed twins that compile the kernels
small_disk=(benchmarks/bench_disk.py --rows 200000 --cache-gib 0.01 --gpu-cache-gib 0.02
  --gpu-start shares --gpu-settle 0 --gpu-rounds 1 --steps 5 --uniform-rounds 0 --also-ahead ""
  --dir /tmp/nbtools-colab-disk)
small_ahead=(benchmarks/bench_ahead.py --quick --gpu-cache-gib 1 --dir /tmp/nbtools-colab-disk)

if [ "$quick" = --quick ]; then
  one step 300 "$py" benchmarks/bench_step.py --quick
  one word2vec 300 "$py" benchmarks/bench_word2vec.py --quick --systems host,gpu
  one mirror 300 "$py" benchmarks/bench_mirror.py --quick
  one ahead 300 "$py" "${small_ahead[@]}"
  one disk 300 "$py" "${small_disk[@]}"
  one beside 300 "$py" benchmarks/bench_beside.py --quick
else
  gz=/tmp/nbtools-colab-corpus.txt.gz
  # (the corpus only where word2vec runs)
  if [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" word2vec "* ]]; then [ -f "$gz" ] || "$py" -c "import gzip, shutil, sys, zipfile
z = zipfile.ZipFile(sys.argv[1]); src = z.open(z.namelist()[0])
shutil.copyfileobj(src, gzip.open(sys.argv[2], 'wb'))" "$corpus" "$gz"; fi
  # Triton's kernels compiled before either profile runs, by the runs' small twins (untimed):
  # on a fresh machine each kernel compiles at its first launch, seconds each, and the
  # profile that ran first would pay for both (the kernels take no table or lookup size)
  echo "=== compiling the kernels (small runs, untimed)"
  for twin in "small_disk[@]" "small_ahead[@]"; do
    rm -rf /tmp/nbtools-colab-disk
    "$py" "${!twin}" --out "$out/compile" >> "$out/compile.log" 2>&1 || echo "    (failed: $out/compile.log)"
  done
  # the warm-start target's run first (each run stopped at its limit, in seconds)
  one disk "${DISK_S:-290}" "$py" benchmarks/bench_disk.py --rows 20000000 --cache-gib 1.4 \
    --gpu-cache-gib 2 --gpu-start shares --gpu-settle 0 --gpu-rounds 1 --steps 182 \
    --uniform-rounds 0 --rounds "${DISK_ROUNDS:-4}" --also-ahead "" --dir /tmp/nbtools-colab-disk
  one step "${STEP_S:-200}" "$py" benchmarks/bench_step.py --only "nbtools host,nbtools gpu" ${STEP_ARGS:-}
  one word2vec "${WORD2VEC_S:-200}" "$py" benchmarks/bench_word2vec.py --systems host,gpu \
    --epochs 1 --corpus "$gz" --max-tokens "${WORD2VEC_TOKENS:-5000000}"
  one mirror "${MIRROR_S:-150}" "$py" benchmarks/bench_mirror.py
  one ahead "${AHEAD_S:-200}" "$py" benchmarks/bench_ahead.py --gpu-cache-gib 2 --rounds 2 \
    --dir /tmp/nbtools-colab-disk
  one beside "${BESIDE_S:-120}" "$py" benchmarks/bench_beside.py
fi
rm -rf /tmp/nbtools-colab-disk
"$py" benchmarks/colab/compare.py "$out"
exit $status
