"""ShardedEmbedding against the single-process table, over gloo with 2 and 3 processes.

Reference: one OffloadedEmbedding (same initial rows, same optimizer) trained on the concatenation
of every rank's batch, with the global loss = the sum of the ranks' losses. Each rank computes the
reference itself (the batches are drawn from seeds every rank knows) and compares it with the
gathered sharded table and per-row optimizer state. Every multi-process test runs under a
timeout: a hang fails the test and kills the processes it started.

Starting the processes is most of the cost (each imports torch), so on the CPU every check
runs in one start of 3 processes (``on_ranks``): those of 2 processes on two of them in a
default group of 2, then those of 3 in a default group of 3. Every check's traceback comes back
to its own test.
"""
import traceback

import pytest
import torch
import torch.distributed as dist

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.devices import cuda_ok
from nbtools.distributed import ShardedEmbedding, restore_sharded, save_sharded, spawn

# CUDA compute too where there is a GPU (every rank on the same one)
DEVICES = ["cpu", "cuda"] if cuda_ok() else ["cpu"]
ROWS, DIM, STEPS = 23, 4, 4
O = torch.optim
# (optimizer, hyper-parameters, table options)
CASES = [
    (O.Adam, dict(lr=0.05), {}),
    (O.SGD, dict(lr=0.1, momentum=0.9), {}),
    (O.Adagrad, dict(lr=0.1), dict(padding_idx=5)),
]


