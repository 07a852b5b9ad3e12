"""How nbtools.kernels is put together: importing it imports no Triton (tables import it on
CPU machines without Triton), each family's @triton.jit module is loaded on its first launch,
and the fused update an optimizer class gets is named by the class itself, never inherited."""
import subprocess
import sys

import pytest
import torch

from nbtools import kernels
from nbtools.rowwise import PartialRowWiseAdam, RowWiseAdagrad


def test_importing_the_kernels_imports_no_triton():
    code = ("import sys, nbtools, nbtools.kernels, nbtools.tables, nbtools.store.cache; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')"
            " or m.startswith('nbtools.kernels.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "['nbtools.kernels.common']", out.stdout


@pytest.mark.skipif(not kernels.triton_ok(), reason="Triton is not installed")
def test_a_familys_kernels_load_on_their_first_launch():
    """The loader answers each family with its module of kernels, once; the kernels are the
    module's own functions (nothing is made at run time)."""
    rows = kernels.jit("rows")
    assert rows is kernels.jit("rows") and rows.__name__ == "nbtools.kernels._rows"
    for family, names in {"rows": ["gather", "put", "patch", "copy", "take"],
                          "update": ["update"], "admission": ["admit_count", "admit_sets"],
                          "segsum": ["segment_chunks", "segment_join"]}.items():
        module = kernels.jit(family)
        for name in names:
            assert getattr(module, name).fn.__module__ == module.__name__, (family, name)
    with pytest.raises(ModuleNotFoundError):
        kernels.jit("no_such_family")


GROUP = dict(lr=0.1, eps=1e-10, weight_decay=0.0, maximize=False, betas=(0.9, 0.999),
             initial_accumulator_value=0.0)


@pytest.mark.parametrize("cls, names, rule", [
    (RowWiseAdagrad, ["sum"], "rowwise_adagrad"),
    (PartialRowWiseAdam, ["exp_avg", "exp_avg_sq"], "partial_rowwise_adam")])
def test_row_wise_classes_name_their_fused_rule_and_subclasses_do_not_inherit_it(cls, names,
                                                                               rule):
    fused = kernels.fused_update_for(cls, GROUP, names, torch.float32)
    assert fused.rule == rule and fused.whole_row
    sub = type("Changed" + cls.__name__, (cls,), {})     # may change the arithmetic
    assert kernels.fused_update_for(sub, GROUP, names, torch.float32) is None
    named = type("Renamed" + cls.__name__, (cls,), {"fused_kernel": rule})   # says it is alike
    assert kernels.fused_update_for(named, GROUP, names, torch.float32).rule == rule
    assert kernels.fused_update_for(cls, GROUP, ["other"], torch.float32) is None


@pytest.mark.parametrize("cls, names, rule", [
    (torch.optim.SGD, [], "sgd"), (torch.optim.Adam, ["exp_avg", "exp_avg_sq"], "adam"),
    (torch.optim.AdamW, ["exp_avg", "exp_avg_sq"], "adam"),
    (torch.optim.SparseAdam, ["exp_avg", "exp_avg_sq"], "adam"),
    (torch.optim.Adagrad, ["sum"], "adagrad")])
def test_torch_optimizers_get_their_rule_by_exact_class(cls, names, rule):
    assert kernels.fused_update_for(cls, GROUP, names, torch.float32).rule == rule
    sub = type("Changed" + cls.__name__, (cls,), {})
    assert kernels.fused_update_for(sub, GROUP, names, torch.float32) is None
