"""Read-ahead of disk tables several steps deep (nbtools.disk.readahead): training stays
bit-identical to the same table in host RAM (itself tested against torch's optimizers), and a
row a read-ahead evicts is never read back before its write-back is done."""
import threading
import time

import numpy as np
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.disk import readahead
from nbtools.devices import resolve_device
from nbtools.disk import DiskRows
from nbtools.testing import train_reading_ahead

DEVICE = resolve_device()
N, D = 400, 8


def _zipf_batches(steps, batch, gen):
    """Skewed ids: rows come back often, so read-aheads evict rows the next lookups need."""
    ranks = torch.arange(1, N + 1, dtype=torch.float64)
    p = ranks ** -1.1
    return [torch.multinomial(p / p.sum(), batch, replacement=True, generator=gen)
            for _ in range(steps)]


def _train(placement, batches, depth, tmp_path, stray=None, **extra):
    torch.manual_seed(0)
    init = torch.randn(N, D)
    t = OffloadedEmbedding(N, D, name=f"ra-{placement}", device=DEVICE, placement=placement,
                           **extra)
    with torch.no_grad():
        t.weight.copy_(init)
    train_reading_ahead(t, batches, depth, stray)
    return t


def _table(tmp_path, rows=12, ahead=None):
    """A table of ``rows`` rows (row i holds [2i, 2i + 1]) with 4 RAM slots; with ``ahead``,
    those ids read ahead first (so read-aheads run)."""
    d = DiskRows(str(tmp_path), rows, 2, torch.float32, cache_rows=4, device="cpu")
    d.write_rows(np.arange(rows), torch.arange(2. * rows).view(rows, 2))
    if ahead is not None:
        d.read_ahead(ahead)
        d.wait_read_ahead()
    return d


def _train_rows(d, ids, add):
    """A step's update of rows ``ids`` (+``add``), then a host access that releases the step."""
    got = d.resolve(np.asarray(ids), training=True)
    d.slab.tensor[torch.as_tensor(got)] += add
    d.step_queued()
    d.resolve(np.zeros(0, dtype=np.int64), training=False)


def _hold_writes(d):
    """Make the file's writes wait until ``release`` is set; ``started`` is set by the first.
    Returns (started, release, the file's own write)."""
    started, release = threading.Event(), threading.Event()
    write = d.file.write

    def held_write(*args, **kwargs):
        started.set()
        assert release.wait(10)
        return write(*args, **kwargs)
    d.file.write = held_write
    return started, release, write


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("cache_rows", [70, 200])
def test_deep_read_ahead_trains_as_host(tmp_path, depth, cache_rows):
    gen = torch.Generator().manual_seed(depth)
    batches = _zipf_batches(9, 48, gen)
    stray = torch.randint(0, N, (40,), generator=gen)
    host = _train("host", batches, depth, tmp_path)
    disk = _train("disk", batches, depth, tmp_path, stray=stray, disk_dir=str(tmp_path),
                  host_cache_bytes=cache_rows * 3 * D * 4)
    assert torch.equal(host.weight, disk.weight)
    for name in host.state_names:
        assert torch.equal(host.state_columns(name), disk.state_columns(name)), name
    s = disk.disk.stats
    assert s["read_ahead"] > 0 and s["ahead_hits"] > 0
    if cache_rows == 70:                 # read-aheads evicted dirty rows and wrote them back
        assert s["written_back"] > 0


@pytest.mark.parametrize("engine", ["threads", "kaio"])
def test_every_io_engine_trains_as_host(tmp_path, monkeypatch, engine):
    """The default engine (glibc's AIO where it works) is what the test above runs; the others
    train the same bits through the same read-aheads and write-backs."""
    from nbtools.rowfile.fileio import native_aio
    if engine == "kaio" and not native_aio.ready():
        pytest.skip(f"native AIO unavailable: {native_aio.why}")
    monkeypatch.setenv("NBTOOLS_DISK_ENGINE", engine)
    gen = torch.Generator().manual_seed(7)
    batches = _zipf_batches(9, 48, gen)
    host = _train("host", batches, 3, tmp_path)
    disk = _train("disk", batches, 3, tmp_path, disk_dir=str(tmp_path),
                  host_cache_bytes=70 * 3 * D * 4)
    f = disk.disk.file
    assert getattr(f, "file", f).engine == engine
    assert torch.equal(host.weight, disk.weight)
    for name in host.state_names:
        assert torch.equal(host.state_columns(name), disk.state_columns(name)), name
    assert disk.disk.stats["written_back"] > 0


