"""Kernels or the exact torch path, on any CUDA GPU: which kernel families run is decided
once per device, from its compute capability and a first launch of each family, whose
failure is caught there and said in one line; the families that cannot run take the torch
path, with the same results.

The decision is checked with a fake GPU here (CPU CI); on CUDA the fast-path tests run again
in a process whose GPU looks like a P100 (tests/kernels/fake_p100.py): once with kernels it
cannot load (every family on the torch path), once with only the capability faked (the
kernels run, the admission with its pre-sm_70 atomics).
"""
import os
import subprocess
import sys
import warnings

import pytest
import torch

from nbtools import kernels
from nbtools.kernels import common

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device index 0 of the capability and probe outcome a test sets."""
    got = {"capability": (9, 0), "fails": set(), "probed": []}

    def probe(family, device):
        got["probed"].append(family)
        if family in got["fails"]:
            raise RuntimeError("Triton Error [CUDA]: no kernel image is available for "
                               "execution on the device\nmore detail")
    monkeypatch.setattr(common, "triton_ok", lambda: True)
    monkeypatch.setattr(common, "probe", probe)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: got["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla P100-PCIE-16GB")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv("NBTOOLS_KERNELS", raising=False)
    common.forget()
    yield got
    common.forget()


GPU = torch.device("cuda", 0)


def test_every_family_runs_where_its_first_launch_works(fake_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # no line to say
        assert all(kernels.usable_on(GPU, f) for f in kernels.FAMILIES)
        assert kernels.usable_on(GPU)
    assert fake_gpu["probed"] == list(kernels.FAMILIES)
    kernels.usable_on(GPU, "rows")
    assert fake_gpu["probed"] == list(kernels.FAMILIES)      # decided once


def test_a_family_whose_first_launch_fails_takes_the_torch_path_said_once(fake_gpu):
    fake_gpu["capability"] = (6, 0)
    fake_gpu["fails"] = {"admission"}
    with pytest.warns(RuntimeWarning) as said:
        assert not kernels.usable_on(GPU, "admission")
    assert len(said) == 1
    line = str(said[0].message)
    assert "\n" not in line and "Tesla P100-PCIE-16GB (sm_60)" in line
    assert "no kernel image" in line and "the GPU cache's admission" in line
    assert "fused optimizer updates" not in line
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # said once only
        assert kernels.usable_on(GPU, "rows") and kernels.usable_on(GPU, "update")
        assert not kernels.usable_on(GPU)         # not every family
        assert not kernels.usable_on(GPU, "admission")
    assert "torch path for admission" in common.describe_line(GPU)


def test_a_decided_answer_asks_the_device_nothing_again(fake_gpu, monkeypatch):
    """A step asks several times a step: once decided, the answers (and the admission's form
    of atomics) come without the capability, a probe or the current device; forget() decides
    again, with what the device reports then."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda d=None: asked.append(d) or fake_gpu["capability"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append("current") or 0)
    assert kernels.usable_on(GPU, "rows") and not common.plain_atomics(GPU)
    before = (len(asked), len(fake_gpu["probed"]))
    for _ in range(3):
        assert kernels.usable_on(GPU, "rows") and kernels.usable_on(GPU)
        assert not common.plain_atomics(GPU)
    assert (len(asked), len(fake_gpu["probed"])) == (before[0], len(kernels.FAMILIES))
    fake_gpu["capability"] = (6, 0)
    assert not common.plain_atomics(GPU)          # (still the decided answer)
    common.forget()
    assert common.plain_atomics(GPU) and kernels.usable_on(GPU, "rows")


def test_a_gpu_older_than_a_familys_minimum_never_launches_it(fake_gpu, monkeypatch):
    monkeypatch.setitem(common.MIN_CAPABILITY, "update", (7, 0))
    fake_gpu["capability"] = (6, 1)
    with pytest.warns(RuntimeWarning, match=r"update \(needs sm_70\)"):
        assert not kernels.usable_on(GPU, "update")
    assert "update" not in fake_gpu["probed"]
    assert kernels.usable_on(GPU, "segsum")


def test_every_family_builds_for_sm_60_and_admission_takes_plain_atomics_there():
    assert all(common.family_ok_for_capability(f, (6, 0)) for f in kernels.FAMILIES)
    assert common.plain_atomics_for((6, 0)) and common.plain_atomics_for((6, 1))
    assert not common.plain_atomics_for((7, 0))


def test_the_environment_forces_the_torch_path(fake_gpu, monkeypatch):
    monkeypatch.setenv("NBTOOLS_KERNELS", "torch")
    assert not any(kernels.usable_on(d, f) for d in (GPU, torch.device("cpu"))
                   for f in kernels.FAMILIES)
    assert fake_gpu["probed"] == []
    assert "NBTOOLS_KERNELS=torch" in common.describe_line(GPU)
    monkeypatch.setenv("NBTOOLS_KERNELS", "triton")
    with pytest.raises(ValueError, match="'auto' or 'torch', got 'triton'"):
        kernels.usable_on(GPU)
    with pytest.raises(ValueError, match="unknown kernel family 'row'"):
        kernels.usable_on(GPU, "row")


# The fast-path tests run again with the GPU looking like a P100: optimizer steps against
# torch.optim, the GPU cache (its admission against the reference policy), prefetching and
# write-behind, the loader's gathers.
FAST_PATH_TESTS = ["tests/test_optim.py", "tests/test_cache.py", "tests/test_step.py",
                   "tests/test_loader.py"]


@pytest.mark.skipif(not torch.cuda.is_available() or not common.triton_ok(),
                    reason="needs CUDA and Triton")
@pytest.mark.parametrize("mode", ["unloadable", "capability"])
def test_the_fast_path_tests_pass_on_a_p100(mode):
    env = dict(os.environ, FAKE_P100=mode,
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("NBTOOLS_KERNELS", None)
    check = ("import fake_p100, torch; fake_p100.pytest_configure(None); "
             "from nbtools.kernels import common as c; "
             "print(sorted(f for f, w in c.unavailable(torch.device('cuda')).items() if w))")
    got = subprocess.run([sys.executable, "-W", "ignore", "-c", check], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    expect = sorted(kernels.FAMILIES) if mode == "unloadable" else []
    assert got.returncode == 0 and got.stdout.strip() == str(expect), \
        f"families off: {got.stdout.strip()!r}, expected {expect}\n{got.stderr[-2000:]}"
    try:                         # four workers where pytest-xdist is installed
        import xdist  # noqa: F401
        workers = ["-n", "4", "--dist", "loadgroup"]
    except ImportError:
        workers = []
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--maxfail=20", "-p",
                          "fake_p100", "-p", "no:cacheprovider", *workers, *FAST_PATH_TESTS],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_importing_the_fake_p100_plugin_changes_nothing():
    """The suite's doctest collection imports every file under tests/: the plugin must fake a
    P100 only where pytest loads it (``-p fake_p100``), or every later CUDA test of that
    process takes the torch path."""
    check = ("import torch; real = (torch.cuda.get_device_capability, "
             "__import__('nbtools.kernels.common', fromlist=['probe']).probe); "
             "import fake_p100; from nbtools.kernels import common; "
             "print(torch.cuda.get_device_capability is real[0], common.probe is real[1])")
    env = dict(os.environ,
               PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    got = subprocess.run([sys.executable, "-c", check], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.split() == ["True", "True"], got.stderr[-2000:]
