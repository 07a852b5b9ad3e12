"""OffloadedEmbedding.from_pretrained, OffloadOptimizer.load_row_state and the NumPy / CuPy views
(nbtools.pretrained).

The references are torch's own: ``nn.Embedding.from_pretrained`` for lookups (``torch.equal``),
``torch.optim.Adam`` on a dense ``nn.Embedding`` for a training step after loading, and the
source array itself for loaded optimizer state. Chunks are made tiny (``small_chunks``) so that
every source crosses many chunk boundaries; the memory bound is measured on a 156 MiB file in a
subprocess (peak RSS, reset with /proc/self/clear_refs).
"""
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import nbtools
from nbtools import OffloadedEmbedding, OffloadOptimizer, pretrained
from nbtools.devices import cuda_ok, held_host_bytes
from nbtools.pretrained import NonFiniteSourceError, as_cupy, as_numpy

N, D = 300, 16
KINDS = ["torch", "numpy", "memmap", "path"]


@pytest.fixture
def small_chunks(monkeypatch):
    """~2 KiB chunks: a 300-row source is ~10 chunks, file reads in 1 KiB requests."""
    monkeypatch.setattr(pretrained, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(pretrained, "REQUEST_BYTES", 1024)


def _weights(n=N, d=D, seed=0, dtype=torch.float32):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _source(kind: str, w: torch.Tensor, tmp_path):
    """``w`` as a source of ``kind``: the object from_pretrained is given."""
    if kind == "torch":
        return w.clone()
    if kind == "cuda":
        return w.to("cuda")
    if kind == "numpy":
        return w.numpy().copy()
    path = tmp_path / f"src-{kind}.npy"
    np.save(path, w.numpy())
    if kind == "memmap":
        return np.load(path, mmap_mode="r")
    if kind == "pathlib":
        return path
    return str(path)


def _where(placement: str, tmp_path) -> dict:
    """from_pretrained's placement arguments for ``placement`` ("host+cache": a cache of hot
    rows, made when the optimizer attaches)."""
    if placement == "disk":
        return {"placement": "disk", "disk_dir": str(tmp_path / "tables"),
                "host_cache_bytes": 64 * D * 4}
    if placement == "host+cache":
        return {"placement": "host", "cache_rows": 40}
    return {"placement": placement}


def _ids(device="cpu", n=N):
    return torch.tensor([[0, 5, 5, n - 1], [17, 0, 123, 42]], device=device)


@pytest.mark.parametrize("kind", KINDS + ["pathlib"])
@pytest.mark.parametrize("placement", ["host", "host+cache", "disk"])
def test_lookups_equal_torch_from_pretrained(kind, placement, tmp_path, small_chunks):
    w = _weights()
    table = OffloadedEmbedding.from_pretrained(_source(kind, w, tmp_path), device="cpu",
                                               **_where(placement, tmp_path))
    ref = torch.nn.Embedding.from_pretrained(w)
    assert torch.equal(table(_ids()), ref(_ids()))
    assert torch.equal(table.weight, w)
    assert (table.num_embeddings, table.embedding_dim) == (N, D)
    assert table.trainable is False              # freeze=True, as torch's default
    assert not table(_ids()).requires_grad


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS + ["cuda"])
@pytest.mark.parametrize("placement", ["gpu", "host", "host+cache", "disk"])
def test_lookups_equal_torch_from_pretrained_cuda(kind, placement, tmp_path, small_chunks):
    w = _weights()
    table = OffloadedEmbedding.from_pretrained(_source(kind, w, tmp_path), device="cuda",
                                               **_where(placement, tmp_path))
    assert table.placement == placement.split("+")[0]
    ref = torch.nn.Embedding.from_pretrained(w.cuda())
    assert torch.equal(table(_ids("cuda")), ref(_ids("cuda")))
    assert torch.equal(table.weight.cpu(), w)


