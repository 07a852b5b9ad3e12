#!/usr/bin/env python
"""Run a notebook's code cells in order, in one namespace, without Jupyter, and save it with
its outputs.

A machine with Python, torch and matplotlib is enough: no jupyter, nbclient, ipykernel or
nbformat (the notebook is read and written as nbformat v4 JSON). Each code cell's stdout and
stderr become stream outputs, its last expression (unless the line ends with ``;``) and every
``display(...)`` become rich outputs (``_repr_png_``, ``_repr_html_``, ``_repr_markdown_`` and
text), and matplotlib figures (Agg backend; ``plt.show()`` and any figure left open at the end
of a cell) become ``image/png`` outputs. IPython syntax a script cannot run is rewritten:
``%time``/``%%time`` time their statement, ``%matplotlib`` is dropped, ``%pip``/``!pip`` lines
are skipped (the install cell's job is done by running inside a checkout); any other
``%magic`` or ``!command`` line stops the run with the cell named.

Parameters are set as papermill does, but in place: ``--set SMOKE=False`` runs ``SMOKE = False``
right after the cell's own top-level assignment of ``SMOKE``, so everything the cell derives
from it follows. The sources saved are the notebook's own (its default setting stays); what was
set is printed as the first output of that cell and kept in ``metadata.nbtools``, with the run
("full" when the notebook's ``SMOKE`` ended False, else "smoke"), the GPU and its memory, the
date, the commit and the seconds taken.

When a cell raises, the run stops: the notebook is written up to that cell (the error as its
output) and the script exits with status 1 and a message naming the cell.

    python scripts/run_notebook.py notebooks/word2vec.ipynb -o artifacts/word2vec.ipynb
    python scripts/run_notebook.py notebooks/recommender.ipynb -o $OUT/recommender.ipynb \\
        --set SMOKE=False --set "DATA_PATH='.scratch/ml-100k/ml-100k.inter'"

Cells run with the notebook's folder as the working directory (``--cwd`` to change it).
"""
from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import datetime
import io
import json
import linecache
import os
import re
import subprocess
import sys
import time
import tokenize
import traceback
from pathlib import Path

STREAM_LIMIT = 200_000      # characters kept of one cell's stdout (or stderr): head and tail
FIGURE_DPI = 100            # a 14 x 3 in figure is ~50 KB at this resolution


class CellError(Exception):
    """A cell raised; ``args[0]`` names the cell."""


# --- IPython syntax ------------------------------------------------------------------------------

_SKIPPED_INSTALL = re.compile(r"^(%pip|!pip|!\s*python\s+-m\s+pip|%conda|!conda)\b")


def translate(source: str) -> str:
    """The cell's source as plain Python: IPython magics and shell lines rewritten or refused.

    >>> print(translate("%time x = f(1)"))
    _nbrun_time('x = f(1)')
    >>> print(translate("%%time\\ny = 2"))
    _nbrun_time('y = 2')
    >>> translate("%pip install foo\\nimport os")
    'pass  # skipped: %pip install foo\\nimport os'
    """
    lines = source.splitlines()
    if lines and lines[0].strip() == "%%time":
        return f"_nbrun_time({chr(10).join(lines[1:])!r})"
    out = []
    for line in lines:
        stripped = line.lstrip()
        indent = line[:len(line) - len(stripped)]
        if _SKIPPED_INSTALL.match(stripped):
            out.append(f"{indent}pass  # skipped: {stripped}")
        elif stripped.startswith("%time "):
            out.append(f"{indent}_nbrun_time({stripped[len('%time '):]!r})")
        elif stripped.startswith("%matplotlib"):
            out.append(f"{indent}pass  # skipped: {stripped}")
        elif stripped.startswith(("%", "!")):
            raise CellError(f"{stripped.split()[0]!r} is IPython syntax this runner does not "
                            f"run (it runs %time, %%time, %matplotlib and skips %pip): {stripped}")
        else:
            out.append(line)
    return "\n".join(out)


# --- outputs -------------------------------------------------------------------------------------

class Capture(io.TextIOBase):
    """A stream that keeps what a cell writes (as its stream output) and echoes it to the
    console, so that a long run shows progress."""

    def __init__(self, name: str, echo, outputs: list):
        self.name, self.echo, self.outputs = name, echo, outputs

    def writable(self) -> bool:
        return True

    def write(self, text) -> int:
        if not text:
            return 0
        if self.outputs and self.outputs[-1].get("output_type") == "stream" \
                and self.outputs[-1]["name"] == self.name:
            self.outputs[-1]["text"] += text
        else:
            self.outputs.append({"output_type": "stream", "name": self.name, "text": text})
        if self.echo is not None:
            self.echo.write(text)
        return len(text)

    def flush(self) -> None:
        if self.echo is not None:
            self.echo.flush()

    def isatty(self) -> bool:
        return False


