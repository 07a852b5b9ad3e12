"""PinnedLoader: order, completeness, resume, transforms, errors; on the CPU and on CUDA."""
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from nbtools import hostmem, loader as loader_mod
from nbtools.hostmem import whole_range_pinned
from nbtools.loader import (GOLDEN, LoaderConfig, PinnedLoader, mix_, mix_int, permutation,
                            signed64)

# the `device` fixture holds no state, so reusing it across hypothesis examples is fine
_settings = settings(max_examples=25, deadline=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])


def _dataset(n):
    """Tensors of several dtypes and shapes whose rows all say which sample they are."""
    ids = torch.arange(n, dtype=torch.int64)
    images = (ids.view(n, 1, 1) + torch.arange(16).view(1, 4, 4)).to(torch.uint8)   # 16-byte rows
    odd = (ids.view(n, 1, 1) * 0.5 + torch.arange(15).view(1, 3, 5)).to(torch.float16)  # 30-byte rows
    pairs = torch.stack([ids, -ids], 1).to(torch.int32)
    flags = ids % 3 == 0
    return ids, images, odd, pairs, flags


def _cpu_reference(loader, tensors, epoch):
    """The batches of `epoch`, built on the CPU from the loader's permutation."""
    perm = loader.permutation(epoch)
    nb, bs = len(loader), loader.batch_size
    return [tuple(t[perm[b * bs:(b + 1) * bs]] for t in tensors) for b in range(nb)]


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert len(g) == len(w)
        for a, b in zip(g, w):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.cpu(), b)


@_settings
@given(n=st.integers(0, 300), batch_size=st.integers(1, 70), shuffle=st.booleans(),
       drop_last=st.booleans(), seed=st.integers(-2**63, 2**64 - 1))
