"""Can the write-behind load test fail? Runs it with ``RowStore.patch`` turned into a no-op: a
lookup then reads rows whose write-back has not landed, and the test must fail.

    python benchmarks/experiments/patch_mutation.py        # GPU machine, ~20 s
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import nbtools.store.rows  # noqa: E402

nbtools.store.rows.RowStore.patch = lambda self, batch, out, start=0, capture=None: None
rc = pytest.main(["-q", "-p", "no:cacheprovider", "tests/test_step.py", "-k", "under_load"])
print("MUTATION CHECK:", "ok, the test failed without the patch" if rc != 0 else
      "BAD: it passed without the patch")
sys.exit(0 if rc != 0 else 1)
