"""Tiers around a row store (nbtools.store.tiers): a table's placement as a stack of tiers,
and each wrapper checked against the plain tier it wraps (F.embedding-style reads, torch's
index_copy_ for writes), on the CPU here and on CUDA on the GPU machine."""
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.devices import resolve_device
from nbtools.disk.gpu import GpuLevel
from nbtools.disk.store import DiskStore
from nbtools.hostmem import HostTensor
from nbtools.store.cache import RowCache
from nbtools.store.layout import RowLayout
from nbtools.store.rows import RowStore, unique_ids
from nbtools.store.tiers import Cached, WriteBehind, with_cache

DEVICE = resolve_device()
N, D = 64, 4


def _plain(seed=0):
    """A plain tier over host rows (pinned and read zero-copy on CUDA), and its reference."""
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(N, D, generator=gen)
    host = HostTensor((N, D), pin=DEVICE.type == "cuda", name="t",
                      device=DEVICE if DEVICE.type == "cuda" else None)
    host.tensor.copy_(ref)
    return RowStore(host, DEVICE), ref


def _stack(t):
    """The tiers of ``t.rows``, outermost first, by class name."""
    names, tier = [], t.rows
    while True:
        names.append(type(tier).__name__)
        if not hasattr(tier, "inner") or "inner" not in vars(tier):
            return names
        tier = tier.inner


def test_a_placement_is_a_stack_of_tiers(tmp_path):
    host = OffloadedEmbedding(N, D, device=DEVICE, placement="host")
    assert _stack(host) == ["WriteBehind", "RowStore"]
    cached = OffloadedEmbedding(N, D, device=DEVICE, placement="host", cache_rows=32)
    OffloadOptimizer(torch.optim.Adam, cached, lr=0.1)
    assert _stack(cached) == ["Cached", "RowStore"]
    assert isinstance(cached.cache, RowCache) and cached.rows.cache is cached.cache
    disk = OffloadedEmbedding(N, D, device=DEVICE, placement="disk", disk_dir=str(tmp_path),
                              cache_rows=16, host_cache_bytes=20 * 3 * D * 4)
    OffloadOptimizer(torch.optim.Adam, disk, lr=0.1)
    assert _stack(disk) == ["Cached", "DiskStore"]
    assert isinstance(disk.rows.cache, GpuLevel) and disk.rows.cache is disk.disk.above
    assert isinstance(disk.rows.base, DiskStore) and disk.rows.writes_back is False
    # what the tiers do not change, they answer as the tier inside does
    assert disk.rows.kind == "disk" and disk.rows.keeps_host_ids
    assert host.rows.kind == host.rows.base.kind and host.rows.host is host.storage
    for t in (host, cached, disk):
        t.close()


def test_cached_reads_and_writes_as_the_rows_below_it():
    plain, ref = _plain()
    tier = with_cache(plain, 32)
    assert isinstance(tier, Cached) and tier.inner is plain
    # admit hot rows: a lookup's unique ids, counted and admitted set by set
    ids = torch.tensor([3, 5, 9, 9, 17, 33, 3], device=DEVICE)
    batch = unique_ids(ids, N)
    for _ in range(3):
        rows = tier.gather_batch(batch, admit=True)
    assert tier.cache.cached_rows() > 0
    used = int(batch.count)
    want = ref[batch.ids[:used].cpu()]
    assert torch.equal(rows[:used].cpu(), want)
    assert not rows[used:].any()                         # the sentinel reads as zeros
    # writes: cached rows land in the cache, the rest in host memory; reads see both
    idx = torch.tensor([3, 5, 40, 41], device=DEVICE)
    new = torch.arange(16.).view(4, D).to(DEVICE)
    tier.scatter(idx, new)
    ref[idx.cpu()] = new.cpu()
    assert torch.equal(tier.gather(torch.arange(N, device=DEVICE)).cpu(), ref)
    hot = tier.cache.locate(idx).cpu()
    assert (hot[:2] >= 0).all()                          # (3 and 5 were admitted)
    # a fused update's target names the cache and each id's slot in it
    t = tier.target(idx, RowLayout(D, torch.float32, torch.float32))
    assert t.cache is tier.cache.rows and torch.equal(t.slots.cpu(), hot)
    # flushed, the rows below are current; dropped, the cache is empty
    assert torch.equal(tier.rows_now(keep_cache=False).cpu(), ref)
    assert tier.cache.cached_rows() == 0


@pytest.mark.kernels("rows")
def test_write_behind_writes_the_rows_back_and_patches_reads_meanwhile():
    plain, ref = _plain(1)
    tier = WriteBehind(plain)
    ids = torch.tensor([2, 7, 7, 11], device=DEVICE)
    batch = unique_ids(ids, N)
    rows = tier.gather_batch(batch)
    assert tier.can_write_behind(rows, forced=True)
    rows[: int(batch.count)] += 1.0                     # the step's update, in place
    tier.write_behind(batch, rows)
    assert tier.write_back_queued and tier.writing(batch.ids)
    ref[[2, 7, 11]] += 1.0
    # the next lookup shares rows with it: it reads them as written
    again = unique_ids(torch.tensor([7, 11, 20], device=DEVICE), N)
    got = tier.gather_batch(again)
    assert torch.equal(got[:3].cpu(), ref[[7, 11, 20]])
    tier.settle()
    assert not tier.write_back_queued
    assert torch.equal(tier.rows_now(keep_cache=True).cpu(), ref)


def test_a_cache_replaces_writing_behind():
    plain, _ = _plain()
    tier = WriteBehind(plain)
    cached = with_cache(tier, 32)
    assert cached.inner is plain                        # the write-back is not kept
    rows = torch.zeros(4, D, device=DEVICE)
    assert not cached.can_write_behind(rows, forced=True)


def test_a_cache_needs_rows_in_host_memory():
    if DEVICE.type != "cuda":
        pytest.skip("a CPU machine has no GPU placement to refuse")
    from nbtools.store.rows import DeviceRows
    gpu = RowStore(DeviceRows((N, D), torch.float32, DEVICE), DEVICE)
    with pytest.raises(ValueError, match="pinned host memory"):
        with_cache(gpu, 32)
