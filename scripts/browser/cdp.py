"""A tiny Chrome DevTools Protocol client over ``--remote-debugging-pipe``: no Playwright, no
websocket package, nothing to download. Chromium reads commands on fd 3 and writes replies on
fd 4, each a JSON message ended by a NUL byte.

    python scripts/browser/cdp.py page.html out.png [--selector .nbtools-dashboard]

screenshots one element (or the whole page) of a local HTML file, e.g. the static snapshot that
``benchmarks/bench_dashboard.py`` writes on the GPU machine (``dashboard.html``) for the README.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
         "--disable-dev-shm-usage", "--remote-debugging-pipe",
         # prove the page needs no internet: every name but localhost fails at once
         "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """Headless Chromium driven over a pipe. ``with Browser() as b: page = b.open(url)``."""

    def __init__(self, executable: str | None = None, timeout_s: float = 60.0):
        exe = executable or find_chromium()
        if exe is None:
            raise FileNotFoundError("no chromium found (apt-get install chromium)")
        self.timeout_s = timeout_s
        self.profile = tempfile.mkdtemp(prefix="nbtools-chromium-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def fds():   # the child reads commands on fd 3 and writes replies on fd 4
            r, w = os.dup(to_chrome_r), os.dup(from_chrome_w)   # out of the way of 3 and 4
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            preexec_fn=fds, close_fds=False,   # close_fds would close 3 and 4 after fds()
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.profile, "stderr.log"), "w"))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)
        raise TimeoutError(f"no reply to {method} in {self.timeout_s} s")

    def _read(self) -> dict:
        while b"\0" not in self._buf:
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the debugging pipe (did it crash?)")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def open(self, url: str, width: int = 1100, height: int = 900) -> "Page":
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.send("Runtime.enable")
        page.send("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        page.send("Page.navigate", {"url": url})
        return page

    def close(self):
        try:
            self.send("Browser.close")
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Page:
    def __init__(self, browser: Browser, session: str):
        self.browser, self.session = browser, session

    def send(self, method, params=None):
        return self.browser.send(method, params, self.session)

    def eval(self, expression: str):
        r = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"page script failed: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0, what: str = ""):
        """Poll a JS expression until it is truthy; returns its value (or the last one)."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.2)
        return value

    def errors(self) -> list[str]:
        """Exceptions the page's scripts threw (from Runtime.exceptionThrown events)."""
        out = []
        for e in self.browser.events:
            if e.get("method") == "Runtime.exceptionThrown" and e.get("sessionId") == self.session:
                d = e["params"]["exceptionDetails"]
                out.append(d.get("exception", {}).get("description") or d.get("text", ""))
        return out

    def screenshot(self, path, selector: str | None = None, pad: int = 8) -> dict:
        """PNG of the element matching ``selector`` (or the whole page); returns its box."""
        if selector:
            box = self.eval(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
                if (!e) return null; e.scrollIntoView(); const r = e.getBoundingClientRect();
                return {{x: r.left + window.scrollX, y: r.top + window.scrollY,
                        width: r.width, height: r.height}}; }})()""")
            if not box:
                raise LookupError(f"nothing on the page matches {selector!r}")
            clip = {"x": max(0, box["x"] - pad), "y": max(0, box["y"] - pad),
                    "width": box["width"] + 2 * pad, "height": box["height"] + 2 * pad, "scale": 1}
        else:
            size = self.eval("({w: document.documentElement.scrollWidth,"
                             " h: document.documentElement.scrollHeight})")
            clip = {"x": 0, "y": 0, "width": size["w"], "height": size["h"], "scale": 1}
        png = self.send("Page.captureScreenshot", {"format": "png", "clip": clip,
                                                   "captureBeyondViewport": True})["data"]
        pathlib.Path(path).write_bytes(base64.b64decode(png))
        return clip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--selector", default=".nbtools-dashboard")
    ap.add_argument("--width", type=int, default=1000)
    args = ap.parse_args(argv)
    url = pathlib.Path(args.html).resolve().as_uri()
    with Browser() as b:
        page = b.open(url, width=args.width)
        if not page.wait_for(f"!!document.querySelector({json.dumps(args.selector)})", 20):
            sys.exit(f"{args.selector!r} not found in {args.html}")
        page.wait_for("[...document.images].every(i => i.complete)", 10)
        page.screenshot(args.png, args.selector or None)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
