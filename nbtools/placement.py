"""Where a table's rows live, decided before anything is allocated: the GPU, host RAM, or a
file on local disk (``placement="auto"``), the checks that refuse what does not fit, and the
chunked copies that move rows between them without doubling their memory.
"""
from __future__ import annotations

import ctypes
import dataclasses
import mmap
import numbers

import torch

from . import NbtoolsError
from .devices import gpu_free_bytes, host_memory_bytes, synchronize
from .hostmem import HostTensor, pin_tensor
from .store.layout import RowLayout, row_padding
from .store.precision import LOW_PRECISION, check_rounding
from .store.rows import DeviceRows
from .units import human_bytes, positive_int


class HostMemoryError(NbtoolsError, MemoryError):
    """A table or its optimizer state would not fit in host memory; nothing was allocated."""


# What a table's arguments may be (check_table_args): where its rows go, and what they hold.
PLACEMENTS = ("auto", "gpu", "host", "disk")
TABLE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_table_args(sizes: dict, dtype, placement: str = "auto", gpu_fraction=0.5,
                     disk_dir=None) -> list:
    """The checks a table's arguments pass, the same for :class:`nbtools.OffloadedEmbedding`
    and :func:`nbtools.plan`: ``sizes`` (``{name: value}``, e.g. the rows and the dim)
    positive ints (NumPy ints too, never a bool), a storage dtype a table takes, a known
    placement, ``gpu_fraction`` in (0, 1] and a ``disk_dir`` that can be a folder
    (:func:`nbtools.disk.check_dir`). Raises TypeError, ValueError or NotADirectoryError
    naming the argument, what was passed and what it may be; returns the sizes as ints.

    >>> check_table_args({"num_rows": 10, "dim": 4}, torch.bfloat16, placement="disk")
    [10, 4]
    """
    out = [positive_int(name, value) for name, value in sizes.items()]
    if not isinstance(dtype, torch.dtype) or dtype not in TABLE_DTYPES:
        raise TypeError(f"dtype must be torch.float32, float64, bfloat16 or float16, got "
                        f"{dtype!r}")
    if not isinstance(placement, str) or placement not in PLACEMENTS:
        raise ValueError(f"placement must be 'auto', 'gpu', 'host' or 'disk', got "
                         f"{placement!r}")
    if isinstance(gpu_fraction, bool) or not isinstance(gpu_fraction, numbers.Real) \
            or not 0 < gpu_fraction <= 1:
        raise ValueError(f"gpu_fraction must be a number in (0, 1] (the share of the GPU's free "
                         f"memory placement='auto' may take), got {gpu_fraction!r}")
    if disk_dir is not None:
        from . import disk
        disk.check_dir(disk_dir)
    return out


