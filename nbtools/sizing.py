"""How many rows make a table some number of times bigger than RAM, and whether the local
disk holds it (:func:`rows_for`).

A row's bytes are :func:`nbtools.plan`'s ``disk_row_bytes``: its weights and its optimizer
state, as a disk table holds them (without the padding of rows in RAM). A disk table's file
packs its rows 32 bytes apart in a log (a 260-byte row takes 288 bytes) with spare slots where
the disk has room, or, rows in place, stores each in whole ``O_DIRECT`` blocks (512 bytes on
most disks, probed on the folder itself), so its file is larger than its rows. RAM keeps 4
bytes and a bit per row of a disk table whatever its size
(its int32 row -> slot map and change marks, :class:`nbtools.disk.DiskRows`; 8 and a bit past
2**31 rows).

>>> import tempfile, torch
>>> s = rows_for(5, 252, "rowwise_adagrad", dtype=torch.bfloat16, ram_bytes=1 << 20,
...              disk_dir=tempfile.mkdtemp())
>>> s.rows, s.row_bytes, s.file_row_bytes, round(s.times_ram, 2)
(10320, 508, 512, 5.0)
"""
from __future__ import annotations

import dataclasses
import os
import uuid

import torch

from .disk import log as disklog
from .units import human_bytes

ROW_MAP_BYTES = 4.125  # RAM per row of a disk table: its int32 slot and its change mark (a bit)


@dataclasses.dataclass
class Sizing:
    """A table sized against RAM and the disk (see :func:`rows_for`)."""

    rows: int
    dim: int
    dtype: str
    optimizer: str
    row_bytes: int          # a row and its optimizer state, as RAM would hold it
    file_row_bytes: int     # a row in a disk table's file (packed, or whole O_DIRECT blocks)
    ram_bytes: int          # what the table is measured against
    ram_name: str           # what ram_bytes is, in words ("this machine's RAM")
    wanted: float           # times ram_bytes asked for
    disk_dir: str
    disk_free_bytes: int
    capped: bool            # the disk holds fewer rows than asked for

    @property
    def table_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def file_bytes(self) -> int:
        return disklog.file_rows(self.rows, self.file_row_bytes,
                                 self.disk_free_bytes) * self.file_row_bytes

    @property
    def row_map_bytes(self) -> int:
        """RAM a disk table of these rows keeps whatever its cache: 4 bytes and a bit per row
        (and the log layout's maps)."""
        from .disk import row_map_bytes
        return row_map_bytes(self.rows) + disklog.map_bytes(
            self.rows, self.file_row_bytes, self.disk_free_bytes, row_bytes=self.row_bytes)

    @property
    def times_ram(self) -> float:
        return self.table_bytes / self.ram_bytes

    def __str__(self) -> str:
        s = (f"{self.rows:,} rows x {self.dim} {self.dtype} with {self.optimizer}: "
             f"{self.row_bytes} B per row ({self.file_row_bytes} B in the file), "
             f"{human_bytes(self.table_bytes)} = {self.times_ram:.1f}x "
             f"{self.ram_name} ({human_bytes(self.ram_bytes)})\n"
             f"  file {human_bytes(self.file_bytes)} in {self.disk_dir} "
             f"({human_bytes(self.disk_free_bytes)} free); row maps in RAM "
             f"{human_bytes(self.row_map_bytes)}")
        if self.capped:
            want = int(self.wanted * self.ram_bytes / self.row_bytes) * self.file_row_bytes
            s += (f"\n  CAPPED by the disk: {self.wanted:g}x needs a file of "
                  f"{human_bytes(want)} and {human_bytes(self.disk_free_bytes)} is free (a "
                  f"share of it is left free). Free disk space, or pick a disk_dir on a larger "
                  f"disk, for the full {self.wanted:g}x.")
        return s


