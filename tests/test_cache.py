"""The GPU cache of hot rows (nbtools.store.cache): exact against the same table without a cache, for
every fused optimizer and the generic path, under id streams chosen to break it.

On the CPU the cache is a second CPU tensor and the fused kernels run in Triton's interpreter
(conftest), so CI checks the admission, eviction and write-back logic; on the GPU machine the
same tests run on CUDA, where training lookups replay as CUDA graphs with the admission inside.
"""
import warnings

import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer, kernels
from nbtools.store.cache import RowCache
from nbtools.checkpoint import CheckpointConfig, CheckpointManager
from nbtools.optim import OffloadConfig
from test_optim import CASES as OPTIM_CASES, IDS as OPTIM_IDS

O = torch.optim
CPU_KERNELS = kernels.usable_on(torch.device("cpu"))
FUSABLE = (O.Adam, O.AdamW, O.SGD, O.Adagrad, O.SparseAdam)


def insist(cls, fused):
    """OffloadConfig.fused for a test: "auto" takes the fused kernels only on CUDA; True makes
    the CPU run them too (in Triton's interpreter, without a GPU) where one exists."""
    return True if fused == "auto" and cls in FUSABLE and CPU_KERNELS else fused


def expect_fused(cls, fused, device) -> bool:
    return fused == "auto" and cls in FUSABLE and kernels.usable_on(torch.device(device),
                                                                    "update")
N, D = 120, 4

# every supported optimizer (test_optim's list: fused and generic paths, non-zero initial state)
OPTIMIZERS = OPTIM_CASES + [(O.SparseAdam, dict(lr=0.05))]
OPT_IDS = OPTIM_IDS + ["SparseAdam"]


def cache_for(rows: int, width_state: int) -> int:
    """cache_bytes that hold ``rows`` rows of D x (1 + width_state) fp32."""
    return RowCache.overhead_bytes(N) + rows * RowCache.slot_bytes(4 * D * (1 + width_state))


def stream(kind: str, steps: int, batch: int = 40, seed: int = 0) -> list:
    """Id batches (each a list of lookups) for one adversarial pattern."""
    gen = torch.Generator().manual_seed(seed)
    zipf = lambda n: (torch.rand(n, generator=gen) ** 4 * N).long()
    out = []
    for t in range(steps):
        if kind == "repeat":                   # the same ids in consecutive batches
            ids = zipf(batch) if t % 3 == 0 else out[-1][0]
            out.append([ids])
        elif kind == "uniform":                # all cold: no row comes back often
            out.append([torch.randint(0, N, (batch,), generator=gen)])
        elif kind == "zipf":
            out.append([zipf(batch)])
        elif kind == "two_lookups":            # a row in both lookups of a step, evicted by the 2nd
            a = zipf(batch)
            b = torch.cat([a[: batch // 4], torch.randint(0, N, (batch,), generator=gen)])
            out.append([a, b])
    return out


def train(device, cls, kw, batches, cache_bytes=None, fused="auto", init_seed=1, warm=None,
          cache_rows=None):
    torch.manual_seed(0)
    table = OffloadedEmbedding(N, D, device=device, name="t", cache_bytes=cache_bytes,
                               cache_rows=cache_rows)
    table.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(init_seed)))
    if warm is not None:
        table.warm_cache(warm)
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=insist(cls, fused)), **kw)
    assert (opt.slot(next(iter(opt.tables))).fused_update() is not None) == expect_fused(cls, fused, device)
    w = torch.arange(1, D + 1, dtype=torch.float32, device=device)
    for lookups in batches:
        opt.zero_grad()
        loss = sum(((table(ids.to(device)) * w).sin() * (k + 1)).sum()
                   for k, ids in enumerate(lookups))
        loss.backward()
        opt.step()
    return table, opt


