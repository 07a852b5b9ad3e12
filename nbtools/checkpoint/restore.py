"""Reading one checkpoint back: the pieces :meth:`CheckpointManager.restore` puts together once
it has picked a checkpoint to try.

A checkpoint of disk tables may need other checkpoint directories (the base and deltas of each
table's chain); they are looked for in the checkpoint's own root first, then in the manager's
other root (local or mirror): :func:`find_dir`, :func:`check_needs`, :func:`chain_of`. The
tensors are read straight into the objects' live tensors where shape and dtype match
(:func:`read_tensors`), every byte checked against its CRC before anything is handed over;
then each object gets its decoded state (:func:`hand_over`). A damaged file raises
:class:`~nbtools.checkpoint.format._Damaged`, which makes the manager try an older checkpoint.

A restore is all or nothing: before the first byte goes into a live object, :func:`preflight`
checks every object against what the checkpoint holds for it (type, keys, shapes, dtypes, the
optimizer's class and tables) and :func:`verify_live` reads the checksums of every byte that
would land in a live tensor, so a mismatch or a damaged file raises with nothing changed. The
side file of extras is read first, as data only (:func:`nbtools.checkpoint.tree.load_extras`).
"""
from __future__ import annotations

import collections
import copy
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..devices import cuda_ok
from . import rows as _rows
from . import tree as _tree
from .format import (EXTRAS, CheckpointConfig, CheckpointError, check_files, Damaged, _dtype,
                     open_regular, pickles, read_manifest, Reader)
from .layout import Entry, needs
from .rng import check_rng_state
from ..units import progress_bar


def find_dir(roots: list[Path], first: Path, name: str, uid: str) -> tuple[Path, dict] | None:
    """The complete checkpoint directory ``name`` of id ``uid``: in ``first`` (the root of
    the checkpoint that needs it), else in the other roots (local or mirror)."""
    for root in [first] + [r for r in roots if r != first]:
        path = root / name
        try:
            mm = read_manifest(path)
            if mm.get("id") != uid:
                continue
            check_files(path, mm)
        except Damaged:
            continue
        return path, mm
    return None


def check_needs(roots: list[Path], path: Path, m: dict) -> None:
    """Raise :class:`Damaged` when a base or delta the checkpoint at ``path`` needs is
    missing or incomplete in every root."""
    for name, uid in needs(m):
        if find_dir(roots, path.parent, name, uid) is None:
            raise Damaged(f"it needs {name} (a base or delta of its disk tables), which is "
                           f"missing or incomplete in {' and '.join(map(str, roots))}")


def chain_of(roots: list[Path], entry: Entry, item: dict) -> list:
    """``(directory, link, tensor entry)`` of each link of a disk table's chain."""
    m, out = entry.manifest, []
    for link in item["chain"]:
        if link["id"] == m.get("id"):
            found = (entry.path, m)
        else:
            found = find_dir(roots, entry.path.parent, link["dir"], link["id"])
        if found is None:
            raise Damaged(f"it needs {link['dir']} (the {link['kind']} of disk table "
                           f"{item['name']!r}), which is missing or incomplete")
        tensors = found[1]["tensors"]
        if not 0 <= link["tensor"] < len(tensors):
            raise Damaged(f"{link['dir']} has no tensor {link['tensor']} (the "
                           f"{link['kind']} of disk table {item['name']!r})")
        out.append((found[0], link, tensors[link["tensor"]]))
    return out


