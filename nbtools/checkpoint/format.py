"""The on-disk format of one checkpoint: data files of raw tensor bytes (written and read in
chunks, CRC-32 per run) and the ``MANIFEST`` that lists them, with its own checksum.

A checkpoint directory holds ``data-0000.bin``, ``data-0001.bin``, ... (rolling over at
``file_bytes``), an optional ``extras.pt`` for values JSON cannot hold, and ``MANIFEST``, written
last. The manifest's first line is ``nbtools-checkpoint <version> crc32=<8 hex> bytes=<n>``; the
rest is JSON: every tensor's dtype, stored dtype, shape and segments ``[file, offset, nbytes,
crc32]``, every file's size, and the encoded state trees (:mod:`nbtools.checkpoint.tree`).

A checkpoint may come from someone else (a shared Drive folder), so what it says is data: a
manifest is checked against the layout this module writes before anything it names is opened
(:func:`check_manifest`: plain file names of the format, chain links that are step directories
of the same root, indices in range), and every file is opened as a regular file, never through
a symbolic link, never blocking on a FIFO (:func:`open_regular`). A manifest that fails is a
damaged checkpoint, like one whose checksum fails.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import stat
import zlib
from pathlib import Path

import torch

from .. import NbtoolsError
from ..devices import cuda_ok
from ..rowfile import fadvise
from ..files import create_private, regular_or_refuse

FORMAT = "nbtools-checkpoint"
FORMAT_VERSION = 2                # what this reads; checkpoints without disk tables are written as 1
MANIFEST = "MANIFEST"
EXTRAS = "extras.pt"
ALIGN = 64                       # every tensor starts at a multiple of this in its data file
STEP_DIR = re.compile(r"^step-(\d{9,})(?:-r(\d+))?$")   # a checkpoint's directory under its root
DATA_FILE = re.compile(r"^data-\d{4,}\.bin$")          # its data files
# A checkpoint holds the user's tables and state: what nbtools creates of one (files, step
# directories, a root it makes) is the user's alone, whatever the umask, as its table files
# are. To share a checkpoint, chmod it (or its root) as you mean to.
PRIVATE_FILE, PRIVATE_DIR = 0o600, 0o700
MANIFEST_MAX_BYTES = 1 << 30     # a manifest is JSON text: one past this is not one nbtools wrote


class CheckpointError(NbtoolsError, RuntimeError):
    """A checkpoint could not be written or none could be restored."""


class CheckpointSpaceError(NbtoolsError, OSError):
    """Not enough free space for a checkpoint (checked before writing, or ENOSPC while writing)."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped, or a half-precision one was restored."""


class Damaged(Exception):
    """Internal: this checkpoint fails verification (the message says where)."""


