"""The package's public surface: names the README and error messages send users to."""
import subprocess
import sys

import pytest

import nbtools


@pytest.mark.parametrize("name, module", [
    ("OffloadConfig", "nbtools.optim"), ("NonFiniteGradientError", "nbtools.optim"),
    ("UnsupportedOptimizerError", "nbtools.optim"), ("HostMemoryError", "nbtools.tables"),
    ("PinningError", "nbtools.hostmem"), ("describe", "nbtools.env"),
    ("CheckpointManager", "nbtools.checkpoint.manager"),
])
def test_top_level_names_are_the_module_objects(name, module):
    obj = getattr(nbtools, name)
    assert obj.__module__ == module and name in dir(nbtools)


def test_errors_share_the_base_and_a_builtin():
    assert issubclass(nbtools.NonFiniteGradientError, (nbtools.NbtoolsError, FloatingPointError))
    assert issubclass(nbtools.HostMemoryError, MemoryError)
    assert issubclass(nbtools.PinningError, RuntimeError)
    assert issubclass(nbtools.UnsupportedOptimizerError, TypeError)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'OffloadConfg'"):
        nbtools.OffloadConfg


def test_no_import_cycles_between_the_split_modules():
    # colab must not need checkpoint, nor devices need hostmem: import each alone, first
    code = ("import sys; import nbtools.{m}; "
            "print(sorted(n for n in ('nbtools.checkpoint', 'nbtools.hostmem') if n in sys.modules))")
    for module, absent in (("colab", "nbtools.checkpoint"), ("devices", "nbtools.hostmem")):
        out = subprocess.run([sys.executable, "-c", code.format(m=module)], capture_output=True,
                             text=True, check=True)
        assert absent not in out.stdout, (module, out.stdout)
