"""Offloaded tables against nn.Embedding / nn.EmbeddingBag / F.embedding, and bad input."""
import gc
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import nbtools
from nbtools import OffloadedEmbedding, OffloadedEmbeddingBag, OffloadOptimizer
from nbtools.tables import HostMemoryError
from nbtools.testing import take_grad


def test_import_is_light():
    code = ("import sys, nbtools; heavy = [m for m in ('cupy', 'ipywidgets', 'matplotlib', "
            "'pynvml', 'gdown') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_forward_matches_f_embedding(device):
    table = OffloadedEmbedding(100, 6, device=device)
    ids = torch.randint(0, 100, (4, 5, 3))
    out = table(ids)
    assert out.device.type == device.type and out.shape == (4, 5, 3, 6)
    torch.testing.assert_close(out.cpu(), F.embedding(ids, table.weight))


@pytest.mark.parametrize("dtype,state_dtype,prefetch", [
    (torch.float32, None, False), (torch.bfloat16, None, False),
    (torch.bfloat16, torch.bfloat16, False), (torch.bfloat16, None, True)],
    ids=["fp32", "bf16", "bf16-bf16state", "bf16-prefetch"])
def test_a_lookup_in_id_order_is_its_weights_upcast_and_trains_as_one(device, dtype,
                                                                      state_dtype, prefetch):
    """table(ids) takes its rows in id order straight from the gathered rows (reordered in
    their storage dtype, then upcast): bit for bit F.embedding of the weights, training or
    not, and its gradient reaches the step like an EmbeddingBag's lookup of the same ids
    (a bag of one id each: the unique-rows path; on CUDA to a bf16 rounding, where the bag's
    backward may add a repeated id's gradients in another order)."""
    torch.manual_seed(0)
    init = torch.randn(50, 8)
    ids = torch.randint(0, 50, (6, 7))
    ids[0, :3] = 4                                       # repeats
    runs = []
    for bag in (False, True):
        cls = OffloadedEmbeddingBag if bag else OffloadedEmbedding
        extra = {"mode": "sum"} if bag else {}
        table = cls(50, 8, device=device, dtype=dtype, state_dtype=state_dtype, **extra)
        with torch.no_grad():
            table.weight.copy_(init)
        opt = OffloadOptimizer(nbtools.RowWiseAdagrad, [table], lr=0.1)
        want = F.embedding(ids, table.weight.float()).to(device)
        with torch.no_grad():
            assert torch.equal(table(ids.reshape(-1, 1) if bag else ids).reshape(want.shape),
                               want)
        for step in range(3):
            if prefetch and not bag and step:
                rows = table(ids)
            elif bag:
                rows = table(ids.reshape(-1, 1)).reshape(*ids.shape, 8)
            else:
                rows = table(ids)
            if not bag:
                assert torch.equal(rows.detach(), F.embedding(ids, table.weight.float())
                                   .to(device))
            if prefetch and not bag:
                table.prefetch(ids)
            (rows * torch.arange(8.0, device=rows.device)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append(table.weight.float().cpu())
    if device.type == "cpu":
        assert torch.equal(runs[0], runs[1])
    else:     # the bag's backward may sum a repeated id's gradients in another order
        torch.testing.assert_close(runs[0], runs[1], rtol=1.6e-2, atol=1e-3)


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 49), max_size=60), dtype=st.sampled_from([torch.int32, torch.int64]))
def test_ids_property(ids, dtype):
    table = OffloadedEmbedding(50, 3, device="cpu")
    t = torch.tensor(ids, dtype=dtype)
    out = table(t)
    assert out.shape == (len(ids), 3)
    torch.testing.assert_close(out, F.embedding(t.long(), table.weight))
    if ids:
        out.sum().backward()
        got_ids, grad, _, _ = take_grad(table)
        counts = torch.bincount(t.long(), minlength=50)
        assert got_ids.tolist() == sorted(set(ids))
        torch.testing.assert_close(grad[:, 0], counts[got_ids].float())