def test_dtype_follows_the_source_unless_given(tmp_path, small_chunks):
    w64 = _weights(dtype=torch.float64)
    t = OffloadedEmbedding.from_pretrained(w64.numpy(), device="cpu")
    assert t.weight.dtype == torch.float64 and torch.equal(t.weight, w64)
    t = OffloadedEmbedding.from_pretrained(w64, device="cpu", dtype=torch.bfloat16)
    assert torch.equal(t.weight, w64.to(torch.bfloat16))
    # a file of float16 into a float32 table (converted chunk by chunk) and into a disk table
    w16 = _weights(dtype=torch.float16)
    path = tmp_path / "h.npy"
    np.save(path, w16.numpy())
    for where in ({"placement": "host"}, _where("disk", tmp_path)):
        t = OffloadedEmbedding.from_pretrained(path, device="cpu", dtype=torch.float32, **where)
        assert torch.equal(t.weight, w16.float())
        assert torch.equal(t(_ids()), torch.nn.Embedding.from_pretrained(w16.float())(_ids()))
    # config's dtype when a config is given and dtype is not
    t = OffloadedEmbedding.from_pretrained(w16, device="cpu",
                                           config=nbtools.TableConfig(dtype=torch.bfloat16))
    assert t.weight.dtype == torch.bfloat16


def test_unusual_layouts_and_byte_orders(tmp_path, small_chunks):
    """Views read as they are: column slices, reversed rows, Fortran order, big-endian."""
    w = _weights()
    path = tmp_path / "w.npy"
    np.save(path, w.numpy())
    mm = np.load(path, mmap_mode="r")
    wide = _weights(d=2 * D)
    np.save(tmp_path / "wide.npy", wide.numpy())
    cases = {
        "row slice of a memory map": (mm[10:200], w[10:200]),
        "column slice of a memory map": (np.load(tmp_path / "wide.npy", mmap_mode="r")[:, 3:3 + D],
                                         wide[:, 3:3 + D]),
        "reversed rows": (w.numpy()[::-1], w.flip(0)),
        "transposed (Fortran order)": (np.asfortranarray(w.numpy()), w),
        "big-endian": (w.numpy().astype(">f4"), w),
        "copy-on-write memory map": (np.load(path, mmap_mode="c"), w),
        "list of lists": (w[:5].tolist(), w[:5]),
    }
    np.save(tmp_path / "f.npy", np.asfortranarray(w.numpy()))
    cases["Fortran-order .npy file"] = (tmp_path / "f.npy", w)
    for what, (source, expect) in cases.items():
        t = OffloadedEmbedding.from_pretrained(source, device="cpu")
        assert torch.equal(t.weight, expect), what


def test_random_streams_untouched():
    before = torch.get_rng_state()
    OffloadedEmbedding.from_pretrained(_weights(), device="cpu")
    assert torch.equal(torch.get_rng_state(), before)


def test_padding_row_is_zero_like_every_offloaded_padding_row(tmp_path):
    w = _weights()
    with pytest.warns(UserWarning, match="row 5 is not zero"):
        t = OffloadedEmbedding.from_pretrained(w, device="cpu", padding_idx=5, freeze=False)
    zeroed = w.clone()
    zeroed[5] = 0
    ref = torch.nn.Embedding.from_pretrained(zeroed, padding_idx=5, freeze=False)
    assert torch.equal(t(_ids()), ref(_ids()))
    assert torch.equal(t.weight, zeroed)
    with pytest.warns(UserWarning, match="row 299 is not zero"):
        disk = OffloadedEmbedding.from_pretrained(zeroed, device="cpu", padding_idx=-1,
                                                  **_where("disk", tmp_path))
    assert disk.padding_idx == N - 1
    expect = zeroed.clone()
    expect[-1] = 0
    assert torch.equal(disk.weight, expect)


def test_embedding_bag_from_pretrained():
    w = _weights()
    bag = nbtools.OffloadedEmbeddingBag.from_pretrained(w, mode="sum", device="cpu")
    ref = torch.nn.EmbeddingBag.from_pretrained(w, mode="sum")
    assert torch.equal(bag(_ids()), ref(_ids()))


# --- training after loading ---------------------------------------------------------------------