def file_row_bytes(row_bytes: int, disk_dir) -> int:
    """Bytes one row of ``row_bytes`` takes in a disk table's file in ``disk_dir``: the
    ``O_DIRECT`` block it is rounded up to, probed with a one-row file (created and removed;
    the folder is created if missing), or the packed stride of a log file
    (:func:`nbtools.disk.log.log_stride`)."""
    from .disk import table_dir
    from .rowfile import RowFile
    folder = table_dir(disk_dir)        # (the default one checked as a table's file would be)
    if disklog.wanted() and disklog.packed():
        return disklog.log_stride(row_bytes)
    f = RowFile.create(os.path.join(folder, f".probe-{uuid.uuid4().hex[:8]}.nbrows"), 1,
                       row_bytes)
    try:
        return f.stride
    finally:
        f.delete()


def rows_for(times_ram: float, dim: int, optimizer, *, dtype=torch.float32, ram_bytes=None,
             ram_name: str | None = None, disk_dir=None, disk_share: float = 0.9,
             **optimizer_kwargs) -> Sizing:
    """The rows of a table ``times_ram`` times bigger than ``ram_bytes``, capped so that its
    file takes at most ``disk_share`` of the free space in ``disk_dir``.

    Args:
        times_ram: how many times RAM the rows and their optimizer state should take.
        dim, optimizer, dtype, **optimizer_kwargs: the table, as :func:`nbtools.plan` takes
            them (``optimizer``: a class or a name such as ``"rowwise_adagrad"``).
        ram_bytes, ram_name: what to measure against, and its name in the printout (default:
            the machine's RAM, ``MemTotal``); e.g. a host budget, ``"the host budget"``.
        disk_dir: the disk table's folder (default :func:`nbtools.disk.default_dir`).
        disk_share: of the disk's free space the file may take.

    Raises:
        ValueError: an argument is out of range, or the disk has no room for a single row.
    """
    from . import disk
    from .devices import host_memory_bytes
    from .optim import plan
    if not (isinstance(times_ram, (int, float)) and times_ram > 0):
        raise ValueError(f"times_ram must be a positive number, got {times_ram!r}")
    if not 0 < disk_share <= 1:
        raise ValueError(f"disk_share must be in (0, 1], got {disk_share!r}")
    if ram_bytes is None:
        ram_bytes, ram_name = host_memory_bytes()["total"], ram_name or "this machine's RAM"
        if ram_bytes is None:
            raise ValueError("this machine's RAM is unknown (no /proc/meminfo): pass ram_bytes")
    if ram_bytes <= 0:
        raise ValueError(f"ram_bytes must be positive, got {ram_bytes!r}")
    folder = os.path.abspath(os.fspath(disk_dir or disk.default_dir()))
    p = plan(1, dim, optimizer, dtype, device="cpu", disk_dir=folder, **optimizer_kwargs)
    row = p.disk_row_bytes
    stride = file_row_bytes(row, folder)
    free = disk.free_bytes(folder)
    wanted = int(times_ram * ram_bytes // row)
    room = int(disk_share * free) // stride   # (in place: the log's spare only where it fits)
    if room < 1:
        raise ValueError(f"{folder} has {human_bytes(free)} free: not room for one row of "
                         f"{stride} B. Pick a disk_dir on a disk with free space.")
    return Sizing(min(wanted, room), dim, p.dtype, p.optimizer, row, stride, int(ram_bytes),
                  ram_name or "the RAM given", float(times_ram), folder, free,
                  capped=wanted > room)


__all__ = ["Sizing", "rows_for", "file_row_bytes", "ROW_MAP_BYTES"]


T4_BYTES = 16 * 10**9    # the smallest GPU a notebook is likely to get (Colab's free T4): 16 GB


def against_gpu(nbytes: int, what: str = "tables and optimizer state") -> str:
    """``nbytes`` against a 16 GB T4 and against this machine's GPU, in one line.

    >>> against_gpu(20 * 10**9).startswith("18.6 GiB of tables and optimizer state: 1.25x a 16 GB T4")
    True
    """
    line = f"{human_bytes(nbytes)} of {what}: {nbytes / T4_BYTES:.2f}x a 16 GB T4"
    from .devices import cuda_ok
    if cuda_ok():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        line += (f", {nbytes / props.total_memory:.2f}x this GPU's {human_bytes(props.total_memory)}"
                 f" ({props.name})")
    else:
        line += "; no GPU here"
    return line
