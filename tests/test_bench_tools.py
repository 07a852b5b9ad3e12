"""benchmarks/sample_threads.py's ``--within``: which sampled stacks it counts, checked on real
frames of calls made here (the reference: the call chain itself)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from sample_threads import Sampler, short_path  # noqa: E402


def outer(inner_fn):
    return middle(inner_fn)


def middle(inner_fn):
    return inner_fn()


def innermost():
    return sys._getframe()


def test_within_counts_a_path_of_functions_in_call_order():
    frame = outer(innermost)
    inside = Sampler._inside
    assert inside(frame, ["outer"]) and inside(frame, ["middle"]) and inside(frame, ["innermost"])
    assert inside(frame, ["outer", "middle"]) and inside(frame, ["outer", "innermost"])
    assert inside(frame, ["outer", "middle", "innermost"])
    assert not inside(frame, ["middle", "outer"])            # the order matters
    assert not inside(frame, ["outer", "elsewhere"])
    assert not inside(middle(innermost), ["outer", "middle"])   # middle called, but not from outer
    assert not inside(None, ["outer"])


def test_short_path_is_the_same_in_any_checkout():
    assert short_path("/a/b/site-packages/torch/nn/x.py") == "torch/nn/x.py"
    assert short_path("/work/x/nbtools/disk/gpu.py") == "nbtools/disk/gpu.py"
    assert short_path("/tmp/ci/benchmarks/bench_disk.py") == "benchmarks/bench_disk.py"
    assert short_path("/usr/lib/python3.12/threading.py") == "threading.py"