@dataclasses.dataclass
class TableConfig:
    """Options of an offloaded table beyond its shape, name, device and placement."""

    # Storage of the weights. bfloat16/float16 halve the bytes; every update is still computed
    # in float32 (rows are upcast when gathered, rounded once when written).
    dtype: torch.dtype = torch.float32
    # Storage of the optimizer state: None = float32 for low-precision weights (an Adam moment
    # in bf16 loses small updates), else the weights' dtype. bfloat16 here halves it too.
    state_dtype: torch.dtype | None = None
    # How low-precision values are rounded when written: "nearest" (ties to even) or
    # "stochastic" (bfloat16 only: unbiased, so updates below bf16's resolution still count).
    rounding: str = "nearest"
    pin: bool = True               # register host rows with CUDA (zero-copy); False: pageable
    # placement="auto" puts a table on the GPU when its rows and optimizer state take at most
    # this share of the GPU memory free at that moment; the rest of it stays for activations.
    gpu_fraction: float = 0.5
    # Replay each training lookup's ~20 small kernels as one CUDA graph (per batch size seen
    # twice): most of a small step's CPU time. Off: every lookup launches them one by one.
    cuda_graphs: bool = True
    # A GPU cache of hot rows (weight and optimizer state together) for a table in pinned host
    # memory (nbtools.store.cache) or on disk (nbtools.disk.gpu: a level above its RAM cache,
    # holding other rows than RAM): its size in GPU bytes (the rows, plus for a host table 8
    # bytes per table row for the row -> slot map and the counts), or a share of the GPU
    # memory free when the optimizer attaches, or room for cache_rows rows. None, None, None:
    # no cache, except under placement="auto" when the table goes to host memory or disk,
    # where the cache takes the gpu_fraction budget.
    cache_bytes: int | None = None
    cache_fraction: float | None = None
    cache_rows: int | None = None
    # Write a step's updated rows back to pinned host memory behind the next step, on a side
    # stream, so the link stays busy while the GPU computes (nbtools.store.rows, docs/step.md).
    # None: for tables in pinned host memory without a cache of hot rows, updated by a fused
    # kernel, in steps that write at least WriteBehind.WRITE_BEHIND_MIN_BYTES (8 MiB); False:
    # never (the update writes host memory itself); True: wherever the update is fused, any
    # size, a CPU table too (where the write runs at once: tests use it).
    write_behind: bool | None = None
    # placement="disk": the folder of the table's file (local disk, not a Drive mount; None:
    # nbtools.disk.default_dir(), under the system's temporary folder), and the RAM its cache
    # of hot rows may take (None: nbtools.disk.DEFAULT_HOST_CACHE_BYTES, 1 GiB). The file
    # holds every row with its optimizer state; RAM holds only the cached rows.
    disk_dir: str | None = None
    host_cache_bytes: int | None = None

    @classmethod
    def with_options(cls, config: "TableConfig | None", options: dict) -> "TableConfig":
        """``config`` (default: a new one) with the fields ``options`` names replaced; a
        TypeError names any that is not a field."""
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = set(options) - set(fields)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {sorted(unknown)}; a table takes "
                            f"padding_idx, name, device, placement, config, and the TableConfig "
                            f"fields {fields}")
        return dataclasses.replace(config or cls(), **options)

    @property
    def storage_state_dtype(self) -> torch.dtype:
        """What the optimizer state is stored in (``state_dtype``, or its default)."""
        if self.state_dtype is not None:
            return self.state_dtype
        return torch.float32 if self.dtype in LOW_PRECISION else self.dtype

    def check(self, placement: str, sizes: dict | None = None) -> list:
        """Raise TypeError / ValueError naming the first field (or ``placement``, or one of
        ``sizes``, ``{name: value}``) that is wrong; the sizes as ints. Shape, dtype,
        placement, ``gpu_fraction`` and ``disk_dir`` are checked as :func:`nbtools.plan`
        checks them (:func:`nbtools.placement.check_table_args`)."""
        dtype = self.dtype
        out = check_table_args(sizes or {}, dtype, placement, self.gpu_fraction, self.disk_dir)
        if self.state_dtype is not None and not (
                isinstance(self.state_dtype, torch.dtype) and self.state_dtype.is_floating_point):
            raise TypeError(f"state_dtype must be a floating torch.dtype, got "
                            f"{self.state_dtype!r}")
        state_dtype = self.storage_state_dtype
        if state_dtype.itemsize < dtype.itemsize or state_dtype.itemsize == dtype.itemsize \
                and state_dtype != dtype:
            raise ValueError(f"state_dtype {state_dtype} with dtype {dtype}: the state may be "
                             f"as wide as the weights or wider (e.g. bf16 weights, fp32 state)")
        for value in (dtype, state_dtype):
            check_rounding(self.rounding, value if value in LOW_PRECISION else torch.bfloat16)
        if self.host_cache_bytes is not None:      # bytes of RAM for a disk table's hot rows
            positive_int("host_cache_bytes", self.host_cache_bytes)
        if self.write_behind not in (None, True, False):
            raise ValueError(f"write_behind must be None (large steps of tables in pinned host "
                             f"memory), True or False, got {self.write_behind!r}")
        return out


