"""Offloaded tables in checkpoints, whatever their placement: their rows are saved once per
table, as a full copy (a *base*) or as the rows changed since the previous save (a *delta*),
and reached only through the table's tier, as a whole (:meth:`nbtools.store.RowTier.whole`:
tensor slices for rows in RAM or on the GPU, :class:`nbtools.disk.access.WholeTable` for a
disk table's file, never read through RAM).

A table's ``state_dict()`` (and its optimizer's) hands out views of its rows (a disk table's:
of its file mapped into memory). While a checkpoint is being planned, each table holds one
mapping (the face's ``hold_mapping``), so every view of it is recognised and saved as a
``{"$rows": k, ...}`` node (which columns of table ``k``'s rows it is), never read; a view of
a table in memory that is not columns of every row is saved as a tensor of its own (of a
disk table, refused). The rows themselves, weights and optimizer state together:

* a **base**: every row, ``row_bytes`` each (not the stride of the rows in memory or in the
  file), read in blocks of at most ``chunk_bytes / 4`` while the previous block is written,
  one checksum per block. A log-structured file (:mod:`nbtools.disk.log`) whose rows have
  left their home slots saves its base as records ``[id | row]`` in *file* order (link
  ``"records": true``): read sequentially, where id order would read every moved row at
  random;
* a **delta**: records ``[id (int64) | row]`` of the rows written since the previous save, in
  id order, one checksum per 256 KiB. The tier counts those rows itself (the face's
  ``changed_since``); its count restarts only once the checkpoint is committed, so a save
  that fails loses no change.

Each checkpoint's manifest lists, per table, the *chain* it needs: the base and every delta
since, as (directory, checkpoint id, tensor entry). A chain grows by one delta per save until
``CheckpointConfig.base_every`` links or until its deltas would hold ``base_fraction`` of the
rows; then a new base starts a new chain. Pruning keeps what a kept checkpoint needs
(:func:`nbtools.checkpoint.layout.needs`), and a mirror copies it first.

A restore merges the chain in one pass: base blocks in row order, each overlaid with the
rows that the deltas, oldest first, hold for it, then written through the face. A base of
records is written record by record instead (appended, in a log file), then each delta,
oldest first, the same way. Nothing is written before its checksum is checked; the caches
above the rows are emptied first (their rows are older than the checkpoint's). The state dicts
are then loaded with the same mapping held, so their ``load_state_dict`` finds the very views
it would write to and copies nothing. A chain restores into a table of another placement than
the one that saved it (``placement="auto"`` on another machine) the same way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..units import human_bytes
from ..store.whole import WholeRows
from .format import CheckpointError, Damaged, _dtype, dtype_name, _fadvise, open_regular

NOTHING_CHANGED = ("Nothing was restored: every table, optimizer state, parameter and RNG "
                   "state is as it was.")
PIECE = 256 << 10          # bytes per checksummed piece of a delta (a restore holds one per delta)
_ID = 8                    # bytes of a row id in a delta record


@dataclasses.dataclass
class Table:
    """A table found among the objects of a save or restore: its rows as a whole (the face
    its tier answers with, :meth:`nbtools.store.RowTier.whole`) and its tier."""
    rows: object                  # nbtools.store.whole.WholeRows, or a disk table's WholeTable
    tier: object                  # the table's RowTier (what hands out the face for writing)
    keys: list                    # where the objects reach it: "model:emb", "opt:emb"
    index: int | None = None      # its place in the manifest's "rows", once a view refers to it
    held: torch.Tensor | None = None

    @property
    def in_file(self) -> bool:
        """Its rows live in a file (a disk table), never read into RAM whole."""
        return not isinstance(self.rows, WholeRows)


@dataclasses.dataclass
class Chain:
    """What a manager last saved or restored for one table: the checkpoint id whose rows the
    table matched then (its changes are counted from there) and the links a delta extends."""
    rows: weakref.ref
    token: str
    links: list
    delta_rows: int


@dataclasses.dataclass
class SaveRows:
    """One table's part of a save: ``kind`` "base", "delta" or "same" (no row changed)."""
    table: Table
    kind: str
    count: int                    # rows this checkpoint writes
    links: list                   # the chain this checkpoint needs, its own link last
    entry: dict | None            # its tensor entry (None for "same")

    def item(self) -> dict:
        d = self.table.rows
        return {"name": d.name, "keys": self.table.keys, "num_rows": d.num_rows,
                "row_bytes": d.row_bytes, "width": d.width, "dtype": dtype_name(d.dtype),
                "kind": self.kind, "count": self.count, "chain": self.links}


