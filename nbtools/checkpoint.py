"""Checkpoints that survive a Colab disconnect: chunked, atomic, verified, Drive-aware.

A checkpoint is a directory ``step-000000100`` holding raw tensor bytes in a few data files,
a small side file for the odd non-JSON value, and a ``MANIFEST`` written last: it lists every
tensor (dtype, shape, where its bytes are, CRC-32 of each run) and every file's size, and
carries its own checksum in its first line. The directory is built under a temporary name,
every file is fsync'ed, and only then is it renamed into place, so a checkpoint is either
complete or invisible. A process killed at any point leaves the earlier checkpoints intact.

Tensors are streamed in chunks (64 MiB by default), never copied whole: a 10 GB pinned table
is written straight from its host memory, and read back straight into it. CUDA tensors pass
through one reusable staging buffer.

Everything needed to continue exactly is saved: each object's ``state_dict()`` (modules with
offloaded tables, optimizers incl. :class:`~nbtools.OffloadOptimizer`, LR schedulers,
:class:`~nbtools.PinnedLoader`, metric histories), plain dicts, the step, and the RNG states of
python, numpy, torch CPU and CUDA.

>>> import tempfile
>>> model = torch.nn.Linear(3, 2)
>>> ckpt = CheckpointManager(tempfile.mkdtemp(), keep=2, config=CheckpointConfig(verbose=False))
>>> info = ckpt.save(10, model=model, extra={"epoch": 1})
>>> before = model.weight.detach().clone()
>>> with torch.no_grad():
...     _ = model.weight.zero_()
>>> ckpt.restore(model=model)
10
>>> torch.equal(model.weight, before)
True
"""
from __future__ import annotations

import collections
import dataclasses
import errno
import io
import json
import os
import random
import re
import shutil
import socket
import time
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from . import NbtoolsError, __version__
from .devices import cuda_ok, human_bytes

FORMAT = "nbtools-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST"
EXTRAS = "extras.pt"
_ALIGN = 64                       # every tensor starts at a multiple of this in its data file
_DIR_RE = re.compile(r"^step-(\d{9,})(?:-r(\d+))?$")
_TMP_PREFIX = ".tmp-"
_DEL_PREFIX = ".del-"
_RESERVED = ("rng", "half_tables", "allow_half")


class CheckpointError(NbtoolsError, RuntimeError):
    """A checkpoint could not be written or none could be restored."""


class CheckpointSpaceError(NbtoolsError, OSError):
    """Not enough free space for a checkpoint (checked before writing, or ENOSPC while writing)."""


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped, or a half-precision one was restored."""


class _Damaged(Exception):
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

    def __post_init__(self):
        if self.chunk_bytes < 4096 or self.chunk_bytes % _ALIGN:
            raise ValueError(f"chunk_bytes must be a multiple of {_ALIGN} and >= 4096, "
                             f"got {self.chunk_bytes}")
        if self.file_bytes < self.chunk_bytes or self.file_bytes % _ALIGN:
            raise ValueError(f"file_bytes must be a multiple of {_ALIGN} and >= chunk_bytes, "
                             f"got {self.file_bytes}")
        if self.half_dtype not in ("bfloat16", "float16"):
            raise ValueError(f"half_dtype must be 'bfloat16' or 'float16', got {self.half_dtype!r}")


# --- small helpers --------------------------------------------------------------------------

def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise _Damaged(f"unknown dtype {name!r} in manifest")
    return dt


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _fsync_dir(path) -> None:
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


def _fadvise(fd, advice_name: str) -> None:
    advice = getattr(os, advice_name, None)
    if advice is not None and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, advice)
        except OSError:
            pass


def _write_all(f, mv) -> None:
    while len(mv):
        n = f.write(mv)
        mv = mv[n:]


def _byte_view(t: torch.Tensor) -> memoryview:
    """Writable bytes of a contiguous CPU tensor, without copying."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _progress_bar(total: int, desc: str, progress):
    if progress is False or total <= 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    # delay: the bar appears only for operations that last longer than a moment.
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                delay=0 if progress else 1.0, leave=False)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{human_bytes(nbytes / seconds)}/s" if seconds > 0 else "N/A"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- state trees <-> JSON ---------------------------------------------------------------------
# JSON keeps everything readable; a tensor becomes {"$tensor": i} (its bytes go to the data
# files), a tuple {"$tuple": [...]}, a dict with non-string keys (optimizer state is keyed by
# int) {"$items": [[k, v], ...]}, and anything else ({"$pickle": i}) goes through torch.save
# into the small side file, so nothing is ever lost to the format.

