"""Bit-for-bit reproducibility (issue 24): two identical runs, a run saved and resumed into a fresh
model, and a run with one inf/nan step skipped all end equal (``torch.equal``, no tolerance) to
their references, for every placement and option.

The model: two tables, one of them looked up twice per step, a Linear head, Adam through
:class:`~nbtools.OffloadOptimizer`; its ids alternate between uniform and Zipf(1.1) draws, so
many ids repeat within a lookup (on CUDA the hottest id of a Zipf batch repeats hundreds of
times: its gradient rows span many of :func:`nbtools.kernels.segment_sum`'s chunks). Those
repeats are what an atomic ``index_add_`` would sum in a different order on every run: the
CUDA versions of these tests (``gpu``-marked parameters) fail without the fixed-order sums
(6e-8 apart after 60 steps, issue 24). On the CPU every sum already runs in a fixed order, so
there they guard the rest: the checkpoint carrying everything a step depends on (stochastic
rounding's seeds included), a skipped step leaving no trace (a cache's admissions, a
prefetch), and the same ids taking the same path.
"""
import os

# cuBLAS needs a fixed workspace under torch.use_deterministic_algorithms (torch refuses the
# Linear head otherwise); read when cuBLAS first runs, so set before any test does.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch
from torch import nn

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.checkpoint import CheckpointConfig, CheckpointManager
from nbtools.devices import cuda_ok
from nbtools.optim import OffloadConfig
from nbtools.store.rows import sum_by_slot, unique_ids
from nbtools.testing import take_grad

GPU = pytest.mark.gpu
CUDA = [pytest.param("cuda", marks=GPU)]

# (table options, OffloadConfig options, prefetch) per placement. The CPU runs fused kernels
# in Triton's interpreter only where an option needs them (write-behind).
KINDS = {
    "host": (dict(placement="host"), {}, False),
    "gpu": (dict(placement="gpu"), {}, False),
    "cache": (dict(placement="host", cache_rows=64), {}, False),
    "write_behind": (dict(placement="host", write_behind=True), dict(fused=True), False),
    "prefetch": (dict(placement="host"), {}, True),
    "bf16": (dict(placement="host", dtype=torch.bfloat16, state_dtype=torch.bfloat16,
                  rounding="stochastic"), {}, False),
}
CPU_KINDS = ["host", "cache", "write_behind", "prefetch", "bf16"]
# every kind on CUDA, with the lookups' and steps' CUDA graphs on and off. A case's tests share
# a pytest-xdist worker (tests/conftest.py: GROUPS), and so its uninterrupted run.
CASES = [pytest.param("cpu", k, True, id=f"cpu-{k}") for k in CPU_KINDS] + \
    [pytest.param("cuda", k, g, id=f"cuda-{k}-{'graphs' if g else 'eager'}", marks=GPU)
     for k in KINDS for g in (True, False)]

ROWS_A, ROWS_B, DIM = 300, 200, 8


def sizes(device: str) -> tuple[int, int]:
    """(ids per lookup, steps): small on the CPU; on CUDA the issue's 60 steps, with batches
    whose hottest Zipf ids repeat across many segment_sum chunks. On the CPU (Triton's
    interpreter: a cache or write-behind step ~0.05-0.1 s) 10 steps of 128 ids: a cache of 64
    rows has evicted ~40-50 rows of each table before the resume at step 5 and ~15-25 more
    after it."""
    return (4096, 60) if device == "cuda" else (128, 10)


def draw(n: int, rows: int, zipf: bool, gen: torch.Generator) -> torch.Tensor:
    if not zipf:
        return torch.randint(0, rows, (n,), generator=gen)
    p = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** 1.1
    return torch.multinomial(p, n, replacement=True, generator=gen)


