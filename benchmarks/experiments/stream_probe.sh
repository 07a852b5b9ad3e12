# A disk table's loop reads at 0.75-0.89x the lone probe on the GPU machine: calls of a
# step's size, eight at once back to back, with and without a thread holding the GIL.
set -u
P="python3 benchmarks/experiments/probe_lengths.py --dir ${DIR:-/tmp/nbp} --rows 20000000 --keep --depths 128 --rounds 3"
S="$P --concurrent 8 --stream 3"
$P --lengths 8192 --depths 64,128 --batches 1024,4096 2>&1 | tail -6
$S --lengths 1700 --batches 1024,2048,4096 2>&1 | tail -5
$S --lengths 1700 --batches 1024,2048,4096 --busy 1 2>&1 | tail -5
$S --lengths 1700 --batches 1024,2048 --busy 1 --switch-ms 0.5 2>&1 | tail -4
$S --lengths 5861 --batches 1024,8192 --busy 1 2>&1 | tail -4
$S --lengths 5861 --batches 1024,8192 2>&1 | tail -4
rm -rf "${DIR:-/tmp/nbp}"