def padding_row(padding_idx, num_rows: int) -> int | None:
    """``padding_idx`` as a row id in ``[0, num_rows)`` (negative counts from the end), or
    the TypeError / ValueError that says what is wrong with it."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, numbers.Integral):
        raise TypeError(f"padding_idx must be an int row id or None, got "
                        f"{padding_idx!r} ({type(padding_idx).__name__})")
    if not -num_rows <= padding_idx < num_rows:
        raise ValueError(f"padding_idx={padding_idx} is out of range for {num_rows:,} rows")
    return int(padding_idx) % num_rows


def check_fits(nbytes: int, what: str, hint: str = "", reclaim: int = 0, *, disk_dir=None,
               num_rows: int | None = None) -> None:
    """Refuse, before allocating, ``nbytes`` of host memory that this machine does not have.

    ``reclaim``: bytes the allocation frees as it goes (a table growing into its optimizer
    state hands its old rows back), counted as available. The rule is :func:`nbtools.plan`'s:
    the final footprint must fit in 90% of what is available before any of it exists. Where
    the rows (``num_rows`` of them) would fit on the disk of ``disk_dir`` (default
    :func:`nbtools.disk.default_dir`), the error says so, with the disk's free space.
    """
    available = host_memory_bytes()["available"]
    if available is not None:
        available += reclaim
    if available is not None and nbytes > 0.9 * available:
        raise HostMemoryError(
            f"{what} needs {human_bytes(nbytes)} of host memory but only "
            f"{human_bytes(available)} is available (nbtools keeps 10% free). {hint}".rstrip()
            + (_disk_hint(nbytes, disk_dir, num_rows) if what else ""))


def _disk_hint(nbytes: int, disk_dir, num_rows: int | None) -> str:
    """Where a table's rows would fit on local disk: the advice to place them there."""
    from . import disk
    folder = disk_dir or disk.default_dir()
    free = disk.free_bytes(folder)
    if free < disk_bytes(nbytes, num_rows):
        return ""
    return (f" It fits on local disk: placement='disk' keeps the rows in a file under "
            f"{folder} ({human_bytes(free)} free; disk_dir= picks another folder) with a RAM "
            f"cache of the hot rows (host_cache_bytes=).")