def _streamable(x: torch.Tensor) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and x.device.type in ("cpu", "cuda") and not x.is_quantized)


class _Packer:
    def __init__(self):
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.extras: list = []

    def encode(self, x, path: str):
        if x is None or type(x) in (bool, int, float, str):
            return x
        if isinstance(x, torch.Tensor) and _streamable(x):
            self.tensors.append((path, x))
            return {"$tensor": len(self.tensors) - 1}
        if type(x) is list:
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(x)]
        if type(x) is tuple:
            return {"$tuple": [self.encode(v, f"{path}/{i}") for i, v in enumerate(x)]}
        if type(x) in (dict, collections.OrderedDict):
            plain = type(x) is dict and all(type(k) is str and not k.startswith("$") for k in x)
            if plain:
                return {k: self.encode(v, f"{path}/{k}") for k, v in x.items()}
            out = {"$items": [[self.encode(k, f"{path}/<key>"), self.encode(v, f"{path}/{k}")]
                              for k, v in x.items()]}
            if type(x) is collections.OrderedDict:
                out["$odict"] = True
                meta = getattr(x, "_metadata", None)     # module state_dict versions
                if meta is not None:
                    out["$meta"] = self.encode(meta, f"{path}/<metadata>")
            return out
        self.extras.append(x)
        return {"$pickle": len(self.extras) - 1}


def _decode(x, tensors, extras):
    if isinstance(x, list):
        return [_decode(v, tensors, extras) for v in x]
    if not isinstance(x, dict):
        return x
    if "$tensor" in x:
        return tensors[x["$tensor"]]
    if "$tuple" in x:
        return tuple(_decode(v, tensors, extras) for v in x["$tuple"])
    if "$pickle" in x:
        return extras[x["$pickle"]]
    if "$items" in x:
        items = [(_decode(k, tensors, extras), _decode(v, tensors, extras)) for k, v in x["$items"]]
        if x.get("$odict"):
            out = collections.OrderedDict(items)
            if "$meta" in x:
                out._metadata = _decode(x["$meta"], tensors, extras)
            return out
        return dict(items)
    return {k: _decode(v, tensors, extras) for k, v in x.items()}


def _live_tensors(encoded, live, out: dict) -> None:
    """Walk a saved tree beside the object's current state; map tensor index -> live tensor."""
    if isinstance(encoded, list):
        if isinstance(live, (list, tuple)) and len(live) == len(encoded):
            for e, v in zip(encoded, live):
                _live_tensors(e, v, out)
        return
    if not isinstance(encoded, dict):
        return
    if "$tensor" in encoded:
        if isinstance(live, torch.Tensor):
            out[encoded["$tensor"]] = live
        return
    if "$tuple" in encoded:
        _live_tensors(encoded["$tuple"], live, out)
        return
    if "$pickle" in encoded:
        return
    if "$items" in encoded:
        if isinstance(live, dict):
            for k, v in encoded["$items"]:
                if isinstance(k, (str, int)) and not isinstance(k, bool) and k in live:
                    _live_tensors(v, live[k], out)
        return
    if isinstance(live, dict):
        for k, v in encoded.items():
            if k in live:
                _live_tensors(v, live[k], out)


# --- RNG ----------------------------------------------------------------------------------------

def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if cuda_ok():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None:
        if not cuda_ok():
            warnings.warn("the checkpoint holds CUDA RNG states but there is no GPU here: "
                          "CUDA random streams are not restored", CheckpointWarning, stacklevel=3)
        elif len(state["cuda"]) != torch.cuda.device_count():
            warnings.warn(f"the checkpoint holds RNG states of {len(state['cuda'])} GPUs, this "
                          f"machine has {torch.cuda.device_count()}: restoring the common ones",
                          CheckpointWarning, stacklevel=3)
            for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu(), i)
        else:
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


# --- the data files -----------------------------------------------------------------------------

class _DataWriter:
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
        self.f = open(self.root / self.name, "wb", buffering=0)
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
        pad = (-self.offset) % _ALIGN
        if pad and self.offset + pad < self.cfg.file_bytes:
            _write_all(self.f, memoryview(bytes(pad)))
            self.offset += pad
            self.files[self.name] = self.offset
        elif pad:
            self._open_next()
        self.segments = []
        return self.segments

    def write(self, mv: memoryview) -> None:
        while len(mv):
            if self.offset >= self.cfg.file_bytes:
                self._open_next()
            piece = mv[: self.cfg.file_bytes - self.offset]
            if not self.segments or self.segments[-1][0] != self.name:
                self.segments.append([self.name, self.offset, 0, 0])
            seg = self.segments[-1]
            fut = self.pool.submit(_write_all, self.f, piece)
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


