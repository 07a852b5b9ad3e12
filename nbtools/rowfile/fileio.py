"""Positioned file I/O: whole-buffer ``pread``/``pwrite``, page-aligned buffers, ``fadvise``, and
a pool that keeps many requests of one file in flight.

The disk tier's row files (:mod:`nbtools.rowfile`) are what this is for; checkpoints
(:mod:`nbtools.checkpoint`) and memory-mapped pretrained vectors (:mod:`nbtools.pretrained`)
use the same helpers. A cloud disk answers one random read in ~50 µs but serves tens of
thousands per second only with many in flight, and ``os.preadv`` releases the GIL: so the
requests of one call are handed out in small chunks to a thread pool that lives as long as the
file, the calling thread working too (:class:`RequestPool`). ``O_DIRECT`` needs buffers aligned
to the device's block: :func:`_aligned` maps anonymous memory, which is page-aligned and never
in the page cache; the pool keeps such buffers between calls, so a step does not pay for fresh
pages.

>>> import os, tempfile
>>> fd = os.open(os.path.join(tempfile.mkdtemp(), "f"), os.O_RDWR | os.O_CREAT)
>>> pool = RequestPool(threads=4, keep_bytes=1 << 20, name="doctest")
>>> buf = pool.take(8192)
>>> buf[:8192] = np.arange(8192) % 251
>>> pool.run(fd, buf, [0, 4096], [4096, 4096], [0, 4096], write=True)
>>> back = np.zeros(8192, dtype=np.uint8)
>>> pool.run(fd, back, [0, 4096], [4096, 4096], [0, 4096], write=False)
>>> bool((back == buf[:8192]).all())
True
>>> pool.give(buf); pool.kept_bytes
65536
>>> pool.close(); os.close(fd)
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import mmap
import os
import platform
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ENGINES = ("aio", "threads", "kaio")
# Requests per lio_listio call at most (a call's requests go in such batches, one after the
# other). glibc queues a descriptor's requests in a list it walks to the end for each new one,
# under its one lock: long queues slow everything. On a virtual disk, 8 calls at once of
# 49,152 random 512-byte reads over 128 shared descriptors: 98K rows/s in batches of 512-1,024,
# 89K of 2,048, 69K of 4,096 (6 calls), and one call of 8,192 in one batch of 131,072 ~20K;
# a single call of 8,192 reads ~100K either way.
AIO_BATCH = 1024


# Descriptors the pools' duplicates hold in all ("held") and may hold ("limit"): at most half
# the process's limit (raised to its hard limit, up to 65,536, the first time duplicates are
# made), so that a process with several disk tables keeps descriptors for everything else
# (checkpoints, notebooks, sockets)
DUPLICATES = {"held": 0, "limit": None}
_DUPLICATES_LOCK = threading.Lock()


def _dup_room(want: int) -> int:
    """How many of ``want`` more duplicates the pools may hold now (reserves them)."""
    with _DUPLICATES_LOCK:
        if DUPLICATES["limit"] is None:
            try:
                import resource
                soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
                goal = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
                if soft != resource.RLIM_INFINITY and soft < goal:
                    try:
                        resource.setrlimit(resource.RLIMIT_NOFILE, (goal, hard))
                        soft = goal
                    except (ValueError, OSError):
                        pass
                DUPLICATES["limit"] = 1 << 20 if soft == resource.RLIM_INFINITY else soft // 2
            except (ImportError, ValueError, OSError):
                DUPLICATES["limit"] = 512
        room = max(0, min(want, DUPLICATES["limit"] - DUPLICATES["held"]))
        DUPLICATES["held"] += room
        return room


def _dups_closed(n: int) -> None:
    with _DUPLICATES_LOCK:
        DUPLICATES["held"] = max(0, DUPLICATES["held"] - n)


class RequestPool:
    """Requests of one file, many in flight, and the bounce buffers kept between calls.

    Three engines issue the requests (``engine``; default: :func:`default_engine`,
    ``NBTOOLS_DISK_ENGINE``, else ``"kaio"`` for an ``O_DIRECT`` file where it works, else
    ``"aio"`` where it works, else ``"threads"``):

    * ``"aio"``: glibc's POSIX AIO. One ``lio_listio`` call hands every request of a call to
      glibc's own C threads and waits for them, the GIL released throughout (a ctypes call):
      no Python runs per request, so a training loop's Python does not slow the reads, nor
      they it. glibc runs one request of a file descriptor at a time, so the requests are
      spread over ``threads`` duplicates of the descriptor (while all pools together hold
      less than half the process's descriptor limit), kept for the pool's life and shared by
      every call: calls running at once (a table's read-aheads, its write-backs)
      queue behind each other on the same descriptors, in the order they came, with
      ``threads`` requests in flight in all. (With descriptors of its own per call, eight
      read-aheads at once put 512 descriptors in glibc's queue, whose lookups are linear
      under one lock, and finished together rather than in order: a disk table's loop
      read 0.65-0.8x the rate a lone call reads; benchmarks/RESULTS.md, "shared AIO
      descriptors".)
      Linux with glibc only; checked by a self-test at first use (anything unexpected:
      ``"threads"`` from then on).
    * ``"threads"``: Python threads in ``os.preadv`` / ``os.pwritev`` (which release the GIL
      during the system call, but need it between two).
    * ``"kaio"``: Linux's native AIO (:class:`NativeAio`): a call's requests handed to the
      kernel by ``io_submit``, ``batch`` at a time at most (more as a quarter of them finish),
      waited for in ``io_getevents``: the GIL is needed only between those calls, and no
      thread pool runs them (``threads`` does not apply). The default for ``O_DIRECT`` files
      (a disk table's loop takes less time than on ``"aio"``, much less on a host of two
      cores; benchmarks/RESULTS.md, "native AIO by default"). Not for
      buffered files, where the kernel serves native AIO inside ``io_submit``, one request
      after another. Checked by a self-test at first use; where the kernel refuses a context
      later (``fs.aio-max-nr`` reached), the pool goes on with ``"aio"`` (or ``"threads"``)
      and warns once.

    Args:
        threads: requests in flight at most (``"threads"``: the pool has ``threads - 1``
            threads, the calling thread working too; ``"aio"``: descriptors).
        keep_bytes: bytes of buffers kept between calls at most (the largest are kept).
        name: the pool threads' name prefix.
        engine: ``"aio"``, ``"threads"``, ``"kaio"`` or None (the default above).
        direct: whether the file is open with ``O_DIRECT`` (the default engine depends on it).
    """

    def __init__(self, threads: int, keep_bytes: int, name: str, engine: str | None = None,
                 direct: bool = False):
        self.threads = max(1, int(threads))
        self.keep_bytes = keep_bytes
        self.name = name
        self.engine = default_engine(direct) if engine is None else check_engine(engine)
        self._pool = None
        self._closed = False
        self._lock = threading.Lock()
        self._spare: list[np.ndarray] = []       # bounce buffers kept between calls
        self._fd, self._dups = None, []          # "aio": the file's duplicates, shared
        self._turns = Turns()                    # "kaio": calls hand requests over in order
        self.batch = AIO_BATCH                   # "aio": requests per lio_listio call; "kaio":
        #                                          requests in the kernel's hands per call

    def run(self, fd: int, buf: np.ndarray, boff, blen, foff, write: bool,
            chunk: int = 0) -> None:
        """Requests ``j``: ``blen[j]`` bytes at ``buf[boff[j]:]`` <-> file offset ``foff[j]``.

        Handed out in chunks of requests (``chunk`` each; 0: a size that keeps every thread
        busy) to the pool's threads and the calling thread, each taking the next chunk when
        done (a slow request delays only its own thread)."""
        jobs = len(boff)
        workers = min(self.threads, jobs)
        if jobs > 1 and self.engine == "kaio" and native_aio.ready():
            try:
                native_aio.run(fd, buf, boff, blen, foff, write, self.batch, turn=self._turns.turn)
                return
            except NoContextError as e:         # nothing was handed over: another engine
                self.engine = "aio" if glibc_aio.ready() else "threads"
                warnings.warn(f"{self.name}: Linux's native AIO refused a context ({e}); "
                              f"this file's reads and writes go on with the {self.engine!r} "
                              "engine", RuntimeWarning, stacklevel=2)
        if workers > 1 and self.engine == "aio" and glibc_aio.ready():
            glibc_aio.run(self._descriptors(fd), buf, boff, blen, foff, write, self.batch)
            return
        flat = memoryview(buf.reshape(-1))
        op = pwrite_all if write else pread_all
        if workers <= 1:
            for j in range(jobs):
                op(fd, flat[boff[j]:boff[j] + blen[j]], foff[j])
            return
        chunk = chunk or max(1, min(32, jobs // (workers * 4)))
        nchunks = -(-jobs // chunk)
        counter = itertools.count()          # next() is atomic under the GIL
        failed: list[BaseException] = []

        def work():
            try:
                while not failed:
                    c = next(counter)
                    if c >= nchunks:
                        return
                    for j in range(c * chunk, min(jobs, c * chunk + chunk)):
                        op(fd, flat[boff[j]:boff[j] + blen[j]], foff[j])
            except BaseException as e:       # re-raised by the caller
                failed.append(e)

        futures = [self._executor().submit(work) for _ in range(workers - 1)]
        work()
        # every thread done with the buffer, even when interrupted (the others then stop at
        # their next chunk)
        uninterrupted(lambda: [f.result() for f in futures], failed.append)
        if failed:
            raise failed[0]

    def _descriptors(self, fd: int) -> list:
        """``threads`` duplicates of ``fd`` (fewer when the process runs out of descriptors;
        ``fd`` itself at least), made once and shared by every call. Only grown while the
        pool lives (a call in flight may use any of them); closed by :meth:`close`."""
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.name}: the request pool is closed")
            if self._fd != fd:                   # (a pool serves one file descriptor)
                self._close_dups()
                self._fd = fd
            room = _dup_room(self.threads - len(self._dups))
            try:
                while room:
                    self._dups.append(os.dup(fd))
                    room -= 1
            except OSError:      # out of descriptors (EMFILE): fewer requests in flight
                pass
            _dups_closed(room)   # (the reserved ones not made)
            return self._dups[: self.threads] or [fd]

    def __del__(self):
        try:
            self._close_dups()
        except Exception:      # (interpreter shutdown)
            pass

    def _close_dups(self) -> None:
        dups, self._dups, self._fd = self._dups, [], None
        for d in dups:
            try:
                os.close(d)
            except OSError:
                pass
        _dups_closed(len(dups))

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1 or 1,
                                                thread_name_prefix=self.name)
            return self._pool

    def take(self, nbytes: int) -> np.ndarray:
        """An aligned buffer of at least ``nbytes`` (a kept one when one is large enough)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.nbytes >= nbytes]
            if fits:
                return self._spare.pop(min(fits, key=lambda i: self._spare[i].nbytes))
        # powers of two from 64 KiB: calls of similar sizes reuse one buffer
        return _aligned(max(1 << 16, 1 << (nbytes - 1).bit_length()))

    def give(self, buf: np.ndarray) -> None:
        """Hand back a buffer from :meth:`take` (kept while within ``keep_bytes``)."""
        with self._lock:
            if self._closed:
                return
            self._spare.append(buf)
            self._spare.sort(key=lambda b: -b.nbytes)
            while sum(b.nbytes for b in self._spare) > self.keep_bytes:
                self._spare.pop()            # the smallest go first
                if not self._spare:
                    break

    @property
    def duplicates(self) -> int:
        """Duplicates of the file's descriptor the pool holds ("aio": made at its first call,
        as many as ``threads`` while :data:`DUPLICATES` has room; closed by :meth:`close`)."""
        return len(self._dups)

    @property
    def kept_bytes(self) -> int:
        """Bytes of buffers held between calls."""
        return sum(b.nbytes for b in self._spare)

    def close(self) -> None:
        """Stop the threads and drop the kept buffers (idempotent); buffers given back later
        are dropped too."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
            self._spare = []
            self._close_dups()
        if pool is not None:
            # no call is in flight (each waits for its requests), so nothing to wait for; and
            # joining threads from a finalizer run by the garbage collector can deadlock (a
            # collection inside Thread.start holds the lock that join needs)
            pool.shutdown(wait=False)


class Turns:
    """Callers take turns in the order they asked (a ticket lock): ``with turns.turn(): ...``.
    A caller interrupted while waiting gives its turn up (the next one is not held up).
    ``condition``: the ``threading.Condition`` they wait on (default a new one)."""

    def __init__(self, condition: threading.Condition | None = None):
        self._cond = condition or threading.Condition()
        self._next = 0                  # the next ticket handed out
        self._serving = 0               # the ticket whose turn it is
        self._gone = set()              # tickets given up while waiting

    @property
    def asked(self) -> int:
        """How many turns were asked for so far (tickets handed out)."""
        return self._next

    @contextlib.contextmanager
    def turn(self):
        with self._cond:
            ticket = self._next
            self._next += 1
            try:
                while self._serving != ticket:
                    self._cond.wait()
            except BaseException:
                self._gone.add(ticket)
                self._skip()
                raise
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._skip()

    def _skip(self) -> None:
        while self._serving in self._gone:
            self._gone.remove(self._serving)
            self._serving += 1
        self._cond.notify_all()


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"disk I/O engine {engine!r}: expected one of {', '.join(ENGINES)}")
    return engine


def default_engine(direct: bool = True) -> str:
    """``NBTOOLS_DISK_ENGINE`` if set, else ``"kaio"`` (Linux's native AIO) where it works
    and the file is read with ``O_DIRECT`` (``direct``), else ``"aio"`` where glibc's AIO
    works, else ``"threads"``."""
    env = os.environ.get("NBTOOLS_DISK_ENGINE")
    if env:
        return check_engine(env)
    if direct and native_aio.ready():
        return "kaio"
    return "aio" if glibc_aio.ready() else "threads"


# struct aiocb of glibc on 64-bit Linux (x86_64, aarch64): the fields used, by offset; 168 bytes;
# its op is LIO_READ or LIO_WRITE
AIOCB = np.dtype({"names": ["fd", "op", "buf", "nbytes", "notify", "error", "ret", "offset"],
                   "formats": ["<i4", "<i4", "<u8", "<u8", "<i4", "<i4", "<i8", "<i8"],
                   "offsets": [0, 4, 16, 24, 44, 112, 120, 128], "itemsize": 168})
LIO_READ, LIO_WRITE, _LIO_WAIT, _SIGEV_NONE = 0, 1, 0, 1
# An aiocb's error field before the call: glibc writes EINPROGRESS into it once the request is
# queued, then the request's outcome; a request it could not queue (no memory for its entry)
# keeps this value, so it is neither waited for nor mistaken for one in flight
_UNQUEUED = -2


class _AioInit(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int) for n in ("aio_threads", "aio_num", "aio_locks", "aio_usedba",
                                            "aio_debug", "aio_numusers", "aio_idle_time",
                                            "aio_reserved")]


class GlibcAio:
    """glibc's POSIX AIO through ctypes (see :class:`RequestPool`): loaded and self-tested
    once per process; a forked child (whose copy of glibc's AIO state names threads it does
    not have) falls back to threads. :data:`glibc_aio` is the process's one instance; once
    loaded, its ``lio_listio`` and ``aio_suspend`` are glibc's functions (ctypes; tests stand
    in for them), which get control blocks laid out as :data:`AIOCB`."""

    THREADS = 128                # glibc's AIO threads at most (its default is 20)

    def __init__(self):
        self._lock = threading.Lock()
        self._pid = None         # the process that loaded it
        self._ok = None          # None: not tried yet
        self.why = None          # why it is not used, when it is not

    def ready(self) -> bool:
        if self._ok is None or self._pid != os.getpid():
            with self._lock:
                if self._ok is None:
                    self._load()
                elif self._pid != os.getpid():
                    self._ok, self.why = False, "a forked process (glibc's AIO threads are " \
                        "the parent's)"
        return self._ok

    def _load(self) -> None:
        self._pid = os.getpid()
        try:
            if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or \
                    platform.machine() not in ("x86_64", "aarch64") or \
                    ctypes.sizeof(ctypes.c_void_p) != 8:
                raise OSError("glibc's AIO on 64-bit Linux only")
            libc = ctypes.CDLL(None, use_errno=True)
            if not hasattr(libc, "lio_listio"):          # glibc < 2.34: in librt
                libc = ctypes.CDLL("librt.so.1", use_errno=True)
            self.lio_listio, self.aio_suspend = libc.lio_listio, libc.aio_suspend
            self.lio_listio.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                        ctypes.c_void_p]
            self.aio_suspend.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
            # (aio_num: requests glibc expects at once, a hint for its allocations)
            libc.aio_init(ctypes.byref(_AioInit(self.THREADS, 16384, 0, 0, 0, 0, 1, 0)))
            self._ok = True
            self._selftest()
        except Exception as e:                            # noqa: BLE001 (any failure: threads)
            self._ok, self.why = False, f"{type(e).__name__}: {e}"

    def _selftest(self) -> None:
        def run(fd, *args):                 # over two descriptors of the file
            dup = os.dup(fd)
            try:
                self.run([fd, dup], *args)
            finally:
                os.close(dup)
        _self_test(run, "glibc's AIO")

    def run(self, fds: list, buf: np.ndarray, boff, blen, foff, write: bool,
            batch: int = AIO_BATCH) -> None:
        """The requests handed to glibc ``batch`` at a time (each batch waited for), spread
        over the descriptors ``fds`` (of one file; glibc runs each descriptor's requests one
        at a time, in order)."""
        base = buf.ctypes.data
        boff = np.asarray(boff, dtype=np.int64)
        blen = np.asarray(blen, dtype=np.int64)
        foff = np.asarray(foff, dtype=np.int64)
        if len(boff) and (boff.min() < 0 or (boff + blen).max() > buf.nbytes):
            raise ValueError("a request falls outside its buffer")
        fds = list(fds)[: max(1, len(boff))]
        batch = max(1, int(batch))
        for a in range(0, len(boff), batch):
            self._batch(fds, base, boff[a:a + batch], blen[a:a + batch], foff[a:a + batch],
                        write)

    def _batch(self, fds: list, base: int, boff, blen, foff, write: bool) -> None:
        k = len(boff)
        cb = np.zeros(k, dtype=AIOCB)
        cb["fd"] = np.asarray(fds, dtype=np.int32)[np.arange(k) % len(fds)]
        cb["op"] = LIO_WRITE if write else LIO_READ
        cb["buf"] = base + boff
        cb["nbytes"] = blen
        cb["offset"] = foff
        cb["notify"] = _SIGEV_NONE
        cb["error"] = _UNQUEUED
        ptrs = cb.ctypes.data + np.arange(k, dtype=np.uint64) * np.uint64(AIOCB.itemsize)
        rc = None
        try:
            rc = self.lio_listio(_LIO_WAIT, ptrs.ctypes.data, k, None)
        finally:
            if rc != 0:
                # interrupted (a signal: a KeyboardInterrupt is raised as the call returns),
                # some not queued (EAGAIN), or some failed: glibc's threads may still be
                # writing into the buffer and these control blocks
                self._drain(cb, ptrs)
        # requests not queued, short transfers and failed requests are finished the plain
        # way (rare)
        redo = np.flatnonzero((cb["error"] != 0) | (cb["ret"] != blen))
        ok = cb["error"][redo] == 0
        _finish_plain(fds[0], base, boff, blen, foff, redo,
                      np.where(ok, np.maximum(cb["ret"][redo], 0), 0),
                      np.where(ok | (cb["error"][redo] == _UNQUEUED), 0, cb["error"][redo]),
                      write)


    def _drain(self, cb: np.ndarray, ptrs: np.ndarray) -> None:
        """Wait until no request of ``cb`` is in flight, whatever interrupts the wait: the
        buffer and the control blocks must outlive glibc's use of them."""
        def wait():
            while True:
                busy = np.flatnonzero(cb["error"] == errno.EINPROGRESS)
                if not len(busy):
                    return
                self.aio_suspend(ptrs[busy].ctypes.data, len(busy), None)
        uninterrupted(wait)


glibc_aio = GlibcAio()


# io_setup, io_destroy, io_getevents, io_submit (NativeAio.CALLS)
_CALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
# struct iocb (linux/aio_abi.h, little-endian 64-bit): the fields used, by offset; 64 bytes
_IOCB = np.dtype({"names": ["data", "opcode", "fildes", "buf", "nbytes", "offset"],
                  "formats": ["<u8", "<u2", "<u4", "<u8", "<u8", "<i8"],
                  "offsets": [0, 16, 20, 24, 32, 40], "itemsize": 64})
# struct io_event: data, obj, res, res2
_EVENT = np.dtype({"names": ["data", "res"], "formats": ["<u8", "<i8"],
                   "offsets": [0, 16], "itemsize": 32})
_PREAD, _PWRITE = 0, 1
# Requests in the kernel's hands at once per call at most (a context's events)
KAIO_DEPTH = 4096


class NativeAio:
    """Linux's native AIO (the ``"kaio"`` engine of :class:`RequestPool`).

    glibc's POSIX AIO (the ``"aio"`` engine) runs every request on one of its own threads and hands
    a call's requests over in batches, each waited for before the next: the thread that waits needs
    the GIL between two batches, and a training loop's Python holding it then delays the next
    batch (eight streams of step-sized reads lose a measurable share of their rate beside a
    thread running Python; benchmarks/RESULTS.md, "the 100M Zipf step"). Here a call's
    requests go to the kernel in one ``io_submit`` and are
    waited for in one ``io_getevents``, the GIL released in both (ctypes calls), with no thread
    pool: the device's own queue keeps them in flight. For ``O_DIRECT`` files the kernel reads
    and writes asynchronously; for buffered ones ``io_submit`` does the work itself (still
    without the GIL).

    The system calls go through libc's ``syscall()`` (no library to install): x86_64 and aarch64
    Linux only, checked by a self-test at first use; anything unexpected leaves the engine unused
    (:attr:`NativeAio.why`). Each thread keeps one context (``io_setup``: 1,024 events, more if a
    call asks) for its life: destroying one waits for an RCU grace period, milliseconds that a
    context per call paid on every read (the table's loop ran at half its speed). The system-wide
    limit (``fs.aio-max-nr``, 65,536 events by default) bounds how many threads may hold one.
    :data:`native_aio` is the process's one instance; every system call goes through
    :meth:`call`.
    """

    CALLS = ("io_setup", "io_destroy", "io_getevents", "io_submit")   # the calls it makes

    def __init__(self):
        self._lock = threading.Lock()
        self._ok = None          # None: not tried yet
        self.why = None          # why it is not used, when it is not
        self._local = threading.local()

    def ready(self) -> bool:
        if self._ok is None:
            with self._lock:
                if self._ok is None:
                    self._load()
        return self._ok

    def _load(self) -> None:
        try:
            calls = _CALLS.get(platform.machine())
            if platform.system() != "Linux" or calls is None or \
                    ctypes.sizeof(ctypes.c_void_p) != 8:
                raise OSError("Linux's native AIO on 64-bit x86 and ARM only")
            libc = ctypes.CDLL(None, use_errno=True)
            self._syscall = libc.syscall
            self._syscall.restype = ctypes.c_long
            self._nr = dict(zip(self.CALLS, calls))
            self._ok = True
            self._selftest()
        except Exception as e:                            # noqa: BLE001 (any failure: unused)
            self._ok, self.why = False, f"{type(e).__name__}: {e}"

    def _context(self, depth: int):
        """This thread's context, of at least ``depth`` events (made on first use; kept while
        the thread lives: io_destroy waits for an RCU grace period, milliseconds a call)."""
        held = getattr(self._local, "ctx", None)
        if held is None or held.size < depth or held.pid != os.getpid():
            size = max(depth, min(KAIO_DEPTH, 1024))
            held = self._local.ctx = None        # (the old one destroyed first)
            self._local.ctx = held = _Context(self, size)
        return held.id

    def io_setup(self, size: int, ctx_address: int) -> int:
        """``io_setup(size, ctx)``: 0, or minus the errno."""
        return self.call("io_setup", size, ctx_address)

    def io_destroy(self, ctx: int) -> int:
        return self.call("io_destroy", ctx)

    def call(self, name: str, *args) -> int:
        """The system call ``name`` (one of :attr:`CALLS`) with ``args``: its result, or minus
        the errno. Every call to the kernel goes through here (tests wrap it to refuse or cut
        short some)."""
        r = self._syscall(ctypes.c_long(self._nr[name]), *[ctypes.c_long(a) for a in args])
        return r if r >= 0 else -ctypes.get_errno()

    def drop_context(self) -> None:
        """Let this thread's context go (destroyed once nothing holds it); its next call makes
        a new one."""
        self._local.__dict__.pop("ctx", None)

    def _selftest(self) -> None:
        def run(*args):
            if self.run(*args):     # (io_submit refused them: finished the plain way)
                raise OSError("the kernel did not take the self-test's requests")
        _self_test(run, "native AIO")

    def run(self, fd: int, buf: np.ndarray, boff, blen, foff, write: bool,
            depth: int = KAIO_DEPTH, turn=None) -> int:
        """Requests ``j``: ``blen[j]`` bytes at ``buf[boff[j]:]`` <-> file offset ``foff[j]``,
        at most ``depth`` in the kernel's hands at once (more are handed over as a quarter of
        them finish: the device's queue never drains in the middle of a call). ``turn``: a
        context manager factory, held while this call hands its requests over (calls of one
        file take turns in the order they came, so the device serves them about in that order: a
        read-ahead's rows come before the next one's, as with glibc's queues). Returns how many
        requests were finished the plain way (refused by the kernel, or short)."""
        base = buf.ctypes.data
        boff = np.asarray(boff, dtype=np.int64)
        blen = np.asarray(blen, dtype=np.int64)
        foff = np.asarray(foff, dtype=np.int64)
        n = len(boff)
        if not n:
            return 0
        if boff.min() < 0 or (boff + blen).max() > buf.nbytes:
            raise ValueError("a request falls outside its buffer")
        depth = max(1, min(int(depth), n, KAIO_DEPTH))
        ctx = self._context(depth)
        cb = np.zeros(n, dtype=_IOCB)
        cb["data"] = np.arange(n)
        cb["opcode"] = _PWRITE if write else _PREAD
        cb["fildes"] = fd
        cb["buf"] = base + boff
        cb["nbytes"] = blen
        cb["offset"] = foff
        ptrs = cb.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(_IOCB.itemsize)
        events = np.zeros(depth, dtype=_EVENT)
        # bytes moved per request, or -errno; requests the kernel did not take keep -EAGAIN
        # (done the plain way below)
        res = np.full(n, -errno.EAGAIN, dtype=np.int64)
        state = {"sent": 0, "got": 0, "refused": False}

        def reap(least: int) -> None:
            r = self.call("io_getevents", ctx, least, depth, events.ctypes.data, 0)
            if r == -errno.EINTR:
                return
            if r < 0:
                raise OSError(-r, f"io_getevents: {os.strerror(-r)}")
            ev = events[:r]
            res[ev["data"].astype(np.int64)] = ev["res"]
            state["got"] += r

        def submit():
            while state["sent"] < n and not state["refused"]:
                room = depth - (state["sent"] - state["got"])
                if room < max(1, depth // 4) and state["sent"] > state["got"]:
                    reap(min(state["sent"] - state["got"], max(1, depth // 4)))
                    continue
                r = self.call("io_submit", ctx, min(room, n - state["sent"]),
                               int(ptrs.ctypes.data) + 8 * state["sent"])
                if r > 0:
                    state["sent"] += r
                elif r in (-errno.EAGAIN, -errno.EINTR) and state["sent"] > state["got"]:
                    reap(1)                         # room, once some are done
                elif r != -errno.EINTR:             # the rest not taken: done the plain way
                    state["refused"] = True

        def work():
            with turn() if turn is not None else contextlib.nullcontext():
                submit()
            while state["got"] < state["sent"]:
                reap(state["sent"] - state["got"])
        # every request finished before the buffer and the control blocks may go, whatever
        # interrupts the wait (a KeyboardInterrupt is raised once it is over); on an error,
        # the context goes (io_destroy waits for whatever it still holds)
        try:
            uninterrupted(work)
        except BaseException:
            self.drop_context()
            raise
        redo = np.flatnonzero(res != blen)
        _finish_plain(fd, base, boff, blen, foff, redo, np.maximum(res[redo], 0),
                      np.maximum(-res[redo], 0), write)
        return len(redo)


class NoContextError(OSError):
    """The kernel made no native AIO context (``io_setup`` failed): nothing was submitted."""


class _Context:
    """One thread's AIO context (``io_setup``), destroyed with the thread's locals or when
    replaced; a forked child makes its own (the parent's is not its)."""

    def __init__(self, aio: NativeAio, size: int):
        ctx = ctypes.c_ulong(0)
        r = aio.io_setup(size, ctypes.addressof(ctx))
        if r < 0:
            raise NoContextError(-r, f"io_setup({size}): {os.strerror(-r)} (fs.aio-max-nr "
                                 "reached?)")
        self.aio, self.id, self.size, self.pid = aio, ctx.value, size, os.getpid()

    def __del__(self):
        try:
            if self.pid == os.getpid():
                self.aio.io_destroy(self.id)
        except Exception:          # (interpreter shutdown)
            pass


native_aio = NativeAio()


def native_aio_why() -> str:
    """Why Linux's native AIO is not in use here (None where it is usable)."""
    return native_aio.why


def _finish_plain(fd: int, base: int, boff, blen, foff, redo, done, errors, write: bool) -> None:
    """Requests ``redo`` that an AIO engine did not finish (not taken, short, or failed with
    ``errors[k]``, an errno or 0; ``done[k]`` bytes moved): the first hard failure is raised,
    the rest finished the plain way (rare)."""
    if not len(redo):
        return
    hard = [int(e) for e in errors if e not in (0, errno.EAGAIN, errno.EINTR)]
    if hard:
        raise OSError(hard[0], f"disk {'write' if write else 'read'} failed: "
                      f"{os.strerror(hard[0])}")
    mv = memoryview((ctypes.c_uint8 * int((boff + blen)[redo].max())).from_address(base))
    mv = mv.cast("B")
    op = pwrite_all if write else pread_all
    for j, d in zip(redo, done):
        j, d = int(j), int(d)
        op(fd, mv[int(boff[j]) + d:int(boff[j] + blen[j])], int(foff[j]) + d)


def _self_test(run, name: str) -> None:
    """Write two blocks of a scratch file through ``run(fd, buf, boff, blen, foff, write)``
    (each to the other's place), read them back both ways; other bytes back: OSError."""
    import tempfile
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        src = _aligned(8192)
        src[:] = np.arange(8192) % 251
        run(fd, src, [0, 4096], [4096, 4096], [4096, 0], True)
        back = np.frombuffer(os.pread(fd, 8192, 0), dtype=np.uint8)
        got = _aligned(8192)
        run(fd, got, [0, 4096], [4096, 4096], [0, 4096], False)
        if not (np.array_equal(back[:4096], src[4096:]) and
                np.array_equal(back[4096:], src[:4096]) and np.array_equal(got, back)):
            raise OSError(f"{name}: the self-test read back other bytes")


def uninterrupted(wait, on_interrupt=None) -> None:
    """``wait()`` to its end, called again after each KeyboardInterrupt (``on_interrupt(e)``
    first), which is raised once it has returned: for waits that must end before memory that
    other threads write into can be reused."""
    interrupted = None
    while True:
        try:
            wait()
            break
        except KeyboardInterrupt as e:
            interrupted = e
            if on_interrupt is not None:
                on_interrupt(e)
    if interrupted is not None:
        raise interrupted


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of ``nbytes`` (anonymous memory, never in the page cache)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def pread_all(fd: int, mv: memoryview, offset: int) -> None:
    n = os.preadv(fd, [mv], offset)
    while n < len(mv):                       # short reads: rare, but allowed
        if n <= 0:
            raise OSError(errno.EIO, f"short read at offset {offset:,}: the file is shorter "
                          "than its header says (truncated while open?)")
        mv, offset = mv[n:], offset + n
        n = os.preadv(fd, [mv], offset)


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    n = os.pwritev(fd, [mv], offset)
    while n < len(mv):
        mv, offset = mv[n:], offset + n
        n = os.pwritev(fd, [mv], offset)


def fadvise(fd: int, advice: str) -> None:
    """``posix_fadvise`` over the whole file, where the platform has it (best effort)."""
    value = getattr(os, advice, None)
    if value is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, value)
        except OSError:
            pass