def make_batches(device: str, steps: int | None = None, seed: int = 5) -> list:
    """Per step: ids of table a, two lookups of table b, targets; even steps uniform, odd Zipf."""
    n, default_steps = sizes(device)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps or default_steps):
        z = t % 2 == 1
        out.append(tuple(x.to(device) for x in (
            draw(n, ROWS_A, z, gen), draw(n, ROWS_B, z, gen), draw(n // 2, ROWS_B, z, gen),
            torch.randn(n, generator=gen))))
    return out


class TwoTables(nn.Module):
    """Table ``a``, table ``b`` looked up twice (the second lookup's rows pooled in pairs), and
    a Linear head on the three."""

    def __init__(self, device, init_seed=0, **table_kw):
        super().__init__()
        self.a = OffloadedEmbedding(ROWS_A, DIM, device=device, name="a", **table_kw)
        self.b = OffloadedEmbedding(ROWS_B, DIM, device=device, name="b", **table_kw)
        self.head = nn.Linear(3 * DIM, 1)
        gen = torch.Generator().manual_seed(init_seed)
        with torch.no_grad():
            self.a.weight.copy_(torch.randn(ROWS_A, DIM, generator=gen))
            self.b.weight.copy_(torch.randn(ROWS_B, DIM, generator=gen))
            self.head.weight.copy_(torch.randn(1, 3 * DIM, generator=gen) * 0.3)
            self.head.bias.zero_()
        self.head.to(device)


def build(device, kind, graphs=True, init_seed=0, **config):
    table_kw, opt_kw, prefetch = KINDS[kind]
    model = TwoTables(device, init_seed, cuda_graphs=graphs, **table_kw)
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.02,
                           config=OffloadConfig(**{"nonfinite": "skip", **opt_kw, **config}))
    if torch.device(device).type == "cpu":
        for table in (model.a, model.b):   # the cache's torch code (the same decisions as its
            if table.cache is not None:    # kernels, which Triton's interpreter runs slowly)
                table.cache.use_kernels = False
    return model, opt, prefetch


def step(model, opt, batch, after=None, poison=False):
    """One training step; ``after``: the next step's batch (its ids are prefetched);
    ``poison``: table a's gradient turns nan (the step must be skipped)."""
    ia, ib, ib2, y = batch
    xa, xb, xb2 = model.a(ia), model.b(ib), model.b(ib2)
    if after is not None:
        model.a.prefetch(after[0])
        model.b.prefetch(after[1])
    if poison:
        xa.register_hook(lambda g: g * float("nan"))
    pooled = xb2.repeat_interleave(2, 0)
    pred = model.head(torch.cat((xa, xb, pooled), 1)).squeeze(1)
    ((pred - y).square().mean()).backward()
    opt.step()
    opt.zero_grad()


def train(model, opt, prefetch, batches, start=0, stop=None, poison_at=None):
    stop = len(batches) if stop is None else stop
    for t in range(start, stop):
        after = batches[t + 1] if prefetch and t + 1 < stop else None
        step(model, opt, batches[t], after, poison=t == poison_at)


def final(model, opt) -> dict:
    """Everything the run ends with, on the CPU: both tables, their Adam state, the head."""
    opt.synchronize()
    out = {f"{name}.weight": t.weight.detach().cpu().clone()
           for name, t in (("a", model.a), ("b", model.b))}
    for name in ("a", "b"):
        for key, value in opt.table_state(name).items():
            out[f"{name}.{key}"] = value.detach().cpu().clone()
    for key, value in model.head.state_dict().items():
        out[f"head.{key}"] = value.cpu().clone()
    return out


def assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        same = torch.equal(got[key], want[key])
        diff = (got[key].float() - want[key].float()).abs().max().item() if not same else 0
        assert same, f"{key} differs by up to {diff:.3g}"


def run(device, kind, graphs, batches, **config):
    model, opt, prefetch = build(device, kind, graphs, **config)
    train(model, opt, prefetch, batches)
    return final(model, opt)


_UNINTERRUPTED: dict = {}


def uninterrupted(device, kind, graphs) -> dict:
    """``run`` on ``make_batches(device)``: the run a case's tests compare with, trained once
    per process (on the CPU, Triton's interpreter makes a cache or write-behind run seconds
    long). The tests of identical and resumed runs still train their own runs against it."""
    key = (device, kind, graphs)
    if key not in _UNINTERRUPTED:
        _UNINTERRUPTED[key] = run(device, kind, graphs, make_batches(device))
    return _UNINTERRUPTED[key]


# --- the three guarantees, for every placement and option --------------------------------------
@pytest.mark.parametrize("device,kind,graphs", CASES)
def test_identical_runs_end_bit_identical(device, kind, graphs):
    batches = make_batches(device)
    assert_equal(run(device, kind, graphs, batches), uninterrupted(device, kind, graphs))


@pytest.mark.parametrize("device,kind,graphs", CASES)
def test_resumed_run_ends_bit_identical_to_the_uninterrupted_one(device, kind, graphs, tmp_path):
    batches = make_batches(device)
    k = len(batches) // 2
    want = uninterrupted(device, kind, graphs)
    model, opt, prefetch = build(device, kind, graphs)
    train(model, opt, prefetch, batches, stop=k)
    ck = CheckpointManager(tmp_path, config=CheckpointConfig(verbose=False, progress=False))
    ck.save(k, model=model, opt=opt)
    del model, opt
    # a fresh model from other initial values: the checkpoint must restore every bit that counts
    model, opt, prefetch = build(device, kind, graphs, init_seed=99)
    assert ck.restore(model=model, opt=opt) == k
    train(model, opt, prefetch, batches, start=k)
    assert_equal(final(model, opt), want)


