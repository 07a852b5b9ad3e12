"""Execute the dashboard notebooks in a real kernel, render them in headless Chromium with a
locally served widget renderer, check what is on the page and save screenshots.

Called by ``scripts/browser_test.sh`` (which installs what this needs):

    python scripts/browser/check_notebook.py --static DIR --out artifacts

``DIR`` holds ``embed-amd.js`` (npm ``@jupyter-widgets/html-manager``) and ``require.js`` (npm
``requirejs``): nbconvert's HTML export would otherwise load them from a CDN.

Pages checked:
  dashboard.html    notebooks/dashboard.ipynb: the dashboard's static snapshot (badges, memory
                    bars, diagnosis, plot <img>), the bandwidth bars and the re-plotted history.
  live_widget.html  scripts/browser/live_widget.ipynb: dashboards kept as live widgets, drawn by
                    the ipywidgets HTML manager from the saved widget state (badges in an HTML
                    widget, the plot in an Image widget), one of them red after a failure.
Screenshots: dashboard.png (the dashboard), dashboard_page.png (whole page),
dashboard_widget.png (the live widget).
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import pathlib
import shutil
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import cdp  # noqa: E402

NOTEBOOKS = {"dashboard": ROOT / "notebooks" / "dashboard.ipynb",
             "live_widget": HERE / "live_widget.ipynb"}

# What each page must show; evaluated in the page, returns a dict of facts.
FACTS_JS = """(() => {
  const q = s => document.querySelectorAll(s);
  const img = e => e ? {w: e.naturalWidth, h: e.naturalHeight} : null;
  const snap = document.querySelector('.nbtools-dashboard:not(.widget-html *)');
  return {
    snapshot_badges: snap ? snap.querySelectorAll('.nbtools-badge').length : 0,
    snapshot_values: snap ? [...snap.querySelectorAll('.nbtools-value')].map(e => e.textContent) : [],
    snapshot_plot: img(snap && snap.querySelector('img.nbtools-plot')),
    snapshot_state: snap ? snap.className : '',
    bandwidth_bars: q('.nbtools-bandwidth .nbtools-bar').length,
    png_outputs: [...q('.jp-RenderedImage img')].filter(i => i.naturalWidth > 0).length,
    widget_badges: q('.widget-html .nbtools-badge').length,
    widget_plots: [...q('img.widget-image')].filter(i => i.naturalWidth > 100).length,
    widget_failed: q('.widget-html .nbtools-failed .nbtools-error').length,
    widget_errors: (document.body.innerText.match(/Error displaying widget[^\\n]*/g) || []),
    python_errors: q('.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"] pre').length
      ? [...q('.jp-OutputArea-output pre')].map(e => e.textContent).filter(t => /Traceback|Error:/.test(t)) : [],
  };
})()"""

CHECKS = {
    "dashboard": [
        ("the dashboard snapshot shows its 10 badges", lambda f: f["snapshot_badges"] >= 10),
        ("the snapshot's plot <img> is a decoded PNG",
         lambda f: (f["snapshot_plot"] or {}).get("w", 0) > 300),
        ("the dashboard finished (not red)", lambda f: "nbtools-finished" in f["snapshot_state"]),
        ("the bandwidth check shows 5 bars", lambda f: f["bandwidth_bars"] == 5),
        ("the re-plotted history is an image", lambda f: f["png_outputs"] >= 1),
        ("no Python errors in the outputs", lambda f: not f["python_errors"]),
    ],
    "live_widget": [
        ("the live widgets draw their badges", lambda f: f["widget_badges"] >= 20),
        ("the Image widgets show the plots", lambda f: f["widget_plots"] >= 2),
        ("the failed loop's widget is red and says why", lambda f: f["widget_failed"] == 1),
        ("no 'Error displaying widget'", lambda f: not f["widget_errors"]),
    ],
}
READY_JS = {
    "dashboard": "document.querySelectorAll('.nbtools-dashboard .nbtools-badge').length >= 10",
    "live_widget": "[...document.querySelectorAll('img.widget-image')].filter("
                   "i => i.naturalWidth > 100).length >= 2",
}


def execute(src: pathlib.Path, dst: pathlib.Path) -> float:
    import nbclient
    import nbformat
    nb = nbformat.read(src, as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env_path}" if env_path else str(ROOT)
    t0 = time.monotonic()
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(dst.parent)}})
    client.execute()   # raises CellExecutionError with the traceback if a cell fails
    nbformat.write(nb, dst)
    return time.monotonic() - t0


def export(executed: pathlib.Path, html_path: pathlib.Path, base_url: str) -> None:
    import nbformat
    from nbconvert import HTMLExporter
    ex = HTMLExporter(template_name="lab")
    ex.widget_renderer_url = f"{base_url}/_static/embed-amd.js"
    ex.require_js_url = f"{base_url}/_static/require.js"
    ex.mathjax_url = f"{base_url}/_static/no-mathjax.js"
    body, _ = ex.from_notebook_node(nbformat.read(executed, as_version=4))
    html_path.write_text(body, encoding="utf-8")


def serve(directory: pathlib.Path):
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="execute, render and check the dashboard notebooks")
    ap.add_argument("--static", required=True, help="folder with embed-amd.js and require.js")
    ap.add_argument("--out", default=str(ROOT / "artifacts"))
    ap.add_argument("--docs", help="also copy the dashboard screenshot here (docs/dashboard.png)")
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out).resolve()
    work = out / "browser"
    shutil.rmtree(work, ignore_errors=True)
    (work / "_static").mkdir(parents=True)
    for name in ("embed-amd.js", "require.js"):
        shutil.copy(pathlib.Path(args.static) / name, work / "_static" / name)
    (work / "_static" / "no-mathjax.js").write_text("/* no maths on these pages */\n")
    server, base = serve(work)
    failures = []
    try:
        for name, src in NOTEBOOKS.items():
            executed = work / f"{name}.ipynb"
            took = execute(src, executed)
            print(f"executed {src.relative_to(ROOT)} in {took:.1f} s")
            export(executed, work / f"{name}.html", base)
        with cdp.Browser() as browser:
            for name in NOTEBOOKS:
                page = browser.open(f"{base}/{name}.html", width=1000, height=900)
                page.wait_for(READY_JS[name], timeout_s=45)
                page.wait_for("[...document.images].every(i => i.complete)", timeout_s=10)
                time.sleep(0.5)   # let the layout settle before the screenshots
                facts = page.eval(FACTS_JS)
                (work / f"{name}.facts.json").write_text(json.dumps(facts, indent=1))
                for what, ok in CHECKS[name]:
                    good = bool(ok(facts))
                    print(f"  {'ok  ' if good else 'FAIL'} {name}: {what}")
                    if not good:
                        failures.append(f"{name}: {what}")
                js_errors = page.errors()
                if js_errors:
                    print(f"  note {name}: page script errors: {js_errors[:3]}")
                if name == "dashboard":
                    page.screenshot(out / "dashboard.png", ".nbtools-dashboard")
                    page.screenshot(out / "dashboard_page.png")
                else:
                    page.screenshot(out / "dashboard_widget.png", ".widget-vbox")
                if failures:
                    print(json.dumps(facts, indent=1))
    finally:
        server.shutdown()
    if args.docs and not failures:
        shutil.copy(out / "dashboard.png", args.docs)
    print(f"screenshots: {out / 'dashboard.png'}, {out / 'dashboard_page.png'}, "
          f"{out / 'dashboard_widget.png'}")
    if failures:
        print(f"{len(failures)} browser check(s) failed: " + "; ".join(failures))
        return 1
    print("browser checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