def test_max_id_and_cpu_ids_on_any_device(device):
    table = OffloadedEmbedding(7, 2, device=device)
    out = table(torch.tensor([6, 0, 6]))         # CPU ids, whatever the compute device
    torch.testing.assert_close(out.cpu(), table.weight[[6, 0, 6]])


def test_padding_idx_matches_nn_embedding(device):
    ref = nn.Embedding(20, 4, padding_idx=3, sparse=True).to(device)
    table = OffloadedEmbedding(20, 4, padding_idx=3, device=device)
    assert (table.weight[3] == 0).all()
    table.weight.copy_(ref.weight.detach().cpu())
    opt = OffloadOptimizer(torch.optim.SGD, [table], lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ids = torch.tensor([[3, 1, 3], [2, 3, 1]], device=device)
    for m, o in ((table, opt), (ref, ref_opt)):
        out = m(ids)
        (out * torch.arange(1.0, 5.0, device=device)).sum().backward()
        o.step()
    torch.testing.assert_close(table.weight.cpu(), ref.weight.detach().cpu())
    assert (table.weight[3] == 0).all()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_bag_matches_nn_embedding_bag(mode, padding_idx, device):
    ref = nn.EmbeddingBag(30, 5, mode=mode, padding_idx=padding_idx).to(device)
    bag = OffloadedEmbeddingBag(30, 5, mode=mode, padding_idx=padding_idx, device=device)
    bag.weight.copy_(ref.weight.detach().cpu())
    padded = torch.tensor([[4, 5, 0, 0], [7, 7, 7, 1], [0, 9, 0, 0]], device=device)
    torch.testing.assert_close(bag(padded), ref(padded))
    flat = torch.tensor([4, 5, 7, 7, 7, 1, 9, 0], device=device)
    offsets = torch.tensor([0, 2, 6], device=device)
    torch.testing.assert_close(bag(flat, offsets), ref(flat, offsets))
    # gradients reach the same rows with the same values
    bag(padded).pow(2).sum().backward()
    ref(padded).pow(2).sum().backward()
    ids, grad, _, _ = take_grad(bag)
    torch.testing.assert_close(grad, ref.weight.grad[ids])
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[ids.cpu()] = False
    assert (ref.weight.grad.cpu()[untouched] == 0).all()


def test_bag_mean_divides_by_real_length():
    bag = OffloadedEmbeddingBag(10, 2, mode="mean", padding_idx=0, device="cpu")
    bag.weight.copy_(torch.arange(20.0).view(10, 2))
    bag.weight[0].zero_()
    out = bag(torch.tensor([[2, 4, 0, 0, 0]]))
    torch.testing.assert_close(out, ((bag.weight[2] + bag.weight[4]) / 2).unsqueeze(0))


def _intact(table, before):
    assert torch.equal(table.weight, before)
    table(torch.tensor([0, 1])).sum()          # still usable


def test_out_of_range_ids_raise_index_error_naming_the_table(device):
    table = OffloadedEmbedding(50, 3, device=device, name="items")
    before = table.weight.clone()
    with pytest.raises(IndexError, match=r"table 'items' has 50 rows but ids contain 53 \(first at position 2\)"):
        table(torch.tensor([1, 2, 53, 60]))
    with pytest.raises(IndexError, match=r"ids contain -1 \(first at position \(1, 0\)\)"):
        table(torch.tensor([[1, 2], [-1, 3]]))
    _intact(table, before)


def test_bad_id_types(device):
    table = OffloadedEmbedding(50, 3, device=device)
    before = table.weight.clone()
    with pytest.raises(TypeError, match="ids must be integers, got dtype torch.float32"):
        table(torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="bool"):
        table(torch.tensor([True]))
    with pytest.raises(TypeError, match="integer tensor"):
        table("abc")
    _intact(table, before)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="num_embeddings"):
        OffloadedEmbedding(0, 3)
    with pytest.raises(TypeError, match=r"embedding_dim must be a positive int, got 2.5 \(float\)"):
        OffloadedEmbedding(3, 2.5)
    with pytest.raises(ValueError, match="padding_idx=9"):
        OffloadedEmbedding(3, 2, padding_idx=9)
    with pytest.raises(TypeError, match="dtype must be torch.float32, float64, bfloat16 or float16"):
        OffloadedEmbedding(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="mode"):
        OffloadedEmbeddingBag(3, 2, mode="median")