def test_every_sample_once_per_epoch(device, n, batch_size, shuffle, drop_last, seed):
    ids = torch.arange(n)
    x = ids.float().view(n, 1).repeat(1, 3)
    loader = PinnedLoader(ids, x, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                          device=device, seed=seed)
    for epoch in range(2):
        seen = []
        for b_ids, b_x in loader:
            assert b_ids.device.type == device.type and len(b_ids) <= batch_size
            assert torch.equal(b_x[:, 0].long(), b_ids)      # rows of both tensors stay together
            seen.append(b_ids.cpu())
        seen = torch.cat(seen) if seen else torch.empty(0, dtype=torch.int64)
        assert len(seen) == len(set(seen.tolist()))            # no sample twice
        full = n if not drop_last else (n // batch_size) * batch_size
        assert len(seen) == full                              # every sample (but a dropped tail)
        if not shuffle:
            assert seen.tolist() == list(range(full))
        assert loader.epoch == epoch + 1 and loader.position == 0
    assert len(loader) == (n // batch_size if drop_last else -(-n // batch_size))


@pytest.mark.parametrize("n, batch_size", [(103, 16), (3 * 4096 + 777, 4096 + 5)],
                         ids=["small", "address-order"])   # the second sorts each batch on CUDA
def test_batches_match_cpu_reference(device, n, batch_size):
    tensors = _dataset(n)
    loader = PinnedLoader(*tensors, batch_size=batch_size, device=device, seed=7)
    for epoch in range(3):
        want = _cpu_reference(loader, tensors, epoch)
        _assert_same(list(loader), want)
    assert not torch.equal(loader.permutation(0), loader.permutation(1))


@pytest.mark.parametrize("drop_last", [False, True])
def test_address_order_of_every_chunk(device, monkeypatch, drop_last):
    """Chunks are read in increasing id order and put back in the epoch's order, slab by slab."""
    monkeypatch.setattr(loader_mod, "CHUNK_ROWS", 1400)              # 2 batches per chunk
    monkeypatch.setattr(loader_mod, "SLAB_ROWS", 3 * 1400)           # 3 chunks per slab
    loader = PinnedLoader(torch.arange(10_007), batch_size=700, device=device, seed=3,
                          drop_last=drop_last)
    assert loader.chunk_batches == 2
    nb = len(loader)
    with pytest.raises(RuntimeError, match="start a loop first"):
        loader.address_order(0)
    next(iter(loader))                       # makes the streams and epoch 0's order
    perm = loader.permutation(0, device)
    ends = []
    for c in list(range(-(-nb // 2))) + [0]:                         # and back to the first slab
        (lo, hi), ids, places = loader.address_order(c)
        ends.append(hi)
        ids, places = ids.long(), places.long()
        assert torch.equal(ids, torch.sort(perm[lo:hi]).values)
        assert torch.equal(torch.empty_like(ids).index_copy_(0, places, ids), perm[lo:hi])
    assert ends[-2] == (nb * 700 if drop_last else 10_007)        # the last chunk is partial


def test_permutation_same_on_every_device(device):
    for n, seed, epoch in [(1, 0, 0), (1000, 0, 0), (1000, 0, 1), (4097, -5, 3), (4097, 2**64 - 1, 9)]:
        p = permutation(n, seed, epoch, device)
        assert p.device.type == device.type and p.dtype == torch.int64
        assert torch.equal(p.cpu(), permutation(n, seed, epoch))
        assert torch.equal(p.sort().values.cpu(), torch.arange(n))


def test_permutation_depends_on_seed_and_epoch():
    base = permutation(500, 0, 0)
    assert not torch.equal(base, permutation(500, 0, 1))
    assert not torch.equal(base, permutation(500, 1, 0))
    assert torch.equal(base, permutation(500, 0, 0))
    # a fair shuffle: each sample lands in the first half about half of the time
    first_half = torch.stack([permutation(100, 3, e)[:50] for e in range(400)])
    freq = torch.bincount(first_half.flatten().long(), minlength=100) / 400
    assert 0.38 < freq.min() and freq.max() < 0.62


# The published SplitMix64 outputs (Vigna's splitmix64.c; Rosetta Code, "Pseudo-random
# numbers/Splitmix64"): output k of the generator seeded with s is mix(s + k * golden).
SPLITMIX_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                    4593380528125082431, 16408922859458223821]
SPLITMIX_0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]


def test_splitmix_gives_the_published_outputs(device):
    for seed, want in ((1234567, SPLITMIX_1234567), (0, SPLITMIX_0)):
        states = [(seed + k * GOLDEN) % 2**64 for k in range(1, len(want) + 1)]
        assert [mix_int(s) for s in states] == want
        got = mix_(torch.tensor([signed64(s) for s in states], dtype=torch.int64, device=device))
        assert got.cpu().tolist() == [signed64(w) for w in want]


def test_splitmix_matches_python_reference(device):
    rng = np.random.default_rng(0)
    vals = [int(v) for v in rng.integers(-2**63, 2**63 - 1, size=2000, dtype=np.int64)]
    vals += [0, 1, -1, 2**63 - 1, -2**63]
    got = mix_(torch.tensor(vals, dtype=torch.int64, device=device)).cpu().tolist()
    assert got == [signed64(mix_int(v)) for v in vals]


@_settings
@given(n=st.integers(1, 120), batch_size=st.integers(1, 40), stop=st.integers(0, 12),
       drop_last=st.booleans())
def test_resume_continues_the_same_sequence(device, n, batch_size, stop, drop_last):
    ids = torch.arange(n)

    def stream(loader, count):
        out = []
        while len(out) < count:
            before = len(out)
            for (b,) in loader:
                out.append(b.cpu())
                if len(out) == count:
                    break
            if len(out) == before:          # drop_last with n < batch_size: nothing per epoch
                break
        return out

    whole = stream(PinnedLoader(ids, batch_size=batch_size, drop_last=drop_last, device=device,
                                seed=11), stop + 8)
    first = PinnedLoader(ids, batch_size=batch_size, drop_last=drop_last, device=device, seed=11)
    head = stream(first, stop)
    state = first.state_dict()
    assert set(state) >= {"seed", "epoch", "position", "batch_size"}
    resumed = PinnedLoader(ids, batch_size=batch_size, drop_last=drop_last, device=device, seed=99)
    resumed.load_state_dict(state)              # the saved seed wins
    tail = stream(resumed, len(whole) - len(head))
    assert [t.tolist() for t in head + tail] == [t.tolist() for t in whole]


def test_state_saved_in_the_last_batch_resumes_at_next_epoch(device):
    ids = torch.arange(10)
    loader = PinnedLoader(ids, batch_size=4, device=device, seed=1)
    for _ in loader:
        state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 3)
    resumed = PinnedLoader(ids, batch_size=4, device=device)
    resumed.load_state_dict(state)
    got = [b.cpu() for (b,) in resumed]
    assert resumed.epoch == 2
    _assert_same([(b,) for b in got], _cpu_reference(loader, (ids,), 1))


def test_breaking_out_continues_where_it_stopped(device):
    ids = torch.arange(50)
    loader = PinnedLoader(ids, batch_size=8, device=device)
    first = next(iter(loader))[0].cpu()
    rest = [b.cpu() for (b,) in loader]
    assert torch.equal(torch.cat([first, *rest]), loader.permutation(0))
    loader.set_epoch(5)
    assert torch.equal(torch.cat([b.cpu() for (b,) in loader]), loader.permutation(5))


def test_transform_runs_on_the_device_batch(device):
    images, labels = _dataset(40)[1], torch.arange(40)
    seen = []

    def normalise(x, y):
        seen.append((x.device.type, y.device.type))
        return {"x": x.float() / 255, "y": y, "neg": torch.randint(0, 40, y.shape, device=y.device)}

    loader = PinnedLoader(images, labels, batch_size=16, transform=normalise, device=device)
    batches = list(loader)
    assert seen == [(device.type, device.type)] * 3
    ref = _cpu_reference(loader, (images, labels), 0)
    for got, (x, y) in zip(batches, ref):
        assert got["x"].device.type == device.type and got["x"].dtype == torch.float32
        # the same gathered bytes; the division itself may differ by an ulp on the GPU
        torch.testing.assert_close(got["x"].cpu(), x.float() / 255)
        assert torch.equal(got["y"].cpu(), y)


def test_contiguous_cpu_tensors_are_not_copied(device):
    n = 2**16 + 3                                        # 1 MiB and more: pinned in place
    x = torch.randn(n, 4)
    view_t = torch.arange(2 * n).view(2, n).t()          # non-contiguous: one host copy
    loader = PinnedLoader(x, view_t, batch_size=4096, device=device)
    assert loader.tensors[0].data_ptr() == x.data_ptr()
    assert loader.tensors[1].is_contiguous() and torch.equal(loader.tensors[1], view_t)
    _assert_same(list(loader), _cpu_reference(loader, (x, view_t.contiguous()), 0))


def test_empty_rows_and_empty_dataset(device):
    loader = PinnedLoader(torch.zeros(5, 0), torch.arange(5), batch_size=2, device=device)
    shapes = [tuple(a.shape) for a, _ in loader]
    assert shapes == [(2, 0), (2, 0), (1, 0)]
    empty = PinnedLoader(torch.zeros(0, 3), batch_size=4, device=device)
    assert len(empty) == 0 and list(empty) == [] and empty.epoch == 1


def test_transfer_counted_on_cuda_only(device):
    x, y = torch.zeros(64, 8), torch.zeros(64, dtype=torch.int64)
    before = hostmem.transfer_counters()["h2d_bytes"]
    list(PinnedLoader(x, y, batch_size=10, device=device))
    moved = hostmem.transfer_counters()["h2d_bytes"] - before
    assert moved == (64 * (8 * 4 + 8) if device.type == "cuda" else 0)


def test_second_loop_invalidates_the_first(device):
    loader = PinnedLoader(torch.arange(20), batch_size=4, device=device)
    old = iter(loader)
    next(old)
    assert len(list(loader)) == 4             # continues the epoch from position 1
    with pytest.raises(RuntimeError, match="iterated again"):
        next(old)


def test_progress_bar(device, capsys):
    loader = PinnedLoader(torch.arange(20), batch_size=4, device=device, progress=True)
    assert len(list(loader)) == 5
    assert "epoch 0" in capsys.readouterr().err


def test_import_stays_light():
    # torch itself imports plain tqdm; the notebook flavour (and ipywidgets) must wait for progress=True
    code = "import sys, nbtools.loader; print('tqdm.auto' in sys.modules or 'ipywidgets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_repr_and_len():
    loader = PinnedLoader(torch.zeros(10, 28, 28, dtype=torch.uint8), torch.zeros(10),
                          batch_size=3, drop_last=True, device="cpu")
    assert len(loader) == 3
    assert "(10, 28, 28) uint8" in repr(loader) and "position=0/3" in repr(loader)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((torch.zeros(5), torch.zeros(6)), {"batch_size": 2}, ValueError, r"same first dimension.*\(5,\), \(6,\)"),
    ((torch.zeros(5),), {"batch_size": 0}, ValueError, "batch_size must be positive, got 0"),
    ((torch.zeros(5),), {"batch_size": -3}, ValueError, "batch_size must be positive, got -3"),
    ((torch.zeros(5),), {"batch_size": 2.0}, TypeError, "batch_size must be an int"),
    (([1, 2, 3],), {"batch_size": 2}, TypeError, "argument 0 is a builtins.list.*torch.as_tensor"),
    ((torch.zeros(3), np.zeros(3)), {"batch_size": 2}, TypeError, "argument 1 is a numpy.ndarray.*from_numpy"),
    ((), {"batch_size": 2}, TypeError, "at least one tensor"),
    ((torch.tensor(1.0),), {"batch_size": 2}, ValueError, "0-dim"),
    ((torch.zeros(3),), {"batch_size": 2, "transform": 5}, TypeError, "transform must be callable"),
    ((torch.zeros(3),), {"batch_size": 2, "seed": "a"}, TypeError, "seed must be an int"),
    ((torch.zeros(3),), {"batch_size": 2, "device": "tpu"}, (ValueError, RuntimeError), "tpu"),
])
def test_bad_input_raises_clear_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        PinnedLoader(*args, **kwargs)


