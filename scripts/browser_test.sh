#!/usr/bin/env bash
# Browser test of the dashboard: execute notebooks/dashboard.ipynb (and a live-widget notebook)
# in a real Jupyter kernel, export them to HTML with the ipywidgets HTML manager served from
# localhost, render them in headless Chromium (driven over the DevTools pipe, no Playwright),
# check that the badges and the plot images are on the page, and save screenshots:
#   artifacts/dashboard.png         the dashboard (static snapshot)
#   artifacts/dashboard_page.png    the whole notebook page
#   artifacts/dashboard_widget.png  a dashboard kept as a live widget
#
#   bash scripts/browser_test.sh [--docs]     # --docs also copies the shot to docs/dashboard.png
#   bash scripts/browser_test.sh --prepare    # only the apt installs (chromium, npm), no test
#
# Installs what it needs: Debian's chromium (apt), the Python packages (pip, into the current
# python), and two npm packages (@jupyter-widgets/html-manager, requirejs) into a cache folder.
# tests/conftest.py runs --prepare in the background while the other tests run; a run waits for a
# preparation under way (a lock in the cache folder) rather than starting a second apt-get.
# Needs no internet at test time: Chromium resolves no name but localhost.
# Exit status: 0 passed (or prepared), 1 failed, 77 skipped (chromium could not be installed).
# Environment: PYTHON (default: python3), ARTIFACTS (default: artifacts), NBTOOLS_BROWSER_CACHE.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-python3}
art=${ARTIFACTS:-$root/artifacts}
cache=${NBTOOLS_BROWSER_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/nbtools-browser}
docs_arg=()
prepare=
[ "${1:-}" = --docs ] && docs_arg=(--docs "$root/docs/dashboard.png")
[ "${1:-}" = --prepare ] && prepare=1
start=$(date +%s)
mkdir -p "$cache"
if command -v flock >/dev/null; then     # one installer at a time; released before the test
  exec 9>"$cache/.lock"
  flock 9
fi

as_root() {   # run as root: directly, or through passwordless sudo
  if [ "$(id -u)" = 0 ]; then "$@"; elif sudo -n true 2>/dev/null; then sudo "$@"; else return 1; fi
}
apt_install() {
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. Chromium (Debian package)
chromium=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium" ]; then
  echo "browser_test: installing chromium (apt)"
  apt_install chromium || true
  chromium=$(command -v chromium || true)
fi
if [ -z "$chromium" ]; then
  echo "browser_test: SKIP: chromium is not installed and could not be installed with apt-get (needs root or passwordless sudo)"
  exit 77
fi

# (the widget renderer's version follows the ipywidgets that pip is still installing: npm only)
if [ -n "$prepare" ]; then
  if ! ls "$cache"/html-manager-*/embed-amd.js >/dev/null 2>&1 && ! command -v npm >/dev/null; then
    echo "browser_test: installing npm (apt)"
    apt_install npm || echo "browser_test: npm could not be installed"
  fi
  echo "browser_test: prepared in $(( $(date +%s) - start )) s"
  exit 0
fi

# 2. Python packages for executing and exporting the notebooks
if ! "$py" -c "import nbclient, nbformat, nbconvert, ipykernel, ipywidgets, matplotlib, psutil" 2>/dev/null; then
  echo "browser_test: installing Python packages (pip)"
  "$py" -m pip install -q nbclient nbformat nbconvert ipykernel ipywidgets matplotlib psutil
fi

# 3. The widget renderer nbconvert's HTML would load from a CDN, from the npm registry instead.
#    Its major version follows ipywidgets': html-manager 1.x renders ipywidgets 8 state, 0.20.x 7.
widgets_major=$("$py" -c "import ipywidgets; print(ipywidgets.__version__.split('.')[0])")
if [ "$widgets_major" -ge 8 ]; then manager=1.0.15; else manager=0.20.9; fi
static="$cache/html-manager-$manager"
if [ ! -s "$static/embed-amd.js" ] || [ ! -s "$static/require.js" ]; then
  if ! command -v npm >/dev/null; then
    echo "browser_test: installing npm (apt)"
    apt_install npm || { echo "browser_test: npm is needed to fetch the widget renderer"; exit 1; }
  fi
  echo "browser_test: fetching @jupyter-widgets/html-manager@$manager and requirejs (npm)"
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "@jupyter-widgets/html-manager@$manager" requirejs@2.3.8 >/dev/null)
  mkdir -p "$static"
  tar -xzf "$tmp"/jupyter-widgets-html-manager-*.tgz -C "$tmp" package/dist/embed-amd.js
  cp "$tmp/package/dist/embed-amd.js" "$static/"
  tar -xzf "$tmp"/requirejs-*.tgz -C "$tmp" package/require.js
  cp "$tmp/package/require.js" "$static/"
  rm -rf "$tmp"
fi

exec 9>&-                                 # the lock (other runs may install now)

# 4. Execute, render, check, screenshot
mkdir -p "$art"
"$py" scripts/browser/check_notebook.py --static "$static" --out "$art" "${docs_arg[@]}"
echo "browser_test: done in $(( $(date +%s) - start )) s"
