"""Linux's native AIO for :class:`nbtools.fileio.RequestPool` (the ``"kaio"`` engine).

glibc's POSIX AIO (the ``"aio"`` engine) runs every request on one of its own threads and hands
a call's requests over in batches, each waited for before the next: the thread that waits needs
the GIL between two batches, and a training loop's Python holding it then delays the next
batch (benchmarks/RESULTS.md "Session 17": eight streams of step-sized reads lost ~15% beside a
thread running Python). Here a call's requests go to the kernel in one ``io_submit`` and are
waited for in one ``io_getevents``, the GIL released in both (ctypes calls), with no thread pool:
the device's own queue keeps them in flight. For ``O_DIRECT`` files the kernel reads and writes
asynchronously; for buffered ones ``io_submit`` does the work itself (still without the GIL).

The system calls go through libc's ``syscall()`` (no library to install): x86_64 and aarch64
Linux only, checked by a self-test at first use; anything unexpected leaves the engine unused
(:attr:`_KernelAio.why`). Each thread keeps one context (``io_setup``: 1,024 events, more if a
call asks) for its life: destroying one waits for an RCU grace period, milliseconds that a
context per call paid on every read (the table's loop ran at half its speed). The system-wide
limit (``fs.aio-max-nr``, 65,536 events by default) bounds how many threads may hold one.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import threading

import numpy as np

# io_setup, io_destroy, io_getevents, io_submit
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
DEPTH = 4096


class _KernelAio:
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
            self._setup_nr, self._destroy_nr, self._getevents_nr, self._submit_nr = calls
            self._ok = True
            self._selftest()
        except Exception as e:                            # noqa: BLE001 (any failure: unused)
            self._ok, self.why = False, f"{type(e).__name__}: {e}"

    def _context(self, depth: int):
        """This thread's context, of at least ``depth`` events (made on first use; kept while
        the thread lives: io_destroy waits for an RCU grace period, milliseconds a call)."""
        held = getattr(self._local, "ctx", None)
        if held is None or held.size < depth or held.pid != os.getpid():
            size = max(depth, min(DEPTH, 1024))
            held = self._local.ctx = None        # (the old one destroyed first)
            self._local.ctx = held = _Context(self, size)
        return held.id

    def _call(self, *args) -> int:
        r = self._syscall(*[ctypes.c_long(a) for a in args])
        return r if r >= 0 else -ctypes.get_errno()

    def _selftest(self) -> None:
        """Write two blocks of a scratch file, read them back both ways."""
        import tempfile
        from .fileio import _aligned
        with tempfile.TemporaryFile() as f:
            fd = f.fileno()
            src = _aligned(8192)
            src[:] = np.arange(8192) % 251
            self.run(fd, src, [0, 4096], [4096, 4096], [4096, 0], True)
            back = np.frombuffer(os.pread(fd, 8192, 0), dtype=np.uint8)
            got = _aligned(8192)
            self.run(fd, got, [0, 4096], [4096, 4096], [0, 4096], False)
            if not (np.array_equal(back[:4096], src[4096:]) and
                    np.array_equal(back[4096:], src[:4096]) and np.array_equal(got, back)):
                raise OSError("native AIO's self-test read back other bytes")

    def run(self, fd: int, buf: np.ndarray, boff, blen, foff, write: bool,
            depth: int = DEPTH, turn=None) -> None:
        """Requests ``j``: ``blen[j]`` bytes at ``buf[boff[j]:]`` <-> file offset ``foff[j]``,
        at most ``depth`` in the kernel's hands at once (more are handed over as a quarter of
        them finish: the device's queue never drains in the middle of a call). ``turn``: a
        context manager factory, held while this call hands its requests over (calls of one file take
        turns in the order they came, so the device serves them about in that order: a
        read-ahead's rows come before the next one's, as with glibc's queues)."""
        from .fileio import _pread_all, _pwrite_all, uninterrupted
        base = buf.ctypes.data
        boff = np.asarray(boff, dtype=np.int64)
        blen = np.asarray(blen, dtype=np.int64)
        foff = np.asarray(foff, dtype=np.int64)
        n = len(boff)
        if not n:
            return
        if boff.min() < 0 or (boff + blen).max() > buf.nbytes:
            raise ValueError("a request falls outside its buffer")
        depth = max(1, min(int(depth), n, DEPTH))
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
            r = self._call(self._getevents_nr, ctx, least, depth, events.ctypes.data, 0)
            if r == -errno.EINTR:
                return
            if r < 0:
                raise OSError(-r, f"io_getevents: {os.strerror(-r)}")
            ev = events[:r]
            res[ev["data"].astype(np.int64)] = ev["res"]
            state["got"] += r

        def submit_all():
            with turn() if turn is not None else contextlib.nullcontext():
                submit()

        def submit():
            while state["sent"] < n and not state["refused"]:
                room = depth - (state["sent"] - state["got"])
                if room < max(1, depth // 4) and state["sent"] > state["got"]:
                    reap(min(state["sent"] - state["got"], max(1, depth // 4)))
                    continue
                r = self._call(self._submit_nr, ctx, min(room, n - state["sent"]),
                               int(ptrs.ctypes.data) + 8 * state["sent"])
                if r > 0:
                    state["sent"] += r
                elif r in (-errno.EAGAIN, -errno.EINTR) and state["sent"] > state["got"]:
                    reap(1)                         # room, once some are done
                elif r != -errno.EINTR:             # the rest not taken: done the plain way
                    state["refused"] = True

        def work():
            submit_all()
            while state["got"] < state["sent"]:
                reap(state["sent"] - state["got"])
        # every request finished before the buffer and the control blocks may go, whatever
        # interrupts the wait (a KeyboardInterrupt is raised once it is over); on an error,
        # the context goes (io_destroy waits for whatever it still holds)
        try:
            uninterrupted(work)
        except BaseException:
            self._local.__dict__.pop("ctx", None)
            raise
        redo = np.flatnonzero(res != blen)
        if len(redo):
            bad = [int(-x) for x in res[redo] if x < 0 and -x not in (errno.EAGAIN, errno.EINTR)]
            if bad:
                raise OSError(bad[0], f"disk {'write' if write else 'read'} failed: "
                              f"{os.strerror(bad[0])}")
            mv = memoryview((ctypes.c_uint8 * int((boff + blen)[redo].max())).from_address(base))
            mv = mv.cast("B")
            op = _pwrite_all if write else _pread_all
            for j in redo:
                done = max(0, int(res[j]))
                op(fd, mv[int(boff[j]) + done:int(boff[j] + blen[j])], int(foff[j]) + done)


class _Context:
    """One thread's AIO context (``io_setup``), destroyed with the thread's locals or when
    replaced; a forked child makes its own (the parent's is not its)."""

    def __init__(self, aio: _KernelAio, size: int):
        ctx = ctypes.c_ulong(0)
        r = aio._call(aio._setup_nr, size, ctypes.addressof(ctx))
        if r < 0:
            raise OSError(-r, f"io_setup({size}): {os.strerror(-r)} (fs.aio-max-nr reached?)")
        self.aio, self.id, self.size, self.pid = aio, ctx.value, size, os.getpid()

    def __del__(self):
        try:
            if self.pid == os.getpid():
                self.aio._call(self.aio._destroy_nr, self.id)
        except Exception:          # (interpreter shutdown)
            pass


_kaio = _KernelAio()
