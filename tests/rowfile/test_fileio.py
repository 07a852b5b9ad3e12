"""nbtools.rowfile.fileio's I/O engines: glibc's AIO (one GIL-free lio_listio call per batch), Linux's
native AIO (fileio.NativeAio: one io_submit and one io_getevents per call) and Python threads. The
threads engine is the reference: every request set must read and write the same bytes through
each."""
import os
import subprocess
import sys

import numpy as np
import pytest

from nbtools.rowfile import fileio
from nbtools.rowfile.fileio import RequestPool, glibc_aio, native_aio
from nbtools.rowfile import RowFile

needs_aio = pytest.mark.skipif(not glibc_aio.ready(),
                               reason=f"glibc's AIO unavailable: {glibc_aio.why}")
needs_kaio = pytest.mark.skipif(not native_aio.ready(),
                                reason=f"native AIO unavailable: {native_aio.why}")
ASYNC = [pytest.param("aio", marks=needs_aio), pytest.param("kaio", marks=needs_kaio)]


def _requests(rng, n_blocks: int, k: int, block: int = 512):
    """k distinct random blocks of a file, in random order, each to its own buffer slot."""
    where = rng.permutation(n_blocks)[:k]
    return (np.arange(k) * block, np.full(k, block), where * block)


def _random_file(tmp_path, rng, n_blocks: int):
    """A file of ``n_blocks`` random 512-byte blocks: its path and its bytes."""
    path = tmp_path / "f"
    data = rng.integers(0, 256, n_blocks * 512, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return path, data


@pytest.mark.parametrize("engine", ASYNC)
@pytest.mark.parametrize("k", [2, 37, 5000])   # 5,000: more than one lio_listio batch, or io_submit
def test_async_engines_read_and_write_what_threads_do(tmp_path, engine, k, monkeypatch):
    used = []                   # the engine itself ran the requests (no silent fallback)
    impl = {"aio": glibc_aio, "kaio": native_aio}[engine]
    run = impl.run
    monkeypatch.setattr(impl, "run", lambda *a, **kw: used.append(1) or run(*a, **kw))
    rng = np.random.default_rng(k)
    n = 6000
    path, data = _random_file(tmp_path, rng, n)
    fd = os.open(path, os.O_RDWR)
    try:
        boff, blen, foff = _requests(rng, n, k)
        got = {}
        for name in ("threads", engine):
            pool = RequestPool(8, 0, "test", engine=name)
            buf = np.zeros(k * 512, dtype=np.uint8)
            pool.run(fd, buf, boff, blen, foff, write=False)
            got[name] = buf
            pool.close()
        want = np.concatenate([data[o:o + 512] for o in foff])
        assert np.array_equal(got["threads"], want)
        assert np.array_equal(got[engine], want)
        # writes: new bytes through the engine land where the threads engine reads them back
        new = rng.integers(0, 256, k * 512, dtype=np.uint8)
        RequestPool(8, 0, "test", engine=engine).run(fd, new, boff, blen, foff, write=True)
        back = np.zeros_like(new)
        RequestPool(8, 0, "test", engine="threads").run(fd, back, boff, blen, foff, write=False)
        assert np.array_equal(back, new)
        assert len(used) >= 2
        untouched = np.setdiff1d(np.arange(n), foff // 512)[:50]
        now = np.frombuffer(path.read_bytes(), dtype=np.uint8).reshape(n, 512)
        assert np.array_equal(now[untouched], data.reshape(n, 512)[untouched])
    finally:
        os.close(fd)


@pytest.mark.parametrize("engine", ASYNC)
def test_a_read_past_the_end_is_an_error_not_zeros(tmp_path, engine):
    path = tmp_path / "f"
    path.write_bytes(bytes(4096))
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = np.ones(8192, dtype=np.uint8)
        with pytest.raises(OSError, match="short read"):
            RequestPool(4, 0, "test", engine=engine).run(fd, buf, [0, 4096], [4096, 4096],
                                                          [0, 4096], write=False)
    finally:
        os.close(fd)


@needs_aio
def test_a_forked_child_falls_back_to_threads():
    code = ("import os, sys\nfrom nbtools.rowfile.fileio import glibc_aio\n"
            "assert glibc_aio.ready()\npid = os.fork()\n"
            "if pid == 0:\n    os._exit(0 if not glibc_aio.ready() else 3)\n"
            "_, st = os.waitpid(pid, 0)\nsys.exit(os.waitstatus_to_exitcode(st))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_engine_choice_is_checked(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="'uring'.*aio, threads, kaio"):
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
        engines = ["threads"] + (["aio"] if glibc_aio.ready() else []) + \
            (["kaio"] if native_aio.ready() else [])
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
def test_aio_is_used_where_it_should_work(tmp_path):
    # a broken engine would otherwise fail its self-test and fall back to threads silently;
    # an O_DIRECT file takes Linux's native AIO where it works, a buffered one glibc's
    assert glibc_aio.ready(), glibc_aio.why
    forced = os.environ.get("NBTOOLS_DISK_ENGINE")
    assert fileio.default_engine(direct=False) == (forced or "aio")
    assert fileio.default_engine() == (forced or ("kaio" if native_aio.ready() else "aio"))
    for direct in (True, False):
        f = RowFile.create(tmp_path / f"{direct}.rows", 10, 260, {"dtype": "uint8"},
                           direct=direct)
        try:
            assert f.direct == direct or not direct
            assert f.engine == fileio.default_engine(direct=f.direct), (direct, f.direct)
        finally:
            f.close()


@needs_kaio
def test_native_aio_refusing_a_context_goes_on_with_another_engine(tmp_path, monkeypatch):
    """Where the kernel makes no native AIO context (fs.aio-max-nr reached), a pool on the
    "kaio" engine warns once and does the call, and the ones after it, with glibc's AIO (or
    threads): the same bytes, nothing lost."""
    import errno as E
    rng = np.random.default_rng(5)
    path, data = _random_file(tmp_path, rng, 300)
    real = native_aio.call
    monkeypatch.setattr(native_aio, "call", lambda name, *a: -E.EAGAIN if name == "io_setup"
                        else real(name, *a))
    native_aio.drop_context()                # this thread: none yet
    pool = RequestPool(8, 1 << 20, "test", engine="kaio")
    fd = os.open(path, os.O_RDWR)
    try:
        boff, blen, foff = _requests(rng, 300, 50)
        buf = np.zeros(50 * 512, dtype=np.uint8)
        with pytest.warns(RuntimeWarning, match="refused a context.*'(aio|threads)' engine"):
            pool.run(fd, buf, boff, blen, foff, write=False)
        assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
        assert pool.engine == ("aio" if glibc_aio.ready() else "threads")
        new = rng.integers(0, 256, 50 * 512, dtype=np.uint8)
        pool.run(fd, new, boff, blen, foff, write=True)
    finally:
        pool.close()
        os.close(fd)
    now = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    assert np.array_equal(np.concatenate([now[o:o + 512] for o in foff]), new)


class _PartialLio:
    """Stands in for glibc's lio_listio: does the I/O of every other request itself (as glibc's
    threads would, writing the outcome into the aiocb), leaves the rest unqueued (their error
    field untouched) and fails with EAGAIN, as glibc does when it cannot queue them all."""

    def __init__(self):
        self.calls = 0

    def __call__(self, mode, ptrs_addr, k, sig):
        import ctypes
        import errno
        self.calls += 1
        ptrs = np.frombuffer((ctypes.c_uint64 * k).from_address(ptrs_addr), dtype=np.uint64)
        size = fileio.AIOCB.itemsize
        cbs = np.frombuffer((ctypes.c_char * (k * size)).from_address(int(ptrs[0])),
                            dtype=fileio.AIOCB)
        for j in range(0, k, 2):
            cb = cbs[j]
            mv = memoryview((ctypes.c_char * int(cb["nbytes"])).from_address(int(cb["buf"])))
            if cb["op"] == fileio.LIO_WRITE:
                n = os.pwrite(int(cb["fd"]), mv, int(cb["offset"]))
            else:
                n = os.preadv(int(cb["fd"]), [mv], int(cb["offset"]))
            cbs["ret"][j], cbs["error"][j] = n, 0
        ctypes.set_errno(errno.EAGAIN)
        return -1


@needs_aio
def test_aio_finishes_requests_glibc_could_not_queue(tmp_path, monkeypatch):
    """A batch glibc queued only in part (lio_listio: -1, EAGAIN) is finished the plain way,
    neither waited for forever nor left unread."""
    rng = np.random.default_rng(3)
    n, k = 400, 37
    path, data = _random_file(tmp_path, rng, n)
    fake = _PartialLio()
    monkeypatch.setattr(glibc_aio, "lio_listio", fake)
    suspended = []

    def suspend(*args):     # aio_suspend returns at once for a request glibc does not hold
        suspended.append(args)
        if len(suspended) > 100:
            raise RuntimeError("waiting for a request that was never queued")
        return 0
    monkeypatch.setattr(glibc_aio, "aio_suspend", suspend)
    fd = os.open(path, os.O_RDWR)
    try:
        boff, blen, foff = _requests(rng, n, k)
        buf = np.zeros(k * 512, dtype=np.uint8)
        RequestPool(8, 0, "test", engine="aio").run(fd, buf, boff, blen, foff, write=False)
        assert fake.calls == 1 and not suspended
        assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
        new = rng.integers(0, 256, k * 512, dtype=np.uint8)
        RequestPool(8, 0, "test", engine="aio").run(fd, new, boff, blen, foff, write=True)
        now = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        assert np.array_equal(np.concatenate([now[o:o + 512] for o in foff]), new)
    finally:
        os.close(fd)


@needs_aio
def test_an_interrupted_aio_call_returns_only_once_its_requests_are_done(tmp_path, monkeypatch):
    """A KeyboardInterrupt (a notebook's "interrupt kernel") that arrives while glibc holds the
    requests is raised only once they are done: the buffer and control blocks must not be
    reused or freed while glibc's threads still write into them."""
    import ctypes
    import errno
    import threading
    import time
    rng = np.random.default_rng(5)
    n, k = 64, 9
    path, data = _random_file(tmp_path, rng, n)
    workers = []

    def lio(mode, ptrs_addr, count, sig):       # queues everything, then the call is interrupted
        ptrs = np.frombuffer((ctypes.c_uint64 * count).from_address(ptrs_addr), dtype=np.uint64)
        size = fileio.AIOCB.itemsize
        cbs = np.frombuffer((ctypes.c_char * (count * size)).from_address(int(ptrs[0])),
                            dtype=fileio.AIOCB)
        cbs["error"] = errno.EINPROGRESS

        def io():                               # glibc's threads, a little later
            time.sleep(0.2)
            for j in range(count):
                mv = memoryview((ctypes.c_char * int(cbs["nbytes"][j])).from_address(
                    int(cbs["buf"][j])))
                cbs["ret"][j] = os.preadv(int(cbs["fd"][j]), [mv], int(cbs["offset"][j]))
                cbs["error"][j] = 0
        t = threading.Thread(target=io)
        t.start()
        workers.append(t)
        raise KeyboardInterrupt

    monkeypatch.setattr(glibc_aio, "lio_listio", lio)
    monkeypatch.setattr(glibc_aio, "aio_suspend", lambda *a: time.sleep(0.005) or 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        boff, blen, foff = _requests(rng, n, k)
        buf = np.zeros(k * 512, dtype=np.uint8)
        with pytest.raises(KeyboardInterrupt):
            RequestPool(8, 0, "test", engine="aio").run(fd, buf, boff, blen, foff, write=False)
        assert not workers[0].is_alive()
        assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
    finally:
        for t in workers:
            t.join()
        os.close(fd)


@needs_aio
def test_aio_runs_with_the_descriptors_it_can_get(tmp_path, monkeypatch):
    """Out of file descriptors (EMFILE) part-way, or from the start: fewer requests in flight,
    the same bytes."""
    import errno
    rng = np.random.default_rng(11)
    n, k = 300, 40
    path, data = _random_file(tmp_path, rng, n)
    fd = os.open(path, os.O_RDONLY)
    real_dup = os.dup
    try:
        for allowed in (3, 0):
            left = [allowed]

            def dup(f):
                if left[0] <= 0:
                    raise OSError(errno.EMFILE, "Too many open files")
                left[0] -= 1
                return real_dup(f)
            monkeypatch.setattr(fileio.os, "dup", dup)
            boff, blen, foff = _requests(rng, n, k)
            buf = np.zeros(k * 512, dtype=np.uint8)
            RequestPool(16, 0, "test", engine="aio").run(fd, buf, boff, blen, foff, write=False)
            assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
        monkeypatch.setattr(fileio.os, "dup", real_dup)
        os.fstat(fd)                     # the caller's descriptor was not closed
    finally:
        os.close(fd)


@needs_aio
def test_aio_calls_at_once_share_the_pools_descriptors(tmp_path):
    """Calls from several threads at once (a disk table's read-aheads and write-backs) spread
    their requests over the same ``threads`` duplicates of the file's descriptor, made once:
    every call gets its own bytes, no descriptor leaks, and closing the pool closes them."""
    import threading
    rng = np.random.default_rng(12)
    n = 2000
    path, data = _random_file(tmp_path, rng, n)
    fd = os.open(path, os.O_RDONLY)
    open_fds = lambda: len(os.listdir("/proc/self/fd"))       # noqa: E731
    pool = RequestPool(8, 0, "test", engine="aio")
    import gc
    gc.collect()        # earlier tests' pools in reference cycles: closed now, not mid-count
    try:
        before = open_fds()
        errors = []

        def reader(seed):
            r = np.random.default_rng(seed)
            try:
                for _ in range(20):
                    boff, blen, foff = _requests(r, n, 64)
                    buf = np.zeros(64 * 512, dtype=np.uint8)
                    pool.run(fd, buf, boff, blen, foff, write=False)
                    assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
            except BaseException as e:     # (re-raised below)
                errors.append(e)
        threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert pool.duplicates == 8 and open_fds() == before + 8
    finally:
        pool.close()
    assert open_fds() == before
    os.fstat(fd)                          # the caller's descriptor is the caller's
    os.close(fd)


@needs_aio
@pytest.mark.parametrize("batch", [1, 3, 1024])
def test_aio_hands_a_calls_requests_to_glibc_in_batches(tmp_path, batch):
    """A call's requests go to glibc ``pool.batch`` at a time: the same bytes at any size."""
    rng = np.random.default_rng(13)
    n, k = 500, 50
    path, data = _random_file(tmp_path, rng, n)
    fd = os.open(path, os.O_RDWR)
    pool = RequestPool(4, 0, "test", engine="aio")
    pool.batch = batch
    try:
        boff, blen, foff = _requests(rng, n, k)
        buf = np.zeros(k * 512, dtype=np.uint8)
        pool.run(fd, buf, boff, blen, foff, write=False)
        assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
        new = rng.integers(0, 256, k * 512, dtype=np.uint8)
        pool.run(fd, new, boff, blen, foff, write=True)
        back = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        assert all(np.array_equal(back[o:o + 512], new[j * 512:(j + 1) * 512])
                   for j, o in enumerate(foff))
    finally:
        pool.close()
        os.close(fd)


@needs_aio
def test_aio_pools_hold_no_more_duplicates_than_their_share(tmp_path, monkeypatch):
    """All pools' duplicates together stay within their share of the process's descriptors:
    a pool beyond it gets fewer (the file's own descriptor at least), reads the same bytes,
    and the share comes back when a pool closes."""
    rng = np.random.default_rng(14)
    n, k = 300, 40
    path, data = _random_file(tmp_path, rng, n)
    fd = os.open(path, os.O_RDONLY)
    import gc
    gc.collect()                  # (other tests' pools, closed now and not in the middle)
    gc.disable()
    monkeypatch.setitem(fileio.DUPLICATES, "limit", fileio.DUPLICATES["held"] + 10)
    pools = [RequestPool(8, 0, "test", engine="aio") for _ in range(3)]
    try:
        for pool in pools:
            boff, blen, foff = _requests(rng, n, k)
            buf = np.zeros(k * 512, dtype=np.uint8)
            pool.run(fd, buf, boff, blen, foff, write=False)
            assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
        assert [p.duplicates for p in pools] == [8, 2, 0]
        pools[0].close()
        pools[2].run(fd, buf, boff, blen, foff, write=False)
        assert pools[2].duplicates == 8
    finally:
        gc.enable()
        for pool in pools:
            pool.close()
        os.close(fd)


@needs_kaio
def test_native_aio_in_parts_with_partial_submits_and_interrupted_waits(tmp_path, monkeypatch):
    """A call longer than a context (in parts), a kernel that takes a few requests per
    io_submit, waits cut short by a signal (EINTR), and requests the kernel refuses (finished
    the plain way): the same bytes as the threads engine."""
    import errno as E
    rng = np.random.default_rng(11)
    n, k = 400, 97
    path, data = _random_file(tmp_path, rng, n)
    real = native_aio.call
    seen = {"submits": 0, "eintr": 0, "refused": 0}

    def call(name, *args):
        if name == "io_submit":
            seen["submits"] += 1
            if seen["submits"] % 7 == 0:            # now and then: the rest refused
                seen["refused"] += 1
                return -E.EINVAL
            ctx, count, ptrs = args
            return real(name, ctx, min(count, 3), ptrs)
        if name == "io_getevents" and seen["eintr"] < 3:
            seen["eintr"] += 1
            return -E.EINTR
        return real(name, *args)
    monkeypatch.setattr(native_aio, "call", call)
    fd = os.open(path, os.O_RDWR)
    try:
        boff, blen, foff = _requests(rng, n, k)
        buf = np.zeros(k * 512, dtype=np.uint8)
        native_aio.run(fd, buf, boff, blen, foff, write=False, depth=20)
        assert np.array_equal(buf, np.concatenate([data[o:o + 512] for o in foff]))
        new = rng.integers(0, 256, k * 512, dtype=np.uint8)
        native_aio.run(fd, new, boff, blen, foff, write=True, depth=20)
    finally:
        os.close(fd)
    now = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    assert np.array_equal(np.concatenate([now[o:o + 512] for o in foff]), new)
    assert seen["eintr"] == 3 and seen["refused"] > 0


@needs_kaio
def test_native_aio_failures_are_raised_by_name(tmp_path, monkeypatch):
    import errno as E
    path = tmp_path / "f"
    path.write_bytes(bytes(8192))
    real = native_aio.call

    def call(name, *args):                         # io_setup refused (fs.aio-max-nr reached)
        return -E.EAGAIN if name == "io_setup" else real(name, *args)
    monkeypatch.setattr(native_aio, "call", call)
    native_aio.drop_context()                           # this thread's context: made anew
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="io_setup.*aio-max-nr"):
            native_aio.run(fd, np.zeros(8192, dtype=np.uint8), [0, 4096], [4096, 4096], [0, 4096],
                      write=False)
    finally:
        os.close(fd)


def test_turns_go_in_the_order_asked_and_one_who_leaves_holds_no_one_up():
    import threading
    import time

    class Condition(threading.Condition):
        def wait(self, *a):             # the thread named "leaver" is interrupted as it waits
            if threading.current_thread().name == "leaver":
                raise KeyboardInterrupt
            return super().wait(*a)
    turns = fileio.Turns(Condition())
    order = []

    def take(name):
        try:
            with turns.turn():
                order.append(name)
        except KeyboardInterrupt:
            order.append(f"{name} left")
    first = turns.turn()
    first.__enter__()                   # ticket 0 held: everyone after it waits
    threads = []
    for name in ("a", "leaver", "b", "c"):
        th = threading.Thread(target=take, args=(name,), name=name)
        th.start()
        threads.append(th)
        deadline = time.monotonic() + 5
        while turns.asked < len(threads) + 1 and time.monotonic() < deadline:
            time.sleep(0.001)           # its ticket taken before the next one asks
    first.__exit__(None, None, None)
    for th in threads:
        th.join(5)
    assert order == ["leaver left", "a", "b", "c"]


@needs_kaio
def test_native_aio_keeps_a_context_per_thread(tmp_path, monkeypatch):
    """io_destroy waits for an RCU grace period (milliseconds): a thread's calls share one
    context instead of making one each."""
    path, data = _random_file(tmp_path, np.random.default_rng(5), 64)
    real = native_aio.call
    setups = []
    monkeypatch.setattr(native_aio, "call", lambda name, *a: (
        setups.append(1) if name == "io_setup" else None) or real(name, *a))
    native_aio.drop_context()
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(5):
            buf = np.zeros(2 * 512, dtype=np.uint8)
            native_aio.run(fd, buf, [0, 512], [512, 512], [512, 4096], write=False)
            assert np.array_equal(buf, np.concatenate([data[512:1024], data[4096:4608]]))
    finally:
        os.close(fd)
    assert len(setups) == 1


@needs_kaio
def test_native_aio_that_the_kernel_refuses_is_not_used():
    """Where io_submit is refused (a sandbox without it), the self-test fails and the engine is
    not used, rather than finishing every request one by one the plain way."""
    import errno as E

    class Refusing(fileio.NativeAio):
        def call(self, name, *args):
            return -E.ENOSYS if name == "io_submit" else super().call(name, *args)
    k = Refusing()
    assert not k.ready() and "did not take" in k.why
