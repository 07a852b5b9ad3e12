"""Reading one checkpoint back: the pieces :meth:`CheckpointManager.restore` puts together once
it has picked a checkpoint to try.

A checkpoint of disk tables may need other checkpoint directories (the base and deltas of each
table's chain); they are looked for in the checkpoint's own root first, then in the manager's
other root (local or mirror): :func:`find_dir`, :func:`check_needs`, :func:`chain_of`. The
tensors are read straight into the objects' live tensors where shape and dtype match
(:func:`read_tensors`), every byte checked against its CRC before anything is handed over;
then each object gets its decoded state (:func:`hand_over`). A damaged file raises
:class:`~nbtools.checkpoint.format._Damaged`, which makes the manager try an older checkpoint.
"""
from __future__ import annotations

import io
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..devices import cuda_ok
from . import rows as _rows
from . import tree as _tree
from .format import (CheckpointConfig, CheckpointError, _check_files, _Damaged, _dtype,
                     _read_manifest, _Reader)
from .layout import _Entry, needs
from .save import progress_bar


def find_dir(roots: list[Path], first: Path, name: str, uid: str) -> tuple[Path, dict] | None:
    """The complete checkpoint directory ``name`` of id ``uid``: in ``first`` (the root of
    the checkpoint that needs it), else in the other roots (local or mirror)."""
    for root in [first] + [r for r in roots if r != first]:
        path = root / name
        try:
            mm = _read_manifest(path)
            if mm.get("id") != uid:
                continue
            _check_files(path, mm)
        except _Damaged:
            continue
        return path, mm
    return None


def check_needs(roots: list[Path], path: Path, m: dict) -> None:
    """Raise :class:`_Damaged` when a base or delta the checkpoint at ``path`` needs is
    missing or incomplete in every root."""
    for name, uid in needs(m):
        if find_dir(roots, path.parent, name, uid) is None:
            raise _Damaged(f"it needs {name} (a base or delta of its disk tables), which is "
                           f"missing or incomplete in {' and '.join(map(str, roots))}")


def chain_of(roots: list[Path], entry: _Entry, item: dict) -> list:
    """``(directory, link, tensor entry)`` of each link of a disk table's chain."""
    m, out = entry.manifest, []
    for link in item["chain"]:
        if link["id"] == m.get("id"):
            found = (entry.path, m)
        else:
            found = find_dir(roots, entry.path.parent, link["dir"], link["id"])
        if found is None:
            raise _Damaged(f"it needs {link['dir']} (the {link['kind']} of disk table "
                           f"{item['name']!r}), which is missing or incomplete")
        tensors = found[1]["tensors"]
        if not 0 <= link["tensor"] < len(tensors):
            raise _Damaged(f"{link['dir']} has no tensor {link['tensor']} (the "
                           f"{link['kind']} of disk table {item['name']!r})")
        out.append((found[0], link, tensors[link["tensor"]]))
    return out


def read_tensors(entry: _Entry, wanted: list, live: dict, total: int,
                 cfg: CheckpointConfig) -> tuple[list, list]:
    """Read the tensors ``wanted`` (manifest indices, ``total`` bytes) and the side file of
    extras, every checksum verified; returns ``(tensors by index, extras)``. A tensor is read
    into ``live[i]`` (an object's own tensor, no second copy) when its shape, dtype and layout
    allow, else into a fresh CPU tensor."""
    m = entry.manifest
    tensors: list = [None] * len(m["tensors"])
    bar = progress_bar(total, f"restoring step {m['step']}", cfg.progress)
    if cuda_ok():
        torch.cuda.synchronize()
    try:
        with ThreadPoolExecutor(1) as pool, torch.no_grad():
            reader = _Reader(entry.path, cfg, pool, bar)
            try:
                for i in wanted:
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
        extras = read_extras(entry.path, m)
    finally:
        if bar is not None:
            bar.close()
    return tensors, extras


def read_extras(path: Path, m: dict) -> list:
    """The side file of values JSON cannot hold, checked against its CRC."""
    if not m.get("extras"):
        return []
    blob = (path / m["extras"]["file"]).read_bytes()
    if len(blob) != m["extras"]["bytes"] or zlib.crc32(blob) != m["extras"]["crc32"]:
        raise _Damaged(f"{m['extras']['file']}: checksum mismatch (file damaged)")
    # A pickle from your own checkpoint directory (small values that JSON cannot hold).
    return torch.load(io.BytesIO(blob), weights_only=False)


def verify(entry: _Entry, cfg: CheckpointConfig) -> None:
    """Read every byte of the checkpoint and check it (raises :class:`_Damaged`)."""
    m = entry.manifest
    with ThreadPoolExecutor(1) as pool:
        reader = _Reader(entry.path, cfg, pool, None)
        try:
            for e in m["tensors"]:
                reader.read_tensor(e, None, f"tensor {e['path']!r}")
        finally:
            reader.close()
    read_extras(entry.path, m)


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
            obj.load_state_dict(state)
