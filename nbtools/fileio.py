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

import errno
import itertools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class RequestPool:
    """Requests of one file, many in flight, and the bounce buffers kept between calls.

    Args:
        threads: requests in flight at most (the pool has ``threads - 1`` threads: the calling
            thread works too).
        keep_bytes: bytes of buffers kept between calls at most (the largest are kept).
        name: the pool threads' name prefix.
    """

    def __init__(self, threads: int, keep_bytes: int, name: str):
        self.threads = max(1, int(threads))
        self.keep_bytes = keep_bytes
        self.name = name
        self._pool = None
        self._closed = False
        self._lock = threading.Lock()
        self._spare: list[np.ndarray] = []       # bounce buffers kept between calls

    def run(self, fd: int, buf: np.ndarray, boff, blen, foff, write: bool,
            chunk: int = 0) -> None:
        """Requests ``j``: ``blen[j]`` bytes at ``buf[boff[j]:]`` <-> file offset ``foff[j]``.

        Handed out in chunks of requests (``chunk`` each; 0: a size that keeps every thread
        busy) to the pool's threads and the calling thread, each taking the next chunk when
        done (a slow request delays only its own thread)."""
        flat = memoryview(buf.reshape(-1))
        op = _pwrite_all if write else _pread_all
        jobs = len(boff)
        workers = min(self.threads, jobs)
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
        for f in futures:
            f.result()
        if failed:
            raise failed[0]

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
        if pool is not None:
            # no call is in flight (each waits for its requests), so nothing to wait for; and
            # joining threads from a finalizer run by the garbage collector can deadlock (a
            # collection inside Thread.start holds the lock that join needs)
            pool.shutdown(wait=False)


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned uint8 buffer of ``nbytes`` (anonymous memory, never in the page cache)."""
    return np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]


def _pread_all(fd: int, mv: memoryview, offset: int) -> None:
    n = os.preadv(fd, [mv], offset)
    while n < len(mv):                       # short reads: rare, but allowed
        if n <= 0:
            raise OSError(errno.EIO, f"short read at offset {offset:,}: the file is shorter "
                          "than its header says (truncated while open?)")
        mv, offset = mv[n:], offset + n
        n = os.preadv(fd, [mv], offset)


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
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
