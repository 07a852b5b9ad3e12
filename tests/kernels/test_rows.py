"""A lookup's row copies (nbtools.kernels: gather_rows, put_rows, take_rows and the views they
take of the rows) against torch's indexing, bit for bit. On the CPU they run in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
import pytest
import torch

from nbtools import kernels

needs_triton = pytest.mark.skipif(not kernels.usable_on(torch.device("cpu")) and not
                                  torch.cuda.is_available(), reason="Triton is not installed")


@needs_triton
def test_gather_kernel_reads_only_live_rows():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    src = torch.arange(6 * 5, dtype=torch.float32, device=device).view(6, 5)
    ids = torch.tensor([4, 1, 6, 0, 2], device=device)          # 6 is the sentinel
    out = torch.full((5, 3), -1.0, device=device)
    kernels.gather_rows(src, ids, torch.tensor([3], device=device), out, col0=2)
    expect = torch.tensor([[22, 23, 24], [7, 8, 9], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
                          dtype=torch.float32)
    assert torch.equal(out.cpu(), expect)


@needs_triton
@pytest.mark.parametrize("programs", [None, 1, 3])
@pytest.mark.parametrize("keep", [False, True])
def test_gather_kernel_capped_grid_and_keep(programs, keep):
    """A capped grid (each program looping over blocks of rows) reads the same rows;
    ``keep`` leaves the rows it does not read as they were instead of zeroing them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(500, 7, generator=gen).to(device)
    ids = torch.cat([torch.randperm(500, generator=gen)[:300], torch.full((40,), 500)]).to(device)
    ids[::7] = 500                                   # the sentinel, amid the live rows too
    count = torch.tensor([320], device=device)
    before = torch.randn(340, 7, generator=gen).to(device)
    out = kernels.gather_rows(src, ids, count, before.clone(), programs=programs, keep=keep)
    read = (torch.arange(340, device=device) < 320) & (ids < 500)
    expect = torch.where(read.unsqueeze(1), src[ids.clamp(max=499)],
                         before if keep else torch.zeros_like(before))
    assert torch.equal(out, expect)


@needs_triton
@pytest.mark.parametrize("dtype,width,cols", [(torch.bfloat16, 12, None), (torch.bfloat16, 7, None),
                                              (torch.bfloat16, 12, (2, 10)),
                                              (torch.float32, 6, None)])