def _disk_to_host(table, layout: RowLayout, names: list, initial: dict) -> "Regrown":
    """A disk table's rows read into new host rows of ``layout`` (state columns at
    ``initial``), 64 MiB at a time; its file removed: the rows of a host table."""
    n = table.num_embeddings
    disk, dtype = table.disk, layout.unit
    init = _init_columns(layout, names, initial)
    pin = table.config.pin and table.device.type == "cuda"
    new = HostTensor((n, layout.width), dtype, pin=pin, name=table.name,
                     device=table.device if table.device.type == "cuda" else None)
    # rows never written yet are drawn straight into RAM (the chunks the file's first write
    # would use, so the same draws), never through the file
    draw, disk.initial = disk.initial, None
    try:
        chunk = max(1, (64 << 20) // disk.row_bytes)
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            src = draw(a, b).cpu() if draw is not None else disk.read_rows(a, b)
            copy_rows(new.tensor[a:b], src, init, layout)
    except BaseException:
        new.close()
        disk.initial = draw            # (still a disk table, its rows still to be drawn)
        raise
    synchronize(table.device)          # lookups queued before may still read its RAM slots
    disk.close()
    reason = (f"auto: made on disk (Adam-sized state assumed), moved to host RAM: "
              f"{human_bytes(n * layout.width * dtype.itemsize)} of rows with "
              f"{', '.join(names)} fit")
    if layout.pad == 0 and row_padding(layout):
        reason += "; rows not padded to 32-byte sectors (padded, they would not fit)"
    return Regrown(new, layout, None, "host", reason)


def _init_columns(layout: RowLayout, names: list, initial: dict) -> list:
    """(first column, end column, value) of each state of ``layout`` at ``initial[name]``."""
    return [(layout.state_col(i), layout.state_col(i) + layout.state_widths[i],
             float(initial.get(k, 0.0))) for i, k in enumerate(names)]


@dataclasses.dataclass
class Regrown:
    """Where :func:`regrow_for_state` put a table's rows with their optimizer state: the new
    memory, its layout, the disk table's file and slots (or None), the placement and why.
    The table puts a tier over them (:func:`make_store`) in
    :meth:`~nbtools.OffloadedEmbedding.attach_state`."""

    rows: object
    layout: RowLayout
    disk: object
    placement: str
    reason: str


def fits_host(nbytes: int, reclaim: int = 0) -> bool:
    """Whether :func:`check_fits` would let ``nbytes`` of host memory be allocated."""
    try:
        check_fits(nbytes, "", reclaim=reclaim)
    except HostMemoryError:
        return False
    return True


def copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, skipped when ``src`` is the very same memory (a state dict of live
    host tensors handed back)."""
    if (src.device == dst.device and src.data_ptr() == dst.data_ptr()
            and src.stride() == dst.stride() and src.dtype == dst.dtype):
        return
    with torch.no_grad():
        dst.copy_(src)


def weight_in(state_dict: dict, key: str, shape: tuple, name: str, missing_keys: list,
              error_msgs: list):
    """``state_dict[key]``, the weights a table ``name`` of ``shape`` loads, or None where
    ``nn.Module.load_state_dict`` is told (``missing_keys``, ``error_msgs``) what is wrong."""
    if key not in state_dict:
        missing_keys.append(key)
        return None
    src = state_dict[key]
    if tuple(src.shape) != tuple(shape):
        error_msgs.append(f"size mismatch for {key}: checkpoint has {tuple(src.shape)}, table "
                          f"{name!r} is {tuple(shape)}")
        return None
    return src


_libc = None


def copy_rows(dst: torch.Tensor, src: torch.Tensor, init, layout: RowLayout,
               after_chunk=None) -> None:
    """``dst`` [n, width] <- ``src`` [n, d] as the weights of ``layout``, the state columns at
    their initial values (``init``: (first column, end column, value)), 64 MiB of ``dst`` at
    a time (bounded temporaries); ``after_chunk(stop_row)`` runs after each chunk."""
    n = src.shape[0]
    chunk = max(1, (64 << 20) // (dst.shape[1] * dst.element_size()))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        part = dst[start:stop]
        part.zero_()
        layout.weight(part).copy_(src[start:stop])
        for lo, hi, value in init:
            if value:
                dst[start:stop, lo:hi].fill_(value)
        if after_chunk is not None:
            after_chunk(stop)


def release_pages(base: int, done: int, upto: int) -> int:
    """Hand the whole pages of ``[base + done, base + upto)`` back to the OS (``MADV_DONTNEED``;
    they read as zeros afterwards). Returns the new ``done``, page-aligned. Best effort: where
    madvise is unavailable nothing is released and the copy still works."""
    global _libc
    lo = -(-(base + done) // mmap.PAGESIZE) * mmap.PAGESIZE
    hi = (base + upto) // mmap.PAGESIZE * mmap.PAGESIZE
    if hi <= lo:
        return done
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)   # 4: MADV_DONTNEED
    except (OSError, AttributeError):
        return done
    return hi - base


class NoRoomError(HostMemoryError):
    """A table fits on no tier (GPU, host RAM, local disk); nothing was allocated."""


def disk_bytes(nbytes: int, num_rows: int | None) -> int:
    """The least free disk a table of ``nbytes`` in ``num_rows`` rows needs: its rows in place,
    each rounded up to a 512-byte sector (``O_DIRECT``; the file is made with the disk's own
    block, checked again then), or, where that is less, a log file of packed rows with the
    least spare it takes (:func:`nbtools.disk.log.file_rows`: 10%, and a share of the disk left
    free beside it)."""
    if not num_rows:
        return nbytes
    from .disk import log as disklog
    row = nbytes // num_rows
    in_place = num_rows * -(-row // 512) * 512
    if not (disklog.wanted() and disklog.packed()):
        return in_place
    return min(in_place, disklog.least_free_bytes(num_rows, row))


def auto_placement(nbytes: int, device: torch.device, gpu_fraction: float,
                   disk_dir=None, num_rows: int | None = None) -> tuple[str, str]:
    """Where ``placement="auto"`` puts ``nbytes`` of rows and state, and why: the GPU when they
    take at most ``gpu_fraction`` of its free memory, else host RAM when they take at most 90%
    of what is available (:func:`check_fits`' rule), else a file in ``disk_dir`` (default
    :func:`nbtools.disk.default_dir`) when the disk has room. Raises :class:`NoRoomError`,
    with every tier's numbers, when none has. ``num_rows``: the disk's need counts each row
    rounded up to a sector (:func:`disk_bytes`)."""
    tried = []
    if device.type == "cuda":
        free = gpu_free_bytes(device)
        budget = int(gpu_fraction * free)
        if nbytes <= budget:
            return "gpu", (f"{human_bytes(nbytes)} fits {gpu_fraction:.0%} of the "
                           f"{human_bytes(free)} free on {device}")
        tried.append(f"{gpu_fraction:.0%} of the {human_bytes(free)} free on {device}")
    available = host_memory_bytes()["available"]
    if available is None or nbytes <= 0.9 * available:
        if device.type != "cuda":
            return "host", "CPU compute"
        return "host", (f"{human_bytes(nbytes)} exceeds {tried[0]}; host RAM has "
                        f"{human_bytes(available)} available")
    tried.append(f"90% of the {human_bytes(available)} of host RAM available")
    from . import disk
    folder = disk_dir or disk.default_dir()
    free_disk = disk.free_bytes(folder)
    on_disk = disk_bytes(nbytes, num_rows)
    if on_disk <= free_disk:
        return "disk", (f"{human_bytes(nbytes)} exceeds {' and '.join(tried)}; "
                        f"{human_bytes(on_disk)} on disk, {human_bytes(free_disk)} free in "
                        f"{folder}")
    raise NoRoomError(
        f"{human_bytes(nbytes)} of rows and optimizer state fit nowhere: "
        f"{'; '.join(tried)}; {human_bytes(on_disk)} needed on disk (rows in 512-byte "
        f"sectors, or packed in a log with its least spare), {human_bytes(free_disk)} free in "
        f"{folder}. Use "
        "nbtools.plan(...) to size it: fewer rows, a smaller dim, dtype=torch.bfloat16, an "
        "optimizer with less state (SGD, Adagrad), or a disk_dir with more room.")



def grow_host(old, shape, init, layout: RowLayout, pin: bool, name: str, device=None):
    """Copy ``old`` [n, d] host rows into new [n, width] host rows (``layout``, state columns at
    ``init``), chunk by chunk, handing each chunk of ``old`` back to the OS once copied, so
    RAM peaks at the new rows plus one chunk; the result registered when ``pin``. ``device``:
    a CUDA device for the small path's zero-copy view."""
    n, width = shape
    d = old.tensor.shape[1]
    dtype = layout.unit
    itemsize = old.tensor.element_size()
    if n * width * dtype.itemsize < (256 << 20):       # small: the simple way
        new = HostTensor(shape, dtype, pin=pin, name=name, device=device)
        copy_rows(new.tensor, old.tensor, init, layout)
        old.close()
        return new
    old.close()                                  # unregister: its pages may be released now
    src = old.tensor
    # Untouched until written: the new rows take physical memory chunk by chunk.
    dst = torch.empty(shape, dtype=dtype)
    released = 0                                 # bytes of src handed back so far
    base = src.data_ptr()

    def release(stop):
        nonlocal released
        released = release_pages(base, released, stop * d * itemsize)
    copy_rows(dst, src, init, layout, after_chunk=release)
    del src
    return pin_tensor(dst, name=name)



def regrow_for_state(table, names: list, initial: dict, dims) -> Regrown:
    """For ``table.attach_state``: the table's rows reallocated as ``[weight | state...]``
    where its placement is decided for good (``"auto"``), state columns at ``initial``. The
    old rows are released as they are copied; the table installs what this returns."""
    old = table.storage
    state_dtype = table.config.storage_state_dtype
    d, n = table.embedding_dim, table.num_embeddings
    layout = RowLayout(d, table.config.dtype, state_dtype, len(names),
                       tuple((dims or {}).get(k, d) for k in names), names=tuple(names))
    # rows in RAM or on the GPU padded to whole 32-byte sectors (nbtools.store.layout.row_padding);
    # a disk table's rows keep their bytes (its file's stride is the disk's block anyway)
    padded = dataclasses.replace(layout, pad=row_padding(layout))
    nbytes = n * padded.width * state_dtype.itemsize
    was = placement = table.placement
    reason = table.placement_reason

    def choose(nbytes):
        return choose_placement(table.requested_placement, table.device, table.config,
                                table.name, n, nbytes)
    if table.requested_placement == "auto" and was != "disk":   # (a file stays a file)
        placement, reason = choose(nbytes)
        if placement == "disk" and padded.pad:
            # the padding must never be what sends a table that fits in RAM to disk
            where, why = choose(n * layout.width * state_dtype.itemsize)
            if where != "disk":
                placement, padded = where, layout
                reason = f"{why}; rows not padded to 32-byte sectors (padded, they would not fit)"
    elif placement == "host" and padded.pad and not fits_host(
            nbytes, reclaim=old.nbytes if was == "host" else 0):
        padded = layout              # as above: unpadded rows where padded ones do not fit
    elif table.requested_placement == "auto" and was == "disk":
        # Placed on disk when made, its optimizer unknown (Adam-sized state assumed): where
        # this optimizer's rows fit in RAM, they move there (a file would make every step
        # wait for the disk)
        for lay in (padded, layout) if padded.pad else (padded,):
            if fits_host(n * lay.width * state_dtype.itemsize):
                return _disk_to_host(table, lay, names, initial)
    if placement != "disk":
        layout = padded
    nbytes = n * layout.width * state_dtype.itemsize
    width = layout.width
    if placement == "host":
        check_fits(nbytes, f"table {table.name!r} with optimizer state ({', '.join(names)})",
                   "Use nbtools.plan(...) to size it, or an optimizer with less state "
                   "(SGD, nbtools.RowWiseAdagrad: one value per row).",
                   reclaim=old.nbytes if was == "host" else 0, disk_dir=table.config.disk_dir,
                   num_rows=n)
    if was == "host":
        synchronize(table.device)
    init = _init_columns(layout, names, initial)
    disk_rows = None
    if placement == "gpu":
        new = DeviceRows((n, width), state_dtype, table.device, table.name)
        copy_rows(new.tensor, old.tensor, init, layout)
        old.close()
    elif placement == "disk":     # a file of the new rows; from host RAM under "auto"
        from . import disk
        disk_rows = disk.regrow(
            table.disk or old, layout, init, copy_rows,
            lambda width, dtype: disk.new_rows(table.config, n, width, dtype, table.device,
                                               table.name))
        new = disk_rows.slab
    else:
        pin = old.pinned if isinstance(old, HostTensor) else \
            (table.config.pin and table.device.type == "cuda")
        new = grow_host(old, (n, width), init, layout, pin, table.name,
                        table.device if table.device.type == "cuda" else None)
    return Regrown(new, layout, disk_rows, placement, reason)


__all__ = ["HostMemoryError", "NoRoomError", "Regrown", "TableConfig", "auto_placement",
           "check_fits", "choose_placement", "copy_rows", "copy_unless_same", "disk_bytes",
           "first_placement", "fits_host", "grow_host", "make_store", "padding_row",
           "regrow_for_state", "release_pages", "weight_in"]


def choose_placement(asked: str, device: torch.device, config, name: str, num_rows: int,
                     nbytes: int, assumption: str = "") -> tuple[str, str]:
    """``(placement, why)`` for a table ``name`` of ``num_rows`` rows taking ``nbytes`` with its
    state, whose placement argument is ``asked``, computing on ``device``, with ``config``
    (its :class:`TableConfig`: ``gpu_fraction``, ``disk_dir``)."""
    if asked == "disk":
        return "disk", "asked for"
    if asked == "gpu" and device.type != "cuda":
        from .devices import cuda_ok
        raise ValueError(
            f"table {name!r}: placement='gpu' keeps the rows in GPU memory, but this "
            f"table computes on {device}"
            + ("" if cuda_ok() else " (no CUDA device is visible)")
            + ": use placement='host' or 'auto' (the same code then runs on the CPU)"
            + (", or device='cuda'" if cuda_ok() else ""))
    if device.type != "cuda" and asked != "auto":
        return "host", "CPU compute"
    if asked != "auto":
        return asked, "asked for"
    where, why = auto_placement(nbytes, device, config.gpu_fraction, config.disk_dir, num_rows)
    return where, f"auto: {why}" + (f" ({assumption})" if assumption else "")


def first_placement(asked: str, device: torch.device, config, name: str, num_rows: int,
                    dim: int) -> tuple[str, str]:
    """Where a new table's rows go (``asked``: its placement argument) before its optimizer is
    known (Adam-sized state assumed; its weights alone where that fits nowhere), and why; a
    host table that does not fit raises HostMemoryError naming what to change."""
    nbytes = num_rows * dim * config.dtype.itemsize

    def choose(nbytes, assumption):
        return choose_placement(asked, device, config, name, num_rows, nbytes, assumption)
    try:
        where = choose(3 * nbytes, "Adam-sized state assumed until an optimizer attaches")
    except NoRoomError:          # the optimizer may keep less state: its attach decides
        where = choose(nbytes, "placed by its weights alone: with Adam-sized state it fits "
                               "nowhere")
    if where[0] == "host":
        check_fits(nbytes, f"table {name!r} ({num_rows:,} x {dim} "
                           f"{str(config.dtype).replace('torch.', '')})",
                   "Use nbtools.plan(...) to size it; a smaller dim, fewer rows or "
                   "dtype=torch.bfloat16 halves it.", disk_dir=config.disk_dir,
                   num_rows=num_rows)
    return where


def make_store(memory, device: torch.device, layout: RowLayout, disk=None):
    """The tier (:class:`nbtools.store.RowTier`) over a table's rows of ``layout``: ``memory`` (a
    :class:`~nbtools.hostmem.HostTensor` or :class:`~nbtools.store.rows.DeviceRows`), written
    back behind the next step where it is host memory
    (:mod:`nbtools.store.tiers`); or, given ``disk`` (a :class:`nbtools.disk.DiskRows`), its
    RAM slots as they are now, under its GPU level where it has one. (A cache of hot rows over
    host rows comes once the optimizer's state is known: :func:`nbtools.store.tiers.with_cache`.)"""
    from .store.rows import RowStore
    from .store.tiers import Cached, WriteBehind
    if disk is not None:      # rows from the file, through RAM slots
        from .disk.store import DiskStore
        tier = DiskStore(disk, device, layout=layout)
        return tier if disk.above is None else Cached(tier, disk.above, writes_back=False)
    tier = RowStore(memory, device, layout=layout)
    return WriteBehind(tier) if tier.mode in ("zero-copy", "host") else tier