class _Staging:
    """Reusable host buffers for chunks that cannot be read/written in place (pinned when CUDA
    is there, so GPU copies run at full speed)."""

    def __init__(self, nbytes: int, count: int = 1):
        pin = cuda_ok()
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(count)]

    def get(self, i: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.bufs[i % len(self.bufs)].view(dtype)[:numel]


def _save_chunks(t: torch.Tensor, stored: torch.dtype, cfg: CheckpointConfig, staging):
    """Yield the stored bytes of ``t`` chunk by chunk, never more than one chunk extra in RAM."""
    from .hostmem import count_transfer

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


class _Reader:
    """Reads tensors back from the data files into destination tensors, verifying CRCs."""

    def __init__(self, root: Path, cfg: CheckpointConfig, pool, bar):
        self.root, self.cfg, self.pool, self.bar = root, cfg, pool, bar
        self.handles: dict[str, object] = {}
        self.staging = None
        self.read = 0

    def _file(self, name):
        f = self.handles.get(name)
        if f is None:
            f = open(self.root / name, "rb", buffering=0)
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
        from .hostmem import count_transfer

        stored = _dtype(entry["stored"])
        itemsize = torch.empty((), dtype=stored).element_size()
        direct = (dst is not None and dst.device.type == "cpu" and dst.dtype == stored)
        dst_bytes = _byte_view(dst) if direct else None
        dst_flat = dst.view(-1) if dst is not None and dst.dim() else (
            dst.reshape(1) if dst is not None else None)
        if not direct and self.staging is None:
            self.staging = _Staging(self.cfg.chunk_bytes, 2)
        # The plan: reads of at most chunk_bytes, each inside one segment.
        plan = []                    # (segment index, file, offset, nbytes, position in tensor)
        pos = 0
        for si, (name, off, nbytes, _) in enumerate(entry["segments"]):
            for a in range(0, nbytes, self.cfg.chunk_bytes):
                n = min(self.cfg.chunk_bytes, nbytes - a)
                plan.append((si, name, off + a, n, pos))
                pos += n
        if pos != entry["bytes"]:
            raise _Damaged(f"{where}: segments hold {pos} bytes, manifest says {entry['bytes']}")

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
                raise _Damaged(f"{where}: {name} is truncated (wanted {n} bytes at {off}, got {got})")
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
                raise _Damaged(f"{where}: checksum mismatch in {seg[0]} bytes {seg[1]}.."
                               f"{seg[1] + seg[2]} (file damaged)")


# --- manifests ----------------------------------------------------------------------------------

def _write_manifest(root: Path, body: dict, fsync: bool) -> None:
    data = json.dumps(body, indent=1, allow_nan=True).encode()
    head = f"{FORMAT} {FORMAT_VERSION} crc32={zlib.crc32(data):08x} bytes={len(data)}\n".encode()
    with open(root / MANIFEST, "wb") as f:
        f.write(head + data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def _read_manifest(path: Path) -> dict:
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise _Damaged("no MANIFEST (incomplete upload or copy)") from None
    except OSError as e:
        raise _Damaged(f"MANIFEST unreadable: {e}") from None
    head, _, data = raw.partition(b"\n")
    m = re.fullmatch(rf"{FORMAT} (\d+) crc32=([0-9a-f]{{8}}) bytes=(\d+)".encode(), head)
    if not m:
        raise _Damaged("MANIFEST has no valid header (empty or damaged file)")
    if int(m.group(1)) > FORMAT_VERSION:
        raise _Damaged(f"written by a newer nbtools (format {int(m.group(1))}); upgrade nbtools")
    if len(data) != int(m.group(3)) or zlib.crc32(data) != int(m.group(2), 16):
        raise _Damaged("MANIFEST checksum mismatch (file truncated or damaged)")
    try:
        return json.loads(data)
    except ValueError as e:
        raise _Damaged(f"MANIFEST is not valid JSON: {e}") from None


def _check_files(path: Path, manifest: dict) -> None:
    """Cheap structural check: every file there with exactly its recorded size."""
    for name, size in manifest["files"].items():
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            raise _Damaged(f"{name} is missing") from None
        if actual != size:
            raise _Damaged(f"{name} has {actual:,} bytes, expected {size:,} (truncated or "
                           "not fully uploaded)")


@dataclasses.dataclass
class _Entry:
    path: Path
    step: int
    rev: int
    manifest: dict | None
    error: str | None

    @property
    def seq(self) -> int:
        return self.manifest["seq"] if self.manifest else -1


def _scan(root: Path) -> list[_Entry]:
    """Checkpoint directories under ``root`` (complete or damaged), newest first."""
    out = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return out
    for name in names:
        m = _DIR_RE.match(name)
        if not m or not (root / name).is_dir():
            continue
        try:
            manifest, error = _read_manifest(root / name), None
        except _Damaged as e:
            manifest, error = None, str(e)
        out.append(_Entry(root / name, int(m.group(1)), int(m.group(2) or 0), manifest, error))
    out.sort(key=lambda e: (e.seq, e.step, e.rev), reverse=True)
    return out


def _remove_dir(path: Path) -> None:
    """Rename out of the way first (atomic), then delete: a crash mid-delete never leaves a
    half-deleted directory that looks like a checkpoint."""
    trash = path.parent / f"{_DEL_PREFIX}{path.name}-{os.getpid()}-{time.time_ns():x}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _clean_leftovers(root: Path, max_age_s: float = 86400.0) -> None:
    """Remove temp directories of dead saves and interrupted deletions."""
    host = _host()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        path = root / name
        if name.startswith(_DEL_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(_TMP_PREFIX):
            parts = name.rsplit("-", 3)          # .tmp-<name>-<host>-<pid>-<nonce>
            try:
                same_host, pid = parts[1] == host, int(parts[2])
            except (IndexError, ValueError):
                same_host, pid = False, -1
            if same_host:
                stale = pid != os.getpid() and not _pid_alive(pid)
            else:
                try:
                    stale = time.time() - path.stat().st_mtime > max_age_s
                except OSError:
                    stale = False
            if stale:
                shutil.rmtree(path, ignore_errors=True)


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def _tmp_name(final_name: str) -> str:
    return f"{_TMP_PREFIX}{final_name}-{_host()}-{os.getpid()}-{time.time_ns():x}"


def prune(root, keep: int, protect=()) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root`` (and damaged ones
    older than all of those). Paths in ``protect`` are left alone. Returns what was deleted."""
    entries = _scan(Path(root))
    good = [e for e in entries if e.manifest is not None]
    removed = []
    protect = {Path(p) for p in protect}
    for e in good[keep:]:
        if e.path not in protect:
            _remove_dir(e.path)
            removed.append(e.path)
    if len(good) >= keep and keep > 0:
        oldest_kept = good[keep - 1].manifest.get("created_unix", 0)
        for e in entries:
            if e.manifest is None and e.path not in protect:
                try:
                    if e.path.stat().st_mtime < oldest_kept:
                        _remove_dir(e.path)
                        removed.append(e.path)
                except OSError:
                    pass
    return removed


def copy_checkpoint(src, dst_root, *, fsync: bool = True) -> Path:
    """Copy a finished checkpoint directory into ``dst_root`` atomically: files go to a temp
    directory inside ``dst_root`` (a rename from local disk into a Drive mount fails, EXDEV),
    are fsync'ed, MANIFEST last, then the directory is renamed into place there."""
    src, dst_root = Path(src), Path(dst_root)
    dst_root.mkdir(parents=True, exist_ok=True)
    final = dst_root / src.name
    if final.exists():
        try:
            if _read_manifest(final) == _read_manifest(src):
                _check_files(final, _read_manifest(final))
                return final                     # already there and complete
        except _Damaged:
            pass
        _remove_dir(final)
    manifest = _read_manifest(src)
    need = sum(manifest["files"].values())
    free = shutil.disk_usage(dst_root).free
    if free < need:
        raise CheckpointSpaceError(errno.ENOSPC, f"copying {src.name} needs {human_bytes(need)}; "
                                   f"{human_bytes(free)} free on {dst_root}")
    tmp = dst_root / _tmp_name(src.name)
    tmp.mkdir()
    try:
        for name in [*manifest["files"], MANIFEST]:
            with open(src / name, "rb") as fi, open(tmp / name, "wb") as fo:
                shutil.copyfileobj(fi, fo, 16 << 20)
                fo.flush()
                if fsync:
                    os.fsync(fo.fileno())
        if fsync:
            _fsync_dir(tmp)
        os.rename(tmp, final)
        if fsync:
            _fsync_dir(dst_root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


# --- the manager --------------------------------------------------------------------------------

class CheckpointManager:
    """Save and restore training state in ``directory``, keeping the newest ``keep``.

    Args:
        directory: local directory for checkpoints (created if needed).
        keep: how many complete checkpoints to keep (older ones are deleted after a save).
        mirror: a second directory (e.g. ``nbtools.colab.drive_dir("runs/w2v")``) or a
            :class:`nbtools.colab.DriveSync`: each finished checkpoint is copied there in the
            background (temp name + rename inside it). ``restore`` looks in both.
        config: :class:`CheckpointConfig` (chunk size, half precision, progress, ...).

    ``save(step, model=..., opt=..., sched=..., loader=..., history=..., extra={...})``;
    ``restore(model=..., opt=..., ...)`` returns the step (None when there is no checkpoint).
    """

    def __init__(self, directory, keep: int = 3, *, mirror=None, config: CheckpointConfig = None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory).expanduser()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.config = config or CheckpointConfig()
        self._seq = None
        self.last_restore = None     # figures of the last restore(): step, bytes, seconds, ...
        self.sync = None
        if mirror is not None:
            from .colab import DriveSync
            self.sync = mirror if isinstance(mirror, DriveSync) else DriveSync(mirror)
            self.sync.after_copy = lambda: prune(self.sync.target, self.keep)

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, *, rng: bool = True, half_tables: bool | None = None,
             **objects) -> dict:
        """Write a checkpoint of ``objects`` (keyword name -> object) at ``step``.

        Objects: anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers,
        schedulers, loaders, histories), plain dicts, or tensors. ``rng=False`` leaves out the
        RNG states; ``half_tables=True`` stores large float tensors in half precision (lossy,
        marked in the manifest). Returns ``{"step", "path", "bytes", "seconds",
        "bytes_per_s", "half"}``.
        """
        t0 = time.perf_counter()
        cfg = self.config
        step = self._check_step(step)
        half = cfg.half_tables if half_tables is None else bool(half_tables)
        if not isinstance(rng, bool):
            raise TypeError(f"rng={type(rng).__name__}: 'rng' is an option of save() (True/False)"
                            "; rename the object you meant to save")
        if not objects:
            raise ValueError("save() got no objects: pass them by name, e.g. "
                             "save(step, model=model, opt=opt)")
        if cuda_ok():
            torch.cuda.synchronize()   # GPU kernels may still be writing zero-copy tables

        packer = _Packer()
        tree = {}
        for name, obj in objects.items():
            tree[name] = {"type": f"{type(obj).__module__}.{type(obj).__qualname__}",
                          "state": packer.encode(self._state_of(name, obj), name)}
        rng_tree = packer.encode(_rng_state(), "<rng>") if rng else None

        half_dtype = getattr(torch, cfg.half_dtype)
        entries, total = [], 0
        for path, t in packer.tensors:
            stored = t.dtype
            if (half and t.dtype in (torch.float32, torch.float64)
                    and t.numel() * t.element_size() >= cfg.half_min_bytes):
                stored = half_dtype
            nbytes = t.numel() * torch.empty((), dtype=stored).element_size()
            entries.append({"path": path, "dtype": _dtype_name(t.dtype), "stored": _dtype_name(stored),
                            "shape": list(t.shape), "bytes": nbytes, "device": str(t.device),
                            "segments": None})
            total += nbytes
        extras_blob = None
        if packer.extras:
            buf = io.BytesIO()
            torch.save(packer.extras, buf)
            extras_blob = buf.getvalue()
        estimate = total + (_ALIGN + 512) * len(entries) + len(extras_blob or b"") + (64 << 10)
        self._check_space(estimate, step)

        seq = self._next_seq()
        final = self._final_path(step)
        _clean_leftovers(self.directory)
        tmp = self.directory / _tmp_name(final.name)
        bar = _progress_bar(total, f"saving step {step}", cfg.progress)
        try:
            tmp.mkdir()
            with ThreadPoolExecutor(1) as pool:
                writer = _DataWriter(tmp, cfg, pool, bar)
                staging = None
                try:
                    for e, (_, t) in zip(entries, packer.tensors):
                        e["segments"] = writer.begin_tensor()
                        stored = _dtype(e["stored"])
                        if staging is None and (t.is_cuda or stored != t.dtype
                                                or not t.is_contiguous()):
                            staging = _Staging(cfg.chunk_bytes)
                        for mv in _save_chunks(t, stored, cfg, staging):
                            writer.write(mv)
                finally:
                    writer.close()
            files = dict(writer.files)
            extras = None
            if extras_blob is not None:
                with open(tmp / EXTRAS, "wb") as f:
                    f.write(extras_blob)
                    if cfg.fsync:
                        os.fsync(f.fileno())
                files[EXTRAS] = len(extras_blob)
                extras = {"file": EXTRAS, "bytes": len(extras_blob),
                          "crc32": zlib.crc32(extras_blob)}
            body = {
                "format": FORMAT, "version": FORMAT_VERSION, "step": step, "seq": seq,
                "created_unix": time.time(), "host": socket.gethostname(),
                "nbtools": __version__, "torch": torch.__version__,
                "half": half and any(e["stored"] != e["dtype"] for e in entries),
                "half_dtype": cfg.half_dtype if half else None,
                "bytes": sum(files.values()), "files": files, "tensors": entries,
                "extras": extras, "objects": tree, "rng": rng_tree,
            }
            _write_manifest(tmp, body, cfg.fsync)     # last: its presence marks completeness
            if cfg.fsync:
                _fsync_dir(tmp)
            os.rename(tmp, final)
            if cfg.fsync:
                _fsync_dir(self.directory)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(self.directory).free
                raise CheckpointSpaceError(
                    e.errno, f"disk full while saving step {step} to {self.directory} "
                    f"({human_bytes(free)} free, ~{human_bytes(estimate)} needed). The partial "
                    "checkpoint was removed; earlier checkpoints are intact. Free space, lower "
                    "keep=, or save with half_tables=True.") from e
            if isinstance(e, OSError):
                raise CheckpointError(f"saving step {step} to {self.directory} failed: {e}. The "
                                      "partial checkpoint was removed; earlier ones are "
                                      "intact.") from e
            raise
        finally:
            if bar is not None:
                bar.close()
        self._seq = seq
        protect = self.sync.pending() if self.sync is not None else ()
        if self.sync is not None:
            self.sync.submit(final)
        prune(self.directory, self.keep, protect=[final, *protect])
        seconds = time.perf_counter() - t0
        info = {"step": step, "path": str(final), "bytes": body["bytes"], "seconds": seconds,
                "bytes_per_s": body["bytes"] / seconds if seconds > 0 else None,
                "half": body["half"]}
        if cfg.verbose:
            print(f"checkpoint: saved step {step} ({human_bytes(body['bytes'])}"
                  f"{', half-precision tables' if body['half'] else ''}) in {seconds:.2f} s, "
                  f"{_rate(body['bytes'], seconds)} -> {final}")
        return info

    @staticmethod
    def _check_step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}")
        return int(step)

    @staticmethod
    def _state_of(name: str, obj):
        if name in _RESERVED:
            raise TypeError(f"{name!r} is an option name of save()/restore(); save the object "
                            "under another name")
        if isinstance(obj, torch.Tensor):
            return obj
        if isinstance(obj, dict):
            return obj
        if callable(getattr(obj, "state_dict", None)):
            return obj.state_dict()
        raise TypeError(f"save(..., {name}=<{type(obj).__name__}>): expected an object with "
                        "state_dict()/load_state_dict() (module, optimizer, scheduler, "
                        "PinnedLoader, History), a dict or a tensor")

    def _check_space(self, need: int, step: int) -> None:
        free = shutil.disk_usage(self.directory).free
        margin = self.config.free_space_margin_bytes
        if free < need + margin:
            raise CheckpointSpaceError(
                errno.ENOSPC,
                f"not enough space to save step {step}: the checkpoint needs "
                f"~{human_bytes(need)} (+{human_bytes(margin)} margin) but {self.directory} has "
                f"{human_bytes(free)} free. Nothing was written. Delete old checkpoints or lower "
                "keep=, save to a larger disk, or pass half_tables=True (half the table bytes).")

    def _next_seq(self) -> int:
        if self._seq is None:
            seqs = [e.seq for e, _ in self._entries()]
            self._seq = max(seqs, default=0)
        return self._seq + 1

    def _final_path(self, step: int) -> Path:
        base = f"step-{step:09d}"
        revs = [e.rev for e in _scan(self.directory) if e.step == step]
        if not revs and not (self.directory / base).exists():
            return self.directory / base
        return self.directory / f"{base}-r{max(revs, default=0) + 1}"

    def _entries(self) -> list[tuple[_Entry, str]]:
        """Checkpoints here and in the mirror, newest first; local first among equals."""
        out = [(e, "local") for e in _scan(self.directory)]
        if self.sync is not None:
            out += [(e, "mirror") for e in _scan(self.sync.target)]
        out.sort(key=lambda x: (x[0].seq, x[0].step, x[0].rev, x[1] == "local"), reverse=True)
        return out

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, *, rng: bool = True, allow_half: bool | None = None, **objects) -> int | None:
        """Load the newest checkpoint that verifies into ``objects``; return its step.

        Falls back to older checkpoints when the newest is damaged (with a warning); returns
        None when there is no checkpoint at all; raises :class:`CheckpointError` when there are
        checkpoints but none can be read (so a run never silently starts over). A checkpoint
        with half-precision tables is restored only with ``allow_half=True`` (default: the
        config's ``half_tables``).
        """
        t0 = time.perf_counter()
        allow_half = self.config.half_tables if allow_half is None else allow_half
        for name, obj in objects.items():
            self._state_of(name, obj)             # type check before touching anything
        candidates = self._entries()
        if not candidates:
            if self.config.verbose:
                print(f"checkpoint: none in {self.directory}"
                      f"{' or ' + str(self.sync.target) if self.sync else ''}; starting fresh")
            return None
        failures = []
        for entry, where in candidates:
            if entry.manifest is None:   # order unknown (its manifest is what is damaged): say so now
                failures.append(f"{where} {entry.path.name}: {entry.error}")
                warnings.warn(f"checkpoint {entry.path} is damaged ({entry.error}); skipping it",
                              CheckpointWarning, stacklevel=2)
        for entry, where in candidates:
            label = f"{where} {entry.path.name}"
            if entry.manifest is None:
                continue
            try:
                m = entry.manifest
                missing = [n for n in objects if n not in m["objects"]]
                if missing:
                    raise CheckpointError(
                        f"checkpoint {entry.path} has no {', '.join(map(repr, missing))}; it holds "
                        f"{', '.join(map(repr, m['objects']))}. Restore with the names used in save().")
                if m.get("half") and not allow_half:
                    raise CheckpointError(
                        f"checkpoint {entry.path} (step {m['step']}) stores its tables in "
                        f"{m.get('half_dtype')} (saved with half_tables=True): restoring it is "
                        "not exact. Pass allow_half=True to restore it anyway.")
                _check_files(entry.path, m)
                nbytes = self._load(entry, objects, rng)
            except _Damaged as e:
                failures.append(f"{label}: {e}")
                warnings.warn(f"checkpoint {entry.path} is damaged ({e}); trying an older one",
                              CheckpointWarning, stacklevel=2)
                continue
            seconds = time.perf_counter() - t0
            if m.get("half"):
                warnings.warn(f"restored step {m['step']} from half-precision ({m['half_dtype']}) "
                              "copies of the tables: values are rounded, not exact",
                              CheckpointWarning, stacklevel=2)
            if self.config.verbose:
                print(f"checkpoint: restored step {m['step']} from {entry.path} "
                      f"({human_bytes(nbytes)} in {seconds:.2f} s, {_rate(nbytes, seconds)})"
                      + (f"; skipped {len(failures)} damaged" if failures else ""))
            self.last_restore = {"step": m["step"], "path": str(entry.path), "bytes": nbytes,
                                 "seconds": seconds,
                                 "bytes_per_s": nbytes / seconds if seconds > 0 else None,
                                 "skipped": failures}
            return m["step"]
        raise CheckpointError("no checkpoint could be restored; every one is damaged:\n  "
                              + "\n  ".join(failures))

    def _load(self, entry: _Entry, objects: dict, rng: bool) -> int:
        m, cfg = entry.manifest, self.config
        # Destinations: the objects' live tensors where shape and dtype match (read in place,
        # no second copy), else fresh CPU tensors.
        live: dict[int, torch.Tensor] = {}
        for name, obj in objects.items():
            _live_tensors(m["objects"][name]["state"], self._state_of(name, obj), live)
        wanted = self._wanted_tensors(m, objects, rng)
        total = sum(m["tensors"][i]["bytes"] for i in wanted)
        tensors: list = [None] * len(m["tensors"])
        bar = _progress_bar(total, f"restoring step {m['step']}", cfg.progress)
        if cuda_ok():
            torch.cuda.synchronize()
        try:
            with ThreadPoolExecutor(1) as pool, torch.no_grad():
                reader = _Reader(entry.path, cfg, pool, bar)
                try:
                    for i in wanted:
                        e = m["tensors"][i]
                        shape, dtype = tuple(e["shape"]), _dtype(e["dtype"])
                        dst = live.get(i)
                        if (dst is None or tuple(dst.shape) != shape or dst.dtype != dtype
                                or not dst.is_contiguous() or dst.device.type not in ("cpu", "cuda")):
                            dst = torch.empty(shape, dtype=dtype)
                        reader.read_tensor(e, dst, f"tensor {e['path']!r}")
                        tensors[i] = dst
                finally:
                    reader.close()
            extras = self._read_extras(entry.path, m)
        finally:
            if bar is not None:
                bar.close()
        # Every byte verified: now hand the state to the objects.
        for name, obj in objects.items():
            state = _decode(m["objects"][name]["state"], tensors, extras)
            if isinstance(obj, torch.Tensor):
                if obj.shape != state.shape:
                    raise CheckpointError(f"tensor {name!r} has shape {tuple(obj.shape)}, the "
                                          f"checkpoint holds {tuple(state.shape)}")
                if state is not obj:
                    with torch.no_grad():
                        obj.copy_(state)
            elif isinstance(obj, dict):
                obj.clear()
                obj.update(state)
            else:
                obj.load_state_dict(state)
        if rng and m.get("rng") is not None:
            _set_rng_state(_decode(m["rng"], tensors, extras))
        return total

    @staticmethod
    def _wanted_tensors(m: dict, objects: dict, rng: bool) -> list[int]:
        idx: list[int] = []

        def walk(x):
            if isinstance(x, list):
                for v in x:
                    walk(v)
            elif isinstance(x, dict):
                if "$tensor" in x:
                    idx.append(x["$tensor"])
                else:
                    for v in x.values():
                        walk(v)
        for name in objects:
            walk(m["objects"][name]["state"])
        if rng:
            walk(m.get("rng"))
        return sorted(set(idx))

    @staticmethod
    def _read_extras(path: Path, m: dict) -> list:
        if not m.get("extras"):
            return []
        blob = (path / m["extras"]["file"]).read_bytes()
        if len(blob) != m["extras"]["bytes"] or zlib.crc32(blob) != m["extras"]["crc32"]:
            raise _Damaged(f"{m['extras']['file']}: checksum mismatch (file damaged)")
        # A pickle from your own checkpoint directory (small values that JSON cannot hold).
        return torch.load(io.BytesIO(blob), weights_only=False)

    # -- listing -----------------------------------------------------------------------------
    def list(self, verify: bool = False) -> list[dict]:
        """What is there, newest first: step, path, where (local/mirror), bytes, created time,
        half, and status: ``"ok"`` (all files present with their sizes), ``"verified"``
        (every checksum read and matched, with ``verify=True``) or ``"damaged: ..."``."""
        out = []
        for entry, where in self._entries():
            m = entry.manifest
            row = {"step": entry.step, "path": str(entry.path), "where": where,
                   "bytes": m["bytes"] if m else None,
                   "created": time.strftime("%Y-%m-%d %H:%M:%S",
                                            time.localtime(m["created_unix"])) if m else None,
                   "half": m.get("half") if m else None, "status": None}
            try:
                if m is None:
                    raise _Damaged(entry.error)
                _check_files(entry.path, m)
                row["status"] = "ok"
                if verify:
                    self._verify(entry)
                    row["status"] = "verified"
            except _Damaged as e:
                row["status"] = f"damaged: {e}"
            out.append(row)
        return out

    def _verify(self, entry: _Entry) -> None:
        m = entry.manifest
        with ThreadPoolExecutor(1) as pool:
            reader = _Reader(entry.path, self.config, pool, None)
            try:
                for e in m["tensors"]:
                    reader.read_tensor(e, None, f"tensor {e['path']!r}")
            finally:
                reader.close()
        self._read_extras(entry.path, m)

    def latest_step(self) -> int | None:
        """Step of the newest complete checkpoint (not verified), or None."""
        for entry, _ in self._entries():
            if entry.manifest is not None:
                return entry.manifest["step"]
        return None

    def finalize(self, **kwargs) -> None:
        """Wait for background copies to the mirror and flush it (Drive: see
        :meth:`nbtools.colab.DriveSync.finalize`). Call once at the end of training."""
        if self.sync is not None:
            self.sync.finalize(**kwargs)

    def __repr__(self) -> str:
        mirror = f", mirror={str(self.sync.target)!r}" if self.sync else ""
        return f"CheckpointManager({str(self.directory)!r}, keep={self.keep}{mirror})"
