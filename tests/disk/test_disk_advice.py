"""The disk-bound verdict suggests reading ahead only while no read-ahead runs: the meters
count rows read ahead (nbtools.disk.disk_counters()["ahead_rows"], from table.prefetch) and
the diagnosis leaves table.prefetch out once they move (the counter itself:
test_disk.py::test_rows_a_read_ahead_brought_in_are_not_ram_hits)."""
from nbtools.meters import Meters, diagnose
from nbtools.testing import FakeBackend, FakeClock


def _disk_bound(ahead_rows: int) -> dict:
    b, clock = FakeBackend(), FakeClock()
    b.disk_io()
    m = Meters(b, clock=clock, pcie="off")
    m.read()
    clock.advance(1.0)
    b.disk_io(read_bytes=50 << 20, lookup_rows=1000, hit_rows=900, ahead_rows=ahead_rows)
    rec = m.read()
    rec.update(disk_wait_s=0.007, step_s=0.010)
    return rec


def test_verdict_suggests_read_ahead_only_while_none_runs():
    off, on = _disk_bound(0), _disk_bound(4000)
    assert off["nbtools_disk_ahead_rows_per_s"] == 0
    assert on["nbtools_disk_ahead_rows_per_s"] == 4000
    assert "table.prefetch(next_ids)" in diagnose(off)
    said = diagnose(on)
    assert said.startswith("disk-bound: 70%") and "table.prefetch" not in said
    assert said.endswith("(read-ahead is on)")