def read_tensors(entry: Entry, wanted: list, live: dict, cfg: CheckpointConfig) -> list:
    """Read the tensors ``wanted`` (manifest indices), every checksum verified; returns the
    tensors by index (None where not wanted). A tensor is read into ``live[i]`` (an object's
    own tensor, no second copy) when its shape, dtype and layout allow, else into a fresh CPU
    tensor."""
    m = entry.manifest
    tensors: list = [None] * len(m["tensors"])
    total = sum(m["tensors"][i]["bytes"] for i in wanted)
    bar = progress_bar(total, f"restoring step {m['step']}", cfg.progress)
    if cuda_ok():
        for i in range(torch.cuda.device_count()):     # tables may be on any GPU
            torch.cuda.synchronize(i)
    try:
        with ThreadPoolExecutor(1) as pool, torch.no_grad():
            reader = Reader(entry.path, cfg, pool, bar)
            try:
                # tensors read into fresh memory first, each checked as it is read: a damaged
                # one raises before any live tensor (checked beforehand, verify) is written
                for i in sorted(wanted, key=lambda i: i in live):
                    e = m["tensors"][i]
                    shape, dtype = tuple(e["shape"]), _dtype(e["dtype"])
                    dst = live.get(i)
                    if (dst is None or tuple(dst.shape) != shape or dst.dtype != dtype
                            or not dst.is_contiguous() or dst.device.type not in ("cpu", "cuda")):
                        dst = torch.empty(shape, dtype=dtype)
                    reader.read_tensor(e, dst, f"tensor {e['path']!r}")
                    tensors[i] = dst
            finally:
                reader.close()
    finally:
        if bar is not None:
            bar.close()
    return tensors


def read_extras(path: Path, m: dict) -> list:
    """The side file of values JSON cannot hold, checked against its CRC."""
    want = max([pickles(m["objects"][k]["state"]) for k in m["objects"]]
               + [pickles(m.get("rng"))])
    if not m.get("extras"):
        if want:
            raise Damaged(f"its state refers to {want} side-file value(s) and it has no {EXTRAS}")
        return []
    size = m["extras"]["bytes"]
    with os.fdopen(open_regular(path, m["extras"]["file"]), "rb") as f:
        blob = f.read(size + 1)
    if len(blob) != size or zlib.crc32(blob) != m["extras"]["crc32"]:
        raise Damaged(f"{m['extras']['file']}: checksum mismatch (file damaged)")
    try:
        values = _tree.load_extras(blob)
    except _tree.UnsafeValueError as e:
        raise CheckpointError(
            f"checkpoint {path} was not restored: its {m['extras']['file']} holds something "
            f"that is not data ({e}). nbtools never writes that: the file was replaced. "
            "Nothing was loaded or run, and nothing was changed.") from None
    except Exception as e:           # not a torch.save file at all: damaged, like a bad CRC
        raise Damaged(f"{m['extras']['file']} is not a side file nbtools wrote "
                      f"({type(e).__name__}: {e})") from None
    if not isinstance(values, list) or len(values) < want:
        raise Damaged(f"{m['extras']['file']} holds {type(values).__name__} of "
                      f"{len(values) if isinstance(values, list) else 'no'} values; the state "
                      f"refers to {want}")
    return values


def verify(entry: Entry, cfg: CheckpointConfig, which=None) -> None:
    """Read every byte of the checkpoint (or of the tensors ``which``: manifest indices) and
    check it (raises :class:`Damaged`)."""
    m = entry.manifest
    with ThreadPoolExecutor(1) as pool:
        reader = Reader(entry.path, cfg, pool, None)
        try:
            for i, e in enumerate(m["tensors"]):
                if which is None or i in which:
                    reader.read_tensor(e, None, f"tensor {e['path']!r}")
        finally:
            reader.close()
    if which is None:
        read_extras(entry.path, m)


def verify_chain(links: list, name: str, cfg: CheckpointConfig) -> None:
    """Check every byte of disk table ``name``'s chain (its base and deltas) before any is
    written."""
    with ThreadPoolExecutor(1) as pool:
        for root, link, e in links:
            reader = Reader(root, cfg, pool, None)
            try:
                reader.read_tensor(e, None, f"{root.name}: {link['kind']} of disk table {name!r}")
            finally:
                reader.close()


_NOTHING_CHANGED = _rows.NOTHING_CHANGED


