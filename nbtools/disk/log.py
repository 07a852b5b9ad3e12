"""A log-structured row file: rows written back are appended, never written in place.

On a cloud disk, random reads keep only a third of their rate beside random in-place writes
of the same rows, and all of it beside sequential appends (benchmarks/RESULTS.md, "the
disk's steady state"). A disk table in
its steady state writes back about as many rows as it reads, so :class:`LogFile` turns those
writes into appends:

* The file holds ``num_rows`` ids in ``slots`` places (``spare`` more than the ids: up to as
  many again where the disk has room, SPARE; its rows packed, :func:`packed`), cut into
  segments of ``segment_rows`` slots. ``where[id]`` is each id's slot, ``live[segment]`` the
  ids living in a segment. Which id lives in a slot is kept in the row's own padding where it
  has room (:attr:`nbtools.rowfile.RowFile.tagged`: ``id + 1`` as a tag, written with every
  append; a packed 260-byte row has 28 bytes of it), else in RAM (``owner[slot]``, the id or
  -1: 4 bytes a slot, 8 a row with a 100% spare). A tag only names a candidate: slot ``s``
  holds id ``j`` when ``where[j] == s``, and id ``s`` when ``where[s] == s``, whatever its
  tag says. A new file is the identity layout: id ``i`` in slot ``i``, the spare segments
  free.
* :meth:`write` appends the rows at the head segment (one sequential run; RowFile merges
  neighbouring slots into 1 MiB requests), then points ``where`` at them. A segment whose last
  live row moves out is free again.
* While few segments are free, the **cleaner** reads a segment whole (one sequential read)
  and appends its live rows at the head, which frees it. The segment is the one with the most
  free space per row copied, weighted by how long its rows have stayed (LFS's cost-benefit
  rule: cold rows are copied once and then stay put, hot ones die soon without copying). In a
  simulated Zipf steady state it copies 5-13% fewer rows than taking the fewest live rows
  (``NBTOOLS_DISK_CLEANER=greedy``; benchmarks/RESULTS.md, "a log-structured disk file").
* Reads (:meth:`read`, :meth:`read_range`) go through ``where``. They run beside writes: a
  row's new slot is written before ``where`` points at it, its old slot keeps the old bytes,
  and a freed segment is reused only once every read that started before it was freed is done.
* Whole-table views in id order (a memory map: ``table.weight``, a state dict) need the
  identity layout back: :meth:`identity` moves every row home first (random reads and writes
  of the rows that moved). A checkpoint's save does not: it reads rows through ``where``.

Nothing here is made durable: a killed run's table file is never reopened (a run resumes from
its checkpoint, whose rows are read through ``where``).

The interface is :class:`nbtools.rowfile.RowFile`'s (``read``, ``write``, ``read_range``,
``write_range``...), by id; everything else (``path``, ``stride``, ``flush``, ``engine``...) is
the underlying file's.
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .bits import BitSet

SEGMENT_ROWS = 8192          # slots per segment (2.3 MiB at a 288-byte stride)
SPARE = 1.0                  # spare slots, as a share of the ids (where the disk has room)
MIN_SPARE = 0.10             # the least spare share taken where the disk is short of SPARE
LEAVE = 1 << 30              # free bytes a short disk keeps beyond a smaller spare (or 1/20)
RESERVE = 2                  # free segments the cleaner keeps beyond a write's own (one to
                             # append a victim's rows into while cleaning)
BATCH_ROWS = 1 << 16         # rows moved per round by identity()
TAGGED_IDS = 2 ** 32 - 1     # ids a file may keep in its rows' padding (id + 1 in a uint32)


def wanted() -> bool:
    """Whether new disk tables use the log layout: the default; ``NBTOOLS_DISK_LAYOUT=inplace``
    writes rows back where they are instead (a file of exactly the table's rows, no maps)."""
    layout = os.environ.get("NBTOOLS_DISK_LAYOUT", "log").strip().lower()
    if layout not in ("log", "inplace"):
        raise ValueError(f"NBTOOLS_DISK_LAYOUT must be 'log' or 'inplace', got {layout!r}")
    return layout == "log"


def segment_rows_for(num_rows: int) -> int:
    """Slots per segment for a table of ``num_rows`` rows: SEGMENT_ROWS (or
    ``NBTOOLS_DISK_SEGMENT_ROWS``), smaller for small tables (a power of two, at least 16, at
    most a sixteenth of the rows), so that their spare share holds RESERVE + 2 segments."""
    env = os.environ.get("NBTOOLS_DISK_SEGMENT_ROWS")
    if env:
        return int(env)
    small = 1 << max(4, (max(1, num_rows) // 16).bit_length() - 1)
    return min(SEGMENT_ROWS, small)


def slots_for(num_rows: int, segment_rows: int | None = None, spare: float | None = None) -> int:
    """Slots in a log file of ``num_rows`` ids: the ids, the spare share, at least
    ``RESERVE + 2`` spare segments, in whole segments."""
    seg = int(segment_rows or segment_rows_for(num_rows))
    spare = float(spare if spare is not None else os.environ.get("NBTOOLS_DISK_SPARE", SPARE))
    extra = max(int(num_rows * spare), (RESERVE + 2) * seg)
    return -(-(num_rows + extra) // seg) * seg


def packed() -> bool:
    """Whether new log files pack their rows (:data:`nbtools.rowfile.PACK` bytes apart, not
    whole 512-byte sectors): the default; ``NBTOOLS_DISK_PACKED=0`` pads each row to whole
    sectors instead."""
    v = os.environ.get("NBTOOLS_DISK_PACKED", "1").strip().lower()
    if v not in ("0", "1", "true", "false", "yes", "no"):
        raise ValueError(f"NBTOOLS_DISK_PACKED must be 1 or 0, got {v!r}")
    return v in ("1", "true", "yes")


def log_stride(row_bytes: int) -> int:
    """Bytes a row takes in a new log file: packed, or whole 512-byte sectors (a disk of
    larger blocks: the file's create refuses those, and the rows are tried in place)."""
    from ..rowfile import PACK
    from ..rowfile.format import round_up
    return round_up(row_bytes, PACK if packed() else 512)


def least_free_bytes(num_rows: int, row_bytes: int) -> int:
    """The least free disk on which :func:`file_rows` gives a new table of ``num_rows`` rows of
    ``row_bytes`` a log file (MIN_SPARE, in whole segments, with LEAVE or a twentieth of the
    disk left free beside it; the header and a last block included)."""
    seg = segment_rows_for(num_rows)
    extra = max(int(MIN_SPARE * num_rows) + 1, (RESERVE + 2) * seg)
    log = -(-(num_rows + extra) // seg) * seg * log_stride(row_bytes)
    return max(log + LEAVE, -(-log * 20 // 19)) + 2 * 4096


def file_rows(num_rows: int, stride: int | None = None, free: int | None = None) -> int:
    """Rows of the file a new disk table of ``num_rows`` rows makes: its log slots, or
    ``num_rows`` (in place) where the layout is off. Given the file's ``stride`` and the
    ``free`` bytes of its disk: where the whole spare (SPARE) does not fit, a smaller one that
    leaves LEAVE bytes (or a twentieth of ``free``) free, if it is at least MIN_SPARE; else the
    rows in place. The spare never costs a table its place on disk: the least a disk table
    needs is its rows, in place.

    (A smaller spare costs the cleaner more copies, yet keeps more of the disk's reads than
    writing rows back in place: random reads of a step's size ran at 0.70x their rate beside
    a cleaner whose segments were 83% live, about what 10% spare gives, against 0.46-0.49x
    beside random writes, on a virtual disk.)"""
    if not (wanted() and num_rows):
        return num_rows
    slots = slots_for(num_rows)
    if free is None or slots * stride <= free:
        return slots
    seg = segment_rows_for(num_rows)
    smaller = (free - max(LEAVE, free // 20)) // stride // seg * seg    # whole segments
    if smaller - num_rows >= max(MIN_SPARE * num_rows, (RESERVE + 2) * seg):
        return smaller
    return num_rows


def map_bytes(num_rows: int, stride: int | None = None, free: int | None = None,
              row_bytes: int | None = None) -> int:
    """RAM a new disk table's log maps take (``where``, ``owner`` unless the rows' padding
    keeps their ids, given ``row_bytes``, and two numbers a segment; 0 in place)."""
    slots = file_rows(num_rows, stride, free)
    if slots == num_rows:
        return 0
    item = 4 if slots < 2 ** 31 else 8
    tagged = row_bytes is not None and _tags_fit(num_rows, row_bytes)
    return (num_rows + (0 if tagged else slots)) * item \
        + slots // segment_rows_for(num_rows) * 16


def _tags_fit(num_rows: int, row_bytes: int) -> bool:
    """Whether a new log file of these rows keeps each slot's id in the row's padding."""
    from ..rowfile import TAG
    return packed() and log_stride(row_bytes) - row_bytes >= TAG and num_rows < TAGGED_IDS


def create(path, num_rows: int, row_bytes: int, meta: dict, *, threads: int, free: int):
    """The file of a new disk table: a :class:`LogFile` where the disk (``free`` bytes) has
    room for its spare slots, else a RowFile of the rows alone, written in place. Returns it
    and the RowFile under it."""
    from ..rowfile import DiskFullError, RowFile
    stride = log_stride(row_bytes)
    slots = file_rows(num_rows, stride, free)
    if slots != num_rows:
        try:
            raw = RowFile.create(path, slots, row_bytes, {**meta, "layout": "log"},
                                 threads=threads, packed=packed())
        except DiskFullError:
            pass
        else:
            try:
                return LogFile(raw, num_rows), raw
            except BaseException:         # (a bad NBTOOLS_DISK_CLEANER): no file left behind
                raw.delete()
                raise
    raw = RowFile.create(path, num_rows, row_bytes, meta, threads=threads)
    return raw, raw


class LogFile:
    """``num_rows`` ids over a :class:`~nbtools.rowfile.RowFile` of more slots (see module)."""

    def __init__(self, file, num_rows: int, segment_rows: int | None = None):
        self.file = file
        self.num_rows = int(num_rows)
        self.seg = int(segment_rows or segment_rows_for(num_rows))
        self.slots = int(file.num_rows)
        align = int(getattr(file, "align_rows", 1))     # (appends are written "fresh": the
        if self.seg % align:                            # blocks after their rows hold nothing)
            raise ValueError(f"segments of {self.seg} slots do not start whole blocks of a file "
                             f"whose blocks start every {align} slots")
        if self.slots % self.seg or self.slots < self.num_rows + (RESERVE + 2) * self.seg:
            raise ValueError(f"a log file of {self.num_rows:,} ids needs whole segments of "
                             f"{self.seg} slots and {RESERVE + 2} spare ones; the file has "
                             f"{self.slots:,} slots")
        small = self.slots < 2 ** 31
        self.where = np.arange(self.num_rows, dtype=np.int32 if small else np.int64)
        # which id lives in each slot: in the rows' padding (tags, :attr:`tagged`), else in RAM
        self.owner = None
        if not (getattr(file, "tagged", False) and self.num_rows < TAGGED_IDS):
            self.owner = np.full(self.slots, -1, dtype=self.where.dtype)
            self.owner[: self.num_rows] = self.where
        self._occupied = None                  # identity(): a bitmap of the slots in use
        self._map = threading.Lock()          # where/owner/live and the free list
        self._writes = threading.RLock()      # one writer (appends, cleaning, identity)
        self._freed = threading.Condition(self._map)
        self._reads = {}                       # read token -> generation it started at
        self._token = 0
        self._gen = 0
        self.stats = {"appended": 0, "cleaned": 0, "cleaned_segments": 0, "moved_home": 0}
        self.on_clean = None                   # f(read bytes, written bytes) per cleaned segment
        self.away = 0                          # ids not in their home slot
        self.policy = os.environ.get("NBTOOLS_DISK_CLEANER", "cost-benefit")
        if self.policy not in ("greedy", "cost-benefit"):
            raise ValueError(f"NBTOOLS_DISK_CLEANER must be 'cost-benefit' or 'greedy', got "
                             f"{self.policy!r}")
        self._clock = 0                        # appends so far; _stamp: a segment's last
        self._stamp = np.zeros(self.slots // self.seg, dtype=np.int64)   # (its rows' age)
        self._rebuild()

    # --- the map ------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Live counts and free segments from ``where``; no head (the next append takes a
        free segment). Under the write lock, with no read in flight."""
        live = np.zeros(self.slots // self.seg, dtype=np.int64)
        for a in range(0, self.num_rows, 1 << 22):        # (no table-sized temporaries)
            live += np.bincount(self.where[a:a + (1 << 22)] // self.seg, minlength=len(live))
        self.live = live
        self._free = [(int(s), 0) for s in np.flatnonzero(self.live == 0)]
        self._head, self._pos = -1, self.seg

    @property
    def tagged(self) -> bool:
        """Whether each slot's id is kept in its row's padding (no ``owner`` map in RAM)."""
        return self.owner is None

    @property
    def identity_layout(self) -> bool:
        """Every id in its home slot."""
        return self.away == 0

    def _start_read(self, ids) -> tuple[int, np.ndarray]:
        with self._map:
            self._token += 1
            self._reads[self._token] = self._gen
            return self._token, self.where[ids].astype(np.int64)

    def _end_read(self, token: int) -> None:
        with self._map:
            del self._reads[token]
            self._freed.notify_all()

    def _take_segment(self) -> int:
        """A free segment no read in flight may still be reading (the highest such: spare
        segments first, which are nobody's home). Under the map lock; waits for reads."""
        while True:
            oldest = min(self._reads.values(), default=None)
            ok = [k for k, (s, gen) in enumerate(self._free) if oldest is None or gen <= oldest]
            if ok:
                k = max(ok, key=lambda k: self._free[k][0])
                return self._free.pop(k)[0]
            if not self._free:
                raise RuntimeError("log file: no free segment (a bug: the cleaner keeps some)")
            self._freed.wait()

    def _allocate(self, k: int) -> np.ndarray:
        """``k`` fresh slots at the head, in order. Under the write lock."""
        out = []
        with self._map:
            while k:
                if self._pos == self.seg:
                    self._head, self._pos = self._take_segment(), 0
                self._clock += 1
                self._stamp[self._head] = self._clock
                n = min(k, self.seg - self._pos)
                base = self._head * self.seg + self._pos
                out.append(np.arange(base, base + n, dtype=np.int64))
                self._pos += n
                k -= n
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)

    def _point(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """``ids`` now live in ``slots`` (written already): the map follows, and segments left
        with no live row are freed at a new generation."""
        with self._map:
            old = self.where[ids].astype(np.int64)
            self.away += int(np.count_nonzero(slots != ids)) - int(np.count_nonzero(old != ids))
            self.where[ids] = slots
            if self.owner is not None:
                self.owner[old] = -1
                self.owner[slots] = ids
            if self._occupied is not None:
                self._occupied.discard(old)
                self._occupied.add(slots)
            # (bincount: per-segment counts without sorting; the write-back thread holds the
            # GIL for this, beside the reads)
            came = np.bincount(slots // self.seg, minlength=len(self.live))
            left = np.bincount(old // self.seg, minlength=len(self.live))
            self.live += came - left
            if self._free:       # identity() writes homes into free segments: taken now
                self._free = [f for f in self._free if not came[f[0]]]
            gone = np.flatnonzero(left)
            gone = gone[(self.live[gone] == 0) & (gone != self._head)]
            if len(gone):
                self._gen += 1
                self._free.extend((int(s), self._gen) for s in gone)

    def _room(self) -> int:
        """Slots an append can take now: the head's rest and the free segments. Under the map
        lock."""
        return len(self._free) * self.seg + (self.seg - self._pos if self._head >= 0 else 0)

    def _most(self) -> int:
        """Rows one append takes at most (more go in parts): what the spare slots hold beside
        the cleaner's reserve."""
        return max(self.seg, (self.slots - self.num_rows) // 2 - RESERVE * self.seg)

    def _victim(self, live: np.ndarray) -> int:
        """The segment to clean: the fewest live rows ("greedy"), or ("cost-benefit") the
        most space freed per row copied, weighted by how long the segment's rows have stayed
        (cold rows are copied once and then stay put; hot ones die soon without copying)."""
        if self.policy == "greedy":
            return int(np.argmin(live))
        u = np.minimum(live, self.seg) / self.seg
        age = (self._clock - self._stamp).astype(np.float64) + 1.0
        score = (1.0 - u) * age / (1.0 + u)
        score[live > self.seg] = -1.0
        return int(np.argmax(score))

    def clean(self, need: int = 0) -> None:
        """Until ``need`` slots and RESERVE more segments are free: move the live rows of the
        :meth:`_victim` segment to the head. Under the write lock (the log's cleaner; tests call it)."""
        while True:
            with self._map:
                if self._room() >= need + RESERVE * self.seg:
                    return
                live = self.live.copy()
                live[[s for s, _ in self._free]] = self.seg + 1
                if self._head >= 0:
                    live[self._head] = self.seg + 1
                victim = self._victim(live)
                if live[victim] >= self.seg:
                    return                  # nothing to gain (cannot happen with spare segments)
                lo = victim * self.seg
                count = int(self.live[victim])
                if self.owner is not None:
                    slots = np.flatnonzero(self.owner[lo:lo + self.seg] >= 0) + lo
                    ids = self.owner[slots].astype(np.int64)
            if count:             # the whole segment in one sequential read: its live rows
                whole = np.empty((self.seg, self.file.row_bytes), dtype=np.uint8)
                if self.owner is None:                 # lie between dead ones
                    tags = np.empty(self.seg, dtype=np.uint32)
                    self.file.read_range(lo, whole, tags=tags)
                    ids, slots = self._ids_in(lo, tags)
                    if len(ids) != count:
                        raise RuntimeError(
                            f"{self.file.path!r}: segment {victim} holds {len(ids)} rows by "
                            f"their tags and {count} by the map (a damaged log file)")
                else:
                    self.file.read_range(lo, whole)
                rows = whole[slots - lo]
            else:
                ids = slots = np.empty(0, dtype=np.int64)
                rows = np.empty((0, self.file.row_bytes), dtype=np.uint8)
            new = self._allocate(len(slots))
            if len(new):
                self._write(new, rows, ids, fresh=True)
            self._point(ids, new)
            with self._map:    # (_point frees the segments it empties, except the head: a
                # former head whose rows all died is freed here, picked with no live row)
                if self.live[victim] == 0 and all(s != victim for s, _ in self._free):
                    self._gen += 1
                    self._free.append((victim, self._gen))
            self.stats["cleaned"] += len(slots)
            self.stats["cleaned_segments"] += 1
            if self.on_clean is not None:
                self.on_clean(self.seg * self.file.stride if len(slots) else 0,
                              len(slots) * self.file.stride)

    def live_rows(self, start: int, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slots ``start : start + len(out)`` read into ``out`` (one sequential read; none when
        no row lives there): the ids of the live rows among them, and their positions in
        ``out``. A whole-file pass in file order, as a checkpoint's base of records."""
        if self.owner is not None:
            owner = self.owner[start:start + len(out)]
            live = np.flatnonzero(owner >= 0)
            if len(live):
                self.file.read_range(start, out)
            return owner[live].astype(np.int64), live
        stop = start + len(out)
        with self._map:
            empty = not self.live[start // self.seg: -(-stop // self.seg)].any()
        if empty or not len(out):
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
        tags = np.empty(len(out), dtype=np.uint32)
        self.file.read_range(start, out, tags=tags)
        ids, slots = self._ids_in(start, tags)
        return ids, slots - start

    def _ids_in(self, start: int, tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids living in slots ``start : start + len(tags)`` whose tags are ``tags`` (a
        tagged file), and their slots, in slot order: slot ``s`` holds ``tags[s] - 1`` where
        ``where`` agrees, and its own id ``s`` where that id is home."""
        slots = np.arange(start, start + len(tags), dtype=np.int64)
        ids = np.full(len(tags), -1, dtype=np.int64)
        cand = tags.astype(np.int64) - 1
        named = np.flatnonzero((cand >= 0) & (cand < self.num_rows))
        home = np.flatnonzero(slots < self.num_rows)
        with self._map:
            hit = self.where[cand[named]] == slots[named]
            ids[named[hit]] = cand[named[hit]]
            home = home[self.where[slots[home]] == slots[home]]
        ids[home] = slots[home]
        live = np.flatnonzero(ids >= 0)
        return ids[live], slots[live]

    def _write(self, slots: np.ndarray, src: np.ndarray, ids: np.ndarray, at=None,
               fresh: bool = False) -> None:
        """Rows of ``ids`` into ``slots`` of the file (``src[at[j]]`` or ``src[j]`` is id
        ``ids[j]``'s), each tagged with its id where the file keeps tags."""
        self.file.write(slots, src, at=at, fresh=fresh, tags=self._tags_of(ids))

    def _tags_of(self, ids) -> np.ndarray | None:
        """The tags rows of ``ids`` carry in the file (``id + 1``; None without tags)."""
        return None if self.owner is not None else np.asarray(ids) + 1

    # --- RowFile's interface, by id ---------------------------------------------------------
    def read(self, ids: np.ndarray, out: np.ndarray, at: np.ndarray | None = None) -> None:
        ids = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
        self._check_ids(ids)
        token, slots = self._start_read(ids)
        try:
            self.file.read(slots, out, at=at)
        finally:
            self._end_read(token)

    def write(self, ids: np.ndarray, src: np.ndarray, at: np.ndarray | None = None) -> None:
        """Append rows ``ids`` (unique) at the head; ``src[at[j]]`` (or ``src[j]``) is id
        ``ids[j]``'s row."""
        ids = np.asarray(ids).reshape(-1).astype(np.int64, copy=False)
        self._check_ids(ids)
        if len(ids) > 1 and not (ids[1:] > ids[:-1]).all() and len(np.unique(ids)) != len(ids):
            raise ValueError("a log file's write takes each id once")
        most = self._most()
        with self._writes:
            for a in range(0, len(ids), most):       # a write larger than half the spare: parts
                part = ids[a:a + most]
                where = (np.arange(a, a + len(part)) if at is None
                         else np.asarray(at).reshape(-1)[a:a + len(part)])
                self.clean(len(part))
                slots = self._allocate(len(part))
                self._write(slots, src, part, at=where, fresh=True)
                self._point(part, slots)
                self.stats["appended"] += len(part)

    def read_range(self, start: int, out: np.ndarray) -> None:
        ids = np.arange(start, start + len(out), dtype=np.int64)
        self._check_ids(ids)
        token, slots = self._start_read(ids)
        try:
            if len(slots) and slots[-1] - slots[0] == len(slots) - 1 \
                    and np.array_equal(slots, ids - start + slots[0]):
                self.file.read_range(int(slots[0]), out)     # one sequential stretch
            else:
                self.file.read(slots, out)
        finally:
            self._end_read(token)

    def write_range(self, start: int, src: np.ndarray) -> None:
        """Rows ``start : start + len(src)`` written where they live now (in place: whole-table
        writes, as at creation or a restore, into the identity layout)."""
        ids = np.arange(start, start + len(src), dtype=np.int64)
        self._check_ids(ids)
        with self._writes:
            slots = self.where[ids].astype(np.int64)
            if len(slots) and np.array_equal(slots, ids - start + slots[0]):
                self.file.write_range(int(slots[0]), src, tags=self._tags_of(ids))
            else:
                self._write(slots, src, ids)

    def identity(self, progress=None) -> int:
        """Move every row home (id ``i`` to slot ``i``), BATCH_ROWS at a time; returns the rows
        moved. Rows whose home is free go home; when none is (cycles), the rows sitting in the
        homes of moved ids are appended elsewhere first. Call with no read in flight. (A
        tagged file keeps a bitmap of the slots in use meanwhile: a bit a slot.)"""
        with self._writes:
            if not self.away:
                return 0
            with self._map:
                self._head, self._pos = -1, self.seg   # its unused slots may be homes
                if self.owner is None:
                    self._occupied = self._slots_in_use()
            try:
                moved = self._move_home(progress)
            finally:
                self._occupied = None
            self._rebuild()
        self.stats["moved_home"] += moved
        return moved

    def _move_home(self, progress) -> int:
        """identity()'s rounds, under its locks: the rows moved."""
        moved, start = 0, 0
        while self.away:
            ready, stuck, start = self.scan(BATCH_ROWS, start)
            if len(ready):
                rows = np.empty((len(ready), self.file.row_bytes), dtype=np.uint8)
                self.file.read(self.where[ready].astype(np.int64), rows)
                self._write(ready, rows, ready)
                self._point(ready, ready)
                moved += len(ready)
                if progress is not None:
                    progress(len(ready))
                continue
            # every moved id's home holds another moved row: move those out of the way
            stuck = stuck[: self._most()]
            rows = np.empty((len(stuck), self.file.row_bytes), dtype=np.uint8)
            if self.owner is not None:
                ids = self.owner[stuck].astype(np.int64)
                self.file.read(stuck, rows)
            else:
                tags = np.empty(len(stuck), dtype=np.uint32)
                self.file.read(stuck, rows, tags=tags)
                ids = tags.astype(np.int64) - 1
                ok = (ids >= 0) & (ids < self.num_rows)
                if not ok.all() or not np.array_equal(self.where[ids], stuck):
                    raise RuntimeError(f"{self.file.path!r}: a slot's tag names an id that "
                                       "lives elsewhere (a damaged log file)")
            self.clean(len(ids))
            new = self._allocate(len(ids))
            self._write(new, rows, ids)
            self._point(ids, new)
        return moved

    def _slots_in_use(self) -> BitSet:
        """The slots some id lives in (from ``where``, in chunks)."""
        bits = BitSet(self.slots)
        for a in range(0, self.num_rows, 1 << 22):
            bits.add(self.where[a:a + (1 << 22)])
        return bits

    def scan(self, limit: int, start: int = 0,
              chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray, int]:
        """Up to ``limit`` ids away from home whose home is free, up to ``limit`` whose home is
        taken, and where the next scan may start (every id before it is home): scanned from
        ``start``, ``chunk`` ids at a time (no table-sized temporaries, and no rescans of the
        ids already home)."""
        ready, stuck, n_ready, n_stuck, first = [], [], 0, 0, None
        for a in range(start, self.num_rows, chunk):
            w = self.where[a:a + chunk]
            ids = np.flatnonzero(w != np.arange(a, a + len(w), dtype=w.dtype)) + a
            if not len(ids):
                continue
            first = a if first is None else first
            free = (self.owner[ids] < 0 if self.owner is not None
                    else ~self._occupied.contains(ids))
            ready.append(ids[free])
            stuck.append(ids[~free])
            n_ready += int(free.sum())
            n_stuck += len(ids) - int(free.sum())
            if n_ready >= limit or (n_stuck >= limit and n_ready):
                break
        cat = (lambda parts: np.concatenate(parts)[:limit].astype(np.int64) if parts
               else np.empty(0, dtype=np.int64))
        return cat(ready), cat(stuck), self.num_rows if first is None else first

    # --- the rest is the file's ---------------------------------------------------------------
    def _check_ids(self, ids: np.ndarray) -> None:
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_rows):
            bad = int(np.flatnonzero((ids < 0) | (ids >= self.num_rows))[0])
            raise IndexError(f"{self.file.path!r} holds {self.num_rows:,} rows but ids contain "
                             f"{int(ids[bad]):,} (first at position {bad})")

    @property
    def map_bytes(self) -> int:
        """RAM of the maps (``where``, ``owner`` where the rows keep no tags, and two numbers
        a segment)."""
        return self.where.nbytes + (0 if self.owner is None else self.owner.nbytes) \
            + self.live.nbytes + self._stamp.nbytes

    def __getattr__(self, name):
        file = self.__dict__.get("file")
        if file is None:
            raise AttributeError(name)
        return getattr(file, name)

    def __repr__(self):
        free = len(self._free)
        return (f"LogFile({self.file!r}, ids={self.num_rows:,}, slots={self.slots:,}, "
                f"segments of {self.seg}, {free} free)")
