#!/usr/bin/env bash
# The README's test command: sets up .venv (scripts/setup.sh: the CPU build of torch, the package,
# its dev extras) on first use, then runs the whole suite; arguments go to pytest, e.g.
#   bash scripts/test.sh -m "not slow"        # the fast tests only
#   NBTOOLS_SKIP_BROWSER=1 bash scripts/test.sh   # without the dashboard's headless-Chromium test
# The browser test apt-installs Chromium (as root) the first time; tests/conftest.py starts that
# in the background when the run includes it. GPU machines: benchmarks/gpu_suite.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# One pytest-xdist worker per core; --dist loadgroup keeps tests that share state on one worker.
# (nproc would answer OMP_NUM_THREADS, 1, not the cores.)
workers=${NBTOOLS_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
exec python -m pytest -q -n "$workers" --dist loadgroup "$@"