@dataclasses.dataclass
class CheckpointConfig:
    """Tuning knobs of :class:`CheckpointManager` (the defaults suit Colab and local disks)."""

    chunk_bytes: int = 64 << 20        # bytes per read/write call: the only extra RAM a save needs
    file_bytes: int = 1 << 30          # data files roll over at this size: Drive uploads whole files
    half_tables: bool = False          # store large float tensors (tables, per-row state) as half
    half_dtype: str = "bfloat16"       # bfloat16 keeps float32's range (Adam's tiny exp_avg_sq)
    half_min_bytes: int = 16 << 20     # a float tensor at least this big counts as a "table"
    fsync: bool = True                 # make each file durable before the checkpoint becomes visible
    drop_page_cache: bool = True       # don't let written/read files crowd the table out of RAM
    free_space_margin_bytes: int = 64 << 20   # refuse a save that would leave less than this
    progress: bool | None = None       # None: a bar only for saves/restores longer than ~1 s
    verbose: bool = True               # one line per save / restore with its throughput
    # Disk tables (placement="disk") are saved as a full copy of their rows (a base), then as
    # the rows changed since the previous save (deltas). A new base comes after this many
    # saves (a restore reads the base and every delta since: this bounds the chain) ...
    base_every: int = 24
    # ... or once the deltas since the base would hold more than this fraction of the rows
    # (then a base costs little more, and the chain's disk space stays under 1 + this x base)
    base_fraction: float = 0.5

    def __post_init__(self):
        if self.chunk_bytes < 4096 or self.chunk_bytes % ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGN} and >= 4096, "
                             f"got {self.chunk_bytes}")
        if self.file_bytes < self.chunk_bytes or self.file_bytes % ALIGN:
            raise ValueError(f"file_bytes must be a multiple of {ALIGN} and >= chunk_bytes, "
                             f"got {self.file_bytes}")
        if self.half_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"half_dtype must be 'bfloat16' or 'float16', got {self.half_dtype!r}")
        if isinstance(self.base_every, bool) or not isinstance(self.base_every, int) \
                or self.base_every < 1:
            raise ValueError(f"base_every must be an int >= 1 (saves per full copy of a disk "
                             f"table), got {self.base_every!r}")
        if not 0.0 <= self.base_fraction <= 1.0:
            raise ValueError(f"base_fraction must be between 0 and 1 (the share of a disk "
                             f"table's rows that deltas may hold), got {self.base_fraction!r}")