def test_a_row_evicted_by_a_read_ahead_is_read_back_after_its_write(tmp_path):
    """A read-ahead evicts dirty rows and writes them back on its loader thread, slowly here;
    a lookup of one of them meanwhile waits for that write and sees the new value."""
    d = _table(tmp_path)
    _train_rows(d, np.arange(4), 100.0)                 # the step's update of rows 0-3
    started = threading.Event()
    write = d.file.write

    def slow_write(*args, **kwargs):
        started.set()
        time.sleep(0.3)
        return write(*args, **kwargs)
    d.file.write = slow_write
    d.read_ahead(torch.arange(4, 8))        # evicts rows 0-3 (dirty) for rows 4-7
    assert started.wait(5)
    got = d.resolve(np.array([1]), training=False)
    assert d.slab.tensor[int(got[0])].tolist() == [102.0, 103.0]
    d.file.write = write
    d.flush()
    assert d.read_rows(0, 4)[:, 0].tolist() == [100.0, 102.0, 104.0, 106.0]
    d.close()


def test_a_lookup_never_waits_for_a_write_back(tmp_path):
    """A read-ahead's write-back (on a log file it may clean a segment: slow) runs beside the
    next lookups: one whose rows are read in goes on while the write is held, and one that
    needs an evicted row takes it from the write's copy, without waiting; the file gets the
    same value once the write goes through."""
    d = _table(tmp_path)
    _train_rows(d, np.arange(4), 100.0)                 # the step's update of rows 0-3
    started, release, write = _hold_writes(d)
    d.read_ahead(torch.arange(4, 8))        # evicts rows 0-3 (dirty) for rows 4-7
    assert started.wait(5)
    done = []
    looker = threading.Thread(target=lambda: done.append(d.resolve(np.array([5, 6]), False)))
    looker.start()
    looker.join(5)
    assert done, "the lookup of rows read ahead waited for a write-back it does not need"
    assert d.slab.tensor[torch.as_tensor(done[0])][:, 0].tolist() == [10.0, 12.0]
    waiting = []
    other = threading.Thread(target=lambda: waiting.append(d.resolve(np.array([2]), False)))
    other.start()
    other.join(5)
    assert waiting, "the lookup of a row being written back waited for the write"
    assert d.slab.tensor[int(waiting[0][0])].tolist() == [104.0, 105.0]
    assert started.is_set() and not release.is_set()       # the write was held throughout
    release.set()
    d.file.write = write
    d.flush()
    assert d.read_rows(0, 4)[:, 0].tolist() == [100.0, 102.0, 104.0, 106.0]
    d.close()


def test_a_lookups_own_write_back_is_tracked_like_a_read_aheads(tmp_path):
    """Where read-aheads run, a lookup that misses and evicts dirty rows does not wait (holding
    the table's lock) for their write-back; a later lookup of one of them takes it from the
    write's copy, and a row taken so and trained again ends on disk with its newest value."""
    d = _table(tmp_path, ahead=torch.arange(8, 12))    # read-aheads run (rows 8-11 in RAM)
    _train_rows(d, np.arange(4), 100.0)                 # the step's update of rows 0-3
    started, release, write = _hold_writes(d)
    done = []
    looker = threading.Thread(target=lambda: done.append(d.resolve(np.arange(4, 8), False)))
    looker.start()                              # misses 4-7, evicts rows 0-3 (dirty)
    assert started.wait(5)
    looker.join(5)
    assert done, "the lookup waited for its own write-back under the table's lock"
    waiting = []
    other = threading.Thread(target=lambda: waiting.append(d.resolve(np.array([3]), False)))
    other.start()
    other.join(5)
    assert waiting, "the lookup of a row being written back waited for the write"
    slot = int(waiting[0][0])
    assert d.slab.tensor[slot].tolist() == [106.0, 107.0]
    assert d.ram.dirty[slot]                        # the file may not have it yet
    _train_rows(d, [3], 1000.0)                 # trained again while still queued
    release.set()
    d.file.write = write
    d.flush()
    assert d.read_rows(0, 4)[:, 0].tolist() == [100.0, 102.0, 104.0, 1106.0]
    d.close()


