"""nbtools.fileio's two I/O engines: glibc's AIO (one GIL-free lio_listio call per batch) and
Python threads. The threads engine is the reference: every request set must read and write
the same bytes through both."""
import os
import subprocess
import sys

import numpy as np
import pytest

from nbtools import fileio
from nbtools.fileio import RequestPool, _aio
from nbtools.rowfile import RowFile

needs_aio = pytest.mark.skipif(not _aio.ready(), reason=f"glibc's AIO unavailable: {_aio.why}")


def _requests(rng, n_blocks: int, k: int, block: int = 512):
    """k distinct random blocks of a file, in random order, each to its own buffer slot."""
    where = rng.permutation(n_blocks)[:k]
    return (np.arange(k) * block, np.full(k, block), where * block)


@needs_aio
@pytest.mark.parametrize("k", [2, 37, 5000])          # 5,000: more than one lio_listio batch
def test_aio_reads_and_writes_what_threads_do(tmp_path, k):
    rng = np.random.default_rng(k)
    path = tmp_path / "f"
    n = 6000
    data = rng.integers(0, 256, n * 512, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    try:
        boff, blen, foff = _requests(rng, n, k)
        got = {}
        for engine in ("threads", "aio"):
            pool = RequestPool(8, 0, "test", engine=engine)
            buf = np.zeros(k * 512, dtype=np.uint8)
            pool.run(fd, buf, boff, blen, foff, write=False)
            got[engine] = buf
            pool.close()
        want = np.concatenate([data[o:o + 512] for o in foff])
        assert np.array_equal(got["threads"], want)
        assert np.array_equal(got["aio"], want)
        # writes: new bytes through AIO land where the threads engine reads them back
        new = rng.integers(0, 256, k * 512, dtype=np.uint8)
        RequestPool(8, 0, "test", engine="aio").run(fd, new, boff, blen, foff, write=True)
        back = np.zeros_like(new)
        RequestPool(8, 0, "test", engine="threads").run(fd, back, boff, blen, foff, write=False)
        assert np.array_equal(back, new)
        untouched = np.setdiff1d(np.arange(n), foff // 512)[:50]
        now = np.frombuffer(path.read_bytes(), dtype=np.uint8).reshape(n, 512)
        assert np.array_equal(now[untouched], data.reshape(n, 512)[untouched])
    finally:
        os.close(fd)


@needs_aio
def test_aio_read_past_the_end_is_an_error_not_zeros(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = np.ones(8192, dtype=np.uint8)
        with pytest.raises(OSError, match="short read"):
            RequestPool(4, 0, "test", engine="aio").run(fd, buf, [0, 4096], [4096, 4096],
                                                         [0, 4096], write=False)
    finally:
        os.close(fd)


@needs_aio
def test_a_forked_child_falls_back_to_threads():
    code = ("import os, sys\nfrom nbtools.fileio import _aio\nassert _aio.ready()\n"
            "pid = os.fork()\nif pid == 0:\n    os._exit(0 if not _aio.ready() else 3)\n"
            "_, st = os.waitpid(pid, 0)\nsys.exit(os.waitstatus_to_exitcode(st))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_engine_choice_is_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="'uring'.*aio, threads"):
        RequestPool(4, 0, "test", engine="uring")
    monkeypatch.setenv("NBTOOLS_DISK_ENGINE", "threads")
    assert fileio.default_engine() == "threads"
    assert RequestPool(4, 0, "test").engine == "threads"
    monkeypatch.setenv("NBTOOLS_DISK_ENGINE", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        fileio.default_engine()


def test_rowfile_engines_agree(tmp_path):
    rng = np.random.default_rng(3)
    f = RowFile.create(tmp_path / "t.rows", 3000, 260, {"dtype": "uint8"})
    try:
        ids = np.unique(rng.integers(0, 3000, 900))
        rows = rng.integers(0, 256, (len(ids), 260), dtype=np.uint8)
        engines = ["threads"] + (["aio"] if _aio.ready() else [])
        for i, engine in enumerate(engines):
            f.engine = engine
            f.write(ids, rows if i == 0 else rows[::-1].copy())
            out = np.zeros_like(rows)
            for reader in engines:
                f.engine = reader
                f.read(ids, out)
                assert np.array_equal(out, rows if i == 0 else rows[::-1]), (engine, reader)
        with pytest.raises(ValueError, match="disk I/O engine"):
            f.engine = "mmap"
        assert f.engine in repr(f)
    finally:
        f.close()


@pytest.mark.skipif(not (sys.platform == "linux" and __import__("platform").libc_ver()[0] == "glibc"
                         and __import__("platform").machine() in ("x86_64", "aarch64")),
                    reason="glibc's AIO is used on 64-bit Linux with glibc only")
def test_aio_is_used_where_it_should_work():
    # a broken engine would otherwise fail its self-test and fall back to threads silently
    assert _aio.ready(), _aio.why
    assert fileio.default_engine() == ("threads" if os.environ.get("NBTOOLS_DISK_ENGINE") ==
                                       "threads" else "aio")
