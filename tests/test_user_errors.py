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


def test_gpu_placement_without_cuda_is_an_error():
    with pytest.raises(ValueError, match="placement='gpu'.*use placement='host' or 'auto'"):
        OffloadedEmbedding(10, 4, device="cpu", placement="gpu")


def test_disk_dir_that_is_a_file(tmp_path):
    f = tmp_path / "not-a-folder"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        OffloadedEmbedding(10, 4, device="cpu", placement="disk", disk_dir=str(f))
    with pytest.raises(NotADirectoryError):
        nbtools.plan(10, 4, "adam", disk_dir=str(f))


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
