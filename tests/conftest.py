import os

import pytest

# torch is imported where tests run: not in pytest-xdist's controlling process (scripts/test.sh),
# which runs none, and so starts its workers ~2 s sooner (pytest_configure).


def _skip_repeated_interpreter_patches():
    """Triton's interpreter patches triton.language for each kernel launch, and again at every
    call of a device function (a @triton.jit helper such as kernels._tile) inside it, though
    the launch has patched the same modules already: those repeats were ~20% of the CPU time of
    the tests that run the fused kernels (tests/test_cache.py, test_step.py). Skip the repeats
    only; each launch still patches and restores, and the kernels compute the same. Changes
    nothing where Triton's interpreter is not as described (checked on Triton 3.9)."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:                   # no triton: the fused kernels are not tested here
        return
    if not all(hasattr(ti, n) for n in ("_patch_lang", "GridExecutor", "InterpretedFunction",
                                         "_LangPatchScope", "tl")):
        return
    real_patch, real_launch = ti._patch_lang, ti.GridExecutor.__call__
    patched = [None]                     # the language modules this launch has patched

    def langs(fn):
        return {id(v) for v in fn.__globals__.values() if v is ti.tl or v is ti.tl.core}

    def patch_lang(fn):
        if patched[0] is not None and langs(fn) <= patched[0]:
            return ti._LangPatchScope()  # already patched by the launch around this call
        scope = real_patch(fn)
        if patched[0] is not None:
            patched[0] |= langs(fn)
        return scope

    def launch(self, *args, **kwargs):
        outer, patched[0] = patched[0], set()
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            patched[0] = outer

    ti._patch_lang, ti.GridExecutor.__call__ = patch_lang, launch


def _scan_a_slice_at_a_time():
    """Triton's interpreter runs a tl.associative_scan with a custom combine function (the
    segmented sum in nbtools' segment_sum) one element at a time: a Python call of the
    combine function per element of the tile, ~90% of the CPU time of the tests that run
    segment_sum. Here it calls the combine function once per position along the scanned axis,
    on the slice of every other axis at that position: each element still goes through the
    same combine calls on the same values in the same order (the combine functions are
    elementwise), so the results are the same bits (tests/test_interpreter_patches.py checks
    it against the interpreter's own scan). Changes nothing where the interpreter differs
    from the one described (checked on Triton 3.9)."""
    try:
        import numpy as np
        from triton.runtime import interpreter as ti
    except Exception:                   # no triton: the fused kernels are not tested here
        return
    scan = getattr(ti, "ScanOps", None)
    if scan is None or not all(hasattr(scan, n) for n in ("generic_scan", "to_tensor")):
        return
    real = scan.generic_scan

    def generic_scan(self, input):
        data = [arg.handle.data for arg in input]
        axis = self.axis
        if data[0].ndim < 2:            # nothing to gain over the element-wise loop
            return real(self, input)
        out = [np.empty_like(d) for d in data]

        def at(i):                      # every element at position i of the scanned axis
            return (slice(None),) * axis + (i,)
        for o, d in zip(out, data):
            o[at(0)] = d[at(0)]
        for i in range(1, data[0].shape[axis]):
            acc = [self.to_tensor(o[at(i - 1)], arg.dtype) for o, arg in zip(out, input)]
            new = [self.to_tensor(d[at(i)], arg.dtype) for d, arg in zip(data, input)]
            ret = self.combine_fn.fn(*acc, *new)
            for o, r in zip(out, ret if isinstance(ret, tuple) else (ret,)):
                o[at(i)] = r.handle.data if isinstance(r, ti.tl.core.tensor) else r
        return [self.to_tensor(o, arg.dtype) for o, arg in zip(out, input)]

    generic_scan.real = real
    scan.generic_scan = generic_scan


def _remember_interpreter_lookups():
    """Two lookups Triton's interpreter repeats with the same answer, ~15% of the CPU time of
    the tests that run the fused and cache kernels: the numpy dtype of a Triton type (a dict
    of 19 types built on every call, for every value of every operation) and, at every kernel
    launch, the builtins of triton.language that it patches (inspect.getmembers of each
    module). Both are remembered, the builtins as they are here, before any launch: the
    interpreter's own function skips those a launch left patched (Triton 3.9 leaves most of
    triton.language.core patched after a cache's kernels), this one patches them again with
    the same wrappers over the same builtins. tests/test_interpreter_patches.py checks the
    answers against the interpreter's own functions. Changes nothing where the interpreter
    differs from the one described (checked on Triton 3.9)."""
    try:
        from triton.runtime import interpreter as ti
    except Exception:                   # no triton: the fused kernels are not tested here
        return
    if not all(hasattr(ti, n) for n in ("_get_np_dtype", "_patch_builtin", "_patch_attr", "tl")):
        return
    import inspect
    if list(inspect.signature(ti._patch_builtin).parameters) != ["pkg", "builder", "scope"]:
        return
    real_dtype, real_builtins, dtypes = ti._get_np_dtype, ti._patch_builtin, {}
    tl = ti.tl                          # (nothing is patched yet: the originals)
    builtins = {pkg: [(name, member) for name, member in inspect.getmembers(pkg)
                      if tl.core.is_builtin(member)]
                for pkg in (tl, tl.core, tl.math, tl.core.tensor)}

    def get_np_dtype(tt_dtype):
        # a block's is its element's (block types are not hashable)
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return dtypes[key]
        except KeyError:
            dtypes[key] = real_dtype(key)
            return dtypes[key]
        except TypeError:               # not hashable
            return real_dtype(tt_dtype)

    def patch_builtin(pkg, builder, scope):
        if pkg not in builtins:
            return real_builtins(pkg, builder, scope)
        for name, member in builtins[pkg]:
            ti._patch_attr(pkg, name, member, builder, scope)

    get_np_dtype.real, patch_builtin.real = real_dtype, real_builtins
    ti._get_np_dtype, ti._patch_builtin = get_np_dtype, patch_builtin


def cuda_ok() -> bool:
    from nbtools.devices import cuda_ok
    return cuda_ok()


def devices():
    """Devices every behaviour test runs on: the CPU always, CUDA where there is one."""
    return ["cpu", "cuda"] if cuda_ok() else ["cpu"]


def _prepare_browser(config) -> None:
    """In the run's first process: where the run includes the dashboard's headless-Chromium
    test (tests/test_dashboard_browser.py), start its apt installs now, in the background, so
    they overlap the other tests (the test waits for them: a lock in its cache folder)."""
    import subprocess
    if hasattr(config, "workerinput") or os.environ.get("NBTOOLS_SKIP_BROWSER") == "1":
        return
    if "not slow" in (config.option.markexpr or "") or config.option.keyword:
        return
    args = [str(a) for a in config.args]
    if args and not any(a.rstrip("/").endswith("tests") or "browser" in a for a in args):
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(os.path.join(root, "artifacts"), exist_ok=True)
    log = open(os.path.join(root, "artifacts", "browser_prepare.log"), "w")
    config._nbtools_prepare = subprocess.Popen(
        ["bash", os.path.join(root, "scripts", "browser_test.sh"), "--prepare"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def pytest_unconfigure(config):
    job = getattr(config, "_nbtools_prepare", None)
    if job is not None:
        job.wait()


def pytest_configure(config):
    _prepare_browser(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return                  # pytest-xdist's controlling process: its workers run the tests
    # Without a GPU, Triton's interpreter runs the fused kernels on CPU tensors
    # (tests/test_step.py): set before anything imports triton (the tests' modules).
    if not cuda_ok():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _skip_repeated_interpreter_patches()
        _scan_a_slice_at_a_time()
        _remember_interpreter_lookups()

    class DeviceFixture:
        @pytest.fixture(params=devices())
        def device(self, request):
            import torch
            return torch.device(request.param)
    config.pluginmanager.register(DeviceFixture(), "nbtools-device-fixture")


# Under pytest-xdist (scripts/test.sh): the longest tests start first, so that no worker is
# left with one of them at the end; lower runs earlier, files not named here keep their place.
# (xdist hands out the groups of several tests (GROUPS) first, the largest first, then the
# other tests in this order.)
FIRST = {"test_dashboard_browser.py": 0, "test_notebooks.py": 1, "test_distributed.py": 2,
         "test_checkpoint_disk.py": 3, "test_checkpoint_faults.py": 4, "test_package.py": 5,
         "test_cache.py": 6, "test_step.py": 7}


def _same_params(nodeid: str) -> str:
    """The tests of a file with the same parameters (test_determinism: a case's tests share its
    uninterrupted run, trained once per process)."""
    path, _, name = nodeid.partition("::")
    return path + (name[name.index("["):] if "[" in name else "")


# Tests that share a pytest-xdist worker, by file: a group's tests run on one worker, one after
# another. The multi-process tests each pick a free port and start several processes, so they
# run one after another rather than beside each other; the notebooks share a Jupyter kernel.
GROUPS = {"test_distributed.py": lambda nodeid: "processes",
          "test_data_parallel.py": lambda nodeid: "processes",
          "test_train_distributed.py": lambda nodeid: "processes",
          "test_determinism.py": _same_params,
          "test_notebooks.py": lambda nodeid: "notebooks"}


def group_of(nodeid: str) -> str:
    """The unit of work of a test under --dist loadgroup: its group (GROUPS), or itself."""
    group = GROUPS.get(nodeid.partition("::")[0].rsplit("/", 1)[-1])
    return nodeid if group is None else group(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup by GROUPS. pytest-xdist's own loadgroup reads xdist_group marks in
    each worker and renames the test (a suffix), which pytest 9 ignores (a test's id is no
    longer its _nodeid): every test ran as its own unit. The scheduler, in the controlling
    process, sees only the tests' ids: these groups are rules on ids."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group_of(nodeid)
    return Groups(config, log)


def gpu_skip_reason(needed: int, found: int) -> str:
    """What a test that needs ``needed`` CUDA GPUs says where it finds ``found``."""
    if needed == 1:
        return "needs a CUDA GPU (bash benchmarks/gpu_suite.sh runs these tests where there is one)"
    return f"needs {needed} CUDA GPUs, found {found}"


def pytest_runtest_setup(item):
    """``@pytest.mark.kernels(family)``: the test checks what only ``family``'s Triton kernels
    do (late checks, step graphs, write-behind ride on the fused update): skipped on a device
    where they do not run (the CPU without Triton's interpreter, a GPU whose kernels cannot load,
    as tests/kernels/fake_p100.py makes one), on the test's ``device`` (else its module's
    ``DEVICE``, else CUDA)."""
    marker = item.get_closest_marker("kernels")
    if marker is None:
        return
    import torch
    from nbtools import kernels
    params = getattr(item, "callspec", None)
    where = params.params.get("device") if params else None
    where = where or getattr(item.module, "DEVICE", None) or "cuda"    # (a module's own device)
    device = torch.device(where)
    if device.type == "cuda" and not cuda_ok():
        return                  # (the gpu marker, or the device parameter, skips it already)
    family = marker.args[0] if marker.args else "update"
    if not kernels.usable_on(device, family):
        pytest.skip(f"needs the {family} kernels, which do not run on {device} here")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: FIRST.get(item.path.name, len(FIRST)))     # stable
    found = None
    for item in items:
        several = item.get_closest_marker("gpus")          # gpus(n): n CUDA GPUs of one host
        needed = several.args[0] if several else int("gpu" in item.keywords)
        if not needed:
            continue
        if found is None:                                  # asked once, only where a test needs
            import torch
            found = torch.cuda.device_count() if cuda_ok() else 0
        if found < needed:
            item.add_marker(pytest.mark.skip(reason=gpu_skip_reason(needed, found)))


@pytest.fixture
def slow_write_backs(monkeypatch):
    """Every write-back behind a step (WriteBehind.write_behind) held ~5 ms on its CUDA stream
    before it writes: work queued after it that read host rows without waiting or patching
    would read rows it has not written yet. (On the CPU write-backs run at once: no-op.)"""
    import torch

    from nbtools import kernels
    put = kernels.put_rows

    def slow_put(*args, **kwargs):
        if args[0].is_cuda:
            torch.cuda._sleep(10_000_000)       # GPU cycles (~5 ms), on the current stream
        put(*args, **kwargs)
    monkeypatch.setattr(kernels, "put_rows", slow_put)


@pytest.fixture
def slow_side_gathers(monkeypatch):
    """Every gather queued on a side stream (a prefetch's; lookups captured as CUDA graphs
    capture on one too) held ~5 ms on it before it reads. (On the CPU: no-op.)"""
    import torch

    from nbtools import kernels
    gather = kernels.gather_rows

    def slow_gather(*args, **kwargs):
        if args[0].is_cuda and torch.cuda.current_stream() != torch.cuda.default_stream():
            torch.cuda._sleep(10_000_000)       # GPU cycles (~5 ms), on the current stream
        return gather(*args, **kwargs)
    monkeypatch.setattr(kernels, "gather_rows", slow_gather)


@pytest.fixture
def file_server():
    """A local HTTP server for real gdown downloads: ``files`` maps paths (``"/a/b.txt"``) to
    the bytes served there; ``hits`` counts requests per path. Yields ``(base_url, files, hits)``."""
    import http.server
    import threading

    pytest.importorskip("gdown")

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            path = self.path.split("?")[0]
            srv.hits[path] = srv.hits.get(path, 0) + 1
            body = srv.files.get(path)
            code = 200 if body is not None else 404
            body = body if body is not None else b"<html><title>404 Not Found</title></html>"
            self.send_response(code)
            self.send_header("Content-Type", "application/octet-stream" if code == 200 else "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.files, srv.hits = {}, {}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.files, srv.hits
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def eval_server(file_server, monkeypatch):
    """The registry's word-vector evaluation sets ("ws353", "simlex999", "questions-words")
    served by ``file_server``: each entry's URL points there, and its hashes and size are those
    of the bytes served (the bundled samples' bytes). Yields ``(files, hits)``."""
    import dataclasses
    import hashlib

    from nbtools import data

    base, files, hits = file_server
    for name in ("ws353", "simlex999", "questions-words"):
        entry = data.REGISTRY[name]
        body = (data.SAMPLES_DIR / data.REGISTRY[f"{name}-sample"].filename).read_bytes()
        files[f"/gensim/{entry.filename}"] = body
        monkeypatch.setitem(data.REGISTRY, name, dataclasses.replace(
            entry, url=f"{base}/gensim/{entry.filename}", md5=hashlib.md5(body).hexdigest(),
            sha256=hashlib.sha256(body).hexdigest(), bytes=len(body)))
    yield files, hits
