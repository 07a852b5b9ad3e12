#!/usr/bin/env bash
# No-regression check on the GPU machine, in one call: the lean step benchmark's systems and
# word2vec, this tree against an older one (a git worktree carried to the machine), each system
# run old then new so both see the same machine state. Prints new/old per figure.
#   git worktree add .scratch/old <commit>          # here, once; carry .scratch/old (and .scratch/w2v)
#   python3 ../shared/data/build_offline_corpus.py .scratch/w2vbuild && mkdir -p .scratch/w2v &&
#     gzip -c .scratch/w2vbuild/combined.txt > .scratch/w2v/corpus.txt.gz &&
#     cp -r .scratch/w2vbuild/eval .scratch/w2v/      # the word2vec corpus (~20 MB), here, once
#   bash benchmarks/regress.sh [.scratch/old] [systems]     # ARGS=--quick: small sizes (CPU)
#   REPEATS=3 bash benchmarks/regress.sh ...    # old and new alternated 3 times: medians
# Results: $OUT/regress/<old|new>-<system>/step.json (and -w2v/word2vec.json), two levels
# deep (the GPU machine's tool brings back no deeper); the table at the end.
set -u
old=${1:-.scratch/old}
out=${OUT:-artifacts/gpu}/regress
systems=${2:-"nbtools host,nbtools host prefetch,nbtools host bf16 rowwise,nbtools host bf16 rowwise prefetch,nbtools gpu bf16 rowwise"}
export PYTHONUNBUFFERED=1
new=$PWD
failed=0
IFS=, read -r -a names <<< "$systems"
for r in $(seq 1 "${REPEATS:-1}"); do      # REPEATS: old and new alternated, the median taken
  for s in "${names[@]}"; do
    for side in old new; do
      tree=$old; [ "$side" = new ] && tree=$new
      dir="$out/$side-${s// /_}"; [ "$r" -gt 1 ] && dir="$dir-$r"
      mkdir -p "$dir"
      (cd "$tree" && PYTHONPATH="$PWD:${SITE:-}" timeout 150 python3 benchmarks/bench_step.py ${ARGS:-} \
        --only "$s" --out "$(cd "$new" && realpath "$dir")" > "$(cd "$new" && realpath "$dir")/log" 2>&1) \
        || { echo "$side $s: failed (see $dir/log)"; failed=1; }
    done
  done
done
if [ -f .scratch/w2v/corpus.txt.gz ]; then
  for side in old new; do
    tree=$old; [ "$side" = new ] && tree=$new
    mkdir -p "$out/$side-w2v"
    dir=$(realpath "$out/$side-w2v")
    (cd "$tree" && PYTHONPATH="$PWD:${SITE:-}" timeout 200 python3 benchmarks/bench_word2vec.py \
      --corpus "$new/.scratch/w2v/corpus.txt.gz" --eval-dir "$new/.scratch/w2v/eval" \
      --systems host,gpu --epochs 1 --max-tokens 4000000 --out "$dir" > "$dir/log" 2>&1) \
      || { echo "$side word2vec: failed (see $dir/log)"; failed=1; }
  done
fi
python3 - "$out" <<'EOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
def figures(side):
    """figure -> its values, one per repeat (in the order run)."""
    got = {}
    for f in sorted(glob.glob(f"{out}/{side}-*/step.json"),
                    key=lambda f: (len(f), f)):           # (repeat 1's folder has no suffix)
        for k, v in json.load(open(f)).get("ms", {}).items():
            if isinstance(v, (int, float)):
                got.setdefault(k, []).append(v)
    w = f"{out}/{side}-w2v/word2vec.json"
    if os.path.exists(w):
        for name, r in json.load(open(w)).get("systems", {}).items():
            got[f"word2vec {name} (words/s)"] = [r["words_per_s"]]
    return got
old, new = figures("old"), figures("new")
print(f"{'figure':<60} {'old':>10} {'new':>10} {'new/old':>8}" +
      ("   (medians of the repeats; new/old: the median of each repeat's ratio)"
       if any(len(v) > 1 for v in old.values()) else ""))
for k in sorted(set(old) & set(new)):
    ratios = [b / a for a, b in zip(old[k], new[k])]
    print(f"{k:<60} {statistics.median(old[k]):>10.4g} {statistics.median(new[k]):>10.4g} "
          f"{statistics.median(ratios):>8.3f}")
EOF
exit $failed