def _run(fn, world: int, args=(), timeout: float = 40.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; a hang fails the test within
    ``timeout`` s."""
    try:
        return spawn(fn, world, args=args, timeout=timeout)
    except TimeoutError as e:
        pytest.fail(str(e))


def _batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ids at ``step``: duplicates, ids of every owner, a 2-D shape on rank 0,
    no ids at all on rank 1 at step 1, at step 2 only ids that rank 0 owns (multiples of 6)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if rank == 1 and step == 1:
        return torch.zeros(0, dtype=torch.long)
    if step == 2:
        return torch.tensor([0, 6, 6, 12, 18])[rank:]
    ids = torch.randint(0, ROWS, (6 + 2 * rank,), generator=g)
    ids = torch.cat((ids, torch.tensor([7, 7, 5, ROWS - 1])))   # 7 is wanted by every rank
    return ids.view(2, -1) if rank == 0 else ids


def _target(step: int, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + 1000 * step + rank)
    return torch.randn(*shape, DIM, generator=g)


def _loss(out, step, rank):
    # not linear in the rows: the gradient depends on the rows each step
    return ((out - _target(step, rank, out.shape[:-1]).to(out.device)) ** 2).sum()


def _train_worker(rank, world, device):
    if device == "cuda:rank":               # NCCL: one GPU a rank
        device = f"cuda:{rank}"
    for cls, hyper, options in CASES:
        torch.manual_seed(0)
        ref = OffloadedEmbedding(ROWS, DIM, device=device, name="t", **options)
        sharded = ShardedEmbedding(ROWS, DIM, device=device, name="t", **options)
        sharded.load_full_weight(ref.weight)
        ref_opt = OffloadOptimizer(cls, ref, **hyper)
        opt = OffloadOptimizer(cls, sharded, **hyper)
        # the optimizer finds the local shard, and nothing else
        assert opt.tables == {"t": sharded.shard}
        assert sharded.shard.num_embeddings == len(range(rank, ROWS, world))
        for step in range(STEPS):
            batches = [_batch(step, r) for r in range(world)]
            out = ref(torch.cat([b.reshape(-1) for b in batches]))
            parts = [part.view(*b.shape, DIM)
                     for part, b in zip(out.split([b.numel() for b in batches]), batches)]
            total = sum(_loss(part, step, r) for r, part in enumerate(parts))
            expected = parts[rank].detach().clone()
            total.backward()
            ref_opt.step()
            ref_opt.zero_grad()

            mine = sharded(batches[rank])
            torch.testing.assert_close(mine.detach(), expected, rtol=1e-5, atol=1e-6)
            _loss(mine, step, rank).backward()
            opt.step()
            opt.zero_grad()
        what = f"{cls.__name__} {hyper} {options} on rank {rank} of {world}"
        torch.testing.assert_close(sharded.gather_full(), ref.weight.cpu(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{what}: weights differ: {m}")
        assert sharded.shard.state_names == ref.state_names
        for name in ref.state_names:
            torch.testing.assert_close(sharded.gather_full(name), ref.state_columns(name).cpu(),
                                       rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what}: state {name} differs: {m}")


def _checks(rank, world, directory):
    """Every CPU check of this file for ``world`` processes, in order, on the default group:
    ``{check: (its return value, None) or (None, the traceback of its failure)}``."""
    out = {}
    for name, check in CHECKS[world]:
        try:
            out[name] = (check(rank, world, directory), None)
        except Exception:               # the next checks still run; the test of this one fails
            out[name] = (None, traceback.format_exc())
    return out


def _checks_worker(rank, world, directory):
    """On 3 processes: the checks of 2 processes on ranks 0 and 1 in a default group of their
    own (rank 2 waits), then those of 3 in a new default group of all three; one start of
    the processes (each imports torch: most of the cost) for both. ``{2: _checks(...) (ranks
    0 and 1), 3: _checks(...)}``."""
    import datetime
    import socket

    assert world == 3
    ports = [None, None]
    if rank == 0:                        # two ports free at once, for the groups of 2 and 3
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            b.bind(("127.0.0.1", 0))
            ports = [a.getsockname()[1], b.getsockname()[1]]
    dist.broadcast_object_list(ports, src=0)
    dist.destroy_process_group()
    out = {}
    for size, port in zip((2, 3), ports):
        if rank < size:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=size, timeout=datetime.timedelta(seconds=90))
            out[size] = _checks(rank, size, directory)
            if size < 3:
                dist.destroy_process_group()
    return out                           # the group of 3 is left to spawn, which ends it


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def on_ranks(sharded_dir):
    """``{world: [each rank's _checks result]}``: the checks of 2 processes (the checkpoint
    among them is saved there), then those of 3, by one group of 3 processes."""
    done = _run(_checks_worker, 3, args=(sharded_dir,), timeout=150.0)
    return {world: [d[world] for d in done[:world]] for world in (2, 3)}


def _passed(on_ranks, world, check) -> list:
    """The check's return value on each rank, in rank order; fails with the ranks' tracebacks."""
    failures = [f"rank {r}:\n{done[check][1]}" for r, done in enumerate(on_ranks[world])
                if done[check][1]]
    assert not failures, f"{check} on {world} processes failed:\n" + "\n".join(failures)
    return [done[check][0] for done in on_ranks[world]]


@pytest.mark.slow                   # starts processes (each imports torch)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_single_process_table(world, device, request):
    """Where there is a CUDA GPU also with CUDA compute: the gloo group exchanges through the
    CPU."""
    if device == "cpu":
        _passed(request.getfixturevalue("on_ranks"), world, "train")
    else:
        _run(_train_worker, world, args=(device,), timeout=120.0)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(n, marks=pytest.mark.gpus(n)) for n in (2, 4)])
def test_nccl_matches_single_process_table(world):
    """One rank a GPU over NCCL (2 and 4 CUDA GPUs): the same checks."""
    try:
        spawn(_train_worker, world, args=("cuda:rank",), timeout=240.0, backend="nccl")
    except TimeoutError as e:
        pytest.fail(str(e))


def _lookup_worker(rank, world):
    """The forward, no optimizer: every rank reads the rows it asked for, in its own order."""
    full = torch.arange(ROWS * DIM, dtype=torch.float32).view(ROWS, DIM)
    table = ShardedEmbedding(ROWS, DIM, device="cpu")
    table.load_full_weight(full)
    for step in range(2):
        ids = _batch(step, rank)
        torch.testing.assert_close(table(ids), full[ids])
    return table.shard.num_embeddings
    with torch.no_grad():
        ids = torch.tensor([[ROWS - 1, 0]])
        torch.testing.assert_close(table(ids), full[ids])
    return table.shard.num_embeddings


@pytest.mark.slow                   # starts processes (each imports torch)
def test_lookup_returns_rows_in_callers_order(on_ranks):
    # spawn hands back each rank's return value, in rank order: here the size of its shard
    assert _passed(on_ranks, 3, "lookup") == [8, 8, 7]


def _bad_id_worker(rank, world):
    table = ShardedEmbedding(ROWS, DIM, device="cpu", name="t")
    opt = OffloadOptimizer(O.Adam, table, lr=0.1)
    table(_batch(0, rank)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = [table.gather_full(), table.gather_full("exp_avg"), table.gather_full("exp_avg_sq")]
    ids = torch.tensor([[1, 2], [ROWS, 3]]) if rank == 1 else torch.tensor([4, 4, 0])
    try:
        table(ids)
    except IndexError as e:
        text = str(e)
    else:
        raise AssertionError(f"rank {rank}: no IndexError for an out-of-range id on rank 1")
    expected = f"ids contain {ROWS} (first at position (1, 0))" if rank == 1 else "rank(s) [1]"
    assert expected in text, text
    opt.step()                                  # nothing pending: nothing changes
    after = [table.gather_full(), table.gather_full("exp_avg"), table.gather_full("exp_avg_sq")]
    for b, a in zip(before, after):
        assert torch.equal(b, a), f"rank {rank}: a table changed after the bad lookup"
    # the ranks are still in step: a good lookup and step work afterwards
    table(_batch(1, rank)).sum().backward()
    opt.step()
    assert not torch.equal(table.gather_full(), before[0])


@pytest.mark.slow                   # starts processes (each imports torch)
def test_out_of_range_id_raises_on_every_rank(on_ranks):
    _passed(on_ranks, 2, "bad id")


def test_single_process_is_an_offloaded_embedding():
    """No process group: the same ids, optimizer and seed give the same table as an
    OffloadedEmbedding."""
    assert not dist.is_initialized()
    torch.manual_seed(3)
    ref = OffloadedEmbedding(ROWS, DIM, device="cpu", name="t", padding_idx=2)
    torch.manual_seed(3)
    sharded = ShardedEmbedding(ROWS, DIM, device="cpu", name="t", padding_idx=2)
    assert sharded.world == 1 and torch.equal(sharded.weight, ref.weight)
    opts = [OffloadOptimizer(O.Adam, t, lr=0.1) for t in (ref, sharded)]
    for step in range(2):
        ids = _batch(step, 0)
        for t, opt in zip((ref, sharded), opts):
            _loss(t(ids), step, 0).backward()
            opt.step()
    assert torch.equal(sharded.weight, ref.weight)
    assert torch.equal(sharded.shard.state_columns("exp_avg"), ref.state_columns("exp_avg"))
    with pytest.raises(IndexError, match="has 23 rows"):
        with torch.no_grad():
            sharded(torch.tensor([ROWS]))


# --- checkpoints: saved on 2 ranks, restored onto 1, 2 and 3 ---------------------------------
def _global_batch(step: int):
    """The step's ids and targets for all ranks together; rank r of M takes positions r::M."""
    g = torch.Generator().manual_seed(50 + step)
    return torch.randint(0, ROWS, (15,), generator=g), torch.randn(15, DIM, generator=g)


def _initial_rows():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(11))


def _train_steps(table, opt, steps, rank, world):
    for step in steps:
        ids, target = _global_batch(step)
        ((table(ids[rank::world]) - target[rank::world]) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()


def _save_worker(rank, world, directory):
    table = ShardedEmbedding(ROWS, DIM, device="cpu", name="t")
    table.load_full_weight(_initial_rows())
    opt = OffloadOptimizer(O.Adam, table, lr=0.05)
    _train_steps(table, opt, [0, 1], rank, world)
    save_sharded(directory, 2, table, opt)


def _restore_worker(rank, world, directory):
    """Restore (the table starts from other rows), take step 2, compare with one process that
    took steps 0, 1, 2 without stopping."""
    table = ShardedEmbedding(ROWS, DIM, device="cpu", name="t")
    opt = OffloadOptimizer(O.Adam, table, lr=0.05)
    assert restore_sharded(directory, table, opt) == 2
    _train_steps(table, opt, [2], rank, world)
    ref = OffloadedEmbedding(ROWS, DIM, device="cpu", name="t")
    ref.weight.copy_(_initial_rows())
    ref_opt = OffloadOptimizer(O.Adam, ref, lr=0.05)
    _train_steps(ref, ref_opt, [0, 1, 2], 0, 1)
    torch.testing.assert_close(table.gather_full(), ref.weight, rtol=1e-5, atol=1e-6)
    for name in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(table.gather_full(name), ref.state_columns(name), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"state {name}: {m}")


@pytest.mark.slow                   # starts processes (each imports torch)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_checkpoint_restores_onto_any_number_of_ranks(on_ranks, sharded_dir, world):
    _passed(on_ranks, 2, "save")
    if world == 1:              # one process, no process group at all
        _restore_worker(0, 1, sharded_dir)
    else:                       # restored in new objects (by the same processes, for 2)
        _passed(on_ranks, world, "restore")


# The CPU checks run by each group of processes (on_ranks), in this order.
CHECKS = {
    2: [("train", lambda rank, world, d: _train_worker(rank, world, "cpu")),
        ("bad id", lambda rank, world, d: _bad_id_worker(rank, world)),
        ("save", _save_worker),
        ("restore", _restore_worker)],
    3: [("train", lambda rank, world, d: _train_worker(rank, world, "cpu")),
        ("lookup", lambda rank, world, d: _lookup_worker(rank, world)),
        ("restore", _restore_worker)],
}


def test_restore_without_checkpoint_returns_none(tmp_path):
    table = ShardedEmbedding(ROWS, DIM, device="cpu", name="t")
    assert restore_sharded(tmp_path, table, OffloadOptimizer(O.Adam, table, lr=0.1)) is None
