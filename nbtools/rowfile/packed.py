"""A row file's requests, and a packed row file's reads and writes, beside :mod:`nbtools.rowfile`.

:func:`row_requests` turns sorted rows (or blocks) into requests over runs of neighbours, for every
row file. A packed file (rows ``PACK`` bytes apart, sharing blocks; see :mod:`nbtools.rowfile`)
is read and written in whole blocks through its :class:`~nbtools.rowfile.RowFile`'s bounce
buffers: :func:`packed_io` for rows by id, :func:`packed_range` for a range of rows, the rows
copied between the caller's array and the blocks by :func:`rows_in_buffer`. The two take the
file itself (its bounce-buffer I/O: :meth:`~nbtools.rowfile.RowFile.submit`, buffers and counters) and rowfile's ``BOUNCE`` and
``GAP`` from the caller, read there at each call (tests patch them on :mod:`nbtools.rowfile`).
"""
from __future__ import annotations

import numpy as np

REQUEST = 1 << 20              # bytes per request at most when neighbours are merged
TAG = 4                        # bytes of a row's tag, in its padding (RowFile.tagged)


def _tag_bytes(tags: np.ndarray) -> np.ndarray:
    """uint32 tags as [k, TAG] little-endian bytes."""
    return np.ascontiguousarray(tags, dtype="<u4").view(np.uint8).reshape(-1, TAG)


def _tag_values(raw: np.ndarray) -> np.ndarray:
    """[k, TAG] little-endian bytes as k uint32 tags (:func:`_tag_bytes` undone)."""
    return np.ascontiguousarray(raw).view("<u4")[:, 0]


