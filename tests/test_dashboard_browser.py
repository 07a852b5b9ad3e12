"""The dashboard notebook rendered in headless Chromium (wraps scripts/browser_test.sh).

Slow (~30-70 s: it executes two notebooks in a kernel and may apt-install chromium); CI can also
call the script directly. Skipped when chromium cannot be installed, or with NBTOOLS_SKIP_BROWSER=1.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NBTOOLS_SKIP_BROWSER") == "1",
                    reason="NBTOOLS_SKIP_BROWSER=1: the headless-Chromium test is skipped")
def test_dashboard_renders_in_headless_chromium():
    # Screenshots stay in artifacts/ (CI keeps them) unless ARTIFACTS says elsewhere.
    out = pathlib.Path(os.environ.get("ARTIFACTS", ROOT / "artifacts"))
    env = dict(os.environ, PYTHON=sys.executable, ARTIFACTS=str(out))
    r = subprocess.run(["bash", str(ROOT / "scripts" / "browser_test.sh")], env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "browser checks passed" in r.stdout
    for name in ("dashboard.png", "dashboard_page.png", "dashboard_widget.png"):
        png = (out / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000, name
