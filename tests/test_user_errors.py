"""The slips a new user makes get a clear message, not a silent wrong answer."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import nbtools
from nbtools import OffloadedEmbedding, OffloadOptimizer, UnconsumedGradientWarning
from nbtools.placement import HostMemoryError


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.items = OffloadedEmbedding(100, 4, device="cpu", name="items")
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.items(ids)).sum()


def steps(model, opt, n=3):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(n):
            model(torch.tensor([1, 2, 2])).backward()
            opt.step()
            opt.zero_grad()
    return [w for w in caught if issubclass(w.category, UnconsumedGradientWarning)]


def test_a_plain_optimizer_over_a_table_warns_once_naming_the_table_and_the_fix():
    model = Model()
    before = model.items.weight.clone()
    got = steps(model, torch.optim.Adam(model.parameters(), lr=0.1), n=4)
    assert len(got) == 1
    text = str(got[0].message)
    assert "'items'" in text and "OffloadOptimizer(torch.optim.Adam, model" in text
    assert torch.equal(model.items.weight, before)       # indeed nothing trained it


def test_an_offload_optimizer_for_another_model_warns():
    model, other = Model(), Model()
    opt = OffloadOptimizer(torch.optim.Adam, other, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.tensor([3])).backward()
            opt.step()
    assert sum(issubclass(w.category, UnconsumedGradientWarning) for w in caught) == 1


def test_no_warning_when_the_table_trains_or_accumulates_or_evaluates():
    model = Model()
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.1)
    assert steps(model, opt) == []
    with warnings.catch_warnings(record=True) as caught:     # gradient accumulation
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.tensor([1, 5])).backward()
        opt.step()
        opt.zero_grad()
    assert not [w for w in caught if issubclass(w.category, UnconsumedGradientWarning)]
    plain = Model()
    with warnings.catch_warnings(record=True) as caught:     # evaluation only
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(3):
                plain(torch.tensor([1]))
    assert not [w for w in caught if issubclass(w.category, UnconsumedGradientWarning)]


def test_the_warning_names_the_users_line_and_comes_once_per_table():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.users = OffloadedEmbedding(10, 4, device="cpu", name="users")
            self.bag = nbtools.OffloadedEmbeddingBag(10, 4, device="cpu", name="bag")

        def forward(self, ids):
            return (self.users(ids) * self.bag(ids[None])).sum()

    model = Two()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.tensor([1, 2])).backward()
    got = [w for w in caught if issubclass(w.category, UnconsumedGradientWarning)]
    assert sorted(str(w.message).split("'")[1] for w in got) == ["bag", "users"]
    assert {w.filename for w in got} == {__file__}      # the model's forward, not torch's


def test_a_loop_that_never_trains_the_table_does_not_pile_up_lookups():
    """Each step's lookup holds its rows and gradients until an optimizer takes them: a plain
    optimizer never does, so they are dropped once they are known to be unconsumed (else
    memory grows every step, and the warning for lookups waiting for a step comes next)."""
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(nbtools.tables.PENDING_WARN + 20):
            model(torch.tensor([1, 2])).backward()
            opt.step()
            opt.zero_grad()
    assert [w.category for w in caught] == [UnconsumedGradientWarning]


def test_no_warning_where_gradients_are_dropped_or_a_step_is_skipped_on_purpose():
    model = Model()
    opt = OffloadOptimizer(torch.optim.Adam, model, lr=0.1,
                           config=nbtools.OffloadConfig(nonfinite="skip"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.tensor([1, 2])).backward()
        opt.zero_grad()                           # this batch's gradients thrown away
        (model(torch.tensor([3])) * float("inf")).backward()
        opt.step()                                # non-finite: the step is skipped
        opt.zero_grad()
        model(torch.tensor([1, 2])).backward()
        opt.step()
    assert [w for w in caught if issubclass(w.category, UnconsumedGradientWarning)] == []
    assert opt.skipped_steps() == 1


@pytest.mark.parametrize("rows,err,match", [
    (-5, ValueError, "num_rows must be a positive int, got -5"),
    (0, ValueError, "num_rows must be a positive int"),
    (1e6, TypeError, r"num_rows must be a positive int, got 1000000.0 \(float\)"),
    (True, TypeError, "num_rows must be a positive int"),
])
def test_plan_refuses_bad_sizes(rows, err, match):
    with pytest.raises(err, match=match):
        nbtools.plan(rows, 16, "adam")


def test_plan_takes_numpy_ints_and_names_table_options():
    assert nbtools.plan(np.int64(1000), np.int32(8), "sgd").num_rows == 1000
    with pytest.raises(TypeError, match=r"table option\(s\) \['placement'\].*OffloadedEmbedding"):
        nbtools.plan(1000, 8, "adam", placement="disk")
    with pytest.raises(ValueError, match="gpu_fraction"):
        nbtools.plan(1000, 8, "adam", gpu_fraction=0)
    with pytest.raises(TypeError, match="dtype"):
        nbtools.plan(1000, 8, "adam", dtype=torch.int64)


@pytest.mark.parametrize("rows,dim,options,err,match", [
    (10, 2.5, {}, TypeError, r"must be a positive int, got 2.5 \(float\)"),
    (np.int64(-3), 4, {}, ValueError, r"must be a positive int, got (np.int64\()?-3"),
    (10, True, {}, TypeError, "must be a positive int, got True"),
    (10, 4, dict(dtype=torch.int64), TypeError, "dtype must be torch.float32, float64"),
    (10, 4, dict(dtype="float32"), TypeError, "dtype must be torch.float32, float64"),
    (10, 4, dict(gpu_fraction=1.5), ValueError, r"gpu_fraction must be a number in \(0, 1\]"),
    (10, 4, dict(gpu_fraction=True), ValueError, "gpu_fraction must be a number"),
    (10, 4, dict(disk_dir=7), TypeError, r"disk_dir must be a folder path.*got 7 \(int\)"),
])
def test_a_table_and_plan_refuse_the_same_arguments_alike(rows, dim, options, err, match):
    """One checker for both: what OffloadedEmbedding refuses, plan() refuses with the same
    type and words (each names its own arguments)."""
    with pytest.raises(err, match=match):
        OffloadedEmbedding(rows, dim, device="cpu", **options)
    with pytest.raises(err, match=match):
        nbtools.plan(rows, dim, "adam", **options)


def test_a_table_takes_numpy_sizes_and_refuses_a_padding_idx_that_is_not_an_int():
    t = OffloadedEmbedding(np.int64(10), np.int32(4), device="cpu", padding_idx=np.int64(2))
    assert (t.num_embeddings, t.embedding_dim, t.padding_idx) == (10, 4, 2)
    assert type(t.num_embeddings) is int
    with pytest.raises(TypeError, match=r"padding_idx must be an int row id or None, got 1.0"):
        OffloadedEmbedding(10, 4, device="cpu", padding_idx=1.0)


def test_plan_names_keywords_that_the_optimizer_does_not_take():
    with pytest.raises(TypeError, match=r"plan\(\) got keyword\(s\) \['beta'\].*Adam, which "
                                        r"takes \['lr', 'betas'"):
        nbtools.plan(1000, 8, "adam", beta=0.9)
    with pytest.raises(TypeError, match=r"\['momentum'\].*RowWiseAdagrad"):
        nbtools.plan(1000, 8, "rowwise_adagrad", momentum=0.9)
    assert nbtools.plan(1000, 8, "adam", amsgrad=True).row_state[-1] == "max_exp_avg_sq"


def test_plan_offers_only_optimizer_names_it_takes():
    """The unknown-name message lists names, and plan() takes every one of them; torch.optim's
    names that cannot train a table (and the base class) are refused saying why, not offered."""
    import ast
    import re
    with pytest.raises(ValueError, match=r"unknown optimizer 'optimizer': plan\(\) takes one of") \
            as refused:
        nbtools.plan(1000, 8, "optimizer")
    offered = ast.literal_eval(re.search(r"(\[[^]]*\])", str(refused.value)).group(1))
    assert {"adam", "sgd", "sparseadam", "rowwise_adagrad", "partial_rowwise_adam"} <= set(offered)
    for name in offered:
        assert nbtools.plan(1000, 8, name).num_rows == 1000, name
    for cls in ("LBFGS", "Adafactor", "Muon"):
        if hasattr(torch.optim, cls):
            assert cls.lower() not in offered
            with pytest.raises(nbtools.UnsupportedOptimizerError,
                               match=f"{cls} cannot train an offloaded table"):
                nbtools.plan(1000, 8, cls.lower())
    with pytest.raises(TypeError, match="Optimizer'> \\(the base class"):
        nbtools.plan(1000, 8, torch.optim.Optimizer)


def test_gpu_placement_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="placement='gpu'.*use placement='host' or 'auto'"):
        OffloadedEmbedding(10, 4, device="cpu", placement="gpu")


def test_disk_dir_that_is_a_file(tmp_path):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        OffloadedEmbedding(10, 4, device="cpu", placement="disk", disk_dir=str(f))
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        nbtools.plan(10, 4, "adam", disk_dir=f)
    under = f / "tables"                # a folder to be made, but below a file
    for make in (lambda: OffloadedEmbedding(10, 4, device="cpu", placement="disk",
                                            disk_dir=str(under)),
                 lambda: nbtools.plan(10, 4, "adam", disk_dir=str(under))):
        with pytest.raises(NotADirectoryError, match=f"lies under '{f}', which is a file"):
            make()
    assert f.read_text() == "x"
    t = OffloadedEmbedding(10, 4, device="cpu", placement="disk",
                           disk_dir=str(tmp_path / "new" / "folder"))      # made as needed
    assert t.placement == "disk"
    t.close()


def test_host_memory_error_suggests_disk_where_it_fits(monkeypatch, tmp_path):
    from nbtools import devices, disk
    real = devices.host_memory_bytes
    monkeypatch.setattr("nbtools.placement.host_memory_bytes",
                        lambda: {**real(), "available": 1 << 20})
    monkeypatch.setattr(disk, "default_dir", lambda: str(tmp_path))
    with pytest.raises(HostMemoryError, match="placement='disk'.*free"):
        OffloadedEmbedding(100_000, 16, device="cpu", name="big")
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1 << 10)
    with pytest.raises(HostMemoryError) as e:
        OffloadedEmbedding(100_000, 16, device="cpu", name="big")
    assert "placement='disk'" not in str(e.value)
    # the disk asked for is the one judged (and named)
    roomy = tmp_path / "roomy"
    monkeypatch.setattr(disk, "free_bytes", lambda folder: 1 << 40 if str(folder) == str(roomy)
                        else 1 << 10)
    with pytest.raises(HostMemoryError, match=f"under {roomy} \\(1.0 TiB free"):
        OffloadedEmbedding(100_000, 16, device="cpu", name="big", disk_dir=str(roomy))