def squash_carriage_returns(text: str) -> str:
    r"""What a terminal (or Jupyter) shows of text with ``\r`` progress updates: each line's
    last update.

    >>> squash_carriage_returns("10%\r50%\r100%\ndone\n")
    '100%\ndone\n'
    """
    lines = []
    for line in text.split("\n"):
        parts = [p for p in line.split("\r") if p]
        lines.append(parts[-1] if parts else "")
    return "\n".join(lines)


def _clip(text: str, limit: int = STREAM_LIMIT) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return (text[:half] + f"\n... [{len(text) - limit:,} characters left out] ...\n"
            + text[-half:])


def mime_bundle(obj) -> dict:
    """The outputs' ``data`` for an object, as Jupyter's display formatter would make it."""
    data = {}
    method = getattr(obj, "_repr_mimebundle_", None)
    if callable(method):
        try:
            got = method()
        except Exception:   # a repr that fails leaves the plain text
            got = None
        if isinstance(got, tuple):
            got = got[0]
        if isinstance(got, dict):
            data.update(got)
    for mime, name in (("text/html", "_repr_html_"), ("text/markdown", "_repr_markdown_"),
                       ("image/png", "_repr_png_"), ("image/svg+xml", "_repr_svg_")):
        method = getattr(obj, name, None)
        if mime not in data and callable(method) and not isinstance(obj, type):
            try:
                value = method()
            except Exception:
                value = None
            if value is not None:
                data[mime] = value
    if _is_figure(obj) and "image/png" not in data:
        data["image/png"] = _figure_png(obj)
    if isinstance(data.get("image/png"), (bytes, bytearray)):
        data["image/png"] = base64.b64encode(data["image/png"]).decode("ascii")
    data["text/plain"] = data.get("text/plain") or repr(obj)
    # a widget's view needs its kernel: keep only what a static page can show
    data.pop("application/vnd.jupyter.widget-view+json", None)
    return data


def _ends_with_semicolon(code: str) -> bool:
    """Whether the cell's last token (comments aside) is ``;``: IPython then shows no result.

    >>> _ends_with_semicolon("torch.manual_seed(0);   # same weights"), _ends_with_semicolon("x")
    (True, False)
    """
    last = None
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                            tokenize.DEDENT, tokenize.ENDMARKER):
            last = tok
    return last is not None and last.string == ";"


def _is_figure(obj) -> bool:
    return type(obj).__name__ == "Figure" and type(obj).__module__.startswith("matplotlib")


def _figure_png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


class Runner:
    """Runs the cells; ``outputs`` is the current cell's output list."""

    def __init__(self, echo: bool = True):
        self.echo = echo
        self.outputs: list = []
        self.namespace = {"__name__": "__main__", "__builtins__": __builtins__,
                          "display": self.display, "_nbrun_time": self._time}
        self._plt = None

    # what the notebook calls
    def display(self, *objs, raw: bool = False, **_ignored):
        for obj in objs:
            data = dict(obj) if raw and isinstance(obj, dict) else mime_bundle(obj)
            data.pop("application/vnd.jupyter.widget-view+json", None)
            if set(data) - {"text/plain"} or data.get("text/plain"):
                self.outputs.append({"output_type": "display_data", "data": data,
                                     "metadata": {}})
            if self.echo:
                print(data.get("text/plain", ""), file=sys.__stdout__, flush=True)

    def _time(self, code: str):
        """``%time``: run the statement in the namespace, print the wall time as IPython does."""
        t0, c0 = time.perf_counter(), time.process_time()
        tree = ast.parse(code)
        result = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
            exec(compile(tree, "<%time>", "exec"), self.namespace)
            result = eval(compile(last, "<%time>", "eval"), self.namespace)
        else:
            exec(compile(tree, "<%time>", "exec"), self.namespace)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"CPU times: total: {cpu:.2f} s\nWall time: {wall:.2f} s")
        return result

    def _matplotlib(self):
        """pyplot with the Agg backend and ``show`` capturing figures (once it is importable)."""
        if self._plt is None and "matplotlib.pyplot" in sys.modules:
            self._plt = sys.modules["matplotlib.pyplot"]

            def show(*args, **kwargs):     # a function, as pyplot's own (it reads its signature)
                self._show_figures()
            self._plt.show = show
        return self._plt

    def _show_figures(self):
        plt = self._plt
        for num in plt.get_fignums():
            fig = plt.figure(num)
            self.outputs.append({"output_type": "display_data", "metadata": {},
                                 "data": {"image/png": _figure_png(fig),
                                          "text/plain": repr(fig)}})
            plt.close(fig)

    # one cell
    def run_cell(self, source: str, filename: str) -> list:
        self.outputs = []
        code = translate(source)
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        tree = ast.parse(code, filename)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(code):
            last = ast.Expression(tree.body.pop().value)
        out = Capture("stdout", sys.__stdout__ if self.echo else None, self.outputs)
        err = Capture("stderr", sys.__stderr__ if self.echo else None, self.outputs)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            self._matplotlib()
            try:
                exec(compile(tree, filename, "exec"), self.namespace)
                if last is not None:
                    value = eval(compile(last, filename, "eval"), self.namespace)
                    if value is not None:
                        self.outputs.append({"output_type": "execute_result", "metadata": {},
                                             "data": mime_bundle(value)})
                        self.namespace["_"] = value
                if self._matplotlib() is not None:
                    self._show_figures()            # what Jupyter's inline backend shows
            finally:
                out.flush()
                err.flush()
        for o in self.outputs:
            if o["output_type"] == "stream":
                o["text"] = _clip(squash_carriage_returns(o["text"]))
        return self.outputs