def row_requests(ids: np.ndarray, stride: int, data_offset: int, limit: int = REQUEST,
                 gap: int = 0):
    """Sorted row numbers -> requests over runs of consecutive rows, each at most ``limit``
    bytes: (offset in the bounce buffer, bytes, file offset), as Python lists, and each row's
    place in the bounce buffer (in rows). With ``gap``, two rows at most ``gap`` rows apart
    share a run, the rows between them read too (reads only)."""
    n = len(ids)
    step = np.diff(ids)
    join = step <= gap + 1                      # row i + 1 continues row i's run
    skipped = np.where(join, step - 1, 0)       # rows read between them, not asked for
    pos = np.arange(n, dtype=np.int64)
    if n > 1:
        pos[1:] += np.cumsum(skipped)
    starts = np.concatenate(([0], np.flatnonzero(~join) + 1))      # first row of each run
    ends = np.concatenate((starts[1:], [n])) - 1                   # its last row
    bstart = pos[starts]
    lens = pos[ends] - bstart + 1                                  # buffer rows a run spans
    fstart = ids[starts]
    cap = max(1, limit // stride)
    if lens.max() > cap:                     # cut long runs: requests of `cap` rows
        pieces = -(-lens // cap)
        k = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        end = np.repeat(bstart + lens, pieces)
        bstart, fstart = np.repeat(bstart, pieces) + k * cap, np.repeat(fstart, pieces) + k * cap
        lens = np.minimum(bstart + cap, end) - bstart
    return ((bstart * stride).tolist(), (lens * stride).tolist(),
            (data_offset + fstart * stride).tolist(), pos)


def rows_in_buffer(buf: np.ndarray, at: np.ndarray, rows: np.ndarray, where: np.ndarray,
                   stride: int, write: bool) -> None:
    """Copy rows between the caller's ``rows`` and a packed file's bounce buffer (1-D bytes),
    where row ``where[i]`` starts at byte ``at[i]``: into the buffer for a write, out of it
    for a read. Rows that follow each other in the buffer at the file's stride (a log's
    appends, a range of ids) go as one strided copy per run; scattered rows each as a whole
    row of a strided view (several times faster than indexing their bytes one by one)."""
    rb, n = rows.shape[1], len(at)
    brk = np.flatnonzero(np.diff(at) != stride) + 1
    if len(brk) < n // 32:                       # long runs: a strided view each
        for a, b in zip(np.concatenate(([0], brk)).tolist(), np.concatenate((brk, [n])).tolist()):
            view = np.lib.stride_tricks.as_strided(buf[int(at[a]):], shape=(b - a, rb),
                                                   strides=(stride, 1))
            if write:
                view[...] = rows[where[a:b]]
            else:
                rows[where[a:b]] = view
        return
    # scattered rows: the buffer seen as rows starting every `step` bytes, `step` the largest
    # power of two dividing every row's start, and each row taken whole by its number there
    # (overlapping views: the rows of one call never overlap each other)
    bits = int(np.bitwise_or.reduce(at)) if n else 0
    step = min(bits & -bits or stride, 4096)
    view = np.lib.stride_tricks.as_strided(buf, shape=((len(buf) - rb) // step + 1, rb),
                                           strides=(step, 1))
    if write:
        view[at // step] = rows[where]
    else:
        rows[where] = view[at // step]


def packed_io(f, ids: np.ndarray, dst: np.ndarray, rows: np.ndarray, write: bool,
              fresh: bool, *, bounce: int, gap: int, tags: np.ndarray | None = None) -> int:
    """``read`` and ``write`` of the packed :class:`~nbtools.rowfile.RowFile` ``f``, ``ids``
    sorted (``dst``: each one's row in ``rows``): the blocks the rows touch, read (and, for a
    write, patched and written back) through the bounce buffer, of ``bounce`` bytes at most;
    reads take blocks at most ``gap`` bytes apart in one request. ``tags`` (in the order of
    ``ids``): each row's tag, in the TAG bytes after it: written, or read into it. Returns
    the bytes read or written (a write's reads of its blocks are counted as reads here)."""
    u, stride, rb = f.unit, f.stride, f.row_bytes
    reach = rb + (TAG if tags is not None else 0)     # bytes of each row written or read
    gap = 0 if write else gap // u                    # bytes -> blocks
    per = max(1, bounce // ((stride + u) * (gap + 1)))
    moved, buf = 0, None
    try:
        for a in range(0, len(ids), per):
            part, where = ids[a:a + per], dst[a:a + per]
            off = part * stride
            first, last = off // u, (off + reach - 1) // u
            span = last - first + 1                   # blocks a row touches (1 or 2...)
            blocks = np.repeat(first, span) + (np.arange(int(span.sum()))
                                               - np.repeat(np.cumsum(span) - span, span))
            blocks = np.unique(blocks)
            boff, blen, foff, pos = row_requests(blocks, u, f.data_offset, gap=gap)
            need = (int(pos[-1]) + 1) * u
            buf = f.at_least(buf, need)
            at = pos[np.searchsorted(blocks, first)] * u + (off - first * u)  # in buf
            if write:
                if fresh:
                    buf[:need] = 0
                    # the first block of each run of consecutive rows, where the run starts
                    # mid-block: rows written before it end there
                    head = np.ones(len(part), dtype=bool)
                    head[1:] = np.diff(part) != 1
                    head &= off % u != 0
                    if head.any():
                        edge = np.unique(first[head])
                        f.submit(buf,
                                    (pos[np.searchsorted(blocks, edge)] * u).tolist(),
                                    [u] * len(edge),
                                    (f.data_offset + edge * u).tolist(), False)
                        f.count_reads(u * len(edge))
                else:                                  # keep the rows sharing the blocks
                    f.submit(buf, boff, blen, foff, False)
                    f.count_reads(need)
                rows_in_buffer(buf, at, rows, where, stride, write=True)
                if tags is not None:          # (the buffer seen from the rows' ends)
                    rows_in_buffer(buf[rb:], at, _tag_bytes(tags[a:a + per]),
                                    np.arange(len(part)), stride, write=True)
                f.submit(buf, boff, blen, foff, True)
            else:
                f.submit(buf, boff, blen, foff, False)
                rows_in_buffer(buf, at, rows, where, stride, write=False)
                if tags is not None:
                    got = np.empty((len(part), TAG), dtype=np.uint8)
                    rows_in_buffer(buf[rb:], at, got, np.arange(len(part)), stride,
                                    write=False)
                    tags[a:a + per] = _tag_values(got)
            moved += need
    finally:
        if buf is not None:
            f.give_buffer(buf)
    return moved


def packed_range(f, start: int, rows: np.ndarray, write: bool, *, bounce: int,
                 tags: np.ndarray | None = None) -> int:
    """``read_range`` and ``write_range`` of the packed :class:`~nbtools.rowfile.RowFile`
    ``f``: whole blocks, in requests of 4 MiB, through a bounce buffer of about ``bounce``
    bytes; a write whose ends share a block with other rows reads those two blocks first
    (counted as reads here). ``tags``: the rows' tags, written (else zeros) or read. Returns
    the bytes read or written."""
    u, stride, rb = f.unit, f.stride, f.row_bytes
    n, moved = len(rows), 0
    per = max(f.align_rows, bounce // stride // f.align_rows * f.align_rows)
    buf = f.take_buffer(min(n, per) * stride + 2 * u)
    try:
        for a in range(0, n, per):
            m = min(per, n - a)
            lo = f.data_offset + (start + a) * stride          # the rows' bytes
            hi = lo + m * stride
            b0, b1 = lo // u * u, -(-hi // u) * u              # whole blocks around them
            inner = buf[lo - b0: lo - b0 + m * stride].reshape(m, stride)
            step = (4 << 20) // u * u
            boff = list(range(0, b1 - b0, step))
            blen = [min(step, b1 - b0 - b) for b in boff]
            foff = [b0 + b for b in boff]
            if write:
                edges = sorted({b for b, partial in ((b0, lo != b0), (b1 - u, hi != b1))
                                if partial})
                if edges:                  # the end blocks hold other rows: kept
                    f.submit(buf, [e - b0 for e in edges],
                                [u] * len(edges), edges, False, chunk=1)
                    f.count_reads(u * len(edges))
                inner[:, :rb] = rows[a:a + m]
                if stride > rb:
                    inner[:, rb:] = 0
                if tags is not None:
                    inner[:, rb:rb + TAG] = _tag_bytes(tags[a:a + m])
                f.submit(buf, boff, blen, foff, True, chunk=1)
            else:
                f.submit(buf, boff, blen, foff, False, chunk=1)
                rows[a:a + m] = inner[:, :rb]
                if tags is not None:
                    tags[a:a + m] = _tag_values(inner[:, rb:rb + TAG])
            moved += b1 - b0
    finally:
        f.give_buffer(buf)
    return moved
