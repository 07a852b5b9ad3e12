"""Where every thread of a benchmark spends its wall time: runs a script (as ``python SCRIPT
ARGS``) while a sampler thread looks at each thread's Python stack every ``--interval`` ms,
then prints, per thread, the share of samples in each function (own: the innermost frame;
total: anywhere on the stack) and the innermost nbtools frames. cProfile sees one thread; a
disk table's step also runs a read-ahead thread, loader threads and a write-back thread, and on
a 2-core machine they compete with the step for the cores.

    taskset -c 0,1 python benchmarks/sample_threads.py --out DIR/threads.txt -- \\
        benchmarks/bench_disk.py --rows 20000000 ...

Samples are of Python frames only: a thread inside a C call (a torch op, a read, a lock wait)
is counted at the Python line that made the call, so "waiting" shows as the line that waits.
"""
from __future__ import annotations

import argparse
import collections
import os
import runpy
import sys
import threading
import time


def short_path(path: str) -> str:
    """A source file's name as a key the same in any checkout: the path below the package
    it belongs to (nbtools/..., torch/...), else its base name."""
    if "/site-packages/" in path:
        return path.rsplit("/site-packages/", 1)[1]
    for mark in ("/nbtools/", "/benchmarks/", "/concurrent/"):
        if mark in path:
            return mark.strip("/") + "/" + path.rsplit(mark, 1)[1]
    return os.path.basename(path)


class Sampler:
    IDLE = ("concurrent/futures/thread.py:_worker", "threading.py:wait")

    def __init__(self, interval_s: float, within: str | None = None):
        self.interval = interval_s
        # count only while the main thread is in these functions, outermost first
        # ("gpu_cache_rounds/measure": measure called, at any depth, from gpu_cache_rounds)
        self.within = within
        self._path = within.split("/") if within else []
        self.idle = collections.Counter()
        self.own = collections.defaultdict(collections.Counter)      # thread -> frame -> n
        self.total = collections.defaultdict(collections.Counter)
        self.lines = collections.defaultdict(collections.Counter)
        self.samples = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    @staticmethod
    def _name(frame) -> str:
        return f"{short_path(frame.f_code.co_filename)}:{frame.f_code.co_name}"

    def _run(self):
        me, main = threading.get_ident(), threading.main_thread().ident
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            frames = sys._current_frames()
            if self._path and not self._inside(frames.get(main), self._path):
                continue
            self.windows += 1
            for ident, frame in frames.items():
                if ident == me:
                    continue
                thread = names.get(ident, "other")
                thread = thread.rsplit("_", 1)[0] if thread[-1:].isdigit() else thread
                self.samples[thread] += 1
                if self._name(frame) in self.IDLE:
                    self.idle[thread] += 1
                    continue
                self.own[thread][self._name(frame)] += 1
                self.lines[thread][f"{self._name(frame)}:{frame.f_lineno}"] += 1
                seen = set()
                f = frame
                while f is not None:
                    n = self._name(f)
                    if n not in seen:
                        seen.add(n)
                        self.total[thread][n] += 1
                    f = f.f_back

    windows = 0

    @staticmethod
    def _inside(frame, path: list[str]) -> bool:
        """Whether the stack ending at ``frame`` calls ``path``'s functions in its order,
        outermost first (others may come between)."""
        want = len(path) - 1                # matched from the innermost frame outwards
        while frame is not None and want >= 0:
            if frame.f_code.co_name == path[want]:
                want -= 1
            frame = frame.f_back
        return want < 0

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join()

    def report(self, top: int) -> str:
        out = []
        out.append(f"{self.windows} sampling moments" +
                   (f" inside {self.within}" if self.within else ""))
        for thread, n in self.samples.most_common():
            busy = n - self.idle[thread]
            out.append(f"== {thread}: {n} samples (thread-moments), {busy / max(self.windows, 1):.2f}"
                       f" threads busy on average, waiting (for work, a future or a lock) {self.idle[thread] / n:.1%}")
            n = max(busy, 1)
            out.append("   shares of busy samples:")
            out.append("   own:")
            out += [f"   {c / n:6.1%}  {k}" for k, c in self.own[thread].most_common(top)]
            out.append("   own, by line:")
            out += [f"   {c / n:6.1%}  {k}" for k, c in self.lines[thread].most_common(top)]
            out.append("   total (on the stack):")
            out += [f"   {c / n:6.1%}  {k}" for k, c in self.total[thread].most_common(top)]
        return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=2.0, help="ms between samples")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--within", default=None, help="count only while the main thread is in "
                    "this function (e.g. run_steps), or in a path of them, outermost first "
                    "(gpu_cache_rounds/measure: bench_disk.py's GPU-level loops, not its warming)")
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sampler = Sampler(args.interval / 1e3, args.within)
    sys.argv = [args.script] + args.args
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    sampler.start()
    t0 = time.perf_counter()
    try:
        runpy.run_path(args.script, run_name="__main__")
    finally:
        sampler.stop()
        text = f"sampled {time.perf_counter() - t0:.1f} s every {args.interval} ms\n" + \
            sampler.report(args.top)
        print(text)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
            with open(args.out, "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
