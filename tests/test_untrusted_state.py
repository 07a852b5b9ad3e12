"""A crafted checkpoint whose values pass the structural checks (keys, shapes, dtypes) but
that nbtools' own ``load_state_dict`` would refuse, or whose next step would fail: each object's
``check_state_dict`` refuses it before anything is read into a live object. Each case edits a
good checkpoint's MANIFEST, re-signs it, restores into objects trained elsewhere, and compares
every table row, optimizer state, dense parameter and loader position before and after. Valid
checkpoints of each object kind still restore exactly, and train on.
"""
from __future__ import annotations

import json

import pytest
import torch

from nbtools import OffloadOptimizer, PinnedLoader
from nbtools.checkpoint import CheckpointError, CheckpointManager
from nbtools.checkpoint import format as ckformat
from nbtools.models import MatrixFactorization, MFConfig, SkipGram

from test_checkpoint_atomic import QUIET, Model, assert_unchanged, snapshot, trained


def edit(ck, change) -> None:
    m = json.loads((ck / ckformat.MANIFEST).read_bytes().partition(b"\n")[2])
    change(m)
    ckformat.write_manifest(ck, m, fsync=False)


def _table(m):
    return m["objects"]["opt"]["state"]["tables"]["t0"]


def _dense(m):
    return m["objects"]["opt"]["state"]["dense"]


def _dense0(m):
    return _dense(m)["state"]["$items"][0][1]


def _loader_state(m):
    return m["objects"]["loader"]["state"]


CRAFTED = {
    # a table's scalar state: Adam's next step wants a step tensor
    "table step an int": lambda m: _table(m)["scalar_state"].update(step=5),
    "table step a list": lambda m: _table(m)["scalar_state"].update(step=[1, 2]),
    "table step of 8 values": lambda m: _table(m)["scalar_state"].update(step={"$tensor": 3}),
    "table scalar state empty": lambda m: _table(m).update(scalar_state={}),
    "table scalar state extra": lambda m: _table(m)["scalar_state"].update(foo=1),
    # a table's hyper-parameters: what the optimizer's own checks or its step refuse
    "table lr None": lambda m: _table(m)["group"].update(lr=None),
    "table lr negative": lambda m: _table(m)["group"].update(lr=-1.0),
    "table betas above 1": lambda m: _table(m)["group"].update(betas={"$tuple": [2.0, 0.9]}),
    "table amsgrad turned on": lambda m: _table(m)["group"].update(amsgrad=True),
    "table capturable on the CPU": lambda m: _table(m)["group"].update(capturable=True),
    "table group lists params": lambda m: _table(m)["group"].update(params=[1]),
    "table rounds negative": lambda m: _table(m).update(rounds=-1),
    "table rounds a bool": lambda m: _table(m).update(rounds=True),
    "table row state an int": lambda m: _table(m)["row_state"].update(exp_avg=5),
    # the ordinary parameters' optimizer state
    "dense exp_avg of another shape": lambda m: _dense0(m).update(exp_avg={"$tensor": 8}),
    "dense exp_avg a string": lambda m: _dense0(m).update(exp_avg="abc"),
    "dense exp_avg missing": lambda m: _dense0(m).pop("exp_avg"),
    "dense step a string": lambda m: _dense0(m).update(step="abc"),
    "dense state not a dict": lambda m: _dense(m)["state"]["$items"][0].__setitem__(1, 5),
    "dense no state": lambda m: _dense(m).pop("state"),
    "dense params twice": lambda m: _dense(m)["param_groups"][0].update(params=[0, 0]),
    "dense params elsewhere": lambda m: _dense(m)["param_groups"][0].update(params=[5, 6]),
    "dense lr None": lambda m: _dense(m)["param_groups"][0].update(lr=None),
    "dense group without lr": lambda m: _dense(m)["param_groups"][0].pop("lr"),
    # the loader's position: a value int() would cut, or overflow on
    "loader position a float": lambda m: _loader_state(m).update(position=2.7),
    "loader position infinite": lambda m: _loader_state(m).update(position=float("inf")),
    "loader position a string": lambda m: _loader_state(m).update(position="2"),
    "loader position a bool": lambda m: _loader_state(m).update(position=True),
    "loader seed a float": lambda m: _loader_state(m).update(seed=1.5),
    "loader epoch negative": lambda m: _loader_state(m).update(epoch=-3),
}