def final_state(table, opt) -> dict:
    out = {"weight": table.weight.cpu().clone()}
    for k, v in opt.table_state("t").items():
        out[k] = v.cpu().clone()
    return out


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        # the same kernels on the same values: equal, up to the order of atomic gradient sums
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("cls,kw", OPTIMIZERS, ids=OPT_IDS)
def test_cache_equals_no_cache_for_every_optimizer(device, cls, kw):
    batches = stream("zipf", 4)              # the 32-row cache hits and evicts from step 2 on
    ref = final_state(*train(device, cls, kw, batches))
    table, opt = train(device, cls, kw, batches, cache_rows=32)
    stats = table.cache_stats()
    assert stats["hits"] > 0 and stats["evicted"] > 0       # the cache was really used
    assert_same(ref, final_state(table, opt))


@pytest.mark.parametrize("kind", ["repeat", "uniform", "two_lookups"])
@pytest.mark.parametrize("rows", [1, 8, 32, N], ids=lambda r: f"cache{r}")
@pytest.mark.parametrize("fused", ["auto", False], ids=["fused", "generic"])
def test_cache_equals_no_cache_under_adversarial_streams(device, kind, rows, fused):
    """Consecutive repeats, all cold, a row in two lookups of a step; caches of one row
    (smaller than a batch), 8 and 32 one-way sets, and the whole table (all hot). Five steps
    are enough for every smaller cache to evict (checked; the Triton interpreter runs one
    program per set, so each step costs)."""
    batches = stream(kind, 5)
    ref = final_state(*train(device, O.Adam, dict(lr=0.05), batches, fused=fused))
    table, opt = train(device, O.Adam, dict(lr=0.05), batches, cache_bytes=cache_for(rows, 2),
                       fused=fused)
    assert table.cache.capacity == min(rows, N)        # under 64 sets of 32: fewer ways
    stats = table.cache_stats()
    assert stats["hits"] > 0 and (stats["evicted"] > 0) == (rows < N)   # evictions were tested
    assert_same(ref, final_state(table, opt))


def test_all_hot_cache_hits_every_row_after_the_first_touch(device):
    batches = stream("repeat", 6)
    table, opt = train(device, O.Adam, dict(lr=0.05), batches, cache_bytes=cache_for(N, 2))
    s = table.cache_stats()
    distinct = len(torch.unique(torch.cat([b[0] for b in batches])))
    # every row is admitted at its first lookup and never evicted: the rest are hits
    assert s["admitted"] == distinct and s["evicted"] == 0
    assert s["hits"] == s["lookups"] - distinct
    assert s["bytes_saved"] == (2 * s["hits"] - distinct) * table.rows.row_bytes


def test_lfu_keeps_the_frequent_rows(device):
    """Rows 0..7 come in every batch; 200 other ids once each: a 32-row cache ends up holding
    rows 0..7, and the one-off rows never push them out."""
    gen = torch.Generator().manual_seed(3)
    batches = [[torch.cat([torch.arange(8), torch.randint(8, N, (30,), generator=gen)])]
               for _ in range(10)]
    table, opt = train(device, O.Adam, dict(lr=0.05), batches, cache_bytes=cache_for(32, 2))
    slots = table.cache.locate(torch.arange(8, device=table.device))
    assert (slots >= 0).all()
    s = table.cache_stats()
    assert s["hits"] >= 9 * 8


class ReferenceLFU:
    """The admission policy of RowCache written out row by row in Python: the reference its
    vectorised admission is checked against."""

    def __init__(self, n, sets, ways):
        self.sets, self.ways = sets, ways
        self.freq = [0] * n
        self.tags = [-1] * (sets * ways)
        self.stamp = [0] * (sets * ways)
        self.tick = 0
        self.stats = [0, 0, 0, 0]            # lookups, hits, admitted, evicted

    def set_of(self, i):
        return (i * 2654435761) % self.sets

    def admit(self, ids):
        self.tick += 1
        where = {t: k for k, t in enumerate(self.tags) if t >= 0}
        best = {}
        for i in ids:
            self.freq[i] += 1
            self.stats[0] += 1
            if i in where:
                self.stamp[where[i]] = self.tick
                self.stats[1] += 1
        for i in ids:
            if i not in where:
                s = self.set_of(i)
                best[s] = max(best.get(s, (-1, -1)), (self.freq[i], i))
        for s, (f, i) in best.items():
            ways = range(s * self.ways, (s + 1) * self.ways)
            score = [float("inf") if self.stamp[k] == self.tick else
                     (self.freq[self.tags[k]] if self.tags[k] >= 0 else -1) for k in ways]
            w = score.index(min(score))                  # the first least frequent way
            if f > score[w]:
                self.stats[2] += 1
                self.stats[3] += self.tags[s * self.ways + w] >= 0
                self.tags[s * self.ways + w] = i
                self.stamp[s * self.ways + w] = self.tick