def _members(objects: dict):
    """``(object, key)`` for each module's submodules and each optimizer's tables: where a
    table may be ("model:emb", "opt:emb")."""
    for name, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for sub, m in obj.named_modules():
                yield m, f"{name}:{sub}"
        elif isinstance(getattr(obj, "tables", None), dict):
            for sub, t in obj.tables.items():
                yield t, f"{name}:{sub}"


def find(objects: dict, memory: bool = True) -> list[Table]:
    """The tables among ``objects`` (modules' submodules and optimizers' ``tables``): those
    whose rows live in a file, and (``memory``) those in RAM or on the GPU."""
    mod = sys.modules.get("nbtools.tables")
    if mod is None:                       # nothing imported it: there is no table
        return []
    found: dict[int, Table] = {}
    for owner, key in _members(objects):
        if isinstance(owner, mod.OffloadedEmbedding):
            tier = owner.rows
            face = tier.whole()
            t = found.setdefault(id(face), Table(face, tier, []))
            t.keys.append(key)
    return [t for t in found.values() if memory or t.in_file]


@contextlib.contextmanager
def holding(tables: list[Table], writable: bool):
    """Each table's mapping held (see the module docs) for the block."""
    with contextlib.ExitStack() as stack:
        for t in tables:
            t.held = stack.enter_context(t.rows.hold_mapping(writable))
        try:
            yield
        finally:
            for t in tables:
                t.held = None


class Refs:
    """``Packer(ref=...)``: views of held tables become ``$rows`` nodes; ``used`` lists the
    tables referred to, in the order of their indices."""

    def __init__(self, tables: list[Table]):
        self.by_storage = {_where(t.held): t for t in tables}
        self.used: list[Table] = []

    def __call__(self, x: torch.Tensor, path: str):
        if not self.by_storage:
            return None
        t = self.by_storage.get(_where(x))
        if t is None:
            return None
        d, item = t.rows, x.element_size()
        offset = x.storage_offset() * item
        extent = item + sum((n - 1) * s for n, s in zip(x.shape[1:], x.stride()[1:])) * item
        if (x.dim() < 1 or x.shape[0] != d.num_rows or min(x.stride()[1:], default=1) < 0
                or (d.num_rows > 1 and x.stride(0) * item != d.stride)
                or offset + extent > d.row_bytes):
            if not t.in_file:             # (rows in memory: saved as a tensor of its own)
                return None
            raise CheckpointError(
                f"{path}: a view of disk table {d.name!r} (shape {tuple(x.shape)}, strides "
                f"{x.stride()}, {x.dtype}) that is not columns of every row; a checkpoint saves "
                "a disk table's rows by reference. Save a copy (x.clone()) under another name "
                "if you need this one.")
        if t.index is None:
            t.index = len(self.used)
            self.used.append(t)
        return {"$rows": t.index, "offset": offset, "dtype": dtype_name(x.dtype),
                "shape": list(x.shape), "stride": list(x.stride()[1:])}


def _where(x: torch.Tensor) -> tuple:
    return x.device, x.untyped_storage().data_ptr()