def _loader(seed):
    loader = PinnedLoader(torch.arange(256), batch_size=32, device="cpu", seed=seed)
    if seed == 3:
        it = iter(loader)
        next(it), next(it)
    return loader


def _step(model, opt):
    model(torch.randint(0, 100, (16,))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_state_is_refused_with_nothing_changed(tmp_path, case):
    model, opt = trained(0)
    CheckpointManager(tmp_path / "ck", config=QUIET).save(7, model=model, opt=opt,
                                                          loader=_loader(3))
    edit(tmp_path / "ck" / "step-000000007", CRAFTED[case])
    model, opt = trained(1)
    loader = _loader(5)
    before = {**snapshot(model, opt), "loader": repr(loader.state_dict())}
    with pytest.raises(CheckpointError, match="Nothing was restored"):
        CheckpointManager(tmp_path / "ck", config=QUIET).restore(model=model, opt=opt,
                                                                 loader=loader)
    assert_unchanged(before, {**snapshot(model, opt), "loader": repr(loader.state_dict())})
    _step(model, opt)                   # and the objects train on as they were


OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {}),
    "AdamW": (torch.optim.AdamW, {}),
    "SGD momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "SGD": (torch.optim.SGD, {}),
    "Adagrad": (torch.optim.Adagrad, {}),
    "RMSprop centered": (torch.optim.RMSprop, {"centered": True, "momentum": 0.5}),
    "ASGD": (torch.optim.ASGD, {}),
    "NAdam": (torch.optim.NAdam, {}),
    "RAdam": (torch.optim.RAdam, {}),
    "Adamax": (torch.optim.Adamax, {}),
    "Adadelta": (torch.optim.Adadelta, {}),
    "Rprop": (torch.optim.Rprop, {}),
}


def _trained(seed, cls, kw, steps=3):
    torch.manual_seed(seed)
    model = Model()
    opt = OffloadOptimizer(cls, model, lr=0.05, **kw)
    for _ in range(steps):
        _step(model, opt)
    return model, opt


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("fresh", [False, True], ids=["trained", "fresh"])
def test_a_valid_checkpoint_round_trips_exactly_and_trains_on(tmp_path, name, fresh):
    cls, kw = OPTIMIZERS[name]
    model, opt = _trained(0, cls, kw, steps=0 if fresh else 3)
    loader = _loader(3)
    CheckpointManager(tmp_path / "ck", config=QUIET).save(7, model=model, opt=opt, loader=loader)
    saved = {**snapshot(model, opt), "loader": repr(loader.state_dict())}
    torch.manual_seed(5)
    _step(model, opt)
    expected = snapshot(model, opt)

    model, opt = _trained(1, cls, kw)
    loader = _loader(5)
    CheckpointManager(tmp_path / "ck", config=QUIET).restore(model=model, opt=opt, loader=loader)
    restored = {**snapshot(model, opt), "loader": repr(loader.state_dict())}
    saved.pop("rng"), restored.pop("rng")
    assert_unchanged(saved, restored)
    torch.manual_seed(5)
    _step(model, opt)                   # the same step as the saved objects took
    after = snapshot(model, opt)
    expected.pop("rng"), after.pop("rng")
    assert_unchanged(expected, after)


def test_sparse_adam_round_trips(tmp_path):
    from nbtools import OffloadedEmbedding
    torch.manual_seed(0)
    tables = [OffloadedEmbedding(40, 4, device="cpu", name="t")]
    opt = OffloadOptimizer(torch.optim.SparseAdam, tables, lr=0.05)
    for _ in range(2):
        tables[0](torch.randint(0, 40, (8,))).sum().backward()
        opt.step()
    CheckpointManager(tmp_path / "ck", config=QUIET).save(3, opt=opt, table=tables[0])
    saved = {k: v.clone() for k, v in opt.table_state("t").items()}
    torch.manual_seed(1)
    other = [OffloadedEmbedding(40, 4, device="cpu", name="t")]
    opt2 = OffloadOptimizer(torch.optim.SparseAdam, other, lr=0.05)
    CheckpointManager(tmp_path / "ck", config=QUIET).restore(opt=opt2, table=other[0])
    for k, v in opt2.table_state("t").items():
        assert torch.equal(v, saved[k]), k
    other[0](torch.tensor([1, 2])).sum().backward()
    opt2.step()