@pytest.mark.parametrize("placement", ["host", "host+cache", "disk"])
def test_one_adam_step_after_loading_equals_torch(placement, device, tmp_path, small_chunks):
    """One step of nbtools' (lazy) Adam equals dense torch Adam on nn.Embedding.from_pretrained:
    at the first step a row with no gradient has zero moments, so dense Adam leaves it alone."""
    w = _weights()
    table = OffloadedEmbedding.from_pretrained(_source("path", w, tmp_path), freeze=False,
                                               device=device, **_where(placement, tmp_path))
    opt = OffloadOptimizer(torch.optim.Adam, table, lr=0.05)
    assert (table.cache is not None) == (placement == "host+cache")
    ref = torch.nn.Embedding.from_pretrained(w.clone().to(device), freeze=False)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.05)
    coef = torch.linspace(-1, 1, D, device=device)
    for model, o in ((table, opt), (ref, ref_opt)):
        (model(_ids(device)) * coef).sum().backward()
        o.step()
        o.zero_grad()
    got = table.weight.cpu()
    torch.testing.assert_close(got, ref.weight.detach().cpu(), rtol=1e-5, atol=2e-6)
    touched = _ids().unique()
    assert not torch.equal(got[touched], w[touched])                 # the step did something


def test_frozen_table_in_an_optimizer_warns():
    table = OffloadedEmbedding.from_pretrained(_weights(), device="cpu")
    with pytest.warns(RuntimeWarning, match="frozen"):
        OffloadOptimizer(torch.optim.SGD, table, lr=0.1)