def view(node: dict, t: Table) -> torch.Tensor:
    """The live table's view that ``node`` describes, on its held mapping."""
    d, dtype = t.rows, _dtype(node["dtype"])
    item = torch.empty((), dtype=dtype).element_size()
    shape = [int(n) for n in node["shape"]]
    if shape[0] != d.num_rows or node["offset"] % item or d.stride % item:
        raise CheckpointError(f"table {d.name!r}: the checkpoint's view {shape} "
                              f"{node['dtype']} does not fit its {d.num_rows:,} rows")
    stride = [d.stride // item, *node["stride"]]
    return torch.empty(0, dtype=dtype, device=t.held.device).set_(
        t.held.untyped_storage(), t.held.storage_offset() * t.held.element_size() // item
        + node["offset"] // item, shape, stride)


# --- saving -------------------------------------------------------------------------------------

def plan(used: list[Table], chains: dict, cfg, own_dir: str, own_id: str,
         first_index: int) -> list[SaveRows]:
    """Decide base, delta or nothing for each table referred to (every dirty row is written
    back first); ``first_index`` is the tensor index of the first new entry."""
    out = []
    for t in used:
        d = t.rows
        chain = chains.get(id(d))
        if chain is not None and chain.rows() is not d:
            chain = None
        changed = d.changed_since(chain.token if chain is not None else None)
        index = first_index + sum(s.entry is not None for s in out)
        if (changed is None or len(chain.links) >= cfg.base_every
                or chain.delta_rows + changed > cfg.base_fraction * d.num_rows):
            # a log file whose rows left their home slots (nbtools.disk.log): the base is
            # records (id, row) in file order, read sequentially (in id order it would be a
            # random read of every row that moved)
            records = d.moved
            entry = _entry(f"<rows {t.index}>/base", d.num_rows,
                           d.row_bytes + (_ID if records else 0))
            link = {"dir": own_dir, "id": own_id, "tensor": index, "kind": "base",
                    "count": d.num_rows, **({"records": True} if records else {})}
            out.append(SaveRows(t, "base", d.num_rows, [link], entry))
        elif changed == 0:
            out.append(SaveRows(t, "same", 0, list(chain.links), None))
        else:
            entry = _entry(f"<rows {t.index}>/delta", changed, _ID + d.row_bytes)
            link = {"dir": own_dir, "id": own_id, "tensor": index, "kind": "delta",
                    "count": changed}
            out.append(SaveRows(t, "delta", changed, [*chain.links, link], entry))
    return out


def _entry(path: str, n: int, width: int) -> dict:
    return {"path": path, "dtype": "uint8", "stored": "uint8", "shape": [n, width],
            "bytes": n * width, "device": "disk", "segments": None}


def write(s: SaveRows, writer, chunk_bytes: int) -> None:
    """Stream one table's base or delta into the checkpoint's data files (``writer``)."""
    from ..rowfile.fileio import _aligned
    d = s.table.rows
    s.entry["segments"] = writer.begin_tensor()
    if s.kind == "base" and s.links[-1].get("records"):
        write_records_base(s, d, writer, chunk_bytes)
        return
    if s.kind == "base":
        per = max(1, (chunk_bytes // 4) // max(d.row_bytes, d.stride))
        bufs = [_aligned(per * d.row_bytes).reshape(per, d.row_bytes) for _ in range(2)]

        def read(k, a):
            m = min(per, d.num_rows - a)
            d.read_bytes(a, bufs[k % 2][:m])
            return bufs[k % 2][:m]
        with ThreadPoolExecutor(1, thread_name_prefix="nbtools-ckpt-read") as pool:
            fut = pool.submit(read, 0, 0)
            for k, a in enumerate(range(0, d.num_rows, per)):
                block = fut.result()
                if a + per < d.num_rows:       # read the next block while this one is written
                    fut = pool.submit(read, k + 1, a + per)
                writer.cut()
                writer.write(memoryview(block.reshape(-1)))
        return
    rec = _ID + d.row_bytes
    per = max(1, PIECE // rec)                          # records per checksummed piece
    batch = per * max(1, (chunk_bytes // 4) // (per * max(rec, d.stride)))
    buf = np.empty((batch, rec), dtype=np.uint8)
    rows = np.empty((batch, d.row_bytes), dtype=np.uint8)
    seen = 0
    for a in range(0, d.num_rows, 1 << 20):              # the change map, a million rows at once
        ids = d.changed_ids(a, min(d.num_rows, a + (1 << 20)))
        for b in range(0, len(ids), batch):
            part = ids[b:b + batch]
            m = len(part)
            d.copy_rows(part, rows[:m])
            _emit(writer, buf, part, rows[:m], per)
            seen += m
    if seen != s.count:
        raise CheckpointError(f"table {d.name!r}: {seen:,} rows changed while its delta of "
                              f"{s.count:,} was being saved; nothing may write rows during save()")


def _emit(writer, buf: np.ndarray, ids: np.ndarray, rows: np.ndarray, per: int) -> None:
    """Records ``[id | row]`` of ``ids`` and ``rows`` (through ``buf``), ``per`` to a
    checksummed piece."""
    m = len(ids)
    buf[:m, :_ID] = ids.astype("<i8").view(np.uint8).reshape(m, _ID)
    buf[:m, _ID:] = rows
    for c in range(0, m, per):
        writer.cut()
        writer.write(memoryview(buf[c:min(m, c + per)].reshape(-1)))


def write_records_base(s: SaveRows, d, writer, chunk_bytes: int) -> None:
    """A log file's base: every live row's (id, row), in file order, read in large
    sequential pieces (:meth:`nbtools.disk.access.WholeTable.records`)."""
    rb = d.row_bytes
    rec = _ID + rb
    per = max(1, (chunk_bytes // 4) // max(rec, d.stride))
    rows = np.empty((per, rb), dtype=np.uint8)
    out = np.empty((per, rec), dtype=np.uint8)
    piece = max(1, PIECE // rec)
    seen = 0
    for ids, live in d.records(per, rows):
        if len(ids):
            _emit(writer, out, ids, live, piece)
            seen += len(ids)
    if seen != d.num_rows:
        raise CheckpointError(f"disk table {d.name!r}: {seen:,} live rows in its file, "
                              f"{d.num_rows:,} expected; nothing may write rows during save()")


def committed(saved: list[SaveRows], chains: dict, token: str) -> None:
    """The checkpoint ``token`` is on disk: each table counts changes from it now."""
    for s in saved:
        d = s.table.rows
        d.mark_checkpointed(token)
        deltas = sum(link["count"] for link in s.links if link["kind"] == "delta")
        chains[id(d)] = Chain(weakref.ref(d), token, s.links, deltas)


# --- restoring ----------------------------------------------------------------------------------

def match(items: list[dict], wanted: set, tables: list[Table], where: str) -> dict[int, Table]:
    """The live table for each saved table in ``wanted`` (indices into ``items``), checked:
    any placement, the same rows, row bytes and dtype."""
    by_key = {key: t for t in tables for key in t.keys}
    out = {}
    for k in sorted(wanted):
        item = items[k]
        live = [by_key[key] for key in item["keys"] if key in by_key]
        if not live:
            raise CheckpointError(
                f"checkpoint {where} does not fit: it saved table {item['name']!r} (as "
                f"{', '.join(item['keys'])}), expected a table there, and none of the objects "
                "restored here holds one. Create the table (any placement: the same rows, "
                "dtype and optimizer) and its optimizer before restore(), under the same "
                f"names. {NOTHING_CHANGED}")
        t = live[0]
        d = t.rows
        if any(x is not t for x in live[1:]):
            raise CheckpointError(f"checkpoint {where} does not fit: {', '.join(item['keys'])} "
                                  "were one table when saved, and are different tables here. "
                                  + NOTHING_CHANGED)
        have = (d.num_rows, d.row_bytes, d.width, dtype_name(d.dtype))
        want = (item["num_rows"], item["row_bytes"], item["width"], item["dtype"])
        if have != want:
            raise CheckpointError(
                f"checkpoint {where} does not fit table {d.name!r}: it holds {want[0]:,} rows "
                f"of {want[2]} {want[3]} ({want[1]} bytes: weights and optimizer state), "
                f"expected {have[0]:,} rows of {have[2]} {have[3]} ({have[1]} bytes). Create the "
                "table with the same size and dtype, and its optimizer (the same class: its "
                f"state is part of each row), before restore(). {NOTHING_CHANGED}")
        out[k] = t
    return out


class _Stream:
    """The bytes of one tensor entry, in order; each segment's checksum is checked before any
    of its bytes is handed out (one segment held at a time)."""

    def __init__(self, root: Path, entry: dict, what: str):
        self.root, self.what = root, what
        self.segs = entry["segments"] or []
        self.k = 0
        self.buf = np.empty(0, dtype=np.uint8)
        self.pos = self.end = 0
        self.files: dict[str, int] = {}
        self.read = 0

    def _next(self) -> None:
        name, off, n, crc = self.segs[self.k]
        self.k += 1
        if len(self.buf) < n:
            self.buf = np.empty(n, dtype=np.uint8)
        fd = self.files.get(name)
        if fd is None:
            try:
                fd = open_regular(self.root, name)
            except Damaged as e:
                raise Damaged(f"{self.what}: {e}") from None
            _fadvise(fd, "POSIX_FADV_SEQUENTIAL")
            self.files[name] = fd
        mv, got = memoryview(self.buf)[:n], 0
        while got < n:
            r = os.preadv(fd, [mv[got:]], off + got)
            if r <= 0:
                raise Damaged(f"{self.what}: {name} is truncated (wanted {n} bytes at {off})")
            got += r
        if zlib.crc32(mv) != crc:
            raise Damaged(f"{self.what}: checksum mismatch in {name} bytes {off}..{off + n} "
                           "(file damaged)")
        self.pos, self.end = 0, n
        self.read += n

    def read_into(self, out: np.ndarray) -> None:
        out = out.reshape(-1)
        got = 0
        while got < len(out):
            if self.pos == self.end:
                if self.k == len(self.segs):
                    raise Damaged(f"{self.what}: ends early")
                self._next()
            take = min(len(out) - got, self.end - self.pos)
            out[got:got + take] = self.buf[self.pos:self.pos + take]
            got += take
            self.pos += take

    def done(self) -> bool:
        return self.pos == self.end and all(s[2] == 0 for s in self.segs[self.k:])

    def close(self) -> None:
        for fd in self.files.values():
            _fadvise(fd, "POSIX_FADV_DONTNEED")
            os.close(fd)
        self.files.clear()


class _Delta:
    """A delta's records, read piece by piece, laid over base blocks in row order."""

    def __init__(self, stream: _Stream, count: int, row_bytes: int, num_rows: int):
        self.stream, self.left, self.rb, self.n = stream, count, row_bytes, num_rows
        self.buf = np.empty((max(1, PIECE // (_ID + row_bytes)), _ID + row_bytes), np.uint8)
        self.ids = np.zeros(0, dtype=np.int64)
        self.pos = 0
        self.last = -1

    def apply(self, block: np.ndarray, a: int, b: int) -> None:
        """``block`` holds rows ``a:b``: put this delta's rows among them in place."""
        while True:
            if self.pos == len(self.ids):
                if not self.left:
                    return
                k = min(len(self.buf), self.left)
                self.stream.read_into(self.buf[:k])
                self.left -= k
                self.ids = self.buf[:k, :_ID].copy().view("<i8").reshape(-1).astype(np.int64)
                self.pos = 0
                if (self.ids[0] <= self.last or self.ids[-1] >= self.n
                        or (k > 1 and np.any(np.diff(self.ids) <= 0))):
                    raise Damaged(f"{self.stream.what}: row ids out of order or out of range")
                self.last = int(self.ids[-1])
            ids = self.ids[self.pos:]
            j = int(np.searchsorted(ids, b))
            if j:
                if ids[0] < a:
                    raise Damaged(f"{self.stream.what}: row ids out of order")
                block[ids[:j] - a] = self.buf[self.pos:self.pos + j, _ID:]
                self.pos += j
            if self.pos < len(self.ids):         # the next row is past this block
                return


def restore(t: Table, links: list[tuple[Path, dict, dict]], chunk_bytes: int) -> int:
    """Rewrite every row of ``t`` from its chain: ``(directory, link, tensor entry)`` for the
    base, then each delta, oldest first. Returns the checkpoint bytes read."""
    from ..rowfile.fileio import _aligned
    d = t.rows = t.tier.whole(writes=True)     # (its cache of hot rows emptied: written below)
    (base_dir, base_link, base_entry), deltas = links[0], links[1:]
    rb, n = d.row_bytes, d.num_rows
    records = bool(base_link.get("records"))
    _check_shape(base_entry, [n, rb + (_ID if records else 0)], base_dir, d.name)
    for root, link, entry in deltas:
        _check_shape(entry, [link["count"], _ID + rb], root, d.name)
    d.discard_cache()                      # its cached rows are older than the checkpoint's
    if records:
        return restore_records(d, base_dir, base_entry, deltas, chunk_bytes)
    base = _Stream(base_dir, base_entry, f"{base_dir.name}: base of disk table {d.name!r}")
    laid = [_Delta(_Stream(root, e, f"{root.name}: delta of disk table {d.name!r}"),
                   link["count"], rb, n) for root, link, e in deltas]
    # blocks of chunk_bytes / 8: with the base's pieces (chunk_bytes / 4 as saved), RowFile's
    # bounce buffer and a piece of each delta, a restore stays under chunk_bytes of RAM
    per = max(1, (chunk_bytes // 8) // max(rb, d.stride))
    bufs = [_aligned(per * rb).reshape(per, rb) for _ in range(2)]
    pool = ThreadPoolExecutor(1, thread_name_prefix="nbtools-ckpt-write")
    try:
        writing = None
        for k, a in enumerate(range(0, n, per)):
            m = min(per, n - a)
            block = bufs[k % 2][:m]
            base.read_into(block)
            for delta in laid:
                delta.apply(block, a, a + m)
            if writing is not None:
                writing.result()
            writing = pool.submit(d.write_bytes, a, block)   # while the next is merged
        if writing is not None:
            writing.result()
        if not base.done() or any(x.left or x.pos < len(x.ids) for x in laid):
            raise Damaged(f"{base_dir.name}: the chain of disk table {d.name!r} holds more "
                           "rows than the table")
    finally:
        pool.shutdown()
        for s in (base, *(x.stream for x in laid)):
            s.close()
    return base.read + sum(x.stream.read for x in laid)


def restore_records(d, base_dir: Path, base_entry: dict, deltas: list,
                     chunk_bytes: int) -> int:
    """A base of records (a log file's, in file order) and its deltas, written row by row
    through ``d.write_records`` (appended, in a log file), oldest first: each row ends as the
    newest record of it. Every row must be in the base exactly once."""
    rb, n = d.row_bytes, d.num_rows
    rec = _ID + rb
    per = max(1, (chunk_bytes // 8) // max(rec, d.stride))
    buf = np.empty((per, rec), dtype=np.uint8)
    seen = np.zeros(n, dtype=bool)
    streams = [(_Stream(base_dir, base_entry, f"{base_dir.name}: base of disk table "
                                              f"{d.name!r}"), n, True)]
    streams += [(_Stream(root, e, f"{root.name}: delta of disk table {d.name!r}"),
                 link["count"], False) for root, link, e in deltas]
    try:
        for stream, count, is_base in streams:
            for a in range(0, count, per):
                k = min(per, count - a)
                stream.read_into(buf[:k])
                ids = buf[:k, :_ID].copy().view("<i8").reshape(-1).astype(np.int64)
                if ids.min() < 0 or ids.max() >= n or len(np.unique(ids)) != k:
                    raise Damaged(f"{stream.what}: row ids repeated or out of range")
                if is_base:
                    if seen[ids].any():
                        raise Damaged(f"{stream.what}: a row saved twice")
                    seen[ids] = True
                d.write_records(ids, np.ascontiguousarray(buf[:k, _ID:]))
            if not stream.done():
                raise Damaged(f"{stream.what}: holds more rows than recorded")
            if is_base and not seen.all():
                raise Damaged(f"{stream.what}: {int((~seen).sum()):,} rows missing")
    finally:
        for stream, _, _ in streams:
            stream.close()
    return sum(stream.read for stream, _, _ in streams)


def _check_shape(entry: dict, want: list, root: Path, name: str) -> None:
    if list(entry["shape"]) != want or entry["dtype"] != "uint8":
        raise Damaged(f"{root.name}: the rows of disk table {name!r} are {entry['shape']} "
                       f"{entry['dtype']}, expected {want} uint8")


def describe(saved: list[SaveRows]) -> str:
    """``emb: delta of 1,234 rows (29.1 KiB)`` for the save's report."""
    parts = []
    for s in saved:
        if s.kind == "same":
            parts.append(f"{s.table.rows.name}: unchanged")
        else:
            what = "base" if s.kind == "base" else "delta"
            parts.append(f"{s.table.rows.name}: {what} of {s.count:,} rows "
                         f"({human_bytes(s.entry['bytes'])})")
    return "; ".join(parts)