def test_a_row_evicted_twice_while_written_back_comes_back_newest(tmp_path):
    """A row evicted, taken back from its queued write-back, trained and evicted again sits in
    two queued writes: a lookup takes the newer copy, and the file ends with it."""
    d = _table(tmp_path, ahead=torch.arange(8, 12))
    _train_rows(d, np.arange(4), 100.0)
    _, release, write = _hold_writes(d)
    d.resolve(np.arange(4, 8), False)           # evicts rows 0-3 (100+): write 1, held
    _train_rows(d, [3], 1000.0)                 # row 3 from write 1's copy, trained: 1106
    d.resolve(np.arange(8, 12), False)          # evicts row 3 again: write 2, queued
    assert len(d.reader.writes) == 2
    got = d.resolve(np.array([3]), False)
    assert d.slab.tensor[int(got[0])].tolist() == [1106.0, 1107.0]
    release.set()
    d.file.write = write
    d.flush()
    assert d.read_rows(0, 4)[:, 0].tolist() == [100.0, 102.0, 104.0, 1106.0]
    d.close()


@pytest.mark.parametrize("read_ahead_first", [True, False])
def test_a_lookup_waiting_for_its_load_lets_the_next_read_ahead_start(tmp_path,
                                                                      read_ahead_first):
    """A lookup waits for the load of its rows outside the table's lock, so that a coming
    step's read-ahead starts its own reads meanwhile: two steps' reads in flight at once.
    Also where its rows were not read ahead (the loop's first step): it loads them as a
    read-ahead would."""
    d = DiskRows(str(tmp_path), 64, 2, torch.float32, cache_rows=32, device="cpu")
    d.write_rows(np.arange(64), torch.arange(128.).view(64, 2))
    if not read_ahead_first:
        d.read_ahead(torch.arange(40, 44))  # read-aheads run, not for these rows
        d.wait_read_ahead()
    hold, started = threading.Event(), []
    read = d.file.read

    def held_read(ids, *a, **k):
        started.append(np.asarray(ids).copy())
        if int(np.min(ids)) < 8:            # the first step's rows: held
            assert hold.wait(10)
        return read(ids, *a, **k)
    d.file.read = held_read
    if read_ahead_first:
        d.read_ahead(torch.arange(0, 8))    # step 1's rows, their read held
        deadline = time.time() + 5
        while not started and time.time() < deadline:
            time.sleep(0.01)
    done = []
    looker = threading.Thread(target=lambda: done.append(d.resolve(np.arange(0, 8), False)))
    looker.start()                          # waits for the held load
    deadline = time.time() + 5
    while not started and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    d.read_ahead(torch.arange(16, 24))      # step 2's read-ahead
    deadline = time.time() + 5
    while len(started) < 2 and time.time() < deadline:
        time.sleep(0.01)
    second = len(started) >= 2
    hold.set()
    looker.join(5)
    assert second, "the next read-ahead could not start its reads while a lookup waited"
    assert done and d.slab.tensor[torch.as_tensor(done[0])][:, 0].tolist() == \
        [float(2 * i) for i in range(8)]
    d.file.read = read
    d.close()


@pytest.mark.parametrize("read_ahead_first", [True, False])
def test_a_failed_read_is_raised_by_the_lookup_and_nothing_is_lost(tmp_path, read_ahead_first):
    """A read that fails (a disk error) in a read-ahead's load or in a lookup's own load is
    raised: by the lookup that needs the rows, or by the read-ahead thread that settled the
    load first (then by that step's lookup, or at the latest by the next wait for the
    read-aheads). The rows' slots are freed, a lookup reads them again, and nothing is lost:
    the dirty rows evicted meanwhile were written back."""
    d = _table(tmp_path, 16, ahead=torch.arange(12, 14))      # read-aheads run
    _train_rows(d, np.arange(4), 100.0)                 # the step's update of rows 0-3
    read, failed = d.file.read, []

    def failing_read(ids, *a, **k):
        if not failed:
            failed.append(True)
            raise OSError(5, "disk read failed: Input/output error")
        return read(ids, *a, **k)
    d.file.read = failing_read
    if read_ahead_first:
        d.read_ahead(torch.arange(4, 8))        # its load fails
    errors, got = [], None
    for _ in range(2):
        try:
            got = d.resolve(np.arange(4, 8), training=False)
            break
        except OSError as e:
            errors.append(e)
    assert got is not None                      # read again
    assert d.slab.tensor[torch.as_tensor(got)][:, 0].tolist() == [8.0, 10.0, 12.0, 14.0]
    try:
        d.wait_read_ahead()
    except OSError as e:
        errors.append(e)
    assert len(errors) == 1 and "Input/output error" in str(errors[0])
    d.file.read = read
    d.flush()
    assert d.read_rows(0, 8)[:, 0].tolist() == [100.0, 102.0, 104.0, 106.0,
                                                 8.0, 10.0, 12.0, 14.0]
    d.close()