# --- the models' extra state (the negatives' generator) -------------------------------------

def _model(kind, seed):
    torch.manual_seed(seed)
    if kind == "mf":
        model = MatrixFactorization(8, 10, 4, config=MFConfig(loss="mse", init_std=0.5),
                                    device="cpu")
        model.observed_range = (1.0, 5.0)
    else:
        model = SkipGram(30, 6, counts=torch.arange(1, 31), device="cpu")
    if seed:
        sd = model.state_dict()
        model.load_state_dict({k: v + seed if torch.is_tensor(v) and v.is_floating_point() else v
                               for k, v in sd.items()})
        model.generator.manual_seed(seed)
    return model


def _model_snapshot(model):
    out = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    out["generator"] = model.generator.get_state().clone()
    out["observed_range"] = repr(getattr(model, "observed_range", None))
    return out


def _extra(m):
    return dict(m["objects"]["model"]["state"]["$items"])["_extra_state"]


def _set_extra(m, value):
    for item in m["objects"]["model"]["state"]["$items"]:
        if item[0] == "_extra_state":
            item[1] = value


EXTRA = {
    "no generator": lambda m: _extra(m).pop("generator"),
    "generator an int": lambda m: _extra(m).update(generator=5),
    "not a dict": lambda m: _set_extra(m, 5),
}


@pytest.mark.parametrize("kind", ["mf", "skipgram"])
def test_a_model_round_trips_exactly(tmp_path, kind):
    model = _model(kind, 0)
    CheckpointManager(tmp_path / "ck", config=QUIET).save(1, model=model)
    saved = _model_snapshot(model)
    other = _model(kind, 1)
    CheckpointManager(tmp_path / "ck", config=QUIET).restore(model=other)
    assert_unchanged(saved, _model_snapshot(other))


@pytest.mark.parametrize("kind", ["mf", "skipgram"])
@pytest.mark.parametrize("case", list(EXTRA))
def test_a_models_crafted_extra_state_is_refused_by_its_check(kind, case):
    """check_extra_state (and set_extra_state, which runs it first) refuse before anything
    changes, on shape-only tensors as a restore's preflight sees them."""
    model = _model(kind, 0)
    state = model.get_extra_state()
    state = {"state": dict(state)}
    wrap = {"objects": {"model": {"state": {"$items": [["_extra_state", state["state"]]]}}}}
    EXTRA[case](wrap)
    crafted = dict(wrap["objects"]["model"]["state"]["$items"])["_extra_state"]
    before = _model_snapshot(model)
    with pytest.raises(ValueError):
        model.check_extra_state(crafted)
    with pytest.raises(ValueError):
        model.set_extra_state(crafted)
    assert_unchanged(before, _model_snapshot(model))
    meta = dict(model.get_extra_state(), generator=torch.empty(3, dtype=torch.uint8,
                                                               device="meta"))
    with pytest.raises(ValueError, match="generator state"):
        model.check_extra_state(meta)


def test_a_recommenders_observed_range_must_be_a_pair():
    model = _model("mf", 0)
    for bad in ("ab", [1, 2, 3], [True, 2.0]):
        with pytest.raises(ValueError, match="observed_range"):
            model.check_extra_state(dict(model.get_extra_state(), observed_range=bad))
    model.set_extra_state(dict(model.get_extra_state(), observed_range=[0, 4]))
    assert model.observed_range == (0.0, 4.0)


@pytest.mark.parametrize("kind", ["mf", "skipgram"])
def test_a_models_crafted_extra_state_changes_nothing_in_a_restore(tmp_path, kind):
    model = _model(kind, 0)
    CheckpointManager(tmp_path / "ck", config=QUIET).save(1, model=model)
    edit(tmp_path / "ck" / "step-000000001", EXTRA["generator an int"])
    other = _model(kind, 1)
    before = _model_snapshot(other)
    with pytest.raises(CheckpointError):
        CheckpointManager(tmp_path / "ck", config=QUIET).restore(model=other)
    assert_unchanged(before, _model_snapshot(other))