def test_settings_by_name_or_in_a_config_give_the_same_loader():
    x = torch.arange(23)
    named = PinnedLoader(x, batch_size=5, device="cpu", shuffle=True, drop_last=True, seed=4)
    cfg = PinnedLoader(x, batch_size=5, device="cpu",
                       config=LoaderConfig(shuffle=True, drop_last=True, seed=4))
    over = PinnedLoader(x, batch_size=5, device="cpu", config=LoaderConfig(seed=9), seed=4,
                        drop_last=True)
    batches = [[b.tolist() for (b,) in loader] for loader in (named, cfg, over)]
    assert batches[0] == batches[1] == batches[2] and len(batches[0]) == 4
    assert sorted(sum(batches[0], [])) != list(range(20))     # shuffled, last 3 dropped
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['shufle'\]"):
        PinnedLoader(x, batch_size=5, shufle=False)


def test_bad_state_raises_clear_errors():
    loader = PinnedLoader(torch.zeros(10), batch_size=2, device="cpu")
    with pytest.raises(ValueError, match=r"batch_size=4 \(this loader: 2\)"):
        loader.load_state_dict({**loader.state_dict(), "batch_size": 4})
    with pytest.raises(ValueError, match="outside 0..5"):
        loader.load_state_dict({**loader.state_dict(), "position": 6})
    with pytest.raises(KeyError, match="missing"):
        loader.load_state_dict({"epoch": 1})


