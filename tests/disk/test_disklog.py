"""The log-structured row file (nbtools.disk.log): every read returns the newest row written,
through appends, the cleaner, reads beside writes, and the move back to the identity layout.
The reference is a plain numpy array of the rows as written."""
import threading

import numpy as np
import pytest

from nbtools.disk.log import LogFile, slots_for
from nbtools.rowfile import RowFile

RB, SEG = 24, 8
TAGGED_SEG = 16      # a packed file of 32-byte rows starts a 512-byte block every 16 slots


def _log(tmp_path, n, spare=0.3, direct=False, tags=False):
    """A log file of ``n`` ids; ``tags``: packed rows (24 bytes, 32 apart), whose padding
    keeps each slot's id, else whole rows with the ids in RAM (``owner``)."""
    seg = TAGGED_SEG if tags else SEG
    f = RowFile.create(tmp_path / "t.nbrows", slots_for(n, seg, spare), RB, direct=direct,
                       packed=tags)
    log = LogFile(f, n, segment_rows=seg)
    assert log.tagged == tags and (log.owner is None) == tags
    return log


def _live_ids(log):
    """Every id living in the file, read slot by slot in file order (live_rows)."""
    ids, buf = [], np.empty((log.seg, RB), dtype=np.uint8)
    for a in range(0, log.slots, log.seg):
        ids.append(log.live_rows(a, buf)[0])
    return np.sort(np.concatenate(ids))


def _rows(gen, k):
    return gen.integers(0, 256, (k, RB), dtype=np.uint8)


