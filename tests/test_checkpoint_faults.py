"""Fault tests: SIGKILL at random points of save(), a disk that fills up, damaged files.

The saving process is a child forked from a forkserver that has torch and nbtools imported
already, so each of the many kills costs milliseconds, not an interpreter start.
"""
import multiprocessing as mp
import os
import random
import signal
import subprocess
import time
import warnings

import pytest
import torch

from nbtools.checkpoint import CheckpointConfig, CheckpointManager, CheckpointSpaceError
from nbtools.devices import cuda_ok

KILLS = int(os.environ.get("NBTOOLS_CKPT_KILLS", "25"))
# Tiny chunks and files: a save is dozens of writes and several fsyncs, so kills land inside it.
CONFIG = CheckpointConfig(chunk_bytes=4096, file_bytes=8192, verbose=False, progress=False)


def expected(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(48, 64, generator=g), "b": torch.randn(2500, generator=g),
            "ids": torch.randint(0, 10**9, (777,), generator=g), "step": step}


def _saver(directory: str, conn) -> None:
    """Child: resume from the newest checkpoint, then save step after step until killed."""
    ck = CheckpointManager(directory, keep=3, config=CONFIG)
    state = {}
    step = ck.restore(x=state) or 0
    if cuda_ok():      # a save records CUDA's RNG state: start CUDA before the kill window opens
        torch.cuda.get_rng_state_all()
    conn.send(("ready", step))
    while True:
        step += 1
        ck.save(step, x=expected(step))
        conn.send(("saved", step))


def _complete_steps(directory):
    return sorted(int(n.split("-")[1]) for n in os.listdir(directory)
                  if n.startswith("step-") and os.path.exists(os.path.join(directory, n, "MANIFEST")))


def start_child(ctx, target, *args):
    """``target(*args, child)`` started in a process of ``ctx``: ``(process, parent)``, the
    parent end of the pipe it reports on, once it has said its first word."""
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    assert parent.poll(60), f"{target.__name__} child did not start"
    return proc, parent


def test_sigkill_at_random_points_never_loses_the_last_complete_checkpoint(tmp_path):
    ctx = mp.get_context("forkserver")
    # Python 3.11's forkserver ignores sys.path when preloading, so this test module itself is
    # imported again in each child: preloading what it imports keeps that cheap.
    ctx.set_forkserver_preload(["torch", "pytest", "nbtools.checkpoint", _saver.__module__])
    rnd = random.Random(int(os.environ.get("NBTOOLS_CKPT_SEED", "1234")))
    directory = str(tmp_path / "ckpt")
    # kill within a few saves' time: ~10-60 ms each on the CI machines, longer where fsync is
    # slow (a save timed here, on the same disk)
    t0 = time.perf_counter()
    CheckpointManager(str(tmp_path / "timing"), keep=1, config=CONFIG).save(1, x=expected(1))
    window = max(0.2, 4 * (time.perf_counter() - t0))
    last_reported, mid_save, stalled = 0, 0, 0
    for trial in range(KILLS):
        proc, parent = start_child(ctx, _saver, directory)
        kind, start = parent.recv()
        assert kind == "ready" and start >= last_reported, (trial, start, last_reported)
        before = last_reported
        time.sleep(rnd.uniform(0.0, window))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        try:
            while parent.poll():
                kind, step = parent.recv()
                last_reported = max(last_reported, step)
        except EOFError:
            pass
        parent.close()
        mid_save += any(n.startswith(".tmp-") for n in os.listdir(directory))

        ck = CheckpointManager(directory, keep=3, config=CONFIG)
        got = {}
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no checkpoint may ever look damaged
            step = ck.restore(x=got)
        complete = _complete_steps(directory)
        if step is None:                            # killed before the first save completed
            assert not complete and last_reported == 0, (trial, complete, last_reported)
            stalled += 1
            window *= 2 if stalled % 3 == 0 else 1      # (see below)
            continue
        assert step == complete[-1] and last_reported <= step <= last_reported + 1, \
            (trial, step, last_reported, complete)
        want = expected(step)
        assert all(torch.equal(got[k], want[k]) for k in ("a", "b", "ids")) and got["step"] == step
        statuses = [r["status"] for r in ck.checkpoints(verify=True)]
        assert statuses and all(s == "verified" for s in statuses), (trial, statuses)
        last_reported = step
        # three kills in a row before any save completed: saves here are slower than timed
        # (a loaded machine, tests in parallel): widen the window
        stalled = stalled + 1 if step == before else 0
        window *= 2 if stalled and stalled % 3 == 0 else 1
    assert last_reported >= KILLS // 3           # the runs made progress between kills
    assert mid_save >= 1, "no kill landed inside a save; the test would prove nothing"


@pytest.fixture
def disk_fills(monkeypatch):
    """``disk_fills(after)``: from the ``after + 1``-th write of a checkpoint's data on, every
    write fails with ENOSPC, until ``disk_fills.undo()``."""
    import errno

    import nbtools.checkpoint.format as ckformat
    real = ckformat.write_all

    def fill(after: int) -> None:
        calls = {"n": 0}

        def failing(f, mv):
            calls["n"] += 1
            if calls["n"] > after:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(f, mv)
        monkeypatch.setattr(ckformat, "write_all", failing)
    fill.undo = monkeypatch.undo
    return fill


@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MiB tmpfs: a real disk that fills up (needs root; skipped otherwise)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the ENOSPC path is still covered by "
                    "test_checkpoint.py::test_failing_write_leaves_earlier_checkpoints_intact")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}; the ENOSPC path "
                    "is still covered by test_checkpoint.py::test_failing_write_leaves_earlier_"
                    "checkpoints_intact")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=20)


def test_full_disk_leaves_previous_checkpoints_intact(tiny_fs):
    cfg = CheckpointConfig(chunk_bytes=4096, file_bytes=1 << 20, free_space_margin_bytes=0,
                           verbose=False, progress=False)
    ck = CheckpointManager(tiny_fs, keep=5, config=cfg)
    blobs = [torch.full((200_000,), float(i)) for i in range(4)]      # 800 KB each: 2 fit
    ck.save(1, x={"w": blobs[1]}, rng=False)
    ck.save(2, x={"w": blobs[2]}, rng=False)
    real_usage = __import__("shutil").disk_usage
    import nbtools.checkpoint.manager as ckmod
    # Let the pre-check pass so that the write itself hits ENOSPC on the real filesystem.
    ckmod.shutil.disk_usage = lambda p: real_usage(p)._replace(free=1 << 40)
    try:
        with pytest.raises(CheckpointSpaceError, match="disk full"):
            ck.save(3, x={"w": blobs[3]}, rng=False)
    finally:
        ckmod.shutil.disk_usage = real_usage
    assert sorted(os.listdir(tiny_fs)) == ["step-000000001", "step-000000002"]
    assert [r["status"] for r in ck.checkpoints(verify=True)] == ["verified", "verified"]
    got = {}
    assert ck.restore(x=got) == 2 and torch.equal(got["w"], blobs[2])
    # And the pre-check refuses before writing anything.
    with pytest.raises(CheckpointSpaceError, match="not enough space"):
        CheckpointManager(tiny_fs, keep=5, config=CheckpointConfig(verbose=False)).save(
            3, x={"w": blobs[3]}, rng=False)
    assert sorted(os.listdir(tiny_fs)) == ["step-000000001", "step-000000002"]