# --- optimizer state ------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:.*more distinct rows than its RAM cache")
@pytest.mark.parametrize("placement", ["host", "disk"])
def test_loaded_adam_state_steps_like_torch_adam(placement, device, tmp_path, small_chunks):
    """Adam state loaded from arrays (one as a .npy file) then one step touching every row,
    against torch Adam with the same state set by hand."""
    w = _weights()
    gen = torch.Generator().manual_seed(3)
    m = torch.randn(N, D, generator=gen) * 0.1
    v = torch.rand(N, D, generator=gen) * 0.01
    np.save(tmp_path / "exp_avg.npy", m.numpy())
    table = OffloadedEmbedding.from_pretrained(w, freeze=False, device=device,
                                               **_where(placement, tmp_path))
    opt = OffloadOptimizer(torch.optim.Adam, table, lr=0.01)
    opt.load_row_state(table, "exp_avg", tmp_path / "exp_avg.npy", step=7)
    opt.load_row_state(table, "exp_avg_sq", v.numpy())
    assert torch.equal(opt.table_state(table)["exp_avg"].cpu(), m)
    assert torch.equal(opt.table_state(table)["exp_avg_sq"].cpu(), v)

    p = torch.nn.Parameter(w.clone())
    ref = torch.optim.Adam([p], lr=0.01)
    ref.state[p] = {"step": torch.tensor(7.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    grad = torch.randn(N, D, generator=gen)
    table(torch.arange(N, device=device)).backward(grad.to(device))
    opt.step()
    p.grad = grad
    ref.step()
    torch.testing.assert_close(table.weight.cpu(), p.detach(), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(opt.table_state(table)["exp_avg_sq"].cpu(),
                               # squares of gradients that differ in their last bits (the
                               # fused CUDA update against torch's): rtol 1.3e-5 was seen
                               ref.state[p]["exp_avg_sq"], rtol=1e-4, atol=1e-8)
    assert int(opt.state_dict()["tables"][table.name]["scalar_state"]["step"]) == 8


def test_rowwise_state_from_a_column(small_chunks):
    """RowWiseAdagrad's one-column ``sum`` from a 1-D source; one step follows its rule."""
    w = _weights()
    s = torch.rand(N) + 0.5
    table = OffloadedEmbedding.from_pretrained(w, freeze=False, device="cpu")
    opt = OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.1, eps=1e-10)
    opt.load_row_state(table, "sum", s.numpy())        # no scalar state to give
    assert torch.equal(opt.table_state(table)["sum"], s[:, None])
    ids = torch.tensor([3, 9, 9])
    g = torch.randn(3, D, generator=torch.Generator().manual_seed(5))
    table(ids).backward(g)
    opt.step()
    grad = torch.zeros(N, D).index_add_(0, ids, g)[[3, 9]]
    acc = s[[3, 9]] + grad.pow(2).mean(1)
    expect = w[[3, 9]] - 0.1 * grad / (acc.sqrt()[:, None] + 1e-10)
    torch.testing.assert_close(table.weight[[3, 9]], expect, rtol=1e-6, atol=1e-7)


def test_load_row_state_refusals(tmp_path, small_chunks):
    table = OffloadedEmbedding.from_pretrained(_weights(), freeze=False, device="cpu")
    opt = OffloadOptimizer(torch.optim.Adam, table, lr=0.01)
    m = np.zeros((N, D), np.float32)
    with pytest.raises(KeyError, match=r"\['exp_avg', 'exp_avg_sq'\], not 'momentum'"):
        opt.load_row_state(table, "momentum", m, step=1)
    with pytest.raises(ValueError, match=r"is \[300, 16\], but the source is .*\(300, 15\)"):
        opt.load_row_state(table, "exp_avg", m[:, :15], step=1)
    with pytest.raises(ValueError, match="pass step="):
        opt.load_row_state(table, "exp_avg", m)
    with pytest.raises(ValueError, match="non-negative int"):
        opt.load_row_state(table, "exp_avg", m, step=-1)
    with pytest.raises(ValueError, match=r"not \['mu'\]"):
        opt.load_row_state(table, "exp_avg", m, step=1, scalar={"mu": 1.0})
    # a NaN half way: the fresh optimizer's state is as it was (zeros), no step count set
    bad = np.ones((N, D), np.float32)
    bad[200, 3] = np.nan
    with pytest.raises(NonFiniteSourceError, match="row 200, column 3"):
        opt.load_row_state(table, "exp_avg", bad, step=1)
    assert not opt.table_state(table)["exp_avg"].any()
    assert opt.state_dict()["tables"][table.name]["scalar_state"] is None
    # state that was loaded already stays as it was: the source is checked before any write
    opt.load_row_state(table, "exp_avg", np.full((N, D), 2, np.float32), step=4)
    with pytest.raises(NonFiniteSourceError, match="row 200"):
        opt.load_row_state(table, "exp_avg", bad)
    assert (opt.table_state(table)["exp_avg"] == 2).all()


# --- bad input ------------------------------------------------------------------------------------

def _bad_sources(tmp_path):
    np.savez(tmp_path / "a.npz", w=np.ones((3, 2), np.float32))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return [
        (torch.ones(5), ValueError, r"must be 2-D .*shape \(5,\).*1-D"),
        (np.ones((2, 3, 4), np.float32), ValueError, r"must be 2-D .*shape \(2, 3, 4\)"),
        (np.ones((0, 4), np.float32), ValueError, "is empty"),
        (torch.ones(5, 3, dtype=torch.long), TypeError, r"torch\.int64 values.*floating-point"),
        (np.ones((5, 3), bool), TypeError, "bool values.*float32, float64, float16 or bfloat16"),
        (np.ones((5, 3), np.complex64), TypeError, "complex64 values"),
        (torch.ones(5, 3, device="meta"), ValueError, "meta tensor"),
        (torch.ones(5, 3).to_sparse(), TypeError, "to_dense"),
        (str(tmp_path / "missing.npy"), FileNotFoundError, "missing.npy"),
        (tmp_path / "a.npz", ValueError, r"\.npz archive \(\['w'\]\)"),
        (tmp_path / "obj.npy", ValueError, "cannot be memory-mapped"),
        ({"w": 1}, TypeError, "cannot read rows from a dict"),
        (torch.nn.Linear(2, 2), TypeError, "module.weight"),
    ]


def test_bad_sources_are_refused_clearly(tmp_path):
    for source, error, message in _bad_sources(tmp_path):
        with pytest.raises(error, match=message):
            OffloadedEmbedding.from_pretrained(source, device="cpu")


def test_shape_and_argument_checks():
    w = _weights()
    with pytest.raises(ValueError, match="num_embeddings=301 was asked for, but the source .* "
                                         "has 300 rows"):
        OffloadedEmbedding.from_pretrained(w, num_embeddings=301, device="cpu")
    with pytest.raises(ValueError, match="embedding_dim=8 .* 16 values per row"):
        OffloadedEmbedding.from_pretrained(w, embedding_dim=8, device="cpu")
    with pytest.raises(TypeError, match="max_norm.*renormalise"):
        OffloadedEmbedding.from_pretrained(w, max_norm=1.0, device="cpu")
    t = OffloadedEmbedding.from_pretrained(w, num_embeddings=N, embedding_dim=D, device="cpu")
    assert torch.equal(t.weight, w)


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_nonfinite_rows_refused_and_nothing_left_behind(placement, tmp_path, small_chunks):
    w = _weights()
    w[250, 7] = float("inf")
    w[251, 0] = float("nan")
    where = _where(placement, tmp_path)
    gc.collect()                                         # earlier tests' tables
    held = held_host_bytes()
    with pytest.raises(NonFiniteSourceError, match=r"holds inf at row 250, column 7"):
        OffloadedEmbedding.from_pretrained(_source("path", w, tmp_path), device="cpu", **where)
    assert held_host_bytes() == held                     # no table, no buffers held
    if placement == "disk":
        assert os.listdir(tmp_path / "tables") == []     # no file left
    t = OffloadedEmbedding.from_pretrained(w, device="cpu", allow_nonfinite=True, **where)
    torch.testing.assert_close(t.weight, w, rtol=0, atol=0, equal_nan=True)


def test_values_a_narrow_dtype_cannot_hold_are_refused(small_chunks):
    w = _weights(dtype=torch.float64)
    w[123, 4] = 1e6                                    # float16 tops out at 65,504
    with pytest.raises(NonFiniteSourceError, match=r"row 123, column 4 holds 1000000\.0, outside "
                                                   r"the range of torch\.float16.*float32"):
        OffloadedEmbedding.from_pretrained(w, dtype=torch.float16, device="cpu")
    t = OffloadedEmbedding.from_pretrained(w, dtype=torch.float16, device="cpu",
                                           allow_nonfinite=True)
    assert torch.isinf(t.weight[123, 4])


# --- CuPy ------------------------------------------------------------------------------------------

class _FakeCupyArray:
    """Looks like a CuPy array (its type lives in a ``cupy`` module) without CuPy."""
    shape = (3, 2)


_FakeCupyArray.__module__ = "cupy._core.core"


def test_cupy_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)          # `import cupy` raises ImportError
    with pytest.raises(ImportError, match=r'pip install cupy-cuda12x'):
        OffloadedEmbedding.from_pretrained(_FakeCupyArray(), device="cpu")
    table = OffloadedEmbedding(4, 2, device="cpu")
    with pytest.raises(ImportError, match="CuPy"):
        as_cupy(table)


def test_importing_pretrained_imports_no_cupy():
    code = ("import sys, numpy as np, nbtools\n"
            "nbtools.OffloadedEmbedding.from_pretrained(np.ones((3, 2), np.float32), device='cpu')\n"
            "print('cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("memory", ["device", "pinned"])
@pytest.mark.parametrize("placement", ["gpu", "host", "disk"])
def test_cupy_sources(memory, placement, tmp_path, small_chunks):
    """A CuPy array on the GPU, and one in pinned host memory as SpeedTorch allocates it."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda12x)")
    w = _weights()
    if memory == "pinned":
        def pinned(nbytes):                                  # SpeedTorch's PMemory allocator
            mem = cupy.cuda.PinnedMemory(nbytes)
            return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(mem.ptr, nbytes, mem), 0)
        cupy.cuda.set_allocator(pinned)
        try:
            src = cupy.asarray(w.numpy())
        finally:
            cupy.cuda.set_allocator(None)
    else:
        src = cupy.asarray(w.numpy())
    table = OffloadedEmbedding.from_pretrained(src, device="cuda", **_where(placement, tmp_path))
    assert torch.equal(table.weight.cpu(), w)
    ref = torch.nn.Embedding.from_pretrained(w.cuda())
    assert torch.equal(table(_ids("cuda")), ref(_ids("cuda")))


# --- the rows handed to NumPy and CuPy --------------------------------------------------------------

@pytest.mark.parametrize("placement", ["host", "disk"])
def test_numpy_view_writes_are_seen_by_the_table(placement, tmp_path):
    table = OffloadedEmbedding.from_pretrained(_weights(), device="cpu", freeze=False,
                                               **_where(placement, tmp_path))
    OffloadOptimizer(torch.optim.Adam, table, lr=0.1)       # rows [weight | state]: strided
    view = as_numpy(table)
    if placement == "host":                   # (a disk table's file is mapped afresh each time)
        assert np.shares_memory(view, np.asarray(table.weight))     # torch's own route: no copy
    view[7] = 3.0
    assert torch.equal(table(torch.tensor([7, 7])), torch.full((2, D), 3.0))
    ro = as_numpy(table, writable=False)
    with pytest.raises(ValueError, match="read-only"):
        ro[0] = 1.0


def test_numpy_view_refusals():
    bf16 = OffloadedEmbedding(4, 2, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16.*view\\(torch.int16\\)"):
        as_numpy(bf16)


@pytest.mark.gpu
def test_gpu_and_pinned_tables_as_cupy_share_memory(tmp_path):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed (pip install cupy-cuda12x)")
    w = _weights()
    for placement in ("gpu", "host"):
        table = OffloadedEmbedding.from_pretrained(w, device="cuda", placement=placement)
        arr = as_cupy(table)
        arr[7] = 3.0
        cupy.cuda.get_current_stream().synchronize()
        assert torch.equal(table(torch.tensor([7], device="cuda")).cpu(), torch.full((1, D), 3.0))
    gpu = OffloadedEmbedding.from_pretrained(w, device="cuda", placement="gpu")
    with pytest.raises(TypeError, match="GPU memory, which NumPy cannot address"):
        as_numpy(gpu)
    disk = OffloadedEmbedding.from_pretrained(w, device="cuda", **_where("disk", tmp_path))
    with pytest.raises(TypeError, match="file on disk"):
        as_cupy(disk)


# --- memory ------------------------------------------------------------------------------------------

_RSS_SCRIPT = textwrap.dedent("""
    import gc, re, sys, numpy as np
    from nbtools import OffloadedEmbedding

    def status(key):
        return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) << 10

    path, small, folder = sys.argv[1:4]
    for placement in ("host", "disk"):
        kw = dict(device="cpu", placement=placement, disk_dir=folder, progress=False)
        OffloadedEmbedding.from_pretrained(small, **kw).close()   # libraries, pools, first pages
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                          # VmHWM := VmRSS
        base = status("VmRSS")
        table = OffloadedEmbedding.from_pretrained(path, **kw)
        print(placement, status("VmHWM") - base, table.ram_bytes, table.nbytes,
              float(table.weight[-1, -1]))
        table.close()
        del table
""")


def test_memory_mapped_file_streams_with_bounded_memory(tmp_path):
    """A 156 MiB .npy file (~10x the chunk size) into a host and a disk table: peak RSS grows
    by the table's RAM and at most 64 MiB more. (Reading it through the memory map adds the
    whole file: 156 MiB more, measured.)"""
    rows, dim = 320_000, 128
    big = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.float32,
                                    shape=(rows, dim))
    for a in range(0, rows, 64_000):
        big[a:a + 64_000] = np.arange(a * dim, (a + 64_000) * dim, dtype=np.float32).reshape(
            -1, dim)
    big.flush()
    expect_last = float(big[-1, -1])
    del big
    np.save(tmp_path / "small.npy", np.ones((1000, dim), np.float32))
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(tmp_path / "big.npy"),
                          str(tmp_path / "small.npy"), str(tmp_path / "tables")],
                         capture_output=True, text=True, timeout=300)
    if "clear_refs" in out.stderr:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    assert out.returncode == 0, out.stderr
    for line in out.stdout.splitlines():
        placement, growth, ram, nbytes, last = line.split()
        growth, ram, nbytes = int(growth), int(ram), int(nbytes)
        assert nbytes == rows * dim * 4
        assert float(last) == expect_last
        assert growth <= ram + pretrained.EXTRA_BYTES, (placement, growth, ram)
        if placement == "disk":
            assert ram < 16 << 20                # the file holds the rows: RAM holds its maps


def test_progress_bar(capsys):
    pytest.importorskip("tqdm")
    OffloadedEmbedding.from_pretrained(_weights(), device="cpu", name="vecs", progress=True)
    assert "loading 'vecs'" in capsys.readouterr().err
