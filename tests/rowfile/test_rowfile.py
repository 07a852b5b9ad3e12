"""RowFile: random and sequential row I/O against a plain numpy reference, and its errors."""
import errno
import os
import shutil

import numpy as np
import pytest

import nbtools.rowfile.packed as rowfile_packed

from nbtools import NbtoolsError
from nbtools import rowfile
from nbtools.rowfile import format as rowfilefmt
from nbtools.rowfile import DiskFullError, RowFile, RowFileError


def _direct_or_skip(tmp_path, direct):
    """direct=True where the filesystem of tmp_path takes O_DIRECT, else skip."""
    if direct is True:
        try:
            RowFile.create(tmp_path / "probe.rows", 1, 8, direct=True).close()
        except OSError as e:
            pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT: {e}")
        os.remove(tmp_path / "probe.rows")


@pytest.mark.parametrize("row_bytes", [260, 512, 1536, 4100])
@pytest.mark.parametrize("direct", [True, False])
def test_random_rows_round_trip(tmp_path, row_bytes, direct):
    _direct_or_skip(tmp_path, direct)
    n = 500
    rng = np.random.default_rng(row_bytes)
    ref = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    f = RowFile.create(tmp_path / "t.rows", n, row_bytes, {"what": "test"}, threads=4,
                       direct=direct)
    assert f.direct is direct
    assert f.stride >= row_bytes and f.data_offset % 4096 == 0
    assert f.stride == (-(-row_bytes // f.block) * f.block if direct else row_bytes)
    f.write_range(0, ref)
    # unsorted, with runs of neighbours (longer than one request) and isolated rows
    ids = np.unique(np.concatenate((np.arange(40, 90), np.arange(200, 200 + 300),
                                    rng.choice(n, 60, replace=False))))
    rng.shuffle(ids)
    out = np.zeros((len(ids), row_bytes), dtype=np.uint8)
    f.read(ids, out)
    assert np.array_equal(out, ref[ids])
    f.read(np.zeros(0, dtype=np.int64), np.zeros((0, row_bytes), dtype=np.uint8))
    f.write(np.array([], dtype=np.int64), np.zeros((0, row_bytes), dtype=np.uint8))
    new = rng.integers(0, 256, (len(ids), row_bytes), dtype=np.uint8)
    f.write(ids.astype(np.int32), new)
    ref[ids] = new
    back = np.zeros_like(ref)
    f.read_range(0, back)
    assert np.array_equal(back, ref)            # neighbours of written rows untouched
    part = np.zeros((7, row_bytes), dtype=np.uint8)
    f.read_range(n - 7, part)
    assert np.array_equal(part, ref[-7:])
    f.write_range(3, ref[:5][::-1].copy())
    ref[3:8] = ref[:5][::-1].copy()
    assert f.counters["read_calls"] == 4 and f.counters["write_calls"] == 4
    # (a read also takes the rows between two near ones: counted, as the disk read them)
    gap = rowfile.GAP // f.stride
    assert (len(ids) + n + 7) * f.stride <= f.counters["read_bytes"] \
        <= (len(ids) * (gap + 1) + n + 7) * f.stride
    f.close()
    f.close()                                    # idempotent
    with RowFile.open(tmp_path / "t.rows", expect={"num_rows": n, "row_bytes": row_bytes,
                                                   "what": "test"}, direct=direct) as g:
        assert g.meta["what"] == "test" and g.stride == f.stride and g.direct is direct
        g.read_range(0, back)
        assert np.array_equal(back, ref)
    if f.stride > row_bytes:                     # padding between rows stays zero
        raw = np.fromfile(tmp_path / "t.rows", dtype=np.uint8, offset=f.data_offset)
        assert not raw.reshape(n, f.stride)[:, row_bytes:].any()


def test_slots_and_unaligned_buffers(tmp_path):
    """``at=`` scatters into (gathers from) any rows; a misaligned caller buffer is fine."""
    n, rb = 300, 1024
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, (n, rb), dtype=np.uint8)
    with RowFile.create(tmp_path / "t.rows", n, rb, threads=3) as f:
        raw = np.zeros(n * rb + 1, dtype=np.uint8)
        src = raw[1:].reshape(n, rb)             # not aligned: goes through the bounce buffer
        src[:] = ref
        f.write_range(0, src)
        slots = np.zeros((50, rb), dtype=np.uint8)
        ids = rng.choice(n, 20, replace=False)
        at = rng.choice(50, 20, replace=False)
        f.read(ids, slots, at=at)
        assert np.array_equal(slots[at], ref[ids])
        assert not np.delete(slots, at, axis=0).any()
        slots[at] = 7
        f.write(ids, slots, at=at)
        ref[ids] = 7
        back = np.zeros((n, rb), dtype=np.uint8)
        f.read_range(0, back)
        assert np.array_equal(back, ref)
        assert f.ram_bytes <= rowfile.KEEP


def test_requests_merge_neighbours_and_cut_long_runs():
    ids = np.array([0, 1, 2, 5, 7, 8, 9, 10, 11])
    boff, blen, foff, pos = rowfile_packed.row_requests(ids, 512, 4096, limit=3 * 512)
    assert foff == [4096 + 512 * i for i in (0, 5, 7, 10)]
    assert blen == [3 * 512, 512, 3 * 512, 2 * 512]
    assert boff == [0, 3 * 512, 4 * 512, 7 * 512]
    assert pos.tolist() == list(range(len(ids)))


def test_reads_take_the_rows_between_near_ones():
    """A gap of up to ``gap`` rows joins two runs (the rows between read and dropped): one
    request instead of two; each asked row's place in the buffer follows the skipped ones."""
    ids = np.array([0, 3, 4, 20, 22, 40])
    boff, blen, foff, pos = rowfile_packed.row_requests(ids, 512, 0, gap=2)
    assert foff == [0, 20 * 512, 40 * 512]
    assert blen == [5 * 512, 3 * 512, 512]
    assert boff == [0, 5 * 512, 8 * 512]
    assert pos.tolist() == [0, 3, 4, 5, 7, 8]
    boff, blen, foff, pos = rowfile_packed.row_requests(ids, 512, 0, limit=2 * 512, gap=2)
    assert foff == [0, 2 * 512, 4 * 512, 20 * 512, 22 * 512, 40 * 512]
    assert blen == [2 * 512, 2 * 512, 512, 2 * 512, 512, 512]
    assert pos.tolist() == [0, 3, 4, 5, 7, 8]


@pytest.mark.parametrize("direct", [True, False])
def test_reads_across_gaps_match_the_rows(tmp_path, direct):
    """Rows read with the ones between them (clustered ids, gaps of 0 to 12 rows, a call
    larger than one bounce buffer) are the rows asked for, wherever ``at`` puts them."""
    _direct_or_skip(tmp_path, direct)
    n, rb = 4000, 300
    rng = np.random.default_rng(5)
    ref = rng.integers(0, 256, (n, rb), dtype=np.uint8)
    with RowFile.create(tmp_path / "t.rows", n, rb, threads=4, direct=direct) as f:
        f.write_range(0, ref)
        ids = np.unique(np.cumsum(rng.integers(1, 14, 600)))
        ids = ids[ids < n]
        rng.shuffle(ids)
        slots = np.zeros((len(ids) + 9, rb), dtype=np.uint8)
        at = rng.permutation(len(slots))[: len(ids)]
        f.read(ids, slots, at=at)
        assert np.array_equal(slots[at], ref[ids])
        for bounce in (f.stride * 40, f.stride * 9):     # several bounce buffers a call
            old = rowfile.BOUNCE
            rowfile.BOUNCE = bounce
            try:
                out = np.zeros((len(ids), rb), dtype=np.uint8)
                f.read(ids, out)
            finally:
                rowfile.BOUNCE = old
            assert np.array_equal(out, ref[ids])


def test_buffered_cache_stays_small(tmp_path):
    """Buffered mode drops the file's pages after each call (auto_drop) or on drop_cache()."""
    with RowFile.create(tmp_path / "t.rows", 2000, 512, direct=False) as f:
        rows = np.ones((2000, 512), dtype=np.uint8)
        f.write_range(0, rows)
        f.auto_drop = False
        f.read(np.arange(0, 2000, 3), np.zeros((667, 512), dtype=np.uint8))
        f.drop_cache()
        f.flush()
        assert f.unsynced_bytes == 0


def test_errors_name_the_file(tmp_path):
    path = tmp_path / "t.rows"
    with pytest.raises(FileNotFoundError, match="t.rows"):
        RowFile.open(path)
    RowFile.create(path, 10, 8, {"dtype": "float32"}).close()
    with pytest.raises(FileExistsError, match="t.rows"):
        RowFile.create(path, 10, 8)
    RowFile.create(path, 10, 8, {"dtype": "float32"}, overwrite=True).close()
    with pytest.raises(RowFileError, match="row_bytes is 8, expected 16") as e:
        RowFile.open(path, expect={"row_bytes": 16, "num_rows": 10})
    assert "num_rows" not in str(e.value)
    with pytest.raises(RowFileError, match="num_rows is 10, expected 11.*dtype is 'float32', "
                       "expected 'bfloat16'"):
        RowFile.open(path, expect={"num_rows": 11, "dtype": "bfloat16"})
    with open(path, "r+b") as fh:
        fh.truncate(4096 + 30)
    with pytest.raises(RowFileError, match=r"truncated: 4,126 bytes, its header says"):
        RowFile.open(path)
    foreign = tmp_path / "foreign.rows"
    foreign.write_bytes(b"PK\x03\x04" + bytes(5000))
    with pytest.raises(RowFileError, match="foreign.rows' is not an nbtools row file"):
        RowFile.open(foreign)
    assert issubclass(RowFileError, NbtoolsError) and issubclass(RowFileError, ValueError)
    f = RowFile.create(tmp_path / "u.rows", 10, 8)
    with pytest.raises(IndexError, match="10 rows but ids contain 10 \\(first at position 1\\)"):
        f.read(np.array([3, 10]), np.zeros((2, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        f.write(np.array([1]), np.zeros((1, 8), dtype=np.float32))
    with pytest.raises(ValueError, match=r"\[2, 8\]"):
        f.read(np.array([1, 2]), np.zeros((3, 8), dtype=np.uint8))
    with pytest.raises(IndexError, match="it has 10"):
        f.read_range(5, np.zeros((6, 8), dtype=np.uint8))
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.read(np.array([1]), np.zeros((1, 8), dtype=np.uint8))
    g = RowFile.open(tmp_path / "u.rows", writable=False)
    with pytest.raises(PermissionError, match="read-only"):
        g.write(np.array([1]), np.zeros((1, 8), dtype=np.uint8))
    g.close()


def test_disk_full_refused_before_writing(tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: type(real(p))(real(p).total, real(p).total - 10, 10))
    with pytest.raises(DiskFullError, match=r"does not fit: 10 B \(10 bytes\) free in") as e:
        RowFile.create(tmp_path / "big.rows", 1000, 64)
    assert str(tmp_path) in str(e.value) and isinstance(e.value, OSError)
    assert os.listdir(tmp_path) == []


def test_disk_full_while_reserving_removes_the_file(tmp_path, monkeypatch):
    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(DiskFullError, match="the partial file was removed"):
        RowFile.create(tmp_path / "big.rows", 1000, 64)
    assert os.listdir(tmp_path) == []


def test_no_fallocate_falls_back_to_ftruncate(tmp_path, monkeypatch):
    def unsupported(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    monkeypatch.setattr(os, "posix_fallocate", unsupported, raising=False)
    with RowFile.create(tmp_path / "t.rows", 100, 64) as f:
        assert os.path.getsize(f.path) == f.data_offset + 100 * f.stride


def test_folders(tmp_path, monkeypatch):
    # missing folders are created, parents too, each this user's alone; the file too
    with RowFile.create(tmp_path / "a" / "b" / "t.rows", 4, 8) as f:
        assert os.stat(f.path).st_mode & 0o777 == 0o600
    assert [os.stat(tmp_path / p).st_mode & 0o777 for p in ("a", "a/b")] == [0o700, 0o700]
    # a read-only folder (simulated: root ignores permission bits)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) == str(tmp_path)
                        else real(p, mode, **kw))
    with pytest.raises(PermissionError, match=f"{tmp_path}.*read-only.*disk_dir"):
        RowFile.create(tmp_path / "t.rows", 10, 8)
    monkeypatch.undo()

    def refuse(name, mode=0o777, **kw):
        raise PermissionError(errno.EACCES, "Permission denied", name)
    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(PermissionError, match="cannot create the folder.*disk_dir"):
        RowFile.create(tmp_path / "new" / "t.rows", 10, 8)


def test_direct_true_refused_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(rowfilefmt, "probe_block", lambda fd, stride=0: 0)
    with pytest.raises(OSError, match="O_DIRECT.*direct='auto' or direct=False"):
        RowFile.create(tmp_path / "t.rows", 10, 8, direct=True)
    assert os.listdir(tmp_path) == []
    with RowFile.create(tmp_path / "t.rows", 10, 8, direct="auto", overwrite=True) as f:
        assert not f.direct and f.stride == 8     # the buffered fallback


@pytest.mark.parametrize("row_bytes", [16, 100, 260, 512, 700])
@pytest.mark.parametrize("direct", [True, False])
def test_packed_rows_round_trip(tmp_path, row_bytes, direct):
    """A packed file (rows PACK bytes apart, sharing blocks): random writes, reads and ranges
    against a numpy reference (a write keeps the rows that share its blocks), reopened packed;
    the file is the rows at their packed stride, not whole sectors each."""
    _direct_or_skip(tmp_path, direct)
    n = 3000
    rng = np.random.default_rng(row_bytes)
    ref = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    path = tmp_path / "p.rows"
    f = RowFile.create(path, n, row_bytes, threads=4, direct=direct, packed=True)
    assert f.packed and f.stride == -(-row_bytes // rowfile.PACK) * rowfile.PACK
    assert os.path.getsize(path) < f.data_offset + n * f.stride + 4096
    f.write_range(0, ref)
    for _ in range(25):
        ids = rng.choice(n, int(rng.integers(1, 400)), replace=False)
        new = rng.integers(0, 256, (len(ids), row_bytes), dtype=np.uint8)
        f.write(ids, new)
        ref[ids] = new
        ids = rng.choice(n, int(rng.integers(1, 500)), replace=False)
        out = np.zeros((len(ids), row_bytes), dtype=np.uint8)
        f.read(ids, out)
        assert np.array_equal(out, ref[ids])
        a = int(rng.integers(0, n - 1))
        m = int(rng.integers(1, n - a))
        new = rng.integers(0, 256, (m, row_bytes), dtype=np.uint8)
        f.write_range(a, new)
        ref[a:a + m] = new
        a = int(rng.integers(0, n - 1))
        out = np.zeros((int(rng.integers(1, n - a)), row_bytes), dtype=np.uint8)
        f.read_range(a, out)
        assert np.array_equal(out, ref[a:a + len(out)])
        # long runs of consecutive ids through read/write (copied a run at a time)
        runs = np.concatenate([np.arange(b, min(n, b + int(rng.integers(40, 300))))
                               for b in rng.choice(n, 3, replace=False)])
        runs = np.unique(runs)
        new = rng.integers(0, 256, (len(runs), row_bytes), dtype=np.uint8)
        f.write(runs, new)
        ref[runs] = new
        out = np.zeros((len(runs), row_bytes), dtype=np.uint8)
        f.read(runs[::-1].copy(), out)
        assert np.array_equal(out, ref[runs[::-1]])
    f.close()
    with RowFile.open(path, direct=direct) as g:
        assert g.packed and g.stride == f.stride
        back = np.zeros_like(ref)
        g.read_range(0, back)
        assert np.array_equal(back, ref)


@pytest.mark.parametrize("row_bytes", [20, 260, 508])
@pytest.mark.parametrize("direct", [True, False])
def test_tags_in_the_rows_padding(tmp_path, row_bytes, direct):
    """A packed file with at least TAG bytes of padding a row keeps a uint32 tag per row
    there: written with the rows (scattered, fresh, ranges) and read back with them, next to a
    numpy reference of rows and tags; a write without tags keeps the tags of the rows it
    writes in place, a fresh one or a range zeroes them; untagged files refuse tags."""
    _direct_or_skip(tmp_path, direct)
    n = 2000
    rng = np.random.default_rng(row_bytes)
    ref = rng.integers(0, 256, (n, row_bytes), dtype=np.uint8)
    tref = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    f = RowFile.create(tmp_path / "t.rows", n, row_bytes, threads=4, direct=direct, packed=True)
    assert f.tagged
    f.write_range(0, ref, tags=tref)
    for k in range(12):
        ids = rng.choice(n, int(rng.integers(1, 300)), replace=False)
        new = rng.integers(0, 256, (len(ids), row_bytes), dtype=np.uint8)
        if k % 3 == 0:                                 # no tags: in place, theirs kept
            f.write(ids, new)
        else:
            tags = rng.integers(0, 2 ** 32, len(ids), dtype=np.uint64).astype(np.uint32)
            f.write(ids, new, tags=tags)
            tref[ids] = tags
        ref[ids] = new
        a = int(rng.integers(0, n - 50))               # appended runs, fresh
        run = np.arange(a, a + 50)
        new = rng.integers(0, 256, (50, row_bytes), dtype=np.uint8)
        fresh_tags = None if k % 4 == 0 else np.arange(50) + k
        f.write(run, new, fresh=True, tags=fresh_tags)
        ref[run] = new
        tref[run] = 0 if fresh_tags is None else fresh_tags
        # (a fresh write zeroes what follows its rows in their last block: the rows after them
        # there are written again, as a log's next append does)
        last = (f.data_offset + (a + 50) * f.stride - 1) // f.unit
        after = np.arange(a + 50, n)
        after = after[(f.data_offset + after * f.stride) // f.unit <= last]
        f.write(after, ref[after], tags=tref[after])
        ids = rng.choice(n, int(rng.integers(1, 400)), replace=False)
        out, got = np.zeros((len(ids), row_bytes), dtype=np.uint8), np.empty(len(ids), np.uint32)
        f.read(ids, out, tags=got)
        assert np.array_equal(out, ref[ids]) and np.array_equal(got, tref[ids])
    back, tags = np.zeros_like(ref), np.empty(n, dtype=np.uint32)
    f.read_range(0, back, tags=tags)
    assert np.array_equal(back, ref) and np.array_equal(tags, tref)
    f.write_range(10, ref[10:20])                      # a range without tags: zeros
    f.read_range(0, back, tags=tags)
    assert not tags[10:20].any() and np.array_equal(tags[20:], tref[20:])
    with pytest.raises(ValueError, match="uint32"):
        f.read_range(0, back, tags=np.empty(n, dtype=np.int64))
    with pytest.raises(ValueError, match="0 .. 2"):
        f.write(np.array([1]), ref[:1], tags=np.array([-1]))
    f.close()
    for packed, rb in ((False, 20), (True, 32)):     # whole sectors; no padding to keep one
        with RowFile.create(tmp_path / f"u{packed}.rows", 10, rb, packed=packed) as g:
            assert not g.tagged
            with pytest.raises(ValueError, match="no tags"):
                g.write(np.array([1]), np.zeros((1, rb), np.uint8), tags=np.array([1]))
            with pytest.raises(ValueError, match="tagged"):
                g.read_range(0, np.zeros((10, rb), np.uint8), tags=np.empty(10, np.uint32))


def test_fresh_writes_keep_the_rows_before_them_in_a_shared_block(tmp_path):
    """``fresh=True`` (a log's appends): blocks are not read first, except where a run starts
    mid-block; the rows appended before it survive, and nothing else is read."""
    rb, n = 260, 200
    rng = np.random.default_rng(1)
    ref = rng.integers(0, 256, (n, rb), dtype=np.uint8)
    with RowFile.create(tmp_path / "p.rows", n, rb, threads=2, packed=True) as f:
        for a, b in ((0, 5), (5, 11), (11, 12), (12, 40), (40, 200)):   # appends, in order
            before = f.counters["read_bytes"]
            f.write(np.arange(a, b), ref[a:b], fresh=True)
            starts_mid_block = (f.data_offset + a * f.stride) % f.unit != 0
            assert f.counters["read_bytes"] - before == (f.unit if starts_mid_block else 0)
        back = np.zeros_like(ref)
        f.read_range(0, back)
        assert np.array_equal(back, ref)


@pytest.mark.parametrize("rb,stride", [(260, 288), (96, 96), (37, 37), (512, 512)])
@pytest.mark.parametrize("runs", [False, True], ids=["scattered", "runs"])
def test_rows_in_buffer_matches_a_byte_by_byte_copy(rb, stride, runs):
    """A packed file's rows in and out of a bounce buffer, scattered over whole blocks (each
    row at its file offset within its block) or in runs at the file's stride, against a
    copy made one row slice at a time."""
    from nbtools.rowfile.packed import rows_in_buffer
    rng = np.random.default_rng(rb)
    n, block = 300, 4096
    ids = np.arange(50, 50 + n) if runs else np.sort(rng.choice(10 ** 6, n, replace=False))
    off = ids * stride
    first = off // block
    blocks = np.unique(np.concatenate([first, (off + rb - 1) // block]))
    at = np.searchsorted(blocks, first) * block + off - first * block
    rows = rng.integers(0, 256, (n, rb), dtype=np.uint8)
    where = rng.permutation(n)
    got = np.zeros((len(blocks) + 1) * block, np.uint8)
    want = got.copy()
    rows_in_buffer(got, at, rows, where, stride, write=True)
    for i in range(n):
        want[at[i]:at[i] + rb] = rows[where[i]]
    assert np.array_equal(got, want)
    back = np.zeros_like(rows)
    rows_in_buffer(got, at, back, where, stride, write=False)
    assert np.array_equal(back, rows)