ADMISSION = [False] + ([True] if kernels.usable_on(torch.device("cpu")) else [])


@pytest.mark.parametrize("use_kernels", ADMISSION, ids=lambda k: "triton" if k else "torch")
@pytest.mark.parametrize("capacity,n,draws", [(8, 500, 32), (40, 500, 160), (64 * 3, 500, 768),
                                              (64 * 5, 3000, 3000)],
                         ids=["8", "40", "192", "320"])
def test_admission_follows_the_reference_policy(capacity, n, draws, use_kernels):
    """Every lookup's admissions and evictions, the slots it returns and the statistics equal
    the policy spelled out row by row (ReferenceLFU), on Zipf-like and uniform ids, for the
    torch code and the Triton kernels: one-way sets (8 and 40 of them), then 64 sets of 3 and
    of 5 ways (not powers of two), the last with lookups of over 1,024 distinct ids (more than
    one program of the kernels' first pass). 10 steps: every case evicts in 4 to 9 of them
    once its sets have filled (the Triton interpreter runs one program per set and step, so
    each step costs)."""
    gen = torch.Generator().manual_seed(capacity)
    host = torch.randn(n, 3, generator=gen)
    truth = host.clone()
    cache = RowCache(host, capacity)
    cache.use_kernels = use_kernels
    ref = ReferenceLFU(n, cache.sets, cache.ways)
    evicting, widest = 0, 0
    for step in range(10):
        draw = ((torch.rand(draws, generator=gen) ** 3 * n).long() if step % 2
                else torch.randint(0, n, (60,), generator=gen))
        ids = torch.unique(draw)
        widest = max(widest, ids.numel())
        padded = torch.cat([ids, torch.full((7,), n)])        # sentinel padding past count
        slots = cache.admit(padded, torch.tensor([ids.numel()]), host)
        evicted = ref.stats[3]
        ref.admit(ids.tolist())
        evicting += ref.stats[3] > evicted
        assert cache.tags[: cache.capacity].tolist() == ref.tags, step
        want = {t: k for k, t in enumerate(ref.tags) if t >= 0}
        assert slots[: ids.numel()].tolist() == [want.get(i, -1) for i in ids.tolist()]
        assert (slots[ids.numel():] == -1).all()
        # every row's latest value is in the cache if it is held there, else in host memory
        # (evicted rows were written back; admitted ones copied in)
        held = cache.tags[: cache.capacity]
        assert torch.equal(cache.rows[held >= 0], truth[held[held >= 0]])
        out = torch.ones(n, dtype=torch.bool)
        out[held[held >= 0]] = False
        assert torch.equal(host[out], truth[out])
        assert cache.stats.tolist() == ref.stats
        cache.rows[held >= 0] += 1                 # an update of the cached rows
        truth[held[held >= 0]] += 1
    assert evicting >= 4 and (widest > 1024) == (n == 3000), (evicting, widest)  # all was tested


def test_warm_cache_loads_the_most_frequent_rows_and_stays_exact(device):
    counts = torch.zeros(N, dtype=torch.long)
    counts[:16] = torch.arange(1000, 984, -1)
    batches = stream("zipf", 5)
    ref = final_state(*train(device, O.Adam, dict(lr=0.05), batches))
    table, opt = train(device, O.Adam, dict(lr=0.05), batches, cache_bytes=cache_for(32, 2),
                       warm=counts)
    assert_same(ref, final_state(table, opt))
    # before any step: warm right after the optimizer attaches
    fresh = OffloadedEmbedding(N, D, device=device, name="t", cache_bytes=cache_for(32, 2))
    fresh.warm_cache(counts)
    OffloadOptimizer(O.Adam, [fresh], lr=0.05)
    slots = fresh.cache.locate(torch.arange(N, device=fresh.device))
    assert (slots[:16] >= 0).all() and (slots[16:] < 0).all()
    assert fresh.cache.cached_rows() == 16


