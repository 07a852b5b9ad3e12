"""Writing one checkpoint: what :meth:`CheckpointManager.save` does once it knows where.

Two phases. :func:`plan` encodes each object's state (and the RNG states) into JSON trees and
decides how every tensor is stored (half precision or not) and each disk table's rows (a base,
a delta or unchanged, every dirty row written back first); nothing is written yet, so the
space check sees the whole estimate. :func:`write` streams the tensors and rows into data files
under a temporary name, writes the manifest last, fsyncs, and renames the directory into
place; on any failure the partial directory is removed and the error says what is intact.

Which directory, which name, and what happens around a save (space check, pruning, the mirror)
is the manager's (:mod:`nbtools.checkpoint.manager`).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import socket
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .. import __version__
from ..units import human_bytes, progress_bar
from . import rows as _rows
from . import tree as _tree
from .format import (ALIGN, EXTRAS, FORMAT, PRIVATE_DIR, CheckpointConfig, CheckpointError,
                     CheckpointSpaceError, DataWriter, _dtype, create_new, dtype_name,
                     fsync_dir, save_chunks, Staging, write_manifest)
from .layout import clean_leftovers, tmp_name
from .rng import rng_state

_RESERVED = ("rng", "half_tables", "allow_half", "fall_back")


def state_of(name: str, obj):
    """What is saved of ``obj`` (and what a restore loads into): its ``state_dict()``, or the
    dict or tensor itself. ``name`` is the keyword it was passed under."""
    if name in _RESERVED:
        raise TypeError(f"{name!r} is an option name of save()/restore(); save the object "
                        "under another name")
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        return obj
    if callable(getattr(obj, "state_dict", None)):
        return obj.state_dict()
    raise TypeError(f"save(..., {name}=<{type(obj).__name__}>): expected an object with "
                    "state_dict()/load_state_dict() (module, optimizer, scheduler, "
                    "PinnedLoader, History), a dict or a tensor")


def rate(nbytes: int, seconds: float) -> str:
    return f"{human_bytes(nbytes / seconds)}/s" if seconds > 0 else "N/A"


@dataclasses.dataclass
class SavePlan:
    """What save() will write: the encoded trees, the tensors and how each is stored."""
    objects: dict                 # name -> {"type", "state": encoded tree}
    rng: dict | None              # encoded RNG states
    tensors: list                 # (path, tensor) in index order
    entries: list                 # the manifest's tensor entries (segments filled when written)
    extras_blob: bytes | None     # torch.save of the values JSON cannot hold
    total: int                    # tensor bytes as stored
    half: bool
    estimate: int                 # bytes the checkpoint needs on disk, at most
    rows: list                    # disk tables: base, delta or unchanged (rows.SaveRows)
    id: str                       # this checkpoint's id (chains of disk tables name it)


def plan(objects: dict, rng: bool, half: bool, cfg: CheckpointConfig, chains: dict,
         dir_name: str) -> SavePlan:
    """Encode the objects' states (and the RNG states) and decide how each tensor is stored,
    and each disk table's rows (every dirty row written back first); nothing is written
    to the checkpoint yet. ``chains``: the manager's ``id(table rows) -> rows.Chain``."""
    packer = _tree.Packer()
    objects_tree = {}
    # every table's rows by reference (a base or the rows changed since: nbtools.checkpoint.rows),
    # but for half-precision copies of the tables in RAM or on the GPU, saved as tensors
    tables = _rows.find(objects, memory=not half)
    with _rows.holding(tables, writable=False):     # their views become $rows nodes
        refs = packer.ref = _rows.Refs(tables)
        for name, obj in objects.items():
            objects_tree[name] = {"type": f"{type(obj).__module__}.{type(obj).__qualname__}",
                                  "state": packer.encode(state_of(name, obj), name)}
        rng_tree = packer.encode(rng_state(), "<rng>") if rng else None

    half_dtype = getattr(torch, cfg.half_dtype)
    entries, total = [], 0
    for path, t in packer.tensors:
        stored = t.dtype
        if (half and t.dtype in (torch.float32, torch.float64)
                and t.numel() * t.element_size() >= cfg.half_min_bytes):
            stored = half_dtype
        nbytes = t.numel() * torch.empty((), dtype=stored).element_size()
        entries.append({"path": path, "dtype": dtype_name(t.dtype), "stored": dtype_name(stored),
                        "shape": list(t.shape), "bytes": nbytes, "device": str(t.device),
                        "segments": None})
        total += nbytes
    extras_blob = None
    if packer.extras:       # checked to load back as data only (restore never unpickles code)
        extras_blob = _tree.dump_extras(packer.extras, packer.extra_paths)
    uid = uuid.uuid4().hex
    saved = _rows.plan(refs.used, chains, cfg, dir_name, uid, len(entries))
    for s in saved:
        if s.entry is not None:
            entries.append(s.entry)
            total += s.entry["bytes"]
    segments = sum(s.entry["bytes"] // _rows.PIECE + 2 for s in saved if s.entry)
    estimate = (total + (ALIGN + 512) * len(entries) + 64 * segments
                + len(extras_blob or b"") + (64 << 10))
    return SavePlan(objects_tree, rng_tree, packer.tensors, entries, extras_blob, total,
                    half, estimate, saved, uid)


def write(directory: Path, plan: SavePlan, step: int, seq: int, final: Path,
          cfg: CheckpointConfig) -> dict:
    """Write the checkpoint under a temporary name in ``directory``, then rename it to
    ``final``; returns the manifest. On any failure the partial directory is removed."""
    clean_leftovers(directory)
    tmp = directory / tmp_name(final.name)
    bar = progress_bar(plan.total, f"saving step {step}", cfg.progress)
    try:
        tmp.mkdir(mode=PRIVATE_DIR)
        files = _write_tensors(tmp, plan, cfg, bar)
        extras = _write_extras(tmp, plan.extras_blob, files, cfg.fsync)
        body = {
            "format": FORMAT, "version": 2 if plan.rows else 1, "id": plan.id,
            "step": step, "seq": seq,
            "created_unix": time.time(), "host": socket.gethostname(),
            "nbtools": __version__, "torch": torch.__version__,
            "half": plan.half and any(e["stored"] != e["dtype"] for e in plan.entries),
            "half_dtype": cfg.half_dtype if plan.half else None,
            "bytes": sum(files.values()), "files": files, "tensors": plan.entries,
            "extras": extras, "objects": plan.objects, "rng": plan.rng,
        }
        if plan.rows:
            body["rows"] = [s.item() for s in plan.rows]
        write_manifest(tmp, body, cfg.fsync)     # last: its presence marks completeness
        _commit(tmp, final, cfg.fsync)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        clear = _save_error(e, step, plan.estimate, directory)
        if clear is None:
            raise
        raise clear from e
    finally:
        if bar is not None:
            bar.close()
    return body


def _write_tensors(tmp: Path, plan: SavePlan, cfg: CheckpointConfig, bar) -> dict:
    """Stream every tensor into the data files (filling in its segments); returns
    ``{file name: bytes}``."""
    with ThreadPoolExecutor(1) as pool:
        writer = DataWriter(tmp, cfg, pool, bar)
        staging = None
        try:
            for e, (_, t) in zip(plan.entries, plan.tensors):
                e["segments"] = writer.begin_tensor()
                stored = _dtype(e["stored"])
                if staging is None and (t.is_cuda or stored != t.dtype
                                        or not t.is_contiguous()):
                    staging = Staging(cfg.chunk_bytes)
                for mv in save_chunks(t, stored, cfg, staging):
                    writer.write(mv)
            for s in plan.rows:                # disk tables: file to file
                if s.entry is not None:
                    _rows.write(s, writer, cfg.chunk_bytes)
        finally:
            writer.close()
    return dict(writer.files)


def _write_extras(tmp: Path, blob: bytes | None, files: dict, fsync: bool) -> dict | None:
    """The side file of values JSON cannot hold (added to ``files``); its manifest entry."""
    if blob is None:
        return None
    with os.fdopen(create_new(tmp, EXTRAS), "wb") as f:
        f.write(blob)
        if fsync:
            os.fsync(f.fileno())
    files[EXTRAS] = len(blob)
    return {"file": EXTRAS, "bytes": len(blob), "crc32": zlib.crc32(blob)}


def _commit(tmp: Path, final: Path, fsync: bool) -> None:
    """Make the finished checkpoint visible, durably: fsync, then one rename."""
    if fsync:
        fsync_dir(tmp)
    os.rename(tmp, final)
    if fsync:
        fsync_dir(final.parent)


def _save_error(e: BaseException, step: int, estimate: int,
                directory: Path) -> Exception | None:
    """The error to raise for an OSError during a save (None: re-raise ``e`` as it is)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(directory).free
        return CheckpointSpaceError(
            e.errno, f"disk full while saving step {step} to {directory} "
            f"({human_bytes(free)} free, ~{human_bytes(estimate)} needed). The partial "
            "checkpoint was removed; earlier checkpoints are intact. Free space, lower "
            "keep=, or save with half_tables=True.")
    if isinstance(e, OSError):
        return CheckpointError(f"saving step {step} to {directory} failed: {e}. The "
                               "partial checkpoint was removed; earlier ones are intact.")
    return None


def report(step: int, final: Path, body: dict, plan: SavePlan, seconds: float,
           verbose: bool) -> dict:
    """What save() returns (and, ``verbose``, prints) about the checkpoint it wrote."""
    info = {"step": step, "path": str(final), "bytes": body["bytes"], "seconds": seconds,
            "bytes_per_s": body["bytes"] / seconds if seconds > 0 else None,
            "half": body["half"],
            "tables": {s.table.rows.name: {"kind": s.kind, "rows": s.count,
                                           "needs": len(s.links)}
                       for s in plan.rows}}
    info["disk_tables"] = info["tables"]         # (its name when only disk tables had chains)
    if verbose:
        tables = f"; tables: {_rows.describe(plan.rows)}" if plan.rows else ""
        print(f"checkpoint: saved step {step} ({human_bytes(body['bytes'])}"
              f"{', half-precision tables' if body['half'] else ''}) in {seconds:.2f} s, "
              f"{rate(body['bytes'], seconds)}{tables} -> {final}")
    return info