def test_table_too_large_is_refused_before_allocating():
    gc.collect()            # an earlier test's table freed during this one would change the count
    before = nbtools.pinned_bytes()
    with pytest.raises(HostMemoryError, match=r"needs .* host memory .*nbtools.plan"):
        OffloadedEmbedding(10**12, 128, name="huge")
    assert nbtools.pinned_bytes() == before
    p = nbtools.plan(10**12, 128, "adam")
    assert not p.fits and "does NOT fit" in str(p)


def test_state_dict_holds_the_live_host_tensor():
    table = OffloadedEmbedding(10, 2, device="cpu")
    sd = table.state_dict()
    assert sd["weight"].data_ptr() == table.weight.data_ptr()
    other = OffloadedEmbedding(10, 2, device="cpu")
    other.load_state_dict(sd)
    assert torch.equal(other.weight, table.weight)
    with pytest.raises(RuntimeError, match="size mismatch"):
        OffloadedEmbedding(11, 2, device="cpu").load_state_dict(sd)
    model = nn.Sequential(table)
    model.to(torch.float64)                    # not a parameter: stays as it is
    assert table.weight.dtype == torch.float32


def test_eval_under_no_grad_records_nothing():
    table = OffloadedEmbedding(10, 2, device="cpu")
    with torch.no_grad():
        table(torch.tensor([1, 2]))
    assert take_grad(table) == (None, None, None, None)


def test_describe_and_counters():
    info = nbtools.describe(file=open("/dev/null", "w"))
    assert info["torch"] == torch.__version__
    from nbtools.rowfile import fileio
    assert info["disk_engine"] == fileio.default_engine(direct=True) and \
        info["disk_engine"] in fileio.ENGINES
    assert set(nbtools.transfer_counters()) == {"h2d_bytes", "d2h_bytes"}
    from nbtools import devices
    assert info["cores"] == devices.usable_cores()
    assert info["torch_threads"] == torch.get_num_threads()


def test_describe_says_when_the_cores_are_few(monkeypatch):
    import io
    from nbtools import devices, env
    for cores, few in ((2, True), (devices.FEW_CORES + 1, False)):
        monkeypatch.setattr(env, "usable_cores", lambda: cores)
        out = io.StringIO()
        nbtools.describe(file=out)
        line = next(x for x in out.getvalue().splitlines() if x.startswith("CPU "))
        assert f"{cores} cores for this process" in line
        assert ("read-ahead dedups on one thread" in line) == few


@pytest.mark.gpu
def test_pinned_bytes_are_counted_and_released():
    import gc
    gc.collect()                               # what earlier tests left behind goes first
    base = nbtools.pinned_bytes()
    table = OffloadedEmbedding(1000, 64, device="cuda", name="counted")
    assert table.pinned and table.transfer_mode == "zero-copy"
    assert nbtools.pinned_bytes() - base >= 1000 * 64 * 4
    opt = OffloadOptimizer(torch.optim.Adam, [table], lr=0.1)   # reallocates as [w | m | v]
    assert 3 * 1000 * 64 * 4 <= nbtools.pinned_bytes() - base < 3 * 1000 * 64 * 4 + 3 * 4096
    table.close()
    assert nbtools.pinned_bytes() == base
    other = OffloadedEmbedding(1000, 64, device="cuda", name="collected")
    assert nbtools.pinned_bytes() > base
    del other, opt
    gc.collect()
    assert nbtools.pinned_bytes() == base


def test_public_names_resolve():
    for name in nbtools.__all__:
        assert getattr(nbtools, name) is not None
    assert callable(nbtools.colab.drive_dir) and callable(nbtools.data.fetch)