def test_checkpoint_with_a_warm_cache_restores_exactly(device, tmp_path):
    batches = stream("zipf", 10)
    first, rest = batches[:5], batches[5:]
    ref = final_state(*train(device, O.Adam, dict(lr=0.05), batches))

    table, opt = train(device, O.Adam, dict(lr=0.05), first, cache_bytes=cache_for(16, 2))
    assert table.cache.cached_rows() > 0
    ckpt = CheckpointManager(tmp_path, keep=1, config=CheckpointConfig(verbose=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save(5, table=table, opt=opt)
    # a new process's objects: a cache of another size, warm from other steps, then restore
    table2, opt2 = train(device, O.Adam, dict(lr=0.05), stream("uniform", 3, seed=9),
                         cache_bytes=cache_for(8, 2), init_seed=7)
    assert table.cache.cached_rows() > 0          # saving flushed the cache but kept it warm
    assert ckpt.restore(table=table2, opt=opt2) == 5
    w = torch.arange(1, D + 1, dtype=torch.float32, device=device)
    for lookups in rest:
        opt2.zero_grad()
        sum(((table2(ids.to(device)) * w).sin() * (k + 1)).sum()
            for k, ids in enumerate(lookups)).backward()
        opt2.step()
    assert_same(ref, final_state(table2, opt2))


def test_reading_the_weight_flushes_and_empties_the_cache(device):
    table, opt = train(device, O.Adam, dict(lr=0.05), stream("zipf", 3),
                       cache_bytes=cache_for(32, 2))
    assert table.cache.cached_rows() > 0
    table.weight[5] = 123.0            # a write through .weight is not shadowed by the cache
    assert table.cache.cached_rows() == 0
    got = table(torch.tensor([5], device=table.device))
    assert (got == 123.0).all()


def test_cache_options_are_checked():
    with pytest.raises(ValueError, match="cannot hold one row"):
        t = OffloadedEmbedding(N, D, device="cpu", cache_bytes=100)
        OffloadOptimizer(O.Adam, [t], lr=0.1)
    with pytest.raises(ValueError, match="give one of"):
        t = OffloadedEmbedding(N, D, device="cpu", cache_bytes=10**6, cache_fraction=0.1)
        OffloadOptimizer(O.Adam, [t], lr=0.1)
    t = OffloadedEmbedding(N, D, device="cpu", cache_bytes=10**6)
    with pytest.raises(ValueError, match="counts must be"):
        t.warm_cache(torch.ones(N + 1))
    OffloadOptimizer(O.Adam, [t], lr=0.1)
    assert "cache=" in repr(t) and t.cache_stats()["lookups"] == 0


@pytest.mark.gpu
@pytest.mark.kernels("admission")      # one sync a step: the fused path's property
def test_cache_keeps_one_host_sync_per_step():
    from test_step import syncs_during
    table = OffloadedEmbedding(5000, 16, device="cuda", name="t", cache_rows=1024)
    opt = OffloadOptimizer(O.Adam, [table], lr=0.05)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def step():      # 64 hot rows in every batch, the rest cold
        ids = torch.cat([torch.arange(64, device="cuda").repeat(16),
                         torch.randint(64, 5000, (3072,), device="cuda", generator=gen)])
        opt.zero_grad()
        table(ids).square().sum().backward()
        opt.step()

    for _ in range(12):     # the hot rows win their sets within a few steps
        step()
    syncs = syncs_during(step, 5)
    assert len(syncs) <= 5, syncs
    assert table.cache_stats()["hits"] >= 5 * 64
    assert (table.cache.locate(torch.arange(64, device="cuda")) >= 0).all()


@pytest.mark.gpu
@pytest.mark.kernels("rows")           # lookups are captured only where the rows kernels run
def test_captured_lookups_count_each_row_once():
    """A lookup captured as a CUDA graph runs twice first (warm-ups); the cache counts only
    the model's lookups: counts, ticks and statistics equal those of the same training with
    every lookup eager."""
    gen = torch.Generator().manual_seed(3)
    batches = [torch.cat([torch.arange(8), torch.randint(8, 500, (24,), generator=gen)])
               for _ in range(8)]
    got = []
    for graphs in (True, False):
        table = OffloadedEmbedding(500, 4, device="cuda", name="t", cache_rows=64,
                                   cuda_graphs=graphs)
        opt = OffloadOptimizer(O.Adam, [table], lr=0.05)
        for ids in batches:
            opt.zero_grad()
            table(ids.cuda()).square().sum().backward()
            opt.step()
        opt.synchronize()
        captured = table.lookup_graphs.captured
        assert captured == (1 if graphs else 0)
        c = table.cache
        got.append((c.freq.cpu(), int(c.tick), table.cache_stats()["lookups"]))
    assert torch.equal(got[0][0], got[1][0]) and got[0][1:] == got[1][1:] and got[0][1] == 8
    assert int(got[0][0][:8].min()) == 8             # the rows in every batch: 8 lookups


# --- prefetch: the next lookup started while this step computes --------------------------------
def unique_batches(kind, steps, batch=40, seed=0):
    """Batches of distinct ids (so CUDA's atomic gradient sums have nothing to reorder and
    runs compare bit for bit), consecutive batches sharing rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        if kind == "overlap":                      # half of each batch is the previous one's
            keep = out[-1][: batch // 2] if out else torch.randperm(N, generator=gen)[: batch // 2]
            rest = torch.randperm(N, generator=gen)
            rest = rest[~torch.isin(rest, keep)][: batch - keep.numel()]
            out.append(torch.cat([rest, keep]))
        else:                                      # the same batch again and again
            out.append(out[-1] if out else torch.randperm(N, generator=gen)[:batch])
    return out


def train_prefetch(device, cls, kw, batches, prefetch, cache_bytes=None, write_at=None,
                   host_ids=False, write_behind=None, placement="host"):
    table = OffloadedEmbedding(N, D, device=device, name="t", cache_bytes=cache_bytes,
                               write_behind=write_behind, placement=placement)
    table.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(1)))
    opt = OffloadOptimizer(cls, [table], config=OffloadConfig(fused=insist(cls, "auto")), **kw)
    w = torch.arange(1, D + 1, dtype=torch.float32, device=device)
    ids = [b.cpu() if host_ids else b.to(device) for b in batches]
    for t, b in enumerate(ids):
        rows = table(b)
        if prefetch and t + 1 < len(ids):
            table.prefetch(ids[t + 1])
        ((rows * w).sin() + rows.pow(2)).sum().backward()
        opt.step()
        opt.zero_grad()
        if write_at == t:                          # a write through .weight drops the prefetch
            table.weight[ids[t + 1][:3].cpu() if table.weight.device.type == "cpu"
                         else ids[t + 1][:3]] = 7.0
    return final_state(table, opt)


@pytest.mark.parametrize("kind", ["overlap", "same"])
@pytest.mark.parametrize("cls,kw", [(O.Adam, dict(lr=0.05)), (O.RMSprop, dict(lr=0.01))],
                         ids=["Adam", "RMSprop"])
@pytest.mark.parametrize("cache", [None, 16, N], ids=["nocache", "cache16", "cacheall"])
def test_prefetch_is_bit_identical_to_no_prefetch(device, kind, cls, kw, cache):
    batches = unique_batches(kind, 5)
    cb = None if cache is None else cache_for(cache, 2)
    ref = train_prefetch(device, cls, kw, batches, False, cb)
    got = train_prefetch(device, cls, kw, batches, True, cb)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.parametrize("waits", [True, False], ids=["update-waits", "update-beside"])
@pytest.mark.parametrize("host_ids", [False, True], ids=["gpu-ids", "host-ids"])
def test_prefetch_beside_the_steps_update_is_bit_identical(device, waits, host_ids,
                                                           slow_side_gathers, monkeypatch):
    """Prefetcher.UPDATE_WAITS off: the step after a prefetch updates and writes back its rows
    beside the prefetch's gather (held ~5 ms here, so the rows it reads were written already;
    unheld it reads them before), and the next prefetch starts while the take still patches
    rows from the write-back: bit-identical either way. On CUDA also a GPU-placed table,
    whose update writes the rows the gather reads in place."""
    from nbtools.engine.prefetch import Prefetcher
    monkeypatch.setattr(Prefetcher, "UPDATE_WAITS", waits)
    batches = unique_batches("overlap", 5)
    ref = train_prefetch(device, O.Adam, dict(lr=0.05), batches, False)
    runs = [dict(write_behind=False), dict(write_behind=True)]
    if device.type == "cuda":
        runs.append(dict(placement="gpu"))
    for run in runs:
        got = train_prefetch(device, O.Adam, dict(lr=0.05), batches, True,
                             host_ids=host_ids, **run)
        for k in ref:
            assert torch.equal(ref[k], got[k]), (run, k)


@pytest.fixture
def slow_takes(monkeypatch):
    """Every take of a prefetch held ~20 ms on the current stream before it reads anything
    (CUDA; on the CPU: no-op): the next prefetch's work on the side stream runs first."""
    from nbtools.engine.prefetch import Prefetcher
    take = Prefetcher.take

    def slow_take(self, *args, **kwargs):
        if self.table.device.type == "cuda":
            torch.cuda._sleep(40_000_000)
        return take(self, *args, **kwargs)
    monkeypatch.setattr(Prefetcher, "take", slow_take)


@pytest.mark.parametrize("run", [dict(write_behind=False), dict(write_behind=True),
                                 dict(placement="gpu")], ids=["write-through", "write-behind",
                                                              "gpu"])
def test_a_take_reads_the_last_steps_ids_before_the_next_dedup_reuses_them(device, run,
                                                                           slow_takes):
    """Host ids: a prefetch deduplicates them on its side stream at once, into a lookup
    capture released by the step before. The take before it reads that step's ids (to read
    its rows again); with the take held back, the dedup must still wait for that read
    (found on CUDA: without it, rows written by the step before came back stale)."""
    if run.get("placement") == "gpu" and device.type != "cuda":
        pytest.skip("placement='gpu' needs CUDA")
    batches = unique_batches("overlap", 12)
    ref = train_prefetch(device, O.Adam, dict(lr=0.05), batches, False)
    got = train_prefetch(device, O.Adam, dict(lr=0.05), batches, True, host_ids=True, **run)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.fixture
def slow_patches(monkeypatch):
    """Every patch from a write-back on the default stream held ~20 ms before it reads
    (CUDA; on the CPU: no-op): work on side streams runs first."""
    from nbtools.store.rows import RowStore
    patch = RowStore.patch

    def slow_patch(self, *args, **kwargs):
        if self.device.type == "cuda" and \
                torch.cuda.current_stream() == torch.cuda.default_stream():
            torch.cuda._sleep(40_000_000)
        return patch(self, *args, **kwargs)
    monkeypatch.setattr(RowStore, "patch", slow_patch)


@pytest.mark.parametrize("pattern", ["untaken", "early"])
@pytest.mark.parametrize("host_ids", [True, False], ids=["host-ids", "gpu-ids"])
def test_lookups_beside_untaken_prefetches_patch_from_the_rows_written(device, pattern,
                                                                       host_ids, slow_patches):
    """Rows written behind, prefetches no lookup takes, every main-stream patch held back:
    "untaken", every other prefetch is of ids no lookup asks for; "early", each prefetch of
    the next step's ids comes before this step's lookup (against ``prefetch``'s contract, so
    each is dropped untaken). The lookups then gather on the main stream and patch from the
    last write-back, whose ids and rows a lookup capture holds, while a prefetch's dedup or
    gather, replayed on its side stream, may reuse a capture: never that one, and never
    before the patch has read it. Bit-identical to no prefetch."""
    batches = unique_batches("overlap", 16)
    junk = unique_batches("overlap", 16, seed=5)
    place = (lambda b: b.clone()) if host_ids else (lambda b: b.to(device))
    ids = [place(b) for b in batches]
    results = []
    for prefetch in (False, True):
        table = OffloadedEmbedding(N, D, device=device, name="t", write_behind=True)
        table.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(1)))
        opt = OffloadOptimizer(O.Adam, [table], lr=0.05)
        w = torch.arange(1, D + 1, dtype=torch.float32, device=device)
        for t, b in enumerate(ids):
            if prefetch and pattern == "early" and t + 1 < len(ids):
                table.prefetch(ids[t + 1])
            rows = table(b)
            if prefetch and pattern == "untaken" and t + 1 < len(ids):
                table.prefetch(ids[t + 1] if t % 2 == 0 else place(junk[t]))
            ((rows * w).sin() + rows.pow(2)).sum().backward()
            opt.step()
            opt.zero_grad()
        results.append(final_state(table, opt))
    ref, got = results
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.parametrize("cache", [None, 16], ids=["nocache", "cache16"])
def test_prefetch_of_host_ids_is_bit_identical_to_no_prefetch(device, cache):
    """Ids handed over as host tensors: the prefetch copies and deduplicates them beside the
    last step's update, and the lookup of the same tensor takes that copy."""
    batches = unique_batches("overlap", 5)
    cb = None if cache is None else cache_for(cache, 2)
    ref = train_prefetch(device, O.Adam, dict(lr=0.05), batches, False, cb)
    got = train_prefetch(device, O.Adam, dict(lr=0.05), batches, True, cb, host_ids=True)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k