def test_a_failed_write_back_stops_the_table_until_a_restore(tmp_path):
    """A write-back that fails leaves the file without the evicted rows' newest values: the
    table then refuses lookups, flushes and saves (naming the failure and what to do) rather
    than read or save stale rows; the last checkpoint restores into a new table, exactly."""
    import nbtools
    from nbtools import CheckpointManager
    torch.manual_seed(0)
    n, dim = 64, 4
    t = OffloadedEmbedding(n, dim, name="broken", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path / "t"), host_cache_bytes=12 * dim * 4 * 2)
    opt = OffloadOptimizer(torch.optim.Adagrad, t, lr=0.1)
    ck = CheckpointManager(tmp_path / "ck")

    def step(ids):
        (t(ids) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    for k in range(3):
        step(torch.arange(10 * k, 10 * k + 10))
    ck.save(3, model=t, opt=opt)
    saved = t.weight.detach().clone()
    write, calls = t.disk.file.write, []

    def failing_write(*a, **k):
        calls.append(1)
        raise OSError(5, "Input/output error")
    t.disk.file.write = failing_write
    with pytest.raises(OSError):
        for k in range(3, 7):                   # evicts trained rows: their write-back fails
            t.prefetch(torch.arange(10 * k + 5, 10 * k + 15))
            step(torch.arange(10 * k, 10 * k + 10))
        t.disk.flush()
    assert calls
    t.disk.file.write = write
    for use in (lambda: t(torch.arange(4)), t.disk.flush,
                lambda: ck.save(7, model=t, opt=opt)):
        with pytest.raises(nbtools.DiskTableBrokenError, match="Restore the last checkpoint"):
            use()
    assert [c["step"] for c in ck.checkpoints()] == [3]
    t.close()                                   # (closing it works)
    t = OffloadedEmbedding(n, dim, name="broken", device=DEVICE, placement="disk",
                           disk_dir=str(tmp_path / "t"), host_cache_bytes=12 * dim * 4 * 2)
    opt = OffloadOptimizer(torch.optim.Adagrad, t, lr=0.1)
    assert ck.restore(model=t, opt=opt) == 3
    assert torch.equal(t.weight, saved)
    step(torch.arange(10))                      # trains again
    t.close()


def test_rows_in_ram_that_a_read_ahead_needs_get_a_second_chance(tmp_path):
    """A read-ahead marks the rows its step finds in RAM as used, so that a later read-ahead's
    evictions take other idle rows first: the step's lookup then reads none of them again."""
    d = _table(tmp_path, 16, ahead=torch.arange(12, 14))      # read-aheads run
    d.resolve(np.arange(4), training=False)     # rows 0-3 in RAM
    d.ram.ref[:] = False                        # idle long enough: all eviction candidates
    d.ram.hand = int(d.ram.slot_of[0])             # and row 0 the first the sweep meets
    read, seen = d.file.read, []
    d.file.read = lambda ids, *a, **k: (seen.extend(np.asarray(ids).tolist()),
                                         read(ids, *a, **k))[1]
    step_a = torch.tensor([0, 3])
    d.read_ahead(step_a)                        # all in RAM: nothing to read
    d.read_ahead(torch.tensor([10, 11]))        # evicts two idle rows: not 0 or 3
    d.wait_read_ahead()
    got = d.resolve(np.array([0, 3]), training=False)
    assert d.slab.tensor[torch.as_tensor(got)][:, 0].tolist() == [0.0, 6.0]
    assert 0 not in seen and 3 not in seen, seen
    d.file.read = read
    d.close()


def test_read_aheads_queue_no_deeper_than_depth(tmp_path):
    n = 8 * (readahead.DEPTH + 3)
    d = DiskRows(str(tmp_path), n, 2, torch.float32, cache_rows=n, device="cpu")
    d.write_rows(np.arange(n), torch.zeros(n, 2))
    batches = [torch.arange(8 * k, 8 * k + 8) for k in range(readahead.DEPTH + 3)]
    for ids in batches:
        d.read_ahead(ids)
        assert len(d.reader.queue) <= readahead.DEPTH
    p = d.take_prepared(batches[-1])         # the last one: the ones before it are dropped
    last = len(batches) - 1
    assert p is not None and p.uniq.tolist() == list(range(8 * last, 8 * last + 8))
    assert d.take_prepared(batches[-2]) is None
    d.close()


def test_a_lookup_finds_exactly_the_loads_that_bring_its_rows(tmp_path):
    """With several read-aheads' loads in flight, the loads a lookup must wait for are those
    that bring in one of its rows, no more and no fewer (the quick search under the lock:
    ReadAhead.loads_of, against a plain check of every load's rows)."""
    d = DiskRows(str(tmp_path), 64, 2, torch.float32, cache_rows=48, device="cpu")
    d.write_rows(np.arange(64), torch.arange(128.).view(64, 2))
    d.resolve(np.arange(56, 60), False)             # rows in RAM, loaded by nobody
    hold, started = threading.Event(), []
    read = d.file.read

    def held_read(ids, *a, **k):
        started.append(1)
        assert hold.wait(10)
        return read(ids, *a, **k)
    d.file.read = held_read
    steps = [torch.tensor([3, 1, 7, 5]), torch.tensor([10, 12, 14]), torch.tensor([20, 21]),
             torch.tensor([30, 33, 31, 35, 36])]
    try:
        for ids in steps:
            d.read_ahead(ids)
        deadline = time.time() + 5
        while len(started) < len(steps) and time.time() < deadline:
            time.sleep(0.01)
        ra = d.reader
        for item in list(ra.queue):
            item.task.result()
        assert len(ra.loads) == len(steps)
        rng = np.random.default_rng(3)
        asks = [np.array([1, 7]), np.array([12, 33]), np.arange(56, 60), np.arange(40, 50),
                np.zeros(0, dtype=np.int64), np.arange(64)]
        asks += [np.unique(rng.integers(0, 64, k)) for k in (1, 5, 20, 40)]
        for ids in asks:
            with d.slots_lock:
                got = ra.loads_of(ids)
                want = [a for a in ra.loads if np.isin(a.rows, ids).any()]
            assert [id(a) for a in got] == [id(a) for a in want], ids
    finally:
        hold.set()
        d.wait_read_ahead()
        d.file.read = read
    assert d.read_rows(30, 31)[:, 0].tolist() == [60.0]
    d.close()


def _count_on_a_new_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()


@pytest.mark.parametrize("cores, alone", [(2, True), (4, True), (16, False)])
def test_the_read_ahead_dedups_on_its_own_thread_alone_where_cores_are_few(
        tmp_path, monkeypatch, cores, alone):
    """On a machine of few cores the read-ahead's deduplication runs on its thread alone (a
    team of torch threads would take the step's core as well); on more, with torch's count.
    The step's thread, and a thread started afterwards, keep torch's count either way."""
    from nbtools import devices
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(devices, "usable_cores", lambda: cores)
        seen = []
        prepare = readahead.prepare

        def counting(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return prepare(*args, **kwargs)
        monkeypatch.setattr(readahead, "prepare", counting)
        d = _table(tmp_path, ahead=torch.tensor([1, 2, 3]))
        assert d.resolve(np.array([1, 2, 3]), training=False).shape == (3,)
        assert seen == [1 if alone and OPENMP else 2]
        assert torch.get_num_threads() == 2
        assert _count_on_a_new_thread() == 2
    finally:
        torch.set_num_threads(before)


def test_torch_on_this_thread_alone_changes_no_other_thread():
    from nbtools import devices
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = []

        def alone():
            got.append(devices.torch_on_this_thread_alone())
            got.append(torch.get_num_threads())
            got.append(torch.unique(torch.tensor([3, 1, 3])).tolist())   # still computes
        t = threading.Thread(target=alone)
        t.start()
        t.join()
        assert got == ([True, 1, [1, 3]] if OPENMP else [False, 3, [1, 3]])
        assert torch.get_num_threads() == 3
        assert _count_on_a_new_thread() == 3
    finally:
        torch.set_num_threads(before)


def test_the_read_ahead_works_when_its_threads_count_cannot_be_set(tmp_path, monkeypatch):
    from nbtools import devices

    def broken():
        raise RuntimeError("no thread count here")
    monkeypatch.setattr(devices, "usable_cores", lambda: 2)
    monkeypatch.setattr(devices, "torch_on_this_thread_alone", broken)
    d = _table(tmp_path, ahead=torch.tensor([1, 2, 3]))
    got = d.resolve(np.array([1, 2, 3]), training=False)
    assert torch.equal(d.slab.tensor[torch.as_tensor(got)], torch.tensor([[2., 3.], [4., 5.], [6., 7.]]))
