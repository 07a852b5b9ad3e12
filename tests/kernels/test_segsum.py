"""The fixed-order sum of each id's gradient rows (nbtools.kernels.segment_sum) against
index_add_, and its non-finite flag. On the CPU it runs in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU)."""
import pytest
import torch

from nbtools import kernels
from nbtools.devices import cuda_ok
from nbtools.store.rows import unique_ids


def _integer_rows(n: int, d: int, gen) -> torch.Tensor:
    """Small whole numbers: every order of summing them gives the same exact float."""
    return torch.randint(-8, 9, (n, d), generator=gen).float()


@pytest.mark.skipif(not kernels.usable_on(torch.device("cpu")) and not cuda_ok(),
                    reason="Triton is not installed")
@pytest.mark.parametrize("ids", [
    "uniform", "one-run", "runs-at-chunk-edges", "run-of-two-rounds", "strided"])
def test_segment_sum_matches_index_add(ids):
    """kernels.segment_sum against index_add_ (exact on whole numbers), with runs inside a
    chunk, runs ending at and crossing chunk edges, one run over every chunk, a run long
    enough for two rounds of the second pass, and a column-major source."""
    device = torch.device("cuda" if cuda_ok() else "cpu")
    gen = torch.Generator().manual_seed(7)
    c = kernels.SEGMENT_CHUNK
    flat = {"uniform": lambda: torch.randint(0, 40, (150,), generator=gen),
            "one-run": lambda: torch.full((3 * c + 5,), 3),
            "runs-at-chunk-edges": lambda: torch.repeat_interleave(
                torch.arange(6), torch.tensor([c, 1, c - 1, 2 * c, 3, c + 1])),
            "run-of-two-rounds": lambda: torch.cat((
                torch.full((c * kernels.SEGMENT_PARTS + 2 * c,), 1), torch.tensor([0, 2, 2]))),
            "strided": lambda: torch.randint(0, 9, (100,), generator=gen)}[ids]()
    flat = flat[torch.randperm(flat.numel(), generator=gen)].to(device)
    batch = unique_ids(flat, 50)
    d = 5
    src = _integer_rows(flat.numel(), d, gen).to(device)
    if ids == "strided":
        src = src.t().contiguous().t()
    want = torch.zeros(batch.capacity, d, device=device).index_add_(0, batch.inverse, src)
    got = kernels.segment_sum(src, batch.order, batch.slot,       # any contents: all written
                              torch.full((batch.capacity, d), float("nan"), device=device))
    assert torch.equal(got, want)


@pytest.mark.skipif(not kernels.usable_on(torch.device("cpu")) and not cuda_ok(),
                    reason="Triton is not installed")
@pytest.mark.parametrize("case", ["finite", "nan-in-a-chunk", "inf-in-a-long-run",
                                  "inf-minus-inf", "overflow-in-a-chunk",
                                  "overflow-across-chunks", "already-found"])
def test_segment_sum_flags_the_sums_that_are_not_finite(case):
    """segment_sum's ``found`` (the step's inf/nan check, made as the sums are written) is
    1.0 exactly where a written sum is inf or nan: a nan or inf term inside one chunk or in a
    run over many (the second pass adds those), inf + -inf, finite terms that overflow in
    one chunk or only once the chunks' pieces are added; it is never cleared, and the sums
    are index_add_'s either way."""
    device = torch.device("cuda" if cuda_ok() else "cpu")
    gen = torch.Generator().manual_seed(11)
    c = kernels.SEGMENT_CHUNK
    flat = torch.cat([torch.arange(20), torch.full((3 * c,), 20),     # a run over 4 chunks
                      torch.arange(21, 30).repeat_interleave(2)])      # runs of two
    pair = 20 + 3 * c                                     # the first position of id 21
    src = _integer_rows(flat.numel(), 4, gen)
    big = 3e38
    if case == "nan-in-a-chunk":
        src[5, 1] = float("nan")
    elif case == "inf-in-a-long-run":
        src[20 + 2 * c + 3, 0] = float("inf")             # in the run of id 20, third chunk
    elif case == "inf-minus-inf":
        src[pair + 2, 2], src[pair + 3, 2] = float("inf"), -float("inf")     # id 22
    elif case == "overflow-in-a-chunk":
        src[pair + 4, 3] = src[pair + 5, 3] = big         # id 23's two terms, one chunk
    elif case == "overflow-across-chunks":
        src[20 + c + 1, 3] = src[20 + 2 * c + 1, 3] = big   # one term in each of two chunks
    batch = unique_ids(flat.to(device), 50)     # sorted already: positions stay in place
    src = src.to(device)
    want = torch.zeros(batch.capacity, 4, device=device).index_add_(0, batch.inverse, src)
    found = torch.full((1,), 1.0 if case == "already-found" else 0.0, device=device)
    got = kernels.segment_sum(src, batch.order, batch.slot,
                              torch.full((batch.capacity, 4), float("nan"), device=device),
                              found)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    bad = not bool(torch.isfinite(want).all())
    assert bad == (case not in ("finite", "already-found"))
    assert found.item() == (1.0 if bad or case == "already-found" else 0.0)