@pytest.mark.parametrize("host_ids", [False, True], ids=["gpu-ids", "host-ids"])
def test_prefetch_with_write_behind_is_bit_identical_to_writing_through(device, host_ids,
                                                                       slow_write_backs):
    """A prefetch's gather waits for the write-backs still on their way (here held ~5 ms
    each); the rows the step after it writes are taken from that step's GPU copy when the
    prefetch is taken."""
    batches = unique_batches("overlap", 5)
    ref = train_prefetch(device, O.Adam, dict(lr=0.05), batches, False, write_behind=False)
    for prefetch in (False, True):
        got = train_prefetch(device, O.Adam, dict(lr=0.05), batches, prefetch,
                             host_ids=host_ids, write_behind=True)
        for k in ref:
            assert torch.equal(ref[k], got[k]), (prefetch, k)


def test_prefetch_sees_writes_through_weight_and_ignores_other_ids(device):
    batches = unique_batches("overlap", 6)
    ref = train_prefetch(device, O.Adam, dict(lr=0.05), batches, False, write_at=2)
    got = train_prefetch(device, O.Adam, dict(lr=0.05), batches, True, write_at=2)
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    table = OffloadedEmbedding(N, D, device=device, name="t")
    with pytest.raises(ValueError, match="OffloadOptimizer"):
        table.prefetch(torch.tensor([1, 2]))
    opt = OffloadOptimizer(O.SGD, [table], lr=0.1)
    a = torch.tensor([1, 2, 3], device=table.device)
    table.prefetch(a)
    before = table.weight[[4, 5]].clone()
    # other ids: a lookup of its own
    table(torch.tensor([4, 5], device=table.device)).sum().backward()
    opt.step()
    assert torch.equal(table.weight[[4, 5]], before - 0.1)


def test_a_table_with_a_cache_and_a_pending_prefetch_copies(device):
    import copy
    import pickle
    table, opt = train(device, O.Adam, dict(lr=0.05), stream("zipf", 3), cache_rows=32)
    nxt = torch.tensor([1, 2, 3], device=table.device)
    table.prefetch(nxt)
    for clone in (copy.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert clone.lookups.prefetcher.pending is None and clone.cache.capacity == table.cache.capacity
        assert torch.equal(clone.weight.cpu(), table.weight.cpu())
