"""RowFile: random and sequential row I/O against a plain numpy reference, and its errors."""
import os
import shutil

import numpy as np
import pytest

from nbtools.rowfile import DiskFullError, RowFile, RowFileError


@pytest.mark.parametrize("row_bytes", [260, 512, 1536, 4100])
@pytest.mark.parametrize("direct", ["auto", False])
def test_random_rows_round_trip(tmp_path, row_bytes, direct):
    n = 500
    rng = np.random.default_rng(row_bytes)
    ref = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    f = RowFile.create(tmp_path / "t.rows", n, row_bytes, {"what": "test"}, threads=4,
                       direct=direct)
    assert f.stride >= row_bytes and (not f.direct or f.stride % 512 == 0)
    f.write_range(0, ref)
    # unsorted, with runs of neighbours and isolated rows, and an empty request
    ids = np.concatenate((np.arange(40, 90), rng.choice(n, 120, replace=False)))
    ids = np.unique(ids)
    rng.shuffle(ids)
    out = np.zeros((len(ids), row_bytes), dtype=np.uint8)
    f.read(ids, out)
    assert np.array_equal(out, ref[ids])
    f.read(np.zeros(0, dtype=np.int64), np.zeros((0, row_bytes), dtype=np.uint8))
    new = rng.integers(0, 256, (len(ids), row_bytes), dtype=np.uint8)
    f.write(ids, new)
    ref[ids] = new
    back = np.zeros_like(ref)
    f.read_range(0, back)
    assert np.array_equal(back, ref)            # neighbours of written rows untouched
    f.close()
    g = RowFile.open(tmp_path / "t.rows", expect={"num_rows": n, "row_bytes": row_bytes})
    assert g.meta["what"] == "test"
    g.read_range(0, back)
    assert np.array_equal(back, ref)
    assert g.counters["read_calls"] == 1
    g.close()


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "t.rows"
    with pytest.raises(FileNotFoundError, match="t.rows"):
        RowFile.open(path)
    RowFile.create(path, 10, 8).close()
    with pytest.raises(FileExistsError, match="t.rows"):
        RowFile.create(path, 10, 8)
    with pytest.raises(RowFileError, match="row_bytes is 8, expected 16"):
        RowFile.open(path, expect={"row_bytes": 16})
    with open(path, "r+b") as fh:
        fh.truncate(4096 + 100)
    with pytest.raises(RowFileError, match="truncated"):
        RowFile.open(path)
    foreign = tmp_path / "foreign.rows"
    foreign.write_bytes(b"PK\x03\x04" + bytes(5000))
    with pytest.raises(RowFileError, match="not an nbtools row file"):
        RowFile.open(foreign)
    f = RowFile.create(tmp_path / "u.rows", 10, 8)
    with pytest.raises(IndexError, match="10 rows"):
        f.read(np.array([10]), np.zeros((1, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        f.write(np.array([1]), np.zeros((1, 8), dtype=np.float32))
    f.close()


def test_disk_full_refused_before_writing(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: type(real(p))(real(p).total, real(p).total - 10, 10))
    with pytest.raises(DiskFullError, match="does not fit"):
        RowFile.create(tmp_path / "big.rows", 1000, 64)
    assert os.listdir(tmp_path) == []


def test_read_only_folder(tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path)
                        else real(p, mode))
    with pytest.raises(PermissionError, match="read-only"):
        RowFile.create(tmp_path / "t.rows", 10, 8)
