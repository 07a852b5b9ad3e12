import os

import pytest
import torch

from nbtools.devices import cuda_ok

# Without a GPU, Triton's interpreter runs the fused kernels on CPU tensors (tests/test_step.py):
# set before anything imports triton.
if not cuda_ok():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def devices():
    """Devices every behaviour test runs on: the CPU always, CUDA where there is one."""
    return ["cpu", "cuda"] if cuda_ok() else ["cpu"]


# Under pytest-xdist (scripts/test.sh): the longest tests start first, so that no worker is
# left with one of them at the end; lower runs earlier, files not named here keep their place.
FIRST = {"test_dashboard_browser.py": 0, "test_notebooks.py": 1, "test_distributed.py": 2,
         "test_cache.py": 3, "test_step.py": 4}
# Tests that must share a worker: the multi-process tests each pick a free port and start
# several processes, so they run one after another rather than beside each other.
GROUPS = {"test_distributed.py": "processes"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        group = GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: FIRST.get(item.path.name, len(FIRST)))     # stable
    if cuda_ok():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `bash benchmarks/gpu_suite.sh` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=devices())
def device(request):
    return torch.device(request.param)


@pytest.fixture
def slow_write_backs(monkeypatch):
    """Every write-back behind a step (RowStore.write_behind) held ~5 ms on its CUDA stream
    before it writes: work queued after it that read host rows without waiting or patching
    would read rows it has not written yet. (On the CPU write-backs run at once: no-op.)"""
    from nbtools import kernels
    put = kernels.put_rows

    def slow_put(*args, **kwargs):
        if args[0].is_cuda:
            torch.cuda._sleep(10_000_000)       # GPU cycles (~5 ms), on the current stream
        put(*args, **kwargs)
    monkeypatch.setattr(kernels, "put_rows", slow_put)


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
