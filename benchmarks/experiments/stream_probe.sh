# A disk table's loop reads at 0.75-0.89x the lone probe on the GPU machine: does the disk
# serve a loop's pattern (calls of a step's size, eight at once back to back, appends beside
# them) at the probe's rate, and what does a thread holding the GIL cost it? (Session 17, GPU
# machine: 8 streams 1.05-1.1x the lone probe, 0.94x of that with appends; a thread running
# Python cost them 0.85x with 1,024 requests a lio_listio, nothing at a 0.5 ms switch
# interval, but the table's own loop at 0.5 ms was no faster than at 5: benchmarks/RESULTS.md.)
#   bash benchmarks/experiments/stream_probe.sh      # ~3 minutes
set -u
P="python3 benchmarks/experiments/probe_lengths.py --dir ${DIR:-/tmp/nbp} --rows 20000000 --keep --depths 128 --rounds 3"
S="$P --concurrent 8 --stream 3"
$P --lengths 8192 --depths 64,128 --batches 1024,4096 2>&1 | tail -6
$S --lengths 1700 --batches 1024,2048,4096 2>&1 | tail -5
$S --lengths 1700 --batches 1024,2048,4096 --busy 1 2>&1 | tail -5
$S --lengths 1700 --batches 1024,2048 --busy 1 --switch-ms 0.5 2>&1 | tail -4
$S --lengths 5861 --batches 1024,8192 --busy 1 2>&1 | tail -4
$S --lengths 5861 --batches 1024,8192 2>&1 | tail -4
# a loop's pipeline, no table code: step k waits for its call, runs Python, issues k + 8's
$S --lengths 1700 --batches 1024,2048 --paced-ms 0 2>&1 | tail -4
$S --lengths 1700 --batches 1024,2048 --paced-ms 12 2>&1 | tail -4
$S --lengths 1700 --batches 1024 --paced-ms 12 --switch-ms 0.5 2>&1 | tail -3
rm -rf "${DIR:-/tmp/nbp}"