def preflight(entry: Entry, objects: dict, extras: list, matched: dict, half: bool) -> None:
    """Raise :class:`CheckpointError` when the checkpoint's state for an object would not load
    into it (another type, other keys, shapes or dtypes, another optimizer class or other
    tables): checked on the decoded tree with shape-only tensors, before anything is read
    into a live object. ``half``: the checkpoint's tables were saved in half precision (their
    dtypes differ on purpose)."""
    m = entry.manifest

    def shaped(i, _):
        e = m["tensors"][i]
        return torch.empty(e["shape"], dtype=_dtype(e["dtype"]), device="meta")

    def on_rows(node):
        return _rows.view(node, matched[node["$rows"]])

    for name, obj in objects.items():
        saved = m["objects"][name]
        problem = None
        kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
        if saved.get("type") not in (None, kind):
            problem = f"it was saved from a {saved['type']}, this is a {kind}"
        else:
            state = _tree.walk(saved["state"], shaped, extras, on_rows=on_rows)
            problem = _mismatch(name, obj, state, half)
        if problem:
            raise CheckpointError(f"checkpoint {entry.path} (step {m['step']}) does not fit "
                                  f"{name!r}: {problem}. {_NOTHING_CHANGED}")


def _same_tensor(key: str, live, saved, half: bool) -> str | None:
    if not isinstance(saved, torch.Tensor):
        return f"{key}: the checkpoint holds a {type(saved).__name__}, expected a tensor"
    if tuple(saved.shape) != tuple(live.shape):
        return (f"{key}: the checkpoint holds shape {tuple(saved.shape)}, expected "
                f"{tuple(live.shape)}")
    if saved.dtype != live.dtype and not half:
        return f"{key}: the checkpoint holds {saved.dtype}, expected {live.dtype}"
    return None


def _mismatch(name: str, obj, state, half: bool) -> str | None:
    """What keeps ``state`` (tensors shape-only) from loading into ``obj``, or None. An
    object that can say so itself has ``check_state_dict(state)`` (raises ValueError):
    :class:`nbtools.OffloadOptimizer` does. A module or optimizer that loads as torch's do
    is also rehearsed (:func:`rehearse`)."""
    problem = _structure(obj, state, half)
    return problem if problem is not None else rehearse(obj, state)


def _structure(obj, state, half: bool) -> str | None:
    if isinstance(obj, torch.Tensor):
        return _same_tensor("the tensor", obj, state, half)
    if isinstance(obj, dict):
        return None if isinstance(state, dict) else \
            f"the checkpoint holds a {type(state).__name__}, expected a dict"
    if isinstance(obj, torch.nn.Module):
        live = obj.state_dict()
        missing = [k for k in live if k not in state]
        extra = [k for k in state if k not in live]
        if missing or extra:
            return ("the checkpoint " + "; ".join(
                p for p in (f"lacks {missing}" if missing else "",
                            f"has keys this module does not, {extra}" if extra else "") if p))
        for k, v in live.items():
            if isinstance(v, torch.Tensor):
                problem = _same_tensor(k, v, state[k], half)
                if problem:
                    return problem
        return None
    if callable(getattr(obj, "check_state_dict", None)):
        try:
            obj.check_state_dict(state)
        except (ValueError, KeyError, TypeError) as e:
            return str(e).strip("'\"")
        return None
    if isinstance(obj, torch.optim.Optimizer):
        from ..optim.config import check_groups
        if not isinstance(state, dict) or not isinstance(state.get("state", {}), dict):
            return "the checkpoint holds no optimizer state dict"
        try:
            check_groups(state.get("param_groups"), obj.param_groups, "optimizer")
        except ValueError as e:
            return str(e)
    return None