@pytest.mark.parametrize("programs", [None, 2])
def test_put_kernel_writes_live_rows_bit_exact(dtype, width, cols, programs):
    """put_rows writes row r to dst[ids[r]] for r < count and ids in range, bit for bit (2-byte
    rows go as 4-byte words where they can: even widths; an odd width or a column slice of
    odd offset stays 2-byte), and nothing else."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(1)
    dst_full = torch.randn(60, width, generator=gen).to(dtype).to(device)
    dst = dst_full if cols is None else dst_full[:, cols[0]:cols[1]]
    src = torch.randn(25, dst.shape[1], generator=gen).to(dtype).to(device)
    src.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[0, 0] = -1  # a NaN pattern
    ids = torch.randperm(60, generator=gen)[:25].to(device)
    ids[3] = 60                                      # the sentinel: not written
    count = torch.tensor([20], device=device)
    want = dst_full.clone()
    wview = want if cols is None else want[:, cols[0]:cols[1]]
    live = torch.arange(25, device=device)[:20]
    live = live[ids[:20] < 60]
    wview[ids[live]] = src[live]
    kernels.put_rows(dst, ids, count, src, programs=programs)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(dst_full.view(bits), want.view(bits))


def test_row_copies_see_rows_as_vectors_where_the_row_stride_allows():
    """Row copies see rows as the first of int32 / int16 whose row stride is a multiple of 16
    values (Triton's wide loads), with their column offsets and counts in it; else as they
    are (a write-back: 2-byte rows as 4-byte words where it can)."""
    f32, bf16 = torch.float32, torch.bfloat16
    (v,), cols = kernels.as_vectors([torch.zeros(4, 72)], (0, 64))      # 288-byte rows
    assert v.dtype == torch.int16 and v.stride(0) == 144 and cols == (0, 128)
    (v,), cols = kernels.as_vectors([torch.zeros(4, 384)], (2, 10))     # 1,536-byte rows
    assert v.dtype == torch.int32 and cols == (2, 10)
    (v,), _ = kernels.as_vectors([torch.zeros(4, 144, dtype=bf16)])
    assert v.dtype == torch.int16
    (v,), cols = kernels.as_vectors([torch.zeros(4, 300)], (0, 100))    # 1,200 bytes: neither
    assert v.dtype == f32 and cols == (0, 100)
    (v,), _ = kernels.as_vectors([torch.zeros(4, 100, dtype=bf16)])
    assert v.dtype == bf16
    (v,), _ = kernels.as_vectors([torch.zeros(4, 100, dtype=bf16)], kind="put")
    assert v.dtype == torch.int32 and v.shape == (4, 50)
    (v,), cols = kernels.as_vectors([torch.zeros(4, 72)], (1, 3))       # odd columns: int16
    assert v.dtype == torch.int16 and cols == (2, 6)
    a, b = torch.zeros(4, 72), torch.zeros(4, 72, dtype=torch.int32)     # mixed dtypes: as is
    assert kernels.as_vectors([a, b])[0][0] is a
    assert kernels.as_vectors([torch.zeros(4, 72), torch.zeros(4, 75)])[0][0].dtype == f32


@needs_triton
@pytest.mark.parametrize("dtype,width,col0,cols", [
    (torch.float32, 72, 0, 72),       # 288-byte rows (bf16 RowWiseAdagrad): as int16
    (torch.float32, 72, 0, 64),       # their packed weights alone
    (torch.float32, 136, 0, 136),     # 544-byte rows (fp32 RowWiseAdagrad): as int16
    (torch.bfloat16, 144, 0, 144),    # 288-byte rows of bf16 values
    (torch.float32, 72, 1, 3),        # a slice at an odd column
    (torch.float32, 75, 0, 75)])      # no vector view: as they are
def test_gather_and_put_move_every_bit_whatever_view_they_take(dtype, width, col0, cols):
    """The gather and the write-back move rows bit for bit (NaN payloads included) however
    they see them (:func:`nbtools.kernels.as_vectors`), against torch's indexing."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(3)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    info = torch.iinfo(bits)
    src = torch.randint(info.min, info.max, (90, width), generator=gen, dtype=bits)
    src = src.view(dtype).to(device)
    ids = torch.cat([torch.randperm(90, generator=gen)[:40], torch.full((8,), 90)]).to(device)
    ids[5] = 90                                      # the sentinel amid the live rows
    count = torch.tensor([44], device=device)
    out = kernels.gather_rows(src, ids, count, torch.empty(48, cols, dtype=dtype,
                                                           device=device), col0=col0)
    read = (torch.arange(48, device=device) < 44) & (ids < 90)
    want = src[ids.clamp(max=89), col0:col0 + cols].view(bits)
    want = torch.where(read.unsqueeze(1), want, torch.zeros_like(want))
    assert torch.equal(out.view(bits), want)
    if col0 == 0 and cols == width:                  # the write-back of whole rows
        dst = torch.zeros(90, width, dtype=dtype, device=device)
        kernels.put_rows(dst, ids, count, out)
        expect = torch.zeros(90, width, dtype=bits, device=device)
        live = torch.nonzero(read).flatten()
        expect[ids[live]] = out.view(bits)[live]
        assert torch.equal(dst.view(bits), expect)


@needs_triton
@pytest.mark.parametrize("dtype,width,cols", [
    (torch.bfloat16, 144, 128),        # bf16 weights of 288-byte rows
    (torch.float16, 40, 16),           # a narrower slice of narrower rows
    (torch.bfloat16, 9, 9)])           # an odd width, no vectors
def test_take_rows_is_index_select_then_upcast(dtype, width, cols):
    """A lookup's rows in id order, reordered and upcast in one kernel
    (:func:`nbtools.kernels.take_rows`): bit for bit torch's index_select and ``.float()`` of
    the strided weights, NaN and inf included, repeats and an empty lookup too."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(5)
    rows = (torch.randn(70, width, generator=gen) * 1e3).to(dtype).to(device)
    rows[3, 0], rows[4, 1], rows[5, 2] = float("nan"), float("inf"), -float("inf")
    src = rows[:, :cols]                                 # a view: row stride `width`
    idx = torch.cat([torch.randint(0, 70, (300,), generator=gen),
                     torch.tensor([3, 4, 5, 3, 69, 0])]).to(device)
    got = kernels.take_rows(src, idx, torch.float32)
    want = src.index_select(0, idx).float()
    assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert kernels.take_rows(src, idx[:0], torch.float32).shape == (0, cols)