# --- CUDA only: pinning and placement ---------------------------------------------------------

@pytest.mark.gpu
def test_cuda_pins_in_place_and_copies_gpu_input():
    x = torch.arange(2**20, dtype=torch.float32).view(2**18, 4)
    g = torch.arange(2**18, device="cuda")
    loader = PinnedLoader(x, g, batch_size=8192, device="cuda")
    assert x.is_pinned() and loader.tensors[0].data_ptr() == x.data_ptr()
    assert loader.tensors[1].device.type == "cpu" and whole_range_pinned(loader.tensors[1])
    for bx, bg in loader:
        assert torch.equal(bx[:, 0].long() // 4, bg)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_two_loaders_share_one_tensor():
    x = torch.arange(2**18, dtype=torch.int64)           # 2 MiB: pinned in place
    a = PinnedLoader(x, batch_size=8192, device="cuda")
    b = PinnedLoader(x, batch_size=8192, device="cuda", seed=3)
    a.close()
    del a
    assert x.is_pinned() and ("loader[0]", x.nbytes) in hostmem.pinned_regions()   # b holds it
    got = torch.cat([t for (t,) in b]).cpu()
    assert torch.equal(got, b.permutation(0))
    already = torch.arange(100).pin_memory()   # pinned by torch: aliased, not registered again
    c = PinnedLoader(already, batch_size=30, device="cuda")
    assert torch.equal(torch.cat([t for (t,) in c]).cpu(), c.permutation(0))


def test_consumer_may_write_into_its_batches(device):
    tensors = _dataset(90)
    loader = PinnedLoader(*tensors, batch_size=8, device=device, seed=4)
    want = _cpu_reference(loader, tensors, 0)
    got = []
    for batch in loader:
        got.append(tuple(t.clone() for t in batch))
        for t in batch:
            t.zero_()                          # the model scribbles on its input
    _assert_same(got, want)


def _slow_copy(*batch):
    torch.cuda._sleep(1_000_000)              # a transform slower than the gather
    return tuple(t.clone() for t in batch)


@pytest.mark.gpu
@pytest.mark.parametrize("transform", [None, _slow_copy, lambda *batch: batch],
                         ids=["no-transform", "slow-transform", "identity-transform"])
@pytest.mark.parametrize("batch_size", [32, 5000], ids=["chunked", "one-per-gather"])
def test_cuda_batches_survive_a_slow_consumer(transform, batch_size, monkeypatch):
    """A batch dropped while the consumer's stream still reads it must not be reused by the
    loader's streams too early (record_stream), nor read before it is gathered or transformed
    (events), whether batches come several per chunk or one per gather."""
    if batch_size > 1000:
        monkeypatch.setattr(loader_mod, "CHUNK_ROWS", 1)    # one batch per chunk (sorted)
    tensors = _dataset(600 if batch_size < 100 else 4 * batch_size + 123)
    loader = PinnedLoader(*tensors, batch_size=batch_size, device="cuda", seed=2,
                          transform=transform)
    assert (loader.chunk_batches == 1) == (batch_size > 1000)
    want = _cpu_reference(loader, tensors, 0)
    got = []
    for batch in loader:
        torch.cuda._sleep(2_000_000)          # the consumer's stream lags far behind
        got.append(tuple(t.clone() for t in batch))
        del batch
    torch.cuda.synchronize()
    _assert_same(got, want)


@pytest.mark.gpu
def test_cuda_falls_back_when_pinning_is_refused(monkeypatch):
    def refuse(*a, **k):
        raise hostmem.PinningError("cudaHostRegister failed (test)")
    monkeypatch.setattr(hostmem, "pin_tensor", refuse)
    tensors = _dataset(70)
    with pytest.warns(UserWarning, match="same batches, slower"):
        loader = PinnedLoader(*tensors, batch_size=16, device="cuda", seed=5)
    _assert_same(list(loader), _cpu_reference(loader, tensors, 0))


@pytest.mark.gpu
def test_cuda_dropping_a_loader_mid_epoch_is_safe():
    """The pinned memory is unregistered and freed only after the side stream's last gathers,
    and all of it is handed back: the count returns to where it started."""
    import gc
    gc.collect()
    base = hostmem.pinned_bytes()
    for i in range(4):
        x = torch.randn(2**18, 8)                  # 8 MiB: pinned in place
        small = torch.arange(2**18) % 7            # 2 MiB, also in place
        loader = PinnedLoader(x, small, torch.zeros(2**18, 3, dtype=torch.uint8), batch_size=4096,
                              device="cuda", transform=lambda a, b, c: (a * 2, b, c))
        it = iter(loader)
        next(it), next(it)
        if i % 2:
            loader.close()
        del it, loader, x, small
    torch.cuda.synchronize()
    gc.collect()
    assert hostmem.pinned_bytes() == base
