"""Tables from existing arrays, streamed in chunks, and a table's rows handed to NumPy and CuPy.

:meth:`OffloadedEmbedding.from_pretrained <nbtools.OffloadedEmbedding.from_pretrained>` (this
module's :func:`from_pretrained`) makes a table from a torch tensor, a NumPy array, a ``.npy``
file (a path, or ``np.load(path, mmap_mode="r")``) bigger than RAM, or a CuPy array on the GPU
or in pinned host memory (SpeedTorch's tables). :meth:`OffloadOptimizer.load_row_state
<nbtools.OffloadOptimizer.load_row_state>` (:func:`load_row_state`) loads one per-row optimizer
state (Adam's ``exp_avg``, Adagrad's ``sum``) the same way: docs/speedtorch.md is the
migration from SpeedTorch.

How the rows travel, and why that keeps memory bounded:

* **Chunks.** Rows are copied ``CHUNK_BYTES`` (16 MiB) at a time into the table where it lives:
  host RAM, GPU memory, or its file on disk (:meth:`nbtools.disk.DiskRows.write_range`). What
  the copy needs beyond the table is at most ``EXTRA_BYTES`` (64 MiB): two read buffers for a
  file, a conversion buffer where dtypes differ, the row file's own aligned buffer for a disk
  table. A source already in memory needs none of them for a host or GPU table.
* **Files are read, not mapped.** A memory-mapped source read through its mapping would grow
  the process's resident memory by the whole file (each page read stays mapped). The rows of a
  ``.npy`` file are read with ``pread`` instead (4 MiB requests in parallel, the next chunk
  while this one is checked and written), straight into a host table's memory where the dtypes
  agree, and each chunk is dropped from the page cache once read (``POSIX_FADV_DONTNEED``):
  the page cache counts against a container's memory limit. A memory map that cannot be read
  that way (not row-major, copy-on-write) is read through its mapping, its pages released
  behind each chunk where that loses nothing (not for ``mode="c"``, whose pages then stay
  resident until the map is dropped).
* **Checked while streaming.** Each chunk is checked once it is in the table's dtype (a finite
  sum proves a chunk finite; only a chunk that fails is searched), so a NaN, an inf, or a
  finite float64 that overflows a float16 table is refused naming its row; nothing is left
  behind (the table is closed, a disk table's file removed). ``allow_nonfinite=True`` loads
  such rows as they are.

Sharing a table's rows without a copy (:func:`as_numpy`, :func:`as_cupy`):

==========  ===================================  ===========================================
placement   NumPy                                CuPy
==========  ===================================  ===========================================
host        a view of the host rows              pinned rows on CUDA: a CuPy array over them
                                                 (the GPU reads and writes host RAM)
gpu         refused: the rows are in GPU memory  a view of the GPU rows (DLPack)
disk        the file, memory-mapped              refused: a file is not GPU-addressable
==========  ===================================  ===========================================

Writes through a view are what the table reads next (``table.weight`` is what each view is
made from: queued GPU writes land first and a cache of hot rows is written back and emptied).
Take a view again after training steps: steps write rows behind it, through caches a view does
not see. Creating an optimizer reallocates the rows (``[weight | state]``): views made before
it see the old memory.

CuPy is optional and only ever imported here, when a CuPy array is read or asked for
(``pip install cupy-cuda12x``; ``cupy-cuda11x`` for CUDA 11).

>>> import numpy as np
>>> from nbtools import OffloadedEmbedding
>>> table = OffloadedEmbedding.from_pretrained(np.arange(6, dtype=np.float32).reshape(3, 2),
...                                            device="cpu")
>>> table(torch.tensor([2, 0])).tolist(), table.trainable
([[4.0, 5.0], [0.0, 1.0]], False)
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import mmap
import os
import threading
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import NbtoolsError
from .devices import cuda_ok

CHUNK_BYTES = 16 << 20          # rows per chunk: this many bytes of the wider of source and table
EXTRA_BYTES = 64 << 20          # the promise: memory beyond the table that a load may take
_SPARE = 8 << 20                # of which this much is left for small temporaries
REQUEST_BYTES = 4 << 20         # bytes per pread of a file source
_READERS = 4                    # preads in flight
_FLOATS = {2: torch.float16, 4: torch.float32, 8: torch.float64}
_CUPY_INSTALL = "pip install cupy-cuda12x (CuPy for CUDA 12; for CUDA 11: cupy-cuda11x)"
# torch's from_pretrained arguments that an offloaded table does not have
_TORCH_ONLY = {
    "max_norm": "offloaded tables do not renormalise rows on lookup; renormalise the source "
                "first",
    "norm_type": "offloaded tables do not renormalise rows on lookup",
    "scale_grad_by_freq": "use table.set_grad_scale(weights) with your own per-id weights",
    "sparse": "an offloaded table's gradients are always row-sparse (lazy updates); leave it out",
    "include_last_offset": "pass offsets without the last one",
}


class NonFiniteSourceError(NbtoolsError, ValueError):
    """A source row holds NaN or inf (or a value its table's dtype cannot hold); nothing was
    created or changed."""


def _cupy():
    """CuPy, imported now (never by ``import nbtools``), or an ImportError saying what to
    install."""
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"this needs CuPy, which is not installed: {_CUPY_INSTALL}") from e
    return cupy


def _is_cupy(x) -> bool:
    return type(x).__module__.split(".")[0] == "cupy" and hasattr(x, "shape")


# --- sources ---------------------------------------------------------------------------------

@dataclasses.dataclass
class _Source:
    """A 2-D source, read ``rows(a, b)`` at a time (a torch view, no copy) or, for a file,
    with :class:`_File`. ``what`` names it in messages; ``keep`` keeps its owner alive."""

    what: str
    shape: tuple
    dtype: torch.dtype
    device: torch.device
    rows: object                    # (a, b) -> tensor view of rows a:b
    file: "_File | None" = None     # rows read with pread (a row-major memory map)
    release: object = None          # (a, b) -> None: hand the mapped pages of rows a:b back
    keep: object = None

    @property
    def row_bytes(self) -> int:
        return self.shape[1] * self.dtype.itemsize

    def value(self, r: int, c: int) -> float:
        return float(self.rows(r, r + 1)[0, c])


def _describe(kind: str, shape, dtype, device=None) -> str:
    where = f" on {device}" if device is not None else ""
    return f"{kind} of shape {tuple(shape)} and dtype {dtype}{where}"


def _torch_dtype(dt: np.dtype, what: str) -> torch.dtype:
    if dt.kind == "f" and dt.itemsize in _FLOATS:
        return _FLOATS[dt.itemsize]
    if dt.name == "bfloat16" and dt.itemsize == 2:      # ml_dtypes' bfloat16
        return torch.bfloat16
    raise _dtype_error(what, dt)


def _dtype_error(what: str, dtype) -> TypeError:
    return TypeError(
        f"the source ({what}) holds {dtype} values, but a table holds floating-point numbers: "
        "float32, float64, float16 or bfloat16. Convert it first, e.g. source.astype(np.float32) "
        "or source.float() (a copy), or save it as a float .npy file")


def open_source(source, column: bool = False) -> _Source:
    """Wrap what ``from_pretrained`` was given; its values are not read here. ``column``: a
    1-D source is one column (``[rows]`` as ``[rows, 1]``: a row-wise optimizer state)."""
    if isinstance(source, (str, os.PathLike)):
        return _path_source(source, column)
    if isinstance(source, torch.Tensor):
        return _torch_source(source, "torch tensor", column=column)
    if isinstance(source, np.ndarray):
        return _numpy_source(source, column=column)
    if _is_cupy(source):
        return _cupy_source(source, column)
    if isinstance(source, torch.nn.Module):
        raise TypeError(f"the source is a {type(source).__name__} module; pass its weight "
                        "tensor (module.weight)")
    if hasattr(source, "__dlpack__"):            # JAX, TensorFlow, ... on the CPU or a GPU
        try:
            t = torch.from_dlpack(source)
        except Exception as e:
            raise TypeError(f"the source, a {type(source).__name__}, offers DLPack but torch "
                            f"could not read it: {e}") from e
        return _torch_source(t, f"{type(source).__name__} (through DLPack)", keep=source,
                             column=column)
    if hasattr(source, "__cuda_array_interface__") and cuda_ok():   # numba device arrays
        return _torch_source(torch.as_tensor(source, device="cuda"),
                             f"{type(source).__name__} (CUDA array interface)", keep=source,
                             column=column)
    if hasattr(source, "__array__") or isinstance(source, (list, tuple)):
        return _numpy_source(np.asarray(source), kind=type(source).__name__, column=column)
    raise TypeError(
        f"cannot read rows from a {type(source).__name__}: expected a torch tensor, a NumPy "
        "array (a memory map too), a path to a .npy file, a CuPy array, or an object with "
        "__dlpack__ or __array__")


def _check_2d(what: str, shape) -> None:
    if len(shape) != 2:
        raise ValueError(f"the source must be 2-D [num_embeddings, embedding_dim]; got a "
                         f"{what} ({len(shape)}-D). Reshape it first, e.g. "
                         "source.reshape(-1, dim)")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"the source ({what}) is empty; a table needs at least one row of at "
                         "least one value")


def _path_source(path, column: bool = False) -> _Source:
    """A ``.npy`` file at ``path``, memory-mapped (read with ``pread``; see the module). It
    is data someone may have handed over: opened once, without blocking (a FIFO or a device
    is refused, not waited on or read forever; a symbolic link to a regular file is
    followed, since nothing is written), its header checked against its size, and its rows
    read through that descriptor."""
    from .files import open_regular
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"no file {p!r} (from_pretrained reads a .npy file, memory-"
                                "mapped)")
    fd = open_regular(p, follow=True, what=".npy file", error=ValueError)
    try:
        arr, offset = _map_npy(fd, p)
        file = _File(fd, offset, arr.dtype.itemsize * (arr.shape[1] if arr.ndim == 2 else 1)) \
            if arr.flags.c_contiguous and arr.dtype.isnative and arr.size else None
    except BaseException:
        os.close(fd)
        raise
    if file is None:
        os.close(fd)                 # (the map holds its own descriptor)
    try:
        return _numpy_source(arr, kind=f"memory-mapped file {p!r}", column=column, file=file)
    except BaseException:
        if file is not None:
            file.close()
        raise


def _map_npy(fd: int, p: str) -> tuple[np.memmap, int]:
    """The array of the ``.npy`` file open as ``fd`` (at ``p``, for messages), mapped
    read-only, and the offset of its data; a ValueError says why a file is not one."""
    def refuse(why: str) -> ValueError:
        return ValueError(f"{p!r} cannot be memory-mapped as one array ({why}); save the table "
                          "with np.save(path, array) as a .npy file of floats")

    fmt = np.lib.format
    with open(fd, "rb", closefd=False) as f:
        if f.read(len(fmt.MAGIC_PREFIX)) != fmt.MAGIC_PREFIX:
            f.seek(0)
            try:
                got = np.load(f, allow_pickle=False)   # an .npz archive's names, or refused
            except Exception as e:
                raise refuse(str(e)) from e
            names = list(getattr(got, "files", []))
            if hasattr(got, "close"):
                got.close()
            raise ValueError(f"{p!r} is an .npz archive ({names}), whose arrays cannot be memory-"
                             "mapped; pass np.load(path)[name] (read into RAM) or save the table "
                             "with np.save as a .npy file")
        f.seek(0)
        try:
            version = fmt.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = fmt.read_array_header_1_0(f)
            elif version == (2, 0):
                shape, fortran, dtype = fmt.read_array_header_2_0(f)
            else:
                raise ValueError(f".npy format version {version[0]}.{version[1]}, written only "
                                 "for arrays with unicode field names")
        except ValueError as e:
            raise refuse(str(e)) from e
        if dtype.hasobject:
            raise refuse("its dtype holds Python objects")
        if any(k < 0 for k in shape):
            raise refuse(f"its header's shape {shape} is negative")
        offset = f.tell()
        nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
        size = os.fstat(fd).st_size
        if offset + nbytes > size:
            raise ValueError(f"{p!r} is truncated or its header is damaged: the header says "
                             f"{dtype} values of shape {shape}, {nbytes:,} bytes after "
                             f"{offset}, but the file has {size:,} bytes")
        arr = np.memmap(f, dtype=dtype, shape=shape, order="F" if fortran else "C", mode="r",
                        offset=offset)
    return arr, offset


def _numpy_source(arr: np.ndarray, kind: str | None = None, keep=None,
                  column: bool = False, file: "_File | None" = None) -> _Source:
    """A NumPy array; ``file``: a reader of its rows from its file (else one is made for a
    row-major memory map, :meth:`_File.of`)."""
    kind = kind or ("memory-mapped NumPy array" if isinstance(arr, np.memmap) else "NumPy array")
    what = _describe(kind, arr.shape, arr.dtype)
    if column and arr.ndim == 1:
        arr = arr.reshape(-1, 1)                       # a view (a memory map stays one)
    dtype = _torch_dtype(arr.dtype, what)
    _check_2d(what, arr.shape)
    bf16 = dtype == torch.bfloat16

    def rows(a: int, b: int) -> torch.Tensor:
        part = arr[a:b]
        if bf16:
            part = part.view(np.int16)                 # torch reads no ml_dtypes bfloat16
        if not part.dtype.isnative:
            part = part.astype(part.dtype.newbyteorder("="))          # one chunk: bounded
        if any(s < 0 for s in part.strides):
            part = np.ascontiguousarray(part)
        with warnings.catch_warnings():     # a read-only memory map: torch warns; we only read
            warnings.filterwarnings("ignore", message=".*not writable.*")
            t = torch.from_numpy(part)
        return t.view(torch.bfloat16) if bf16 else t

    src = _Source(what, tuple(arr.shape), dtype, torch.device("cpu"), rows, keep=(arr, keep))
    src.file = file if file is not None else _File.of(arr, src.row_bytes)
    if src.file is None:
        src.release = _mapped_pages(arr)
    return src


def _torch_source(t: torch.Tensor, kind: str, keep=None, column: bool = False) -> _Source:
    what = _describe(kind, t.shape, t.dtype, t.device)
    if column and t.dim() == 1:
        t = t.unsqueeze(1)
    if t.layout != torch.strided:
        raise TypeError(f"the source is a {t.layout} tensor ({what}); pass source.to_dense() "
                        "(a copy) or its rows as a dense tensor")
    if t.device.type == "meta":
        raise ValueError(f"the source ({what}) is a meta tensor, which holds no values")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the source is on {t.device} ({what}); expected CPU memory or a "
                         f"CUDA device: pass source.cpu() (a copy)")
    if not t.is_floating_point():
        raise _dtype_error(what, t.dtype)
    _check_2d(what, t.shape)
    t = t.detach()
    return _Source(what, tuple(t.shape), t.dtype, t.device, lambda a, b: t[a:b],
                   keep=(t, keep))


def _cupy_source(x, column: bool = False) -> _Source:
    """A CuPy array: in pinned host memory (SpeedTorch's ``CPUPinn``), read by the CPU as a
    NumPy view; in GPU (or managed) memory, read by torch through DLPack."""
    cupy = _cupy()
    what = _describe("CuPy array", x.shape, x.dtype, f"cuda:{x.device.id}")
    if x.dtype.kind != "f":
        raise _dtype_error(what, x.dtype)
    if column and x.ndim == 1:
        x = x.reshape(-1, 1)
    _check_2d(what, x.shape)
    attrs = cupy.cuda.runtime.pointerGetAttributes(x.data.ptr)
    if attrs.type == 1 and min(x.strides) >= 0:     # cudaMemoryTypeHost: page-locked RAM
        cupy.cuda.runtime.deviceSynchronize()       # kernels that wrote it have finished
        span = sum((n - 1) * s for n, s in zip(x.shape, x.strides)) + x.itemsize
        buf = (np.ctypeslib.ctypes.c_byte * span).from_address(attrs.hostPointer)
        view = np.ndarray(x.shape, dtype=np.dtype(x.dtype.str), buffer=buf, strides=x.strides)
        return _numpy_source(view, kind="CuPy array in pinned host memory", keep=x)
    if not cuda_ok():
        raise ValueError(f"the source is a CuPy array on the GPU ({what}), but this torch "
                         f"({torch.__version__}) has no CUDA; pass cupy.asnumpy(source) (a copy) "
                         "or use a CUDA build of torch")
    try:
        t = torch.from_dlpack(x)
    except Exception:          # e.g. managed memory, which some torch versions refuse in DLPack
        t = torch.as_tensor(x, device=f"cuda:{x.device.id}")
    return _torch_source(t, "CuPy array", keep=x)


class _File:
    """The rows of a row-major memory map, read with ``pread`` from its file (no mapping, so
    no resident pages), dropped from the page cache behind each read."""

    def __init__(self, fd: int, offset: int, row_bytes: int):
        """Rows of ``row_bytes`` from byte ``offset`` of the file open as ``fd`` (which this
        reader now owns: :meth:`close` closes it)."""
        self.offset, self.row_bytes = offset, row_bytes
        self._pool = None
        self.fd = fd
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    @classmethod
    def of(cls, arr: np.ndarray, row_bytes: int) -> "_File | None":
        """A reader for ``arr`` when it is a row-major map of a file that ``pread`` sees as
        the mapping does (not copy-on-write), else None."""
        mm, path = getattr(arr, "_mmap", None), getattr(arr, "filename", None)
        if not isinstance(arr, np.memmap) or mm is None or path is None or \
                getattr(arr, "mode", None) not in ("r", "r+", "w+") or \
                not arr.flags.c_contiguous or not arr.dtype.isnative:
            return None
        try:
            base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
        except (ValueError, TypeError):
            return None
        start = arr.offset - arr.offset % mmap.ALLOCATIONGRANULARITY
        offset = start + arr.ctypes.data - base
        from .files import open_regular
        try:            # (whatever is at its name now: a FIFO put there is not waited on)
            fd = open_regular(path, follow=True, error=ValueError)
        except (OSError, ValueError):
            return None
        if offset < 0 or offset + arr.nbytes > os.fstat(fd).st_size:
            os.close(fd)
            return None
        f = cls(fd, offset, row_bytes)
        head = min(arr.nbytes, 4096)                # the file holds what the map shows
        probe = np.empty(head, dtype=np.uint8)
        f.wait(f.start(0, probe), 0, 0)
        if not np.array_equal(probe, np.frombuffer(arr.reshape(-1).view(np.uint8)[:head],
                                                   dtype=np.uint8)):
            f.close()
            return None
        return f

    def start(self, a: int, out: np.ndarray) -> list:
        """Start reading ``out.nbytes`` bytes of rows from row ``a`` into ``out`` (uint8)."""
        from .rowfile.fileio import pread_all
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="nbtools-pretrained")
        flat = memoryview(out.reshape(-1))
        pos = self.offset + a * self.row_bytes
        return [self._pool.submit(pread_all, self.fd, flat[i:i + REQUEST_BYTES], pos + i)
                for i in range(0, len(flat), REQUEST_BYTES)]

    def wait(self, reads: list, a: int, b: int) -> None:
        """Wait for ``reads``; rows ``a:b`` then leave the page cache."""
        for r in reads:
            r.result()
        if b > a and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, self.offset + a * self.row_bytes,
                             (b - a) * self.row_bytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = close        # a source opened, then refused before it was read


def _mapped_pages(arr: np.ndarray):
    """For a memory map read through its mapping: release the pages of rows a:b after reading
    them (``MADV_DONTNEED``), where that loses nothing: a shared or read-only map whose rows
    are contiguous in memory (a copy-on-write map would lose its private changes)."""
    if not isinstance(arr, np.memmap) or getattr(arr, "mode", None) not in ("r", "r+", "w+") \
            or arr.strides[0] < arr.strides[1] * arr.shape[1] or arr.strides[1] < 0:
        return None
    from .placement import release_pages
    base = arr.ctypes.data

    def release(a: int, b: int) -> None:
        release_pages(base, a * arr.strides[0], b * arr.strides[0])
    return release


_BUILDING = threading.local()     # (rows_written_next)


@contextlib.contextmanager
def rows_written_next():
    """Tables built in this block (on this thread) skip ``nn.Embedding``'s N(0, 1) draw: their
    builder writes every row before anything reads one (:func:`nbtools.pretrained.from_pretrained`:
    a 20 GB table's draw would take a second of GPU and RNG set-up for rows overwritten at once)."""
    _BUILDING.rows_written_next = True
    try:
        yield
    finally:
        _BUILDING.rows_written_next = False



def building_rows_written_next() -> bool:
    """Whether a table built now on this thread skips its N(0, 1) draw (:func:`rows_written_next`)."""
    return getattr(_BUILDING, "rows_written_next", False)


# --- destinations ------------------------------------------------------------------------------

@dataclasses.dataclass
class _Target:
    """Where streamed rows go: ``view`` (host or GPU memory, [n, cols]) or ``put(a, rows)``
    (a disk table's file); ``dtype`` is what they are stored as; ``extra_per_row`` bytes of
    buffers the destination itself needs per chunk row (a disk table's)."""

    n: int
    cols: int
    dtype: torch.dtype
    view: torch.Tensor | None = None
    put: object = None
    extra_per_row: int = 0
    what: str = "the table"


def _weight_target(table) -> _Target:
    d = table.embedding_dim
    if table.rows.in_memory:
        w = table.weight                       # [n, d] host or GPU memory, nothing queued
        return _Target(table.num_embeddings, d, w.dtype, view=w)
    # rows in a file, written through the tier's whole-table face (their N(0, 1) draw was
    # never set up: the table was built for its rows to be written next); the file's aligned
    # buffer (rounded up to a power of two) when rows are padded
    rows = table.rows.whole(writes=True)
    return _Target(table.num_embeddings, d, rows.dtype, put=rows.write_range,
                   extra_per_row=2 * rows.stride)


def _state_target(table, name: str, index: int) -> _Target:
    layout = table.layout
    cols = layout.state_widths[index]
    what = f"state {name!r} of table {table.name!r}"
    if table.rows.in_memory:
        v = table.state_columns(name)          # [n, cols], strided among the row's columns
        return _Target(table.num_embeddings, cols, v.dtype, view=v, what=what)
    rows = table.rows.whole()
    rows.flush()                               # dirty rows in the file; RAM copies stay current

    def put(a: int, values: torch.Tensor) -> None:     # read, change the state's columns, write
        b = a + values.shape[0]
        got = rows.read_rows(a, b)
        layout.state(got, index).copy_(values)
        rows.write_rows(np.arange(a, b), got)
    per_row = layout.width * layout.unit.itemsize + 4 * rows.stride
    return _Target(table.num_embeddings, cols, layout.unit, put=put, extra_per_row=per_row,
                   what=what)


# --- the copy ----------------------------------------------------------------------------------

def _first_nonfinite(y: torch.Tensor):
    """(row, column) of the first value of ``y`` that is not finite, or None. A finite sum
    proves the chunk finite in one pass without allocating; only a chunk that fails (or
    whose sum overflowed) is searched."""
    if y.device.type == "cpu" and y.dtype in (torch.float32, torch.float64):
        fine = bool(np.isfinite(np.sum(y.numpy())))
    else:
        acc = torch.float64 if y.dtype == torch.float64 else torch.float32
        fine = bool(torch.isfinite(y.sum(dtype=acc)))    # note: a sync point on the GPU
    if fine:
        return None
    bad = ~torch.isfinite(y)
    if not bool(bad.any()):
        return None
    i = int(bad.reshape(-1).to(torch.uint8).argmax())
    return divmod(i, y.shape[1])


def _refuse(src: _Source, dst: _Target, row: int, col: int, stored) -> NonFiniteSourceError:
    value = src.value(row, col)
    if np.isfinite(value):
        wider = torch.float64 if dst.dtype.itemsize >= 4 else torch.float32
        return NonFiniteSourceError(
            f"the source ({src.what}): row {row:,}, column {col} holds {value!r}, outside the "
            f"range of {dst.dtype} ({dst.what} would store {stored}); nothing was created. Load "
            f"it as {wider} (dtype={wider}), or pass allow_nonfinite=True to store {stored}")
    return NonFiniteSourceError(
        f"the source ({src.what}) holds {value} at row {row:,}, column {col} (the first row "
        "that is not finite); nothing was created. Fix those rows first (e.g. np.nan_to_num), "
        "or pass allow_nonfinite=True to load them as they are")


def _chunk_rows(n: int, row_bytes: int, buffers_per_row: int) -> int:
    """Rows per chunk: ``CHUNK_BYTES`` of rows, fewer where the buffers a chunk needs
    (``buffers_per_row`` bytes a row) would pass ``EXTRA_BYTES``."""
    rows = CHUNK_BYTES // row_bytes
    if buffers_per_row:
        rows = min(rows, (EXTRA_BYTES - _SPARE) // buffers_per_row)
    return max(1, min(rows, n))


def _fill(dst: _Target, value: float) -> None:
    """Every row of ``dst`` set to ``value`` (chunk by chunk on disk)."""
    if dst.view is not None:
        with torch.no_grad():
            dst.view.fill_(value)
        return
    rows = _chunk_rows(dst.n, dst.cols * dst.dtype.itemsize, dst.extra_per_row)
    for a in range(0, dst.n, rows):
        dst.put(a, torch.full((min(rows, dst.n - a), dst.cols), value, dtype=dst.dtype))


def _copy(src: _Source, dst: _Target, *, allow_nonfinite: bool, progress, desc: str) -> None:
    """Stream every row of ``src`` into ``dst``, chunk by chunk (see the module docs)."""
    from .units import progress_bar
    from .hostmem import HostTensor
    n = src.shape[0]
    src_row, dst_row = src.row_bytes, dst.cols * dst.dtype.itemsize
    view = dst.view
    # a file read straight into the table's memory: no buffer, no conversion
    direct = src.file is not None and view is not None and view.device.type == "cpu" and \
        view.dtype == src.dtype and view.is_contiguous()
    reads = 2 if src.file is not None and not direct else 0
    convert = dst.put is not None and (src.dtype != dst.dtype or src.file is None)
    rows = _chunk_rows(n, max(src_row, dst_row),
                       reads * src_row + convert * dst_row + dst.extra_per_row)
    pin = cuda_ok() and (view is not None and view.is_cuda)     # page-locked: fast H2D copies
    bufs = [HostTensor((rows * src_row,), torch.uint8, pin=pin, name="from_pretrained buffer")
            for _ in range(reads)]
    staged = HostTensor((rows, dst.cols), dst.dtype, pin=False, name="from_pretrained rows") \
        if convert else None
    chunks = [(a, min(n, a + rows)) for a in range(0, n, rows)]
    bar = progress_bar(n * src_row, desc, progress)

    def begin(k: int):                          # start reading chunk k of a file
        if src.file is None or k >= len(chunks):
            return None
        a, b = chunks[k]
        out = view[a:b] if direct else bufs[k % 2].tensor[: (b - a) * src_row]
        return src.file.start(a, out.view(torch.uint8).numpy())

    ahead = begin(0)
    try:
        for k, (a, b) in enumerate(chunks):
            if src.file is not None:
                src.file.wait(ahead, a, b)
                x = view[a:b] if direct else \
                    bufs[k % 2].tensor[: (b - a) * src_row].view(src.dtype).view(b - a, -1)
            else:
                x = src.rows(a, b)
            ahead = begin(k + 1)                # the next chunk is read while this one is used
            if dst.put is None:
                y = view[a:b]
                if not direct:
                    y.copy_(x)
            else:
                y = x if not convert else staged.tensor[: b - a]
                if convert:
                    y.copy_(x)
            if not allow_nonfinite:
                bad = _first_nonfinite(y)
                if bad is not None:
                    raise _refuse(src, dst, a + bad[0], bad[1], y[bad[0], bad[1]].item())
            if dst.put is not None:
                dst.put(a, y)
            if src.release is not None:
                src.release(a, b)
            if bar is not None:
                bar.update((b - a) * src_row)
    finally:
        if ahead is not None:                   # its reads write into memory freed below
            for r in ahead:
                r.exception()
        if src.file is not None:
            src.file.close()
        if bar is not None:
            bar.close()
        for buf in bufs:
            buf.close()
    if view is not None and view.is_cuda:
        torch.cuda.synchronize(view.device)


# --- the public functions ------------------------------------------------------------------------

def from_pretrained(cls, source, *, freeze: bool = True, padding_idx=None, dtype=None,
                    placement: str = "host", name=None, device="auto", config=None,
                    num_embeddings=None, embedding_dim=None, allow_nonfinite: bool = False,
                    progress=None, **options):
    """A table whose rows are ``source``, streamed into it in chunks.

    ``OffloadedEmbedding.from_pretrained(source, ...)`` calls this (``cls`` is the table
    class: this module imports neither nbtools.tables nor nbtools.optim, which call it).

    Args:
        source: a ``[rows, dim]`` float array: a torch tensor (CPU or CUDA), a NumPy array, a
            memory map (``np.load(path, mmap_mode="r")``), a path to a ``.npy`` file (opened
            that way), a CuPy array (on the GPU or in pinned host memory), or anything with
            ``__dlpack__`` or ``__array__``. Files and memory maps are read with ``pread``,
            never mapped whole, so a source bigger than RAM loads into a disk table.
        freeze: as in ``nn.Embedding.from_pretrained`` (default True): the table's lookups
            record no gradient (``table.trainable`` is False) and an optimizer never changes
            it. Pass ``freeze=False`` to train it.
        padding_idx: this row never gets a gradient and, as in every offloaded table, reads as
            zeros: it is stored as zeros whatever the source holds there (torch's
            ``from_pretrained`` keeps the source's row; a warning says when that row was not
            zero).
        dtype: how the table stores its rows; default ``config.dtype`` when a config is given,
            else the source's dtype (float32, float64, float16 or bfloat16, as torch keeps it).
        placement, name, device, config, ``**options``: as for
            :class:`~nbtools.OffloadedEmbedding` (``"host"``, ``"gpu"``, ``"disk"``,
            ``"auto"``; the :class:`~nbtools.TableConfig` fields by name; an
            ``OffloadedEmbeddingBag``'s ``mode``).
        num_embeddings, embedding_dim: when given, the source's shape must match them.
        allow_nonfinite: load NaN and inf as they are instead of refusing the source.
        progress: a tqdm bar (when tqdm is installed): None shows it for loads that last
            longer than a second, True always, False never.

    Memory: beyond the table itself, at most 64 MiB (``EXTRA_BYTES``). The torch and NumPy
    random streams are left as they were (torch's ``from_pretrained`` draws nothing either).

    Raises:
        ValueError: the source is not 2-D, its shape is not the one asked for, or it is on a
            device other than the CPU or CUDA.
        TypeError: its values are not floating-point, or it is nothing rows can be read from.
        NonFiniteSourceError: a row holds NaN or inf (or a value the table's dtype cannot
            hold), named in the message; nothing is left behind (no table, no file).
        ImportError: a CuPy array, and CuPy cannot be imported.
    """
    torch_only = sorted(set(options) & set(_TORCH_ONLY))
    if torch_only:
        raise TypeError(f"from_pretrained got {torch_only}, which offloaded tables do not take: "
                        + "; ".join(f"{k}: {_TORCH_ONLY[k]}" for k in torch_only))
    src = open_source(source)
    n, d = src.shape
    for arg, want, got in (("num_embeddings", num_embeddings, n),
                           ("embedding_dim", embedding_dim, d)):
        if want is not None and want != got:
            raise ValueError(f"{arg}={want:,} was asked for, but the source ({src.what}) has "
                             f"{got:,} {'rows' if arg == 'num_embeddings' else 'values per row'}")
    if dtype is None and config is None and src.dtype != torch.float32:
        dtype = src.dtype
    if dtype is not None:
        options["dtype"] = dtype
    if isinstance(padding_idx, (int, np.integer)) and -n <= padding_idx < n:
        _warn_padding(src, int(padding_idx) % n)
    with rows_written_next():      # no N(0, 1) draw (every row is written below): no RNG used
        table = cls(n, d, padding_idx=padding_idx, name=name, device=device,
                    placement=placement, config=config, **options)
    try:
        _copy(src, _weight_target(table), allow_nonfinite=allow_nonfinite, progress=progress,
              desc=f"loading {table.name!r}")
        if table.padding_idx is not None:      # stored as zeros: what its lookups return
            rows = table.rows.whole(writes=True)
            rows.write_bytes(table.padding_idx, np.zeros((1, rows.row_bytes), dtype=np.uint8))
    except BaseException as e:
        table.close()                          # unpinned; a disk table's file is removed
        # its memory goes now, not at some later collection (a retry may need it): the
        # traceback keeps the frames below, which hold it, and the table is in reference cycles
        traceback.clear_frames(e.__traceback__)
        del table
        gc.collect()
        raise
    table.trainable = not freeze
    return table


def _warn_padding(src: _Source, p: int) -> None:
    if bool((src.rows(p, p + 1) != 0).any()):
        warnings.warn(f"padding_idx={p}: the source's row {p} is not zero, but a padding row "
                      "reads as zeros in an offloaded table, so it is stored as zeros "
                      "(torch.nn.Embedding.from_pretrained would keep it)", UserWarning,
                      stacklevel=4)


def load_row_state(slot, name: str, source, *, initial: float = 0.0, step=None, scalar=None,
                   allow_nonfinite: bool = False, progress=None) -> None:
    """Stream one per-row optimizer state of a table from ``source`` (any ``from_pretrained``
    source), chunk by chunk, as ``from_pretrained`` streams rows.

    Called as ``optimizer.load_row_state(table, name, source, step=...)``
    (:meth:`nbtools.OffloadOptimizer.load_row_state`); ``slot`` is the optimizer's share for
    that table, ``initial`` the value its state ``name`` starts at in every row.

    Args:
        name: the state, e.g. ``"exp_avg"`` / ``"exp_avg_sq"`` (Adam), ``"sum"`` (Adagrad),
            ``"momentum_buffer"`` (SGD); ``optimizer.table_state(table)`` lists them.
        source: ``[rows, k]`` values, ``k`` the state's width (``embedding_dim``, or 1 for a
            row-wise state, which may also come as ``[rows]``).
        step: how many optimizer steps the state has seen (Adam's bias correction depends on
            it). Required with the first state loaded when the optimizer counts steps and has
            not stepped yet; the rows' state is used from the next step on (a fresh optimizer
            would otherwise start its first step from its own zero state).
        scalar: other scalar state the optimizer keeps (ASGD's ``eta`` and ``mu``, NAdam's
            ``mu_product``), required as ``step`` is.
        allow_nonfinite, progress: as for :func:`from_pretrained`.
    """
    table = slot.table
    if name not in slot.names:
        raise KeyError(f"table {slot.name!r}: {slot.cls.__name__} keeps per-row state "
                       f"{slot.names}, not {name!r}")
    src = open_source(source, column=True)
    index = slot.names.index(name)
    cols = table.layout.state_widths[index]
    n = table.num_embeddings
    if src.shape != (n, cols):
        raise ValueError(f"state {name!r} of table {slot.name!r} is [{n:,}, {cols}], but the "
                         f"source is {src.what}")
    new_scalar = _scalar_state(slot, step, scalar)
    target = _state_target(table, name, index)
    fresh = slot.scalar_state is None       # every row holds the optimizer's initial state
    if not (fresh or allow_nonfinite):      # trained state: check the whole source first
        _copy(src, _Target(n, cols, target.dtype, put=lambda a, y: None, what=target.what),
              allow_nonfinite=False, progress=progress, desc=f"checking {name}")
        src = open_source(source, column=True)
    try:
        _copy(src, target, allow_nonfinite=allow_nonfinite, progress=progress,
              desc=f"loading {name} of {slot.name!r}")
    except BaseException:
        if fresh:                           # as it was: the initial state in every row
            _fill(target, initial)
        raise
    slot.scalar_state = new_scalar


def _scalar_state(slot, step, scalar) -> dict:
    """The table's scalar state once the rows are loaded: the optimizer's keys (from its probe)
    with the values given, checked before anything is written."""
    given = dict(scalar or {})
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int (optimizer steps taken), got "
                             f"{step!r}")
        given["step"] = int(step)
    template = slot.scalar_template
    unknown = sorted(set(given) - set(template))
    if unknown:
        raise ValueError(f"{slot.cls.__name__} keeps scalar state {sorted(template)}, not "
                         f"{unknown}")
    current = dict(slot.scalar_state or {})
    missing = sorted(k for k in template if k not in given and k not in current)
    if missing:
        how = "step=N (the optimizer steps this state has seen: Adam's bias correction " \
              "depends on it; from SpeedTorch, the `step` in its torch optimizer's state)" \
            if missing == ["step"] else f"step= and scalar={{...}} for {missing}"
        raise ValueError(f"table {slot.name!r}: {slot.cls.__name__} has not stepped yet, so "
                         f"pass {how} with the loaded state")
    for k, v in given.items():
        t = template[k]
        current[k] = torch.tensor(float(v), dtype=t.dtype) if torch.is_tensor(t) else \
            type(t)(v)
    return current


def as_numpy(table, *, writable: bool = True) -> np.ndarray:
    """The table's weights ``[num_embeddings, embedding_dim]`` as a NumPy array sharing their
    memory: a view of host rows, or a disk table's file mapped. ``writable=False`` makes it
    read-only (a safety net when handing it to code that must not change the table).

    >>> from nbtools import OffloadedEmbedding
    >>> t = OffloadedEmbedding(4, 2, device="cpu")
    >>> as_numpy(t)[1] = 7.0
    >>> t(torch.tensor([1])).tolist()
    [[7.0, 7.0]]
    """
    if table.placement == "gpu" and table.device.type == "cuda":
        raise TypeError(f"table {table.name!r} keeps its rows in GPU memory, which NumPy cannot "
                        "address: use nbtools.pretrained.as_cupy(table) (no copy) or "
                        "table.weight.cpu().numpy() (a copy)")
    if table.config.dtype == torch.bfloat16:
        raise TypeError(f"table {table.name!r} stores bfloat16, which NumPy has no type for: "
                        "read table.weight (a torch view), or its bits with "
                        "table.weight.view(torch.int16).numpy()")
    arr = table.weight.numpy()
    if not writable:
        arr.flags.writeable = False
    return arr


def as_cupy(table):
    """The table's weights as a CuPy array sharing their memory: the GPU rows of a
    ``placement="gpu"`` table, or, for a table in pinned host memory on CUDA, a CuPy array over
    those host rows (GPU kernels then read and write host RAM over PCIe, as SpeedTorch's
    pinned arrays do). Needs CuPy (an ImportError says what to install)."""
    cupy = _cupy()
    if not table.rows.in_memory:
        raise TypeError(f"table {table.name!r} lives in a file on disk, which the GPU cannot "
                        "address: use nbtools.pretrained.as_numpy(table) (the file, memory-"
                        "mapped), or copy rows with cupy.asarray(table.weight[a:b].numpy())")
    if table.config.dtype == torch.bfloat16:
        raise TypeError(f"table {table.name!r} stores bfloat16, which CuPy has no type for")
    weight = table.weight                      # current: queued writes landed, cache emptied
    if weight.is_cuda:
        return cupy.from_dlpack(weight)
    if table.device.type != "cuda" or not table.pinned:
        raise TypeError(f"table {table.name!r} keeps its rows in pageable host memory "
                        f"(device={table.device}, pinned={table.pinned}), which CuPy cannot "
                        "address: use as_numpy(table), or a CUDA table with pin=True")
    return cupy.from_dlpack(table.layout.weight(table.rows.view()))


__all__ = ["CHUNK_BYTES", "EXTRA_BYTES", "NonFiniteSourceError", "as_cupy", "as_numpy",
           "from_pretrained", "load_row_state", "open_source"]
