# Sourced by scripts/test.sh and scripts/main.sh: a .venv with torch, the package and its dev
# extras, made once per version of pyproject.toml (.venv/.nbtools-setup holds its hash; delete
# the file to force a new install), then activated. Never replaces a torch that is installed.
unset PYTHONDONTWRITEBYTECODE   # let Python keep the bytecode it compiles (torch: seconds per process)
stamp="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ] || [ "$(cat .venv/.nbtools-setup 2>/dev/null)" != "$stamp" ] ||
   ! .venv/bin/python -c "import nbtools, pytest, xdist" 2>/dev/null; then
  [ -x .venv/bin/python ] || python3 -m venv --without-pip .venv
  # On these CPU machines torch==2.13.0 is a CPU build already on disk; an unpinned torch would
  # pull a multi-GB CUDA build.
  torch=(torch==2.13.0)
  if .venv/bin/python -c "import torch" 2>/dev/null; then torch=(); fi
  packages=(pip "${torch[@]}" -e ".[dev]")
  # uv installs the same versions several times faster than pip (parallel downloads); it does not
  # read pip's configuration, so pip's find-links and indexes are handed over. Else: pip.
  mapfile -t sources < <(python3 -m pip config list 2>/dev/null | python3 -c '
import ast, sys
flags = {"find-links": "--find-links", "index-url": "--index-url",
         "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
seen = set()
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for v in (ast.literal_eval(value).split() if flag and value else ()):
        if (flag, v) not in seen:
            seen.add((flag, v)); print(flag); print(v)')
  uv=$(command -v uv || true)
  if [ -z "$uv" ] && python3 -m pip install -q --target .venv/uv-tool uv >/dev/null 2>&1; then
    uv=.venv/uv-tool/bin/uv
  fi
  if [ -z "$uv" ] || ! "$uv" pip install -q --python .venv/bin/python "${sources[@]}" "${packages[@]}"; then
    [ -x .venv/bin/pip ] || python3 -m venv .venv                 # pip itself, then the rest
    .venv/bin/python -m pip install -q --no-compile "${packages[@]}"
  fi
  echo "$stamp" >.venv/.nbtools-setup
fi
. .venv/bin/activate
# One torch thread a process unless told otherwise: the tests' tensors are small, and several
# threads per process (and per notebook kernel) on two shared cores made them many times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