# --- a rehearsal of load_state_dict on shape-only twins -------------------------------------
# The checks above see keys, shapes and dtypes. load_state_dict can still refuse what they
# pass (a module's version metadata of the wrong type, an optimizer state value it cannot
# cast), and by then the tensors would already hold the checkpoint's bytes (they are read in
# place). So each module and optimizer that loads as torch's do first loads the checkpoint's
# state into a twin: its own class and settings, its parameters and buffers shape-only (on the
# meta device, no memory), no load hooks. What the twin refuses is refused with nothing read.

def _shallow(obj):
    """A new object of ``obj``'s class holding what its ``__dict__`` holds (the same values):
    not through ``__reduce__``/``__getstate__``, which a class may narrow for pickling."""
    twin = object.__new__(type(obj))
    twin.__dict__.update(obj.__dict__)
    return twin


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    twin = torch.empty_like(t, device="meta")
    return torch.nn.Parameter(twin, t.requires_grad) if isinstance(t, torch.nn.Parameter) else twin


def _consumed(*_args) -> None:
    """A twin's ``_load_from_state_dict`` for a module whose own cannot run shape-only (an
    nbtools table, a class that loads in its own way), and its ``set_extra_state`` where the
    module has no ``check_extra_state(state)``: their fit is what preflight checked."""


def _module_twin(module: torch.nn.Module) -> torch.nn.Module:
    twins: dict[int, torch.nn.Module] = {}

    def twin(m):
        if id(m) in twins:                   # a submodule used twice stays one
            return twins[id(m)]
        t = twins[id(m)] = _shallow(m)       # own __dict__; parameters, buffers, children below
        t._load_state_dict_pre_hooks = type(m._load_state_dict_pre_hooks)()
        t._load_state_dict_post_hooks = type(m._load_state_dict_post_hooks)()
        own = type(m)._load_from_state_dict
        runs = (own is torch.nn.Module._load_from_state_dict
                or own.__module__.startswith("torch.")) and not (
                    m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks)
        try:
            t._parameters = {k: None if p is None else _meta_like(p)
                             for k, p in m._parameters.items()}
            t._buffers = {k: None if b is None else _meta_like(b) for k, b in m._buffers.items()}
        except Exception:                    # (lazy or unusual parameters: not rehearsed)
            runs = False
            t._parameters, t._buffers = {}, {}
        if not runs:
            t._load_from_state_dict = _consumed
        # (a module's extra state goes to objects the twin shares with it, a generator say: it
        # is not loaded there, only checked, where the module can check it)
        check = getattr(m, "check_extra_state", None)
        t.set_extra_state = check if callable(check) else _consumed
        t._modules = {k: None if c is None else twin(c) for k, c in m._modules.items()}
        return t
    return twin(module)