@pytest.mark.parametrize("device,kind,graphs", CASES)
def test_skipped_nonfinite_step_leaves_no_trace(device, kind, graphs):
    """A run whose step ``k`` had a nan gradient (skipped whole, OffloadConfig(nonfinite=
    "skip")) ends as a run that never had that step, though the skipped step's lookups were
    deduplicated, admitted to the cache and prefetched."""
    batches = make_batches(device)
    k = len(batches) // 3
    want = run(device, kind, graphs, batches[:k] + batches[k + 1:])
    model, opt, prefetch = build(device, kind, graphs)
    with pytest.warns(RuntimeWarning, match="skipped an optimizer step"):
        train(model, opt, prefetch, batches, poison_at=k)
    assert opt.skipped_steps() == 1
    assert_equal(final(model, opt), want)


@pytest.mark.parametrize("device,kind", [("cpu", "cache"), ("cpu", "prefetch")] + [
    pytest.param("cuda", k, marks=GPU) for k in ("gpu", "cache", "write_behind", "prefetch")])
def test_placements_end_bit_identical_to_the_host_placement(device, kind):
    """Where rows live and how they travel changes no bit: the same kernels on the same
    values (on the CPU, write-behind takes the fused kernels and host tables the stock
    optimizer, which round differently; on CUDA both are fused)."""
    assert_equal(uninterrupted(device, kind, True), uninterrupted(device, "host", True))