# --- parameters ----------------------------------------------------------------------------------

def parse_sets(pairs) -> dict:
    """``["SMOKE=False", "SIZE='full'"]`` -> ``{"SMOKE": "False", "SIZE": "'full'"}`` (each value
    Python source, checked to parse)."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise SystemExit(f"--set {pair!r}: expected NAME=PYTHON_EXPRESSION, e.g. "
                             "--set SMOKE=False or --set \"SIZE='full'\"")
        try:
            ast.parse(value, mode="eval")
        except SyntaxError as e:
            raise SystemExit(f"--set {pair!r}: the value is not a Python expression ({e.msg}); "
                             "quote strings: --set \"SIZE='full'\"") from None
        out[name] = value.strip()
    return out


def inject(source: str, sets: dict) -> tuple[str, list]:
    """The source with ``NAME = value`` inserted after the top-level assignment of each name it
    makes; and the names it set.

    >>> inject("A = 1\\nB = A + 1", {"A": "5"})
    ('A = 1\\nA = 5\\nB = A + 1', ['A'])
    """
    try:
        tree = ast.parse(translate(source))
    except (SyntaxError, CellError):
        return source, []
    lines = source.splitlines()
    after: dict[int, list] = {}
    done = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            if isinstance(target, ast.Name) and target.id in sets and target.id not in done:
                after.setdefault(node.end_lineno, []).append(f"{target.id} = {sets[target.id]}")
                done.append(target.id)
    if not done:
        return source, []
    out = []
    for i, line in enumerate(lines, start=1):
        out.append(line)
        out.extend(after.get(i, []))
    return "\n".join(out), done


# --- the notebook --------------------------------------------------------------------------------

def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text: str) -> list:
    return text.splitlines(True)


def _commit(root: Path) -> str | None:
    if os.environ.get("NBTOOLS_COMMIT"):
        return os.environ["NBTOOLS_COMMIT"]
    try:
        got = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return got.stdout.strip() or None if got.returncode == 0 else None


def _gpu() -> dict:
    """The GPU the run used (by nbtools' own device helper), or none."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {"gpu": None, "gpu_memory_gib": None}
    try:
        from nbtools.devices import cuda_ok
        if not cuda_ok():
            return {"gpu": None, "gpu_memory_gib": None}
        props = torch.cuda.get_device_properties(0)
        return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    except Exception as e:      # metadata only: a failed query never fails the run
        return {"gpu": None, "gpu_memory_gib": None, "gpu_error": repr(e)}


def _for_json(outputs: list, count: int) -> list:
    saved = []
    for o in outputs:
        o = dict(o)
        if o["output_type"] == "stream":
            if not o["text"]:
                continue
            o["text"] = _lines(o["text"])
        elif o["output_type"] in ("display_data", "execute_result"):
            o["data"] = {k: (_lines(v) if isinstance(v, str) and k.startswith("text/") else v)
                         for k, v in o["data"].items()}
            if o["output_type"] == "execute_result":
                o["execution_count"] = count
        saved.append(o)
    return saved


def run(path: Path, out_path: Path, sets: dict, *, cwd: Path | None = None,
        echo: bool = True, label: str | None = None) -> dict:
    """Run ``path``'s code cells, write the executed notebook to ``out_path``; return its
    ``metadata.nbtools``. Raises CellError (after writing) when a cell raised."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    if nb.get("nbformat") != 4:
        raise SystemExit(f"{path}: nbformat {nb.get('nbformat')}, expected 4")
    runner = Runner(echo=echo)
    root = Path(__file__).resolve().parent.parent
    unset = dict(sets)
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.perf_counter()
    failure = None
    cwd = Path(cwd or Path(path).parent).resolve()
    old_cwd = os.getcwd()
    os.environ.setdefault("MPLBACKEND", "Agg")
    if os.environ["MPLBACKEND"].startswith("module://"):   # an inline backend needs a kernel
        os.environ["MPLBACKEND"] = "Agg"
    code_cells = [c for c in nb["cells"] if c.get("cell_type") == "code"]
    for cell in code_cells:
        cell["outputs"], cell["execution_count"] = [], None
    os.chdir(cwd)
    try:
        for count, cell in enumerate(code_cells, start=1):
            index = nb["cells"].index(cell)
            source, done = inject(_source(cell), unset)
            for name in done:
                unset.pop(name)
            what = f"cell {index} (code cell {count})"
            if echo:
                print(f"--- {Path(path).name}: {what}", file=sys.__stderr__, flush=True)
            notes = []
            if done:
                notes.append({"output_type": "stream", "name": "stdout", "text":
                              "set for this run: " + ", ".join(f"{n} = {sets[n]}" for n in done)
                              + "\n"})
            try:
                outputs = runner.run_cell(source, f"<{what}>")
                cell["outputs"] = _for_json(notes + outputs, count)
            except BaseException as e:   # KeyboardInterrupt too: the notebook is still written
                tb = traceback.format_exception(type(e), e, e.__traceback__)
                cell["outputs"] = _for_json(notes + runner.outputs, count) + [{
                    "output_type": "error", "ename": type(e).__name__, "evalue": str(e),
                    "traceback": [line.rstrip("\n") for line in tb]}]
                failure = CellError(f"{Path(path).name}: {what} raised {type(e).__name__}: {e}\n"
                                    f"--- its source:\n{_source(cell)}")
                cell["execution_count"] = count
                break
            cell["execution_count"] = count
    finally:
        os.chdir(old_cwd)
    if unset and failure is None:
        failure = CellError(f"{Path(path).name}: --set {', '.join(unset)}: no cell assigns "
                            f"{'it' if len(unset) == 1 else 'them'} at its top level")
    smoke = runner.namespace.get("SMOKE", True)
    meta = {"run": label or ("smoke" if smoke else "full"),
            "parameters": sets, **_gpu(),
            "date": started.isoformat(timespec="seconds"),
            "commit": _commit(root),
            "seconds": round(time.perf_counter() - t0, 1),
            "completed": failure is None}
    torch = sys.modules.get("torch")
    if torch is not None:
        meta["torch"] = torch.__version__
    nb.setdefault("metadata", {})["nbtools"] = meta
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n",
                   encoding="utf-8")          # as nbformat writes it
    tmp.replace(out_path)
    if failure is not None:
        raise failure
    return meta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("notebook", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True,
                    help="where to write the executed notebook (never the notebook itself "
                         "unless you mean it)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="NAME=EXPR",
                    help="set a configuration name, e.g. --set SMOKE=False --set \"SIZE='full'\"")
    ap.add_argument("--cwd", type=Path, help="working directory of the cells (default: the "
                    "notebook's folder)")
    ap.add_argument("--label", choices=("full", "smoke"),
                    help="metadata.nbtools.run (default: from the notebook's SMOKE)")
    ap.add_argument("--max-mb", type=float, default=5.0,
                    help="fail when the executed notebook is larger than this (default 5)")
    ap.add_argument("--quiet", action="store_true", help="do not echo the cells' outputs")
    args = ap.parse_args(argv)
    sets = parse_sets(args.sets)
    try:
        meta = run(args.notebook, args.output, sets, cwd=args.cwd, echo=not args.quiet,
                   label=args.label)
    except CellError as e:
        print(f"\nerror: {e}\n(the notebook up to that cell is in {args.output})",
              file=sys.stderr)
        return 1
    size = args.output.stat().st_size
    print(json.dumps({"notebook": args.notebook.name, "output": str(args.output),
                      "bytes": size, **meta}), flush=True)
    if size > args.max_mb * 2**20:
        print(f"error: {args.output} is {size / 2**20:.1f} MiB, more than --max-mb "
              f"{args.max_mb}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