def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise Damaged(f"unknown dtype {name!r} in manifest")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def fsync_dir(path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:        # some filesystems (FUSE mounts) refuse fsync on directories
        pass
    finally:
        os.close(fd)


_fadvise = fadvise         # (one implementation: nbtools.rowfile's)


def write_all(f, mv) -> None:
    """Write every byte of ``mv`` to file object ``f`` (a short write goes on where it
    stopped): a checkpoint's one way to its files (tests put a fault here)."""
    while len(mv):
        n = f.write(mv)
        mv = mv[n:]


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


# --- the data files -----------------------------------------------------------------------------

class DataWriter:
    """Appends tensors to data-0000.bin, data-0001.bin, ... (rolling over at file_bytes).

    Each tensor's bytes become segments ``[file, offset, nbytes, crc32]``. The write of a
    chunk runs on a worker thread while this thread computes its CRC: both release the GIL.
    """

    def __init__(self, root: Path, cfg: CheckpointConfig, pool, bar):
        self.root, self.cfg, self.pool, self.bar = root, cfg, pool, bar
        self.files: dict[str, int] = {}
        self.f = None
        self.name = None
        self.offset = 0
        self.written = 0

    def _open_next(self):
        self._close()
        self.name = f"data-{len(self.files):04d}.bin"
        self.f = os.fdopen(create_new(self.root, self.name), "wb", buffering=0)
        self.files[self.name] = 0
        self.offset = 0

    def _close(self):
        if self.f is None:
            return
        if self.cfg.fsync:
            os.fsync(self.f.fileno())
        if self.cfg.drop_page_cache:
            _fadvise(self.f.fileno(), "POSIX_FADV_DONTNEED")
        self.f.close()
        self.f = None

    def begin_tensor(self) -> list:
        if self.f is None:
            self._open_next()
        pad = (-self.offset) % ALIGN
        if pad and self.offset + pad < self.cfg.file_bytes:
            write_all(self.f, memoryview(bytes(pad)))
            self.offset += pad
            self.files[self.name] = self.offset
        elif pad:
            self._open_next()
        self.segments = []
        return self.segments

    def cut(self) -> None:
        """Start a new segment (its own checksum) here: a reader can then check each piece
        before using it, holding one piece at a time."""
        if self.segments and self.segments[-1][2]:
            self.segments.append([self.name, self.offset, 0, 0])

    def write(self, mv: memoryview) -> None:
        while len(mv):
            if self.offset >= self.cfg.file_bytes:
                self._open_next()
            piece = mv[: self.cfg.file_bytes - self.offset]
            if not self.segments or self.segments[-1][0] != self.name:
                self.segments.append([self.name, self.offset, 0, 0])
            seg = self.segments[-1]
            fut = self.pool.submit(write_all, self.f, piece)
            seg[3] = zlib.crc32(piece, seg[3])
            fut.result()
            n = len(piece)
            seg[2] += n
            self.offset += n
            self.written += n
            self.files[self.name] = self.offset
            if self.bar is not None:
                self.bar.update(n)
            mv = mv[n:]

    def close(self):
        self._close()


class Staging:
    """Reusable host buffers for chunks that cannot be read/written in place (pinned when CUDA
    is there, so GPU copies run at full speed)."""

    def __init__(self, nbytes: int, count: int = 1):
        pin = cuda_ok()
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]

    def get(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.bufs[i % len(self.bufs)].view(dtype)[:numel]


def save_chunks(t: torch.Tensor, stored: torch.dtype, cfg: CheckpointConfig, staging):
    """Yield the stored bytes of ``t`` chunk by chunk, never more than one chunk extra in RAM."""
    from ..hostmem import count_transfer

    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.dim() == 0:
        t = t.reshape(1)
    itemsize = torch.empty((), dtype=stored).element_size()
    per_chunk = cfg.chunk_bytes // itemsize
    if t.device.type == "cpu" and t.is_contiguous() and t.dtype == stored:
        mv = _byte_view(t)                         # straight from the tensor's own memory
        for a in range(0, len(mv), cfg.chunk_bytes):
            yield mv[a: a + cfg.chunk_bytes]
        return
    if t.is_contiguous():
        flat = t.view(-1)
        for a in range(0, flat.numel(), per_chunk):
            piece = flat[a: a + per_chunk]
            buf = staging.get(0, stored, piece.numel())
            buf.copy_(piece)
            if t.is_cuda:
                count_transfer(d2h=piece.numel() * t.element_size())
            yield _byte_view(buf)
        return
    # Non-contiguous: slices along dim 0, each made contiguous in the staging buffer.
    row = max(1, t[0].numel()) if t.shape[0] else 1
    rows = max(1, per_chunk // row)
    for a in range(0, t.shape[0], rows):
        piece = t[a: a + rows]
        if piece.numel() > per_chunk:              # one row larger than a chunk: rare, copy it
            buf = piece.to(device="cpu", dtype=stored).contiguous()
        else:
            buf = staging.get(0, stored, piece.numel()).view(piece.shape)
            buf.copy_(piece)
        if t.is_cuda:
            count_transfer(d2h=piece.numel() * t.element_size())
        yield _byte_view(buf)


class Reader:
    """Reads tensors back from the data files into destination tensors, verifying CRCs."""

    def __init__(self, root: Path, cfg: CheckpointConfig, pool, bar):
        self.root, self.cfg, self.pool, self.bar = root, cfg, pool, bar
        self.handles: dict[str, object] = {}
        self.staging = None
        self.read = 0

    def _file(self, name):
        f = self.handles.get(name)
        if f is None:
            f = os.fdopen(open_regular(self.root, name), "rb", buffering=0)
            _fadvise(f.fileno(), "POSIX_FADV_SEQUENTIAL")
            self.handles[name] = f
        return f

    def close(self):
        for f in self.handles.values():
            if self.cfg.drop_page_cache:
                _fadvise(f.fileno(), "POSIX_FADV_DONTNEED")
            f.close()
        self.handles.clear()

    def read_tensor(self, entry: dict, dst: torch.Tensor | None, where: str) -> None:
        """Stream ``entry``'s bytes into ``dst`` (contiguous, of the entry's shape), or only
        verify them when ``dst`` is None."""
        from ..hostmem import count_transfer

        stored = _dtype(entry["stored"])
        itemsize = torch.empty((), dtype=stored).element_size()
        direct = (dst is not None and dst.device.type == "cpu" and dst.dtype == stored)
        dst_bytes = _byte_view(dst) if direct else None
        dst_flat = dst.view(-1) if dst is not None and dst.dim() else (
            dst.reshape(1) if dst is not None else None)
        if not direct and self.staging is None:
            self.staging = Staging(self.cfg.chunk_bytes, 2)
        # The plan: reads of at most chunk_bytes, each inside one segment.
        plan = []                    # (segment index, file, offset, nbytes, position in tensor)
        pos = 0
        for si, (name, off, nbytes, _) in enumerate(entry["segments"]):
            for a in range(0, nbytes, self.cfg.chunk_bytes):
                n = min(self.cfg.chunk_bytes, nbytes - a)
                plan.append((si, name, off + a, n, pos))
                pos += n
        if pos != entry["bytes"]:
            raise Damaged(f"{where}: segments hold {pos} bytes, manifest says {entry['bytes']}")

        def buffer(k):
            _, _, _, n, p = plan[k]
            if direct:
                return dst_bytes[p: p + n]
            return _byte_view(self.staging.get(k, torch.uint8, n))

        def do_read(k, mv):
            _, name, off, n, _ = plan[k]
            f = self._file(name)
            if f.tell() != off:          # reads are sequential: seek only between tensors
                f.seek(off)
            got = 0
            while got < n:
                r = f.readinto(mv[got:])
                if not r:
                    break
                got += r
            return got

        crcs = [0] * len(entry["segments"])
        fut = self.pool.submit(do_read, 0, buffer(0)) if plan else None
        for k, (si, name, off, n, p) in enumerate(plan):
            mv = buffer(k)
            got = fut.result()
            if got != n:
                raise Damaged(f"{where}: {name} is truncated (wanted {n} bytes at {off}, got {got})")
            if k + 1 < len(plan):                  # read the next chunk while checking this one
                fut = self.pool.submit(do_read, k + 1, buffer(k + 1))
            crcs[si] = zlib.crc32(mv, crcs[si])
            if dst is not None and not direct:
                a = p // itemsize
                src = self.staging.get(k, stored, n // itemsize)
                dst_flat[a: a + src.numel()].copy_(src)
                if dst.is_cuda:
                    count_transfer(h2d=src.numel() * dst.element_size())
            self.read += n
            if self.bar is not None:
                self.bar.update(n)
        for si, seg in enumerate(entry["segments"]):
            if crcs[si] != seg[3]:
                raise Damaged(f"{where}: checksum mismatch in {seg[0]} bytes {seg[1]}.."
                               f"{seg[1] + seg[2]} (file damaged)")


# --- manifests ----------------------------------------------------------------------------------

def write_manifest(root: Path, body: dict, fsync: bool) -> None:
    data = json.dumps(body, indent=1, allow_nan=True).encode()
    version = body.get("version", FORMAT_VERSION)
    head = f"{FORMAT} {version} crc32={zlib.crc32(data):08x} bytes={len(data)}\n".encode()
    fd = os.open(root / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, PRIVATE_FILE)
    with os.fdopen(fd, "wb") as f:
        f.write(head + data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint directory ``path``, checked (:func:`check_manifest`);
    raises :class:`Damaged` for anything else."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise Damaged(f"unreadable ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise Damaged(f"{path.name} is {_kind(st.st_mode)}, not a directory; a checkpoint is "
                      "a directory of regular files")
    try:
        fd = open_regular(path, MANIFEST)
    except Damaged as e:
        if "is missing" in str(e):
            raise Damaged("no MANIFEST (incomplete upload or copy)") from None
        raise
    with os.fdopen(fd, "rb") as f:
        fst = os.fstat(f.fileno())
        # A manager reads every manifest of its folders at each save (naming, pruning): one
        # already read and checked, in a file that has not changed since (its inode, size and
        # times; ctime moves on any change and cannot be set back), is not read again.
        key = (fst.st_dev, fst.st_ino, fst.st_size, fst.st_mtime_ns, fst.st_ctime_ns)
        known = _checked.get(key)
        if known is not None:
            return known
        raw = f.read(MANIFEST_MAX_BYTES + 1)
    if len(raw) > MANIFEST_MAX_BYTES:
        raise Damaged(f"MANIFEST is over {MANIFEST_MAX_BYTES:,} bytes: not one nbtools wrote")
    head, _, data = raw.partition(b"\n")
    m = re.fullmatch(rf"{FORMAT} (\d+) crc32=([0-9a-f]{{8}}) bytes=(\d+)".encode(), head)
    if not m:
        raise Damaged("MANIFEST has no valid header (empty or damaged file)")
    if int(m.group(1)) > FORMAT_VERSION:
        raise Damaged(f"written by a newer nbtools (format {int(m.group(1))}); upgrade nbtools")
    if len(data) != int(m.group(3)) or zlib.crc32(data) != int(m.group(2), 16):
        raise Damaged("MANIFEST checksum mismatch (file truncated or damaged)")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise Damaged(f"MANIFEST is not valid JSON: {e}") from None
    check_manifest(body)
    if len(_checked) >= 512:
        _checked.clear()
    _checked[key] = body
    return body


_checked: dict[tuple, dict] = {}     # read_manifest's: file identity -> the checked manifest


def check_files(path: Path, manifest: dict) -> None:
    """Cheap structural check: every file there, a regular file (not a link) with exactly its
    recorded size."""
    for name, size in manifest["files"].items():
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            raise Damaged(f"{name} is missing") from None
        except OSError as e:
            raise Damaged(f"{name} unreadable ({e.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise Damaged(f"{name} is {_kind(st.st_mode)}, not a regular file")
        if st.st_size != size:
            raise Damaged(f"{name} has {st.st_size:,} bytes, expected {size:,} (truncated or "
                           "not fully uploaded)")


# --- what a checkpoint may open -----------------------------------------------------------------

def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return what
    return "not a regular file"


def _check_name(name) -> None:
    if not isinstance(name, str) or not (name in (MANIFEST, EXTRAS) or DATA_FILE.match(name)):
        raise Damaged(f"names a file {name!r}; a checkpoint holds only {MANIFEST}, {EXTRAS} and "
                      "data-NNNN.bin")


def open_regular(folder, name: str, flags: int = os.O_RDONLY) -> int:
    """A descriptor of the regular file ``name`` in ``folder``: ``name`` is one the format
    writes (no separators, no ``..``), a symbolic link is refused (``O_NOFOLLOW``), and a FIFO
    or device is refused without blocking (opened ``O_NONBLOCK``, checked with ``fstat``).
    Raises :class:`Damaged` naming the file."""
    _check_name(name)
    try:
        fd = os.open(os.path.join(folder, name),
                     flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise Damaged(f"{name} is missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Damaged(f"{name} is a symbolic link; a checkpoint holds regular files "
                          "only") from None
        raise Damaged(f"{name} unreadable ({e.strerror})") from None

    def refuse(mode):
        raise Damaged(f"{name} is {_kind(mode)}, not a regular file")
    return regular_or_refuse(fd, refuse)


def create_new(folder, name: str) -> int:
    """A descriptor of the new file ``name`` in ``folder``, opened for writing: never an
    existing file or a link planted at its name (:func:`nbtools.files.create_private`)."""
    _check_name(name)
    return create_private(os.path.join(folder, name))


def _int(v, lo: int = 0) -> bool:
    return type(v) is int and v >= lo


def check_manifest(m) -> None:
    """Raise :class:`Damaged` unless the manifest ``m`` has the layout :func:`write_manifest`
    writes: file names of the format, sizes and offsets that are counts, segments inside their
    files, tensors of known dtypes, chain links naming step directories (never a path), and
    state trees whose indices point at entries that exist. Nothing is opened."""
    def bad(what):
        raise Damaged(f"MANIFEST {what}")
    if not isinstance(m, dict):
        bad("is not a JSON object")
    files = m.get("files")
    if not isinstance(files, dict):
        bad("has no file list")
    for name, size in files.items():
        _check_name(name)
        if name == MANIFEST or not _int(size):
            bad(f"lists file {name!r} with size {size!r}")
    for key in ("step", "seq"):
        if not _int(m.get(key, 0), -1):
            bad(f"has {key} {m.get(key)!r}, expected a count")
    if not isinstance(m.get("id", ""), str):
        bad(f"has id {m.get('id')!r}, expected a string")
    tensors = m.get("tensors")
    if not isinstance(tensors, list):
        bad("has no tensor list")
    for i, e in enumerate(tensors):
        _check_tensor(e, i, files, bad)
    extras = m.get("extras")
    if extras is not None:
        if (not isinstance(extras, dict) or extras.get("file") != EXTRAS
                or EXTRAS not in files or not _int(extras.get("bytes"))
                or extras["bytes"] != files[EXTRAS]
                or not _int(extras.get("crc32")) or extras["crc32"] >= 1 << 32):
            bad(f"describes its side file as {extras!r}")
    rows = m.get("rows") or []
    if not isinstance(rows, list):
        bad("has a rows entry that is not a list")
    for item in rows:
        _check_rows_item(item, bad)
    objects = m.get("objects")
    if not isinstance(objects, dict):
        bad("has no objects")
    for name, saved in objects.items():
        if not isinstance(saved, dict) or "state" not in saved \
                or not isinstance(saved.get("type"), (str, type(None))):
            bad(f"describes object {name!r} as {type(saved).__name__}")
        _check_tree(saved["state"], len(tensors), len(rows), bad)
    if m.get("rng") is not None:
        _check_tree(m["rng"], len(tensors), 0, bad)


def _check_tensor(e, i: int, files: dict, bad) -> None:
    if not isinstance(e, dict) or not isinstance(e.get("shape"), list) \
            or not all(_int(n) for n in e["shape"]) or not _int(e.get("bytes")):
        bad(f"describes tensor {i} as {e!r:.200}")
    for key in ("dtype", "stored"):
        _dtype(str(e.get(key)))
    segments = e.get("segments") or []
    if not isinstance(segments, list):
        bad(f"gives tensor {i} segments {segments!r:.200}")
    total = 0
    for seg in segments:
        if (not isinstance(seg, list) or len(seg) != 4 or seg[0] not in files
                or not all(_int(v) for v in seg[1:]) or seg[3] >= 1 << 32
                or seg[1] + seg[2] > files[seg[0]]):
            bad(f"gives tensor {i} a segment {seg!r:.200} outside its files")
        total += seg[2]
    if total != e["bytes"]:
        bad(f"gives tensor {i} segments of {total:,} bytes for its {e['bytes']:,}")
    numel = 1
    for n in e["shape"]:
        numel *= n
    if numel * _dtype(e["stored"]).itemsize != e["bytes"]:
        bad(f"gives tensor {i} of shape {e['shape']} {e['stored']} {e['bytes']:,} bytes")


def _check_rows_item(item, bad) -> None:
    if (not isinstance(item, dict) or not isinstance(item.get("name"), str)
            or not isinstance(item.get("keys"), list)
            or not all(isinstance(k, str) for k in item["keys"])
            or not all(_int(item.get(k)) for k in ("num_rows", "row_bytes", "width", "count"))
            or not isinstance(item.get("dtype"), str) or not isinstance(item.get("chain"), list)
            or not item["chain"]):
        bad(f"describes a disk table as {item!r:.200}")
    for link in item["chain"]:
        if (not isinstance(link, dict) or not isinstance(link.get("dir"), str)
                or not STEP_DIR.match(link["dir"]) or not isinstance(link.get("id"), str)
                or not _int(link.get("tensor")) or not _int(link.get("count"))
                or link.get("kind") not in ("base", "delta")
                or not isinstance(link.get("records", False), bool)):
            bad(f"links disk table {item['name']!r} to {link!r:.200}; a link names a step "
                "directory of the same root")


TREE_MAX_DEPTH = 100   # lists, tuples and dicts a saved state nests at most (save refuses more)
_JSON_MAX_DEPTH = 4 * TREE_MAX_DEPTH     # what that takes in JSON (a mapping of int keys: 3 a level)


def _nodes(tree):
    """Every dict node of an encoded state tree, walked without recursion (a crafted tree
    may nest deeper than Python recurses); leaves (tensors, rows, side-file values) are not
    entered. A tree nested deeper than a save allows raises :class:`Damaged` (decoding it
    would recurse past Python's limit)."""
    todo = [(tree, 0)]
    while todo:
        x, depth = todo.pop()
        if depth > _JSON_MAX_DEPTH:
            raise Damaged(f"MANIFEST holds a state nested over {_JSON_MAX_DEPTH} levels deep: "
                          "not one nbtools wrote")
        if type(x) is list:
            todo.extend([(v, depth + 1) for v in x if type(v) in (list, dict)])   # (no scalars)
        elif type(x) is dict:
            yield x
            if "$tensor" not in x and "$rows" not in x and "$pickle" not in x:
                todo.extend([(v, depth + 1) for v in x.values() if type(v) in (list, dict)])


def _key_ok(k) -> bool:
    """An encoded mapping key decodes to something hashable: a scalar, a tuple of keys, or a
    side-file value (checked when decoded: :func:`nbtools.checkpoint.tree.walk`)."""
    if k is None or type(k) in (bool, int, float, str):
        return True
    if type(k) is dict and len(k) == 1 and "$pickle" in k:
        return True
    return (type(k) is dict and len(k) == 1 and type(k.get("$tuple")) is list
            and all(_key_ok(v) for v in k["$tuple"]))


def _check_tree(tree, n_tensors: int, n_rows: int, bad) -> None:
    """The nodes of an encoded state tree (:mod:`~nbtools.checkpoint.tree`) are well formed
    and point at tensors and disk tables that exist."""
    for x in _nodes(tree):
        if "$tensor" in x:
            if not (_int(x["$tensor"]) and x["$tensor"] < n_tensors):
                bad(f"refers to tensor {x['$tensor']!r} of {n_tensors}")
        elif "$rows" in x:
            if not (_int(x["$rows"]) and x["$rows"] < n_rows and _int(x.get("offset"))
                    and isinstance(x.get("dtype"), str)
                    and isinstance(x.get("shape"), list) and x["shape"]
                    and all(_int(n) for n in x["shape"])
                    and isinstance(x.get("stride"), list)
                    and all(_int(n) for n in x["stride"])
                    and len(x["stride"]) == len(x["shape"]) - 1):
                bad(f"refers to disk table rows {x!r:.200}")
            _dtype(x["dtype"])
        elif "$pickle" in x:
            if not _int(x["$pickle"]):
                bad(f"refers to side-file value {x['$pickle']!r}")
        elif "$items" in x and (not isinstance(x["$items"], list) or not all(
                isinstance(p, list) and len(p) == 2 for p in x["$items"])):
            bad("holds a mapping that is not a list of pairs")
        elif "$items" in x and not all(_key_ok(p[0]) for p in x["$items"]):
            bad("holds a mapping with a key that is not a number, string or tuple")
        elif "$tuple" in x and not isinstance(x["$tuple"], list):
            bad("holds a tuple that is not a list")


def pickles(tree) -> int:
    """One past the largest side-file index an encoded tree refers to (0: none)."""
    return max((x["$pickle"] + 1 for x in _nodes(tree) if "$pickle" in x), default=0)
