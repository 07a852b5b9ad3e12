"""What a table asks its tier instead of which kind of tier it is (``in_memory``, ``own_cache``,
``cache_cost``, ``warm_rows``), for every placement and tier stack, before and after an
optimizer attaches. Reference: the kind of rows the placement made (a disk table's file
under RAM slots, or rows in memory), and the sizes :class:`nbtools.store.cache.RowCache`
states for itself."""
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.store.cache import RowCache

from test_whole import D, N, STACKS as WHOLE_STACKS

# the stacks of the whole-table face's tests, and a disk table with a GPU level
STACKS = dict(WHOLE_STACKS, **{"disk-cached": dict(WHOLE_STACKS["disk"], cache_rows=16)})


def _table(stack, tmp_path, optimizer: bool):
    opts = dict(STACKS[stack])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if stack == "gpu" and device.type != "cuda":
        pytest.skip("the GPU placement needs a CUDA device")
    if opts.get("placement") == "disk":
        opts["disk_dir"] = str(tmp_path)
    t = OffloadedEmbedding(N, D, name="emb", device=device, **opts)
    opt = OffloadOptimizer(torch.optim.Adam, t, lr=0.05) if optimizer else None
    return t, opt


@pytest.mark.parametrize("optimizer", [False, True], ids=["alone", "with-optimizer"])
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_each_stack_answers_as_its_placement(stack, optimizer, tmp_path):
    t, _ = _table(stack, tmp_path, optimizer)
    on_disk = STACKS[stack].get("placement") == "disk"
    rows = t.rows
    assert (t.disk is not None) == on_disk and (rows.disk is t.disk)
    assert rows.in_memory is (not on_disk) and rows.own_cache is on_disk
    fixed, per_row = rows.cache_cost(N)
    if on_disk:           # a disk table's GPU level keeps its maps in host RAM
        assert (fixed, per_row) == (0, rows.row_bytes)
    else:
        assert (fixed, per_row) == (RowCache.overhead_bytes(N), RowCache.slot_bytes(rows.row_bytes))
    assert t.storage is rows.host
    t.close()


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_only_a_cache_of_the_tiers_own_is_warmed_by_the_tier(stack, tmp_path):
    t, _ = _table(stack, tmp_path, optimizer=False)
    counts = torch.zeros(N, dtype=torch.int32)
    counts[[7, 3, 250]] = torch.tensor([5, 9, 1], dtype=torch.int32)
    warmed = t.rows.warm_rows(counts)
    assert warmed is t.rows.own_cache
    if warmed:            # the counted rows are in RAM now, hottest first
        # (warming looks nothing up: RAM's figures count no lookup yet)
        assert t.cache_stats().get("ram_lookups", 0) == 0
        assert sorted(t.disk.ram.slot_of[[3, 7, 250]] >= 0) == [True] * 3
    t.close()


def test_a_cache_too_small_for_one_row_says_what_it_takes(tmp_path):
    host = OffloadedEmbedding(N, D, device="cpu", cache_bytes=8)
    with pytest.raises(ValueError, match="row -> slot map alone takes"):
        OffloadOptimizer(torch.optim.SGD, host, lr=0.1)