@pytest.mark.parametrize("device", ["cpu"] + CUDA)
@pytest.mark.parametrize("kind", ["host", "gpu"])
def test_identical_runs_under_torch_deterministic_algorithms(device, kind):
    """Nothing in a step is refused by torch's deterministic mode (which also fills new
    memory with nan, so a buffer read before it is written would show), and runs under it
    end as runs without it: nbtools' sums are fixed-order by construction, not because of
    the mode."""
    if kind == "gpu" and device == "cpu":
        pytest.skip("placement='gpu' needs CUDA")
    batches = make_batches(device)
    plain = run(device, kind, True, batches)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        strict = [run(device, kind, True, batches) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert_equal(strict[0], strict[1])
    assert_equal(strict[0], plain)


@GPU
def test_cuda_lookup_gradient_is_summed_in_a_fixed_order():
    """On CUDA the sum of a lookup's gradient rows per id gives the same bits every time, and
    the right sums (against index_add_ in float64); so does a training lookup's gradient."""
    gen = torch.Generator().manual_seed(3)
    flat = draw(1 << 16, 5000, True, gen).cuda()
    batch = unique_ids(flat, 5000)
    up = torch.randn(flat.numel(), 16, device="cuda")
    grads = [sum_by_slot(up, batch) for _ in range(5)]
    assert all(torch.equal(g, grads[0]) for g in grads)
    want = torch.zeros(batch.capacity, 16, dtype=torch.float64, device="cuda")
    want.index_add_(0, batch.inverse, up.double())
    torch.testing.assert_close(grads[0].double(), want, rtol=1e-5, atol=1e-4)
    # without the sort the deduplication made (a batch made elsewhere): the same sums
    bare = type(batch)(batch.ids, batch.inverse, batch.meta, batch.num_rows)
    assert torch.equal(sum_by_slot(up, bare), grads[0])


@pytest.mark.parametrize("device", ["cpu"] + CUDA)
def test_lookup_gradient_is_its_rows_summed_per_id(device):
    """A training lookup's gradient reaches the optimizer summed per unique id: each id's
    gradient rows added up (fixed order on CUDA), equal to index_add_ in float64 and the same
    bits on every backward; a lookup used twice in the loss gets both uses' gradients."""
    gen = torch.Generator().manual_seed(5)
    flat = draw(4096, 300, True, gen).to(device)
    up = torch.randn(flat.numel(), 8, generator=gen).to(device)
    table = OffloadedEmbedding(300, 8, placement="host" if device == "cpu" else "gpu",
                               device=device)
    opt = OffloadOptimizer(torch.optim.Adam, [table], lr=0.1)
    got = []
    for _ in range(3):
        out = table(flat)
        ((out * up).sum() + out.sum()).backward()
        got.append(take_grad(table)[:2])
        opt.zero_grad()
    ids, grad = got[0]
    assert all(torch.equal(g, grad) and torch.equal(i, ids) for i, g in got)
    want = torch.zeros(300, 8, dtype=torch.float64, device=device)
    want.index_add_(0, flat, up.double() + 1)
    assert torch.equal(ids, torch.unique(flat))
    torch.testing.assert_close(grad.double(), want[ids], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", ["cpu"] + CUDA)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_gradients_are_fixed_order_and_right(mode, device):
    """OffloadedEmbeddingBag's per-id gradients: the same bits on every backward (torch's max
    backward adds with atomics on CUDA; here each id's row is summed in a fixed order), and
    equal to nn.EmbeddingBag's in float64."""
    from nbtools import OffloadedEmbeddingBag

    gen = torch.Generator().manual_seed(4)
    bag = OffloadedEmbeddingBag(500, 16, mode=mode, padding_idx=0, device=device, name="bag")
    with torch.no_grad():
        bag.weight.copy_(torch.randn(500, 16, generator=gen))
    ids = draw(2048 * 8, 500, True, gen).view(2048, 8)
    w = torch.randn(2048, 16, generator=gen)
    got = []
    for _ in range(3):
        (bag(ids.to(device)) * w.to(device)).sum().backward()
        uniq, grad, _, _ = take_grad(bag)
        got.append((uniq.cpu(), grad.cpu()))
    assert all(torch.equal(g[0], got[0][0]) and torch.equal(g[1], got[0][1]) for g in got)
    ref = nn.EmbeddingBag.from_pretrained(bag.weight.detach().cpu().double(), freeze=False,
                                          mode=mode, padding_idx=0)
    (ref(ids) * w.double()).sum().backward()
    torch.testing.assert_close(got[0][1].double(), ref.weight.grad[got[0][0]],
                               rtol=1e-5, atol=1e-5)


# --- the models' own training loops -----------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu"] + CUDA)
def test_word2vec_identical_runs(device):
    from nbtools.models import CorpusLoader, SkipGram, SkipGramConfig
    from nbtools.models import train as train_loop

    gen = torch.Generator().manual_seed(11)
    tokens = draw(6000, 400, True, gen)
    counts = torch.bincount(tokens, minlength=400)

    def once():
        model = SkipGram(400, 16, counts=counts, device=device,
                         config=SkipGramConfig(seed=2, placement="host"))
        loader = CorpusLoader(tokens, batch_size=1024, window=3, seed=1, device=device)
        opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.02)
        train_loop(model, loader, opt, epochs=1, progress=False)
        opt.synchronize()
        return {k: v.cpu().clone() for k, v in
                (("input", model.input.weight), ("output", model.output.weight))}

    assert_equal(once(), once())


@pytest.mark.parametrize("device", ["cpu"] + CUDA)
def test_recommender_identical_runs(device):
    from nbtools.models import MatrixFactorization, MFConfig, SyntheticConfig, fit, make_synthetic

    data = make_synthetic(SyntheticConfig(num_users=80, num_items=60, per_user=12, rank=4))

    def once():
        model = MatrixFactorization(80, 60, 8, device=device, config=MFConfig(
            loss="bce", negatives=4, mlp_hidden=(8,), sampling="popularity"))
        fit(model, data.ratings, epochs=2, batch_size=128)
        out = {k: v.cpu().clone() for k, v in model.state_dict().items()
               if isinstance(v, torch.Tensor)}
        out.update({"users": model.users.weight.cpu().clone(),
                    "items": model.items.weight.cpu().clone()})
        return out

    assert_equal(once(), once())


@GPU
@pytest.mark.skipif(not cuda_ok(), reason="needs CUDA")
def test_random_ops_work_after_a_failed_capture():
    """A capture that fails (here: a host sync inside it) leaves torch's CUDA generator marked
    as capturing; nbtools' capture fallbacks call after_failed_capture, after which random ops
    work and draw what they would have drawn (seed and offset kept)."""
    from nbtools.devices import after_failed_capture
    torch.manual_seed(7)
    expected = torch.randn(4, device="cuda")
    torch.manual_seed(7)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            with pytest.raises(RuntimeError):
                torch.ones(2, device="cuda").sum().item()      # a sync: invalidates the capture
        finally:
            with pytest.raises(RuntimeError):
                graph.capture_end()
    after_failed_capture()
    torch.cuda.synchronize()
    assert torch.equal(torch.randn(4, device="cuda"), expected)
