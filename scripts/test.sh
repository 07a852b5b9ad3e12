#!/usr/bin/env bash
# The README's test command. On a fresh machine it sets itself up (a .venv with torch, the
# package and its dev extras), then runs the whole test suite; extra arguments go to pytest.
# GPU machines: use benchmarks/gpu_suite.sh instead (it keeps the machine's own torch).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
# A pinned torch: on these CPU machines torch==2.13.0 is a CPU build already on disk; an
# unpinned requirement would pull a multi-GB CUDA build. Never replace a torch that is there.
# --no-compile: pip would byte-compile every file of torch, triton and the rest (about 40 s of
# the set-up on two cores); Python compiles the modules the tests import instead, once, and
# keeps them: PYTHONDONTWRITEBYTECODE (set on these machines) would have every process (each
# xdist worker, notebook kernel and spawned rank) compile torch again, several times slower.
unset PYTHONDONTWRITEBYTECODE
if python -c "import torch" 2>/dev/null; then torch=(); else torch=(torch==2.13.0); fi
pip install -q --no-compile "${torch[@]}" -e ".[dev]"
# Includes the headless-Chromium test of the dashboard (tests/test_dashboard_browser.py runs
# scripts/browser_test.sh, which apt-installs chromium); screenshots land in artifacts/.
# One torch thread unless told otherwise: the tests' tensors are small, and on a machine of two
# shared cores several threads per process (and per notebook kernel) made them many times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# One pytest-xdist worker per core (-n 0 in the arguments: none). --dist loadgroup keeps tests
# that share something (tests/conftest.py: xdist_group) on one worker; the slowest start first.
# Only the fast tests: bash scripts/test.sh -m "not slow"
# (nproc would answer OMP_NUM_THREADS, 1, not the cores.)
python -m pytest -q -n "${NBTOOLS_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}" \
  --dist loadgroup "$@"