def _check_all(log, ref):
    got = np.empty_like(ref)
    log.read_range(0, got)
    assert np.array_equal(got, ref)
    ids = np.random.default_rng(0).permutation(len(ref))[: len(ref) // 2]
    part = np.empty((len(ids), RB), dtype=np.uint8)
    log.read(ids, part)
    assert np.array_equal(part, ref[ids])


@pytest.mark.parametrize("tags", [True, False], ids=["ids-in-padding", "ids-in-ram"])
def test_appends_the_cleaner_and_identity_keep_every_row(tmp_path, tags):
    n, gen = 200, np.random.default_rng(1)
    log = _log(tmp_path, n, tags=tags)
    ref = _rows(gen, n)
    log.write_range(0, ref)                       # in place: the identity layout
    assert log.identity_layout and log.file.counters["write_calls"] == 1
    for step in range(60):
        ids = np.sort(gen.choice(n, gen.integers(1, 40), replace=False))
        rows = _rows(gen, len(ids))
        at = gen.permutation(len(ids))            # rows[at[j]] is ids[j]'s
        src = np.empty_like(rows)
        src[at] = rows
        log.write(ids, src, at=at)
        ref[ids] = rows
        if step % 7 == 0:
            _check_all(log, ref)
        assert log.live.sum() == n
        if step % 7 == 0:
            assert np.array_equal(_live_ids(log), np.arange(n))
    assert log.stats["cleaned_segments"] > 0 and not log.identity_layout
    _check_all(log, ref)
    moved = log.identity()
    assert moved > 0 and log.identity_layout
    raw = np.empty_like(ref)
    log.file.read_range(0, raw)                   # the file itself, in id order now
    assert np.array_equal(raw, ref)
    log.write(np.array([5]), _rows(gen, 1))       # and it goes on appending after
    _check_all(log, np.concatenate([ref[:5], log_row(log, 5), ref[6:]]))


def log_row(log, i):
    out = np.empty((1, RB), dtype=np.uint8)
    log.read(np.array([i]), out)
    return out


@pytest.mark.parametrize("tags", [True, False], ids=["ids-in-padding", "ids-in-ram"])
def test_identity_breaks_cycles(tmp_path, tags):
    """Rows that swapped homes (every moved id's home held by another moved row)."""
    n = 64
    log = _log(tmp_path, n, spare=0.5, tags=tags)
    gen = np.random.default_rng(2)
    ref = _rows(gen, n)
    log.write_range(0, ref)
    for _ in range(30):                              # churn until homes are reused
        ids = np.sort(gen.choice(n, 16, replace=False))
        rows = _rows(gen, 16)
        log.write(ids, rows)
        ref[ids] = rows
    log.identity()
    raw = np.empty_like(ref)
    log.file.read_range(0, raw)
    assert np.array_equal(raw, ref) and log.identity_layout


@pytest.mark.parametrize("tags", [True, False], ids=["ids-in-padding", "ids-in-ram"])
def test_write_range_after_moves_writes_where_rows_live(tmp_path, tags):
    n, gen = 50, np.random.default_rng(3)
    log = _log(tmp_path, n, tags=tags)
    ref = _rows(gen, n)
    log.write_range(0, ref)
    log.write(np.arange(10, 20), _rows(gen, 10))
    ref[10:30] = _rows(gen, 20)
    log.write_range(10, ref[10:30])
    _check_all(log, ref)
    ref[10:20] = _rows(gen, 10)          # the moved rows, consecutive: one range, away
    log.write_range(10, ref[10:20])      # from home (their tags written again with them)
    log.write(np.arange(20, 40), _rows(gen, 20))
    log.clean(log.slots)                # every segment the cleaner may take, cleaned
    assert np.array_equal(_live_ids(log), np.arange(n))
    ref[20:40] = log_rows(log, np.arange(20, 40))
    _check_all(log, ref)


def log_rows(log, ids):
    out = np.empty((len(ids), RB), dtype=np.uint8)
    log.read(ids, out)
    return out


@pytest.mark.parametrize("cleaner,tags", [("cost-benefit", False), ("greedy", False),
                                          ("cost-benefit", True)])
def test_reads_beside_writes_and_cleaning(tmp_path, monkeypatch, cleaner, tags):
    """A reader of rows nobody writes, while a writer appends other rows and the cleaner moves
    the reader's rows around: every read is the row as written (freed segments are reused only
    once reads that began before are done)."""
    monkeypatch.setenv("NBTOOLS_DISK_CLEANER", cleaner)
    n, gen = 400, np.random.default_rng(4)
    log = _log(tmp_path, n, spare=0.2, tags=tags)
    assert log.policy == cleaner
    ref = _rows(gen, n)
    log.write_range(0, ref)
    fixed = np.arange(0, n, 2)                    # read only
    moving = np.arange(1, n, 2)                   # written only
    errors, stop = [], threading.Event()

    def reader():
        r = np.random.default_rng(5)
        while not stop.is_set():
            ids = np.sort(r.choice(fixed, 50, replace=False))
            out = np.empty((50, RB), dtype=np.uint8)
            log.read(ids, out)
            if not np.array_equal(out, ref[ids]):
                errors.append(ids)
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(40):                       # ~2,000 reads, ~2,000 rows cleaned
            ids = np.sort(gen.choice(moving, 30, replace=False))
            log.write(ids, _rows(gen, 30))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and log.stats["cleaned"] > 0


def test_bad_input(tmp_path, monkeypatch):
    log = _log(tmp_path, 20)
    with pytest.raises(IndexError, match="20 rows"):
        log.read(np.array([20]), np.empty((1, RB), dtype=np.uint8))
    with pytest.raises(ValueError, match="each id once"):
        log.write(np.array([3, 3]), np.zeros((2, RB), dtype=np.uint8))
    with pytest.raises(ValueError, match="spare"):
        LogFile(RowFile.create(tmp_path / "small.nbrows", 24, RB), 20, segment_rows=SEG)
    monkeypatch.setenv("NBTOOLS_DISK_CLEANER", "fastest")
    with pytest.raises(ValueError, match="NBTOOLS_DISK_CLEANER"):
        _log(tmp_path / "b", 20)
    monkeypatch.setenv("NBTOOLS_DISK_LAYOUT", "journal")
    with pytest.raises(ValueError, match="NBTOOLS_DISK_LAYOUT"):
        from nbtools.disk.log import wanted
        wanted()


# --- a disk table in the log layout trains exactly as in RAM ----------------------------------
@pytest.fixture
def log_layout(monkeypatch):
    """New disk tables in the log layout, segments of 16 slots: the cleaner runs every few
    steps."""
    monkeypatch.setenv("NBTOOLS_DISK_LAYOUT", "log")
    monkeypatch.setenv("NBTOOLS_DISK_SEGMENT_ROWS", "16")


@pytest.mark.parametrize("cache_rows,prefetch,cleaner", [
    (10, False, "cost-benefit"), (60, False, "cost-benefit"), (120, True, "cost-benefit"),
    (60, True, "greedy")])
def test_a_log_table_trains_as_host(tmp_path, log_layout, monkeypatch, cache_rows, prefetch,
                                    cleaner):
    monkeypatch.setenv("NBTOOLS_DISK_CLEANER", cleaner)
    import warnings

    import torch
    from test_disk import D, DEVICE, _assert_same, _pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the 10-row cache grows to hold the step
        tables, _ = _pair(tmp_path, host_cache_bytes=cache_rows * 3 * D * 4, lookups=2,
                          steps=12, prefetch=prefetch)
    disk = tables[1].disk
    assert type(disk.file).__name__ == "LogFile"
    assert disk.file.stats["appended"] > 0 and disk.file.stats["cleaned_segments"] > 0
    if prefetch:
        assert disk.stats["read_ahead"] > 0
    _assert_same(tables)                        # .weight: the rows moved back home first
    assert disk.file.identity_layout
    # and training goes on (appending again) after a whole-table read
    ids = torch.arange(0, 300, 3)
    for t, opt in zip(tables, _):
        (t(ids) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    _assert_same(tables)


def test_a_log_table_whose_rows_keep_their_ids_trains_as_host(tmp_path, log_layout):
    """bf16 weights with RowWiseAdagrad: 20-byte rows packed 32 apart, each slot's id in its
    padding (no owner map in RAM), through appends, the cleaner, a whole-table read and more
    training."""
    import warnings

    import torch

    from nbtools import RowWiseAdagrad
    from test_disk import D, DEVICE, _assert_same, _pair
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the 10-row cache grows to hold the step
        tables, opts = _pair(tmp_path, opt_cls=RowWiseAdagrad, opt_kwargs={"lr": 0.1},
                             table_kwargs={"dtype": torch.bfloat16},
                             host_cache_bytes=10 * 32, lookups=2, steps=12)
    log = tables[1].disk.file
    assert type(log).__name__ == "LogFile" and log.tagged and log.owner is None
    assert log.stats["cleaned_segments"] > 0 and not log.identity_layout
    _assert_same(tables)                        # .weight: the rows moved back home first
    assert log.identity_layout
    ids = torch.arange(0, 300, 3)
    for _ in range(3):
        for t, opt in zip(tables, opts):
            (t(ids) * torch.linspace(-1, 1, D, device=DEVICE)).sum().backward()
            opt.step()
            opt.zero_grad()
    _assert_same(tables)


@pytest.mark.parametrize("into", ["log", "inplace", "host"])
def test_a_log_tables_checkpoints_restore_exactly(tmp_path, log_layout, monkeypatch, into):
    """Bases of records in file order (the rows moved) and deltas, restored into a log table,
    a table written in place, and the same model's table in RAM."""
    import torch
    monkeypatch.setenv("NBTOOLS_DISK_SPARE", "0")            # the least: 4 segments
    import test_checkpoint_disk as C
    import nbtools.checkpoint.rows as ckrows
    from nbtools.checkpoint import CheckpointManager
    calls = {"save": 0, "restore": 0}
    save, restore = ckrows.write_records_base, ckrows.restore_records
    monkeypatch.setattr(ckrows, "write_records_base",
                        lambda *a: (calls.__setitem__("save", calls["save"] + 1), save(*a))[1])
    monkeypatch.setattr(ckrows, "restore_records",
                        lambda *a: (calls.__setitem__("restore", calls["restore"] + 1),
                                    restore(*a))[1])
    host, hopt = C._pair_member("host", tmp_path)
    disk, dopt = C._pair_member("disk", tmp_path, cache_rows=100)
    ck = CheckpointManager(tmp_path / "ck", keep=4, config=C._cfg(base_every=3))
    for s in range(1, 7):
        C._train(host, hopt, [s])
        C._train(disk, dopt, [s])
        ck.save(s, model=disk, opt=dopt)
    assert disk.disk.file.stats["cleaned_segments"] > 0 and calls["save"] >= 2
    if into == "inplace":
        monkeypatch.setenv("NBTOOLS_DISK_LAYOUT", "inplace")
    fresh, fopt = C._pair_member("host" if into == "host" else "disk", tmp_path, seed=5,
                                 cache_rows=100)
    C._train(fresh, fopt, [1, 2])                # (a log table's rows move)
    assert CheckpointManager(tmp_path / "ck", config=C._cfg()).restore(model=fresh,
                                                                       opt=fopt) == 6
    assert calls["restore"] == 1
    C._assert_rows(C._rows(fresh, fopt), C._rows(host, hopt))
    C._train(host, hopt, [7, 8])
    C._train(fresh, fopt, [7, 8])
    C._assert_rows(C._rows(fresh, fopt), C._rows(host, hopt))
    assert torch.equal(fresh.weight, host.weight)


@pytest.mark.parametrize("tags", [True, False], ids=["ids-in-padding", "ids-in-ram"])
def test_identity_in_small_rounds_and_scan_chunks(tmp_path, monkeypatch, tags):
    """Many rounds of a few rows, each scan starting where the last found rows away (chunks of
    8 ids): every row home, none skipped."""
    import nbtools.disk.log as disklog
    orig = LogFile.scan
    monkeypatch.setattr(LogFile, "scan", lambda self, limit, start=0: orig(self, limit, start,
                                                                           chunk=8))
    monkeypatch.setattr(disklog, "BATCH_ROWS", 5)
    n, gen = 120, np.random.default_rng(6)
    log = _log(tmp_path, n, spare=0.4, tags=tags)
    ref = _rows(gen, n)
    log.write_range(0, ref)
    for _ in range(40):
        ids = np.sort(gen.choice(n, 12, replace=False))
        rows = _rows(gen, 12)
        log.write(ids, rows)
        ref[ids] = rows
    assert log.away > 10
    seen = []
    assert log.identity(seen.append) == sum(seen) and log.identity_layout
    raw = np.empty_like(ref)
    log.file.read_range(0, raw)
    assert np.array_equal(raw, ref)


def test_a_disk_without_room_for_the_spare_slots_holds_the_table_in_place(tmp_path, monkeypatch):
    """The spare slots never cost a table its place: where the disk holds the rows but not
    the log's spare, the file is written in place (and the table trains as ever)."""
    import torch

    import nbtools
    from nbtools import disk
    from nbtools.disk import log as disklog
    n, d = 5000, 8
    stride = 512
    monkeypatch.setenv("NBTOOLS_DISK_PACKED", "0")      # (rows padded to sectors, as in place)
    monkeypatch.setattr(disk, "free_bytes", lambda folder: n * stride + stride * 10)
    assert disklog.file_rows(n, stride, n * stride + 10 * stride) == n
    t = nbtools.OffloadedEmbedding(n, d, device="cpu", placement="disk", disk_dir=str(tmp_path),
                                   host_cache_bytes=1 << 16)
    assert type(t.disk.file).__name__ == "RowFile" and t.disk.file.num_rows == n
    opt = nbtools.OffloadOptimizer(torch.optim.SGD, t, lr=0.1)
    (t(torch.arange(0, n, 7)) ** 2).sum().backward()
    opt.step()
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1 << 40)
    t2 = nbtools.OffloadedEmbedding(n, d, device="cpu", placement="disk", disk_dir=str(tmp_path),
                                    host_cache_bytes=1 << 16)
    assert type(t2.disk.file).__name__ == "LogFile"
    # packed rows (32 bytes here, not a 512-byte sector each): the same room holds the log
    monkeypatch.delenv("NBTOOLS_DISK_PACKED")
    monkeypatch.setattr(disk, "free_bytes", lambda folder: n * stride + stride * 10)
    t3 = nbtools.OffloadedEmbedding(n, d, device="cpu", placement="disk", disk_dir=str(tmp_path),
                                    host_cache_bytes=1 << 16)
    assert type(t3.disk.file).__name__ == "LogFile" and t3.disk.file.stride == 32
    assert t3.disk.file_bytes < n * stride


def test_the_cleaners_traffic_is_counted_and_described(tmp_path, log_layout):
    """disk_counters (the dashboard's disk rates) count the cleaner's reads and writes beside
    the write-backs; repr(table) says the file is a log."""
    import warnings

    from nbtools.disk import disk_counters
    from test_disk import D, _pair
    before = disk_counters()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tables, _ = _pair(tmp_path, host_cache_bytes=10 * 3 * D * 4, lookups=2, steps=12)
    d = tables[1].disk
    after = disk_counters()
    log = d.file.stats
    assert log["cleaned"] > 0
    written = d.stats["written_back"] * d.row_bytes + log["cleaned"] * d.file.stride
    assert after["write_bytes"] - before["write_bytes"] >= written
    read = d.stats["misses"] * d.row_bytes + log["cleaned_segments"] * d.file.seg * d.file.stride
    assert after["read_bytes"] - before["read_bytes"] >= read
    assert "log-structured" in repr(tables[1])


def test_a_bad_cleaner_setting_leaves_no_file(tmp_path, monkeypatch):
    import nbtools
    monkeypatch.setenv("NBTOOLS_DISK_CLEANER", "fastest")
    with pytest.raises(ValueError, match="NBTOOLS_DISK_CLEANER"):
        nbtools.OffloadedEmbedding(1000, 8, device="cpu", placement="disk",
                                   disk_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_a_disk_short_of_the_whole_spare_takes_a_smaller_one(tmp_path, monkeypatch):
    """Where the disk holds the rows and some spare but not SPARE's share, the file is a log
    with a smaller spare (at least MIN_SPARE, leaving LEAVE or a twentieth of the disk free),
    not rows in place; below MIN_SPARE, in place."""
    import torch

    import nbtools
    from nbtools import disk
    from nbtools.disk import log as disklog
    n, stride = 100_000_000, 512
    monkeypatch.setenv("NBTOOLS_DISK_PACKED", "0")      # (the small table below: 512-byte rows)
    full = disklog.slots_for(n)
    assert disklog.file_rows(n, stride, full * stride) == full
    for gb, low, high in ((64, 0.15, 0.2), (60, 0.1, 0.12)):
        got = disklog.file_rows(n, stride, gb * 10 ** 9)
        assert low <= got / n - 1 <= high, (gb, got)
        assert got * stride <= gb * 10 ** 9 - max(disklog.LEAVE, gb * 10 ** 9 // 20)
    assert disklog.file_rows(n, stride, 58 * 10 ** 9) == n
    # a table made on such a disk (LEAVE 0 so that a small table shows it)
    monkeypatch.setattr(disklog, "LEAVE", 0)
    monkeypatch.setenv("NBTOOLS_DISK_SEGMENT_ROWS", "512")
    n, d = 50_000, 8
    free = int(n * stride * 1.2)
    monkeypatch.setattr(disk, "free_bytes", lambda folder: free)
    rows = disklog.file_rows(n, stride, free)
    assert n * 1.1 <= rows < disklog.slots_for(n)
    t = nbtools.OffloadedEmbedding(n, d, device="cpu", placement="disk", disk_dir=str(tmp_path),
                                   host_cache_bytes=1 << 16)
    assert type(t.disk.file).__name__ == "LogFile" and t.disk.file.file.num_rows == rows
    h = nbtools.OffloadedEmbedding(n, d, device="cpu", placement="host")
    with torch.no_grad():
        h.weight.copy_(t.weight)
    for table in (t, h):
        opt = nbtools.OffloadOptimizer(torch.optim.Adagrad, table, lr=0.1)
        for k in range(3):
            (table(torch.arange(k, n, 13)) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert torch.equal(t.weight, h.weight)
    t.close()
    h.close()



def test_a_damaged_tag_is_found_by_the_cleaner(tmp_path):
    """A slot whose tag no longer names the id living there: the cleaner's count of the rows
    the tags name falls short of the segment's live count, and it stops with an error rather
    than drop the row."""
    n, gen = 100, np.random.default_rng(8)
    log = _log(tmp_path, n, tags=True)
    log.write_range(0, _rows(gen, n))
    log.write(np.arange(0, 40), _rows(gen, 40))      # appended: tagged 1..40
    slot = int(log.where[7])
    log.file.write(np.array([slot]), log_rows(log, np.array([7])), tags=np.array([0]))
    others = np.setdiff1d(np.arange(40), [7])
    with pytest.raises(RuntimeError, match="damaged"):
        log.write(others, _rows(gen, len(others)))   # id 7 alone in its segment then
        log.clean(log.slots)


def test_map_bytes_of_a_new_file(tmp_path, monkeypatch):
    """disklog.map_bytes (what sizing and plan count) is the maps a new log file keeps: no
    owner where the rows' padding keeps the ids."""
    from nbtools.disk import log as disklog
    monkeypatch.setenv("NBTOOLS_DISK_SEGMENT_ROWS", "16")
    for row_bytes, tagged in ((260, True), (256, False), (28, True), (29, False)):
        n = 1000
        f, raw = disklog.create(tmp_path / f"m{row_bytes}.nbrows", n, row_bytes, {},
                                threads=2, free=1 << 40)
        assert f.tagged == tagged, row_bytes
        assert f.map_bytes == disklog.map_bytes(n, raw.stride, 1 << 40, row_bytes=row_bytes)
        f.close()
