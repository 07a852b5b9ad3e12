#!/usr/bin/env bash
# The README's test command. On a fresh machine it sets itself up (a .venv with torch, the
# package and its dev extras), then runs the whole test suite; extra arguments go to pytest.
# GPU machines: use benchmarks/gpu_suite.sh instead (it keeps the machine's own torch).
set -euo pipefail
cd "$(dirname "$0")/.."

# The whole suite (no arguments: what CI runs) includes the headless-Chromium test of the
# dashboard (tests/test_dashboard_browser.py, through scripts/browser_test.sh), which may have
# to apt-install chromium and fetch the widget renderer: start that now, beside pip's set-up;
# the test waits for it. Its log: artifacts/browser_prepare.log.
prepare=
if [ $# -eq 0 ]; then
  mkdir -p artifacts
  bash scripts/browser_test.sh --prepare >artifacts/browser_prepare.log 2>&1 &
  prepare=$!
fi

# PYTHONDONTWRITEBYTECODE (set on these machines) would have every process (each xdist worker,
# notebook kernel and spawned rank) compile torch again, several times slower: Python compiles
# the modules the tests import once, and keeps them.
unset PYTHONDONTWRITEBYTECODE
# pip's find-links, index URLs and constraints (pip config list: its files and PIP_* variables),
# as uv's options, one a line.
pip_sources() {
  python3 -m pip config list 2>/dev/null | python3 -c '
import ast, sys
flags = {"find-links": "--find-links", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
seen = []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for v in ast.literal_eval(value).split() if flag and value else ():
        if (flag, v) not in seen:
            seen.append((flag, v))
for flag, v in seen:
    print(flag, v, sep="\n")'
}
# The set-up is skipped when this pyproject.toml was installed already (.venv/.nbtools-setup
# holds its hash; remove the file to force a new install).
setup="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.nbtools-setup 2>/dev/null)" != "$setup" ] ||
   ! .venv/bin/python -c "import nbtools, pytest, xdist" 2>/dev/null; then
  # A pinned torch: on these CPU machines torch==2.13.0 is a CPU build already on disk; an
  # unpinned requirement would pull a multi-GB CUDA build. Never replace a torch that is there.
  torch=(torch==2.13.0)
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then torch=(); fi

  # No byte-compiling at install (pip's --no-compile; uv's default): every file of torch,
  # triton and the rest took about 40 s on two cores; Python compiles what the tests import.
  packages=(pip "${torch[@]}" -e ".[dev]")
  [ -x .venv/bin/python ] || python3 -m venv --without-pip .venv
  if .venv/bin/python -m pip --version >/dev/null 2>&1; then
    pip=(.venv/bin/python -m pip)
  elif python3 -m pip --python "$(command -v python3)" --version >/dev/null 2>&1; then
    # A venv without ensurepip's own install of pip (~4 s of CPU: it byte-compiles pip); this
    # python's pip (22.3 or later: --python) installs pip into it with the rest.
    pip=(python3 -m pip --python .venv/bin/python)
  else
    python3 -m venv .venv          # (over the venv made above: adds ensurepip's pip)
    pip=(.venv/bin/python -m pip)
  fi
  # uv installs the same packages as pip at the same versions, several times faster: pip took
  # ~60 s on a fresh 2-core machine (one package at a time: the index pages, 285 MB of triton,
  # then 2 GB of files unpacked), uv ~15 s (in parallel), plus ~4 s to pip-install uv itself.
  # uv does not read pip's configuration: it is given pip's find-links (where the CPU build of
  # torch lies), indexes and constraints. Any failure falls back to pip.
  uv=$(command -v uv || true)
  if [ -z "$uv" ] && { [ -x .venv/bin/uv ] || "${pip[@]}" install -q uv; }; then uv=.venv/bin/uv; fi
  mapfile -t sources < <(pip_sources)
  if [ -z "$uv" ] ||
     ! "$uv" pip install -q --python .venv/bin/python "${sources[@]}" "${packages[@]}"; then
    "${pip[@]}" install -q --no-compile "${packages[@]}"
  fi
  echo "$setup" >.venv/.nbtools-setup
fi
. .venv/bin/activate

# One torch thread unless told otherwise: the tests' tensors are small, and on a machine of two
# shared cores several threads per process (and per notebook kernel) made them many times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# One pytest-xdist worker per core (-n 0 in the arguments: none). --dist loadgroup keeps tests
# that share something (tests/conftest.py: xdist_group) on one worker; the slowest start first.
# Only the fast tests: bash scripts/test.sh -m "not slow"
# (nproc would answer OMP_NUM_THREADS, 1, not the cores.)
status=0
python -m pytest -q -n "${NBTOOLS_TEST_WORKERS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}" \
  --dist loadgroup "$@" || status=$?
if [ -n "$prepare" ]; then wait "$prepare" || true; fi
exit "$status"
