"""nbtools.sizing.rows_for: rows against RAM, capped by the disk.

References: bytes per row written out from the layout (weights plus state), the file's stride and
the RAM per row read off a real disk table (its file and what the host budget counted).
"""
import gc
import os

import numpy as np
import pytest
import torch

import nbtools
from nbtools import devices, disk
from nbtools.disk import log as disklog
from nbtools.sizing import ROW_MAP_BYTES, file_row_bytes, rows_for


@pytest.mark.parametrize("dim,optimizer,dtype,row", [
    (252, "rowwise_adagrad", torch.bfloat16, 252 * 2 + 4),     # bf16 weights, fp32 sum
    (8, "adam", torch.float32, 8 * 4 * 3),                      # weights, exp_avg, exp_avg_sq
    (100, "sgd", torch.float32, 100 * 4),
])
def test_rows_are_times_ram_over_the_row(tmp_path, dim, optimizer, dtype, row):
    s = rows_for(5, dim, optimizer, dtype=dtype, ram_bytes=3 << 20, disk_dir=tmp_path)
    assert s.row_bytes == row and s.rows == 5 * (3 << 20) // row and not s.capped
    assert s.table_bytes == s.rows * row and s.times_ram == pytest.approx(5, rel=1e-3)
    assert s.row_map_bytes == 4 * s.rows + -(-s.rows // 8) \
        + disklog.map_bytes(s.rows, row_bytes=row)   # a log
    assert s.file_bytes == disklog.file_rows(s.rows) * s.file_row_bytes > s.rows * s.file_row_bytes
    assert "5.0x the RAM given (3.0 MiB)" in str(s) and "CAPPED" not in str(s)


def test_default_ram_is_the_machines(tmp_path):
    s = rows_for(0.001, 16, "sgd", disk_dir=tmp_path)
    assert s.ram_bytes == devices.host_memory_bytes()["total"]
    assert "this machine's RAM" in str(s)


def test_file_rows_and_row_maps_are_what_a_disk_table_takes(tmp_path):
    gc.collect()      # (host bytes of tables earlier tests left to the collector: not mid-count)
    held = devices.held_host_bytes()
    table = nbtools.OffloadedEmbedding(1_000, 30, device="cpu", placement="disk",
                                       disk_dir=str(tmp_path), host_cache_bytes=4096)
    d = table.disk
    assert file_row_bytes(d.row_bytes, tmp_path) == d.file.stride
    assert devices.held_host_bytes() - held - d.slab.nbytes == 1_000 * ROW_MAP_BYTES \
        + getattr(d.file, "map_bytes", 0) + d.ram.slots * d.ram.slot_bytes
    assert d.ram.slot_of.dtype == d.ram.id_of.dtype == np.int32     # (row and slot numbers < 2**31)
    assert d.ram_bytes == devices.held_host_bytes() - held
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(d.file.path)]  # probe gone
    table.close()


def test_the_disk_caps_the_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1 << 20)
    s = rows_for(5, 252, "rowwise_adagrad", dtype=torch.bfloat16, ram_bytes=1 << 20,
                 ram_name="the host budget", disk_dir=tmp_path)
    assert s.capped and s.rows == int(0.9 * (1 << 20)) // s.file_row_bytes
    assert s.file_bytes == s.rows * s.file_row_bytes          # no room for spare slots: in place
    text = str(s)
    assert "CAPPED by the disk" in text and "the host budget" in text, text
    assert rows_for(5, 252, "rowwise_adagrad", dtype=torch.bfloat16, ram_bytes=1 << 20,
                    disk_dir=tmp_path, disk_share=0.5).rows == (1 << 19) // s.file_row_bytes
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 100)
    with pytest.raises(ValueError, match="not room for one row"):
        rows_for(5, 252, "rowwise_adagrad", dtype=torch.bfloat16, ram_bytes=1 << 20,
                 disk_dir=tmp_path)


@pytest.mark.parametrize("kwargs,match", [
    (dict(times_ram=0), "times_ram must be a positive number, got 0"),
    (dict(disk_share=1.5), "disk_share must be in"),
    (dict(ram_bytes=-1), "ram_bytes must be positive, got -1"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    args = dict(times_ram=5, dim=8, optimizer="sgd", disk_dir=tmp_path, ram_bytes=1 << 20)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rows_for(**args)


def test_a_table_sized_to_the_disk_takes_its_optimizer(tmp_path, monkeypatch):
    """A disk of 24 MiB (the blocks the folder's files hold count as used): rows_for caps the
    table to it, and the table can then be made and trained there. (Until 00af75b, attaching
    the optimizer made the file with state beside the unwritten weights-only one, and needed
    room for both: Colab's 78 GB could not take the notebook's 64 GB table.)"""
    import shutil
    capacity = 24 << 20

    def usage(path):
        used = sum(f.stat().st_blocks * 512 for f in tmp_path.rglob("*") if f.is_file())
        return shutil._ntuple_diskusage(capacity, used, capacity - used)
    monkeypatch.setattr(shutil, "disk_usage", usage)
    s = rows_for(5, 252, "rowwise_adagrad", dtype=torch.bfloat16, ram_bytes=8 << 20,
                 disk_dir=tmp_path)
    assert s.capped and s.file_bytes <= 0.9 * capacity
    table = nbtools.OffloadedEmbedding(s.rows, 252, device="cpu", dtype=torch.bfloat16,
                                       placement="disk", disk_dir=str(tmp_path),
                                       host_cache_bytes=1 << 20)
    opt = nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.1)
    table(torch.arange(10)).sum().backward()
    opt.step()
    table.close()