def _optimizer_twin(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    t = _shallow(opt)
    metas: dict[int, torch.Tensor] = {}
    t.param_groups = [{**g, "params": [metas.setdefault(id(p), _meta_like(p)) for p in g["params"]]}
                      for g in opt.param_groups]
    t.state = collections.defaultdict(dict)
    return t


def rehearse(obj, state) -> str | None:
    """Load ``state`` (tensors shape-only) into a shape-only twin of ``obj``: what it raises,
    as text, or None. Only a module or optimizer whose ``load_state_dict`` is torch's is
    rehearsed (others say what they accept through ``check_state_dict``); an optimizer with
    load hooks of its own is not (they may reshape the state the twin sees)."""
    try:
        if isinstance(obj, torch.nn.Module):
            if type(obj).load_state_dict is not torch.nn.Module.load_state_dict:
                return None
            twin = _module_twin(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            if (type(obj).load_state_dict is not torch.optim.Optimizer.load_state_dict
                    or getattr(obj, "_optimizer_load_state_dict_pre_hooks", None)
                    or getattr(obj, "_optimizer_load_state_dict_post_hooks", None)):
                return None
            twin = _optimizer_twin(obj)
        else:
            return None
    except Exception:                        # no twin to be had: the structural checks stand
        return None
    try:
        with torch.no_grad():
            twin.load_state_dict(state)
    except Exception as e:
        text = str(e).strip().replace("\n", " ")
        return f"its load_state_dict refuses the checkpoint's state ({type(e).__name__}: " \
               f"{text[:300]})"
    return None


STAGE_MAX_BYTES = 16 << 20      # an object whose saved tensors are this small is staged


def staged(m: dict, objects: dict) -> list[str]:
    """The objects loaded first and put back if the restore fails later: those that are not
    tensors, dicts, modules or optimizers (whose fit :func:`preflight` checks in full), and
    whose saved state is small (no disk table, tensors of at most ``STAGE_MAX_BYTES``), so
    that a copy of their current state costs nothing worth counting."""
    out = []
    for name, obj in objects.items():
        if isinstance(obj, (torch.Tensor, dict, torch.nn.Module, torch.optim.Optimizer)):
            continue
        tree = m["objects"][name]["state"]
        if _tree.rows_nodes(tree):
            continue
        if sum(m["tensors"][i]["bytes"] for i in _tree.tensor_indices(tree)) <= STAGE_MAX_BYTES:
            out.append(name)
    return out


def rng_of(entry: Entry, tensors: list, extras: list):
    """The checkpoint's RNG states (None when it has none), checked to load
    (:func:`~nbtools.checkpoint.rng.check_rng_state`) before any is set."""
    m = entry.manifest
    if m.get("rng") is None:
        return None
    state = _tree.decode(m["rng"], tensors, extras)
    try:
        check_rng_state(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {entry.path} (step {m['step']}): {e}. "
                              f"{_NOTHING_CHANGED}") from None
    return state


def load_staged(entry: Entry, objects: dict, tensors: list, extras: list):
    """Load each of ``objects`` (see :func:`staged`; their tensors already read), keeping a
    copy of its state as it was. A load that raises puts back those already loaded and
    raises :class:`CheckpointError` (nothing changed). Returns the undo: a call that puts
    every one back."""
    m, done = entry.manifest, []

    def undo():
        for obj, before in reversed(done):
            obj.load_state_dict(before)
        done.clear()

    for name, obj in objects.items():
        before = copy.deepcopy(obj.state_dict())
        try:
            obj.load_state_dict(_tree.decode(m["objects"][name]["state"], tensors, extras))
        except Exception as e:
            undo()
            raise CheckpointError(f"checkpoint {entry.path} (step {m['step']}) does not fit "
                                  f"{name!r}: {type(e).__name__}: {str(e).strip(chr(39))}. "
                                  f"{_NOTHING_CHANGED}") from None
        done.append((obj, before))
    return undo


def hand_over(m: dict, objects: dict, tensors: list, extras: list, matched: dict) -> None:
    """``load_state_dict`` of each object with its decoded state (``matched``: the live disk
    tables, by the manifest's index, whose views stand for their rows)."""
    def on_rows(node):
        return _rows.view(node, matched[node["$rows"]])
    for name, obj in objects.items():
        state = _tree.decode(m["objects"][name]["state"], tensors, extras, on_rows)
        if isinstance(obj, torch.Tensor):
            if obj.shape != state.shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(obj.shape)}, the "
                                      f"checkpoint holds {tuple(state.shape)}")
            if state is not obj:
                with torch.no_grad():
                    obj.copy_(state)
        elif isinstance(obj, dict):
            obj.clear()
            obj.update(state)
        else:
            try:
                obj.load_state_dict(state)
            except Exception as e:
                # (preflight's checks and rehearsal passed: a refusal that depends on the values)
                raise CheckpointError(
                    f"checkpoint of step {m['step']}: {name!r} refused its state after the "
                    f"tensors were read ({type(e).__name__}: {str(e).strip()[:300]}). The "
                    "tensors read in place hold the checkpoint's values; the small objects "
                    "loaded before are put back. Re-create the objects before training on "
                    "them.") from e
