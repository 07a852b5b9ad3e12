"""The manager: save and restore training state in a directory, keep the newest few, mirror
them (e.g. to Drive), and fall back to an older checkpoint when the newest is damaged."""
from __future__ import annotations

import dataclasses
import errno
import io
import os
import random
import shutil
import socket
import time
import uuid
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..devices import cuda_ok
from ..units import human_bytes
from . import rows as _rows
from . import tree as _tree
from .format import (_ALIGN, EXTRAS, FORMAT, CheckpointConfig, CheckpointError,
                     CheckpointSpaceError, CheckpointWarning, _check_files, _Damaged, _DataWriter,
                     _dtype, _dtype_name, _fsync_dir, _read_manifest, _Reader, _save_chunks,
                     _Staging, _write_manifest)
from .layout import _clean_leftovers, _Entry, _scan, _tmp_name, needs, prune
from .mirror import DriveSync

_RESERVED = ("rng", "half_tables", "allow_half")


def _progress_bar(total: int, desc: str, progress):
    if progress is False or total <= 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    # delay: the bar appears only for operations that last longer than a moment.
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                delay=0 if progress else 1.0, leave=False)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{human_bytes(nbytes / seconds)}/s" if seconds > 0 else "N/A"



# --- RNG ----------------------------------------------------------------------------------------

def _rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    if cuda_ok():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("cuda") is not None:
        if not cuda_ok():
            warnings.warn("the checkpoint holds CUDA RNG states but there is no GPU here: "
                          "CUDA random streams are not restored", CheckpointWarning, stacklevel=3)
        elif len(state["cuda"]) != torch.cuda.device_count():
            warnings.warn(f"the checkpoint holds RNG states of {len(state['cuda'])} GPUs, this "
                          f"machine has {torch.cuda.device_count()}: restoring the common ones",
                          CheckpointWarning, stacklevel=3)
            for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s.cpu(), i)
        else:
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])



@dataclasses.dataclass
class _SavePlan:
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


# --- the manager --------------------------------------------------------------------------------

class CheckpointManager:
    """Save and restore training state in ``directory``, keeping the newest ``keep``.

    Args:
        directory: local directory for checkpoints (created if needed).
        keep: how many complete checkpoints to keep (older ones are deleted after a save).
        mirror: a second directory (e.g. ``nbtools.colab.drive_dir("runs/w2v")``) or a
            :class:`~nbtools.checkpoint.DriveSync`: each finished checkpoint is copied there in the
            background (temp name + rename inside it). ``restore`` looks in both.
        config: :class:`CheckpointConfig` (chunk size, half precision, progress, ...).

    ``save(step, model=..., opt=..., sched=..., loader=..., history=..., extra={...})``;
    ``restore(model=..., opt=..., ...)`` returns the step (None when there is no checkpoint).
    """

    def __init__(self, directory, keep: int = 3, *, mirror=None, config: CheckpointConfig = None):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
        self.directory = Path(directory).expanduser()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:   # the path, or a parent, is a file
            raise NotADirectoryError(
                errno.ENOTDIR, f"CheckpointManager({str(directory)!r}): expected a directory for "
                f"the checkpoints, but {e.filename or self.directory} is a file. Pass a folder "
                f"path (e.g. {str(self.directory) + '.d'!r}), or move the file away.") from e
        self.keep = keep
        self.config = config or CheckpointConfig()
        self._seq = None
        self.last_restore = None     # figures of the last restore(): step, bytes, seconds, ...
        self.sync = None
        self._chains = {}            # id(DiskRows) -> rows.Chain: what a delta extends
        if mirror is not None:
            self.sync = mirror if isinstance(mirror, DriveSync) else DriveSync(mirror)
            self.sync.after_copy = lambda: prune(self.sync.target, self.keep)

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, *, rng: bool = True, half_tables: bool | None = None,
             **objects) -> dict:
        """Write a checkpoint of ``objects`` (keyword name -> object) at ``step``.

        Objects: anything with ``state_dict()``/``load_state_dict()`` (modules, optimizers,
        schedulers, loaders, histories), plain dicts, or tensors. ``rng=False`` leaves out the
        RNG states; ``half_tables=True`` stores large float tensors in half precision (lossy,
        marked in the manifest). Returns ``{"step", "path", "bytes", "seconds",
        "bytes_per_s", "half"}``.
        """
        t0 = time.perf_counter()
        step = self._check_step(step)
        half = self.config.half_tables if half_tables is None else bool(half_tables)
        if not isinstance(rng, bool):
            raise TypeError(f"rng={type(rng).__name__}: 'rng' is an option of save() (True/False)"
                            "; rename the object you meant to save")
        if not objects:
            raise ValueError("save() got no objects: pass them by name, e.g. "
                             "save(step, model=model, opt=opt)")
        if cuda_ok():
            torch.cuda.synchronize()   # GPU kernels may still be writing zero-copy tables
        final = self._final_path(step)
        plan = self._plan(objects, rng, half, final.name)
        self._check_space(plan.estimate, step)
        seq = self._next_seq()
        body = self._write(plan, step, seq, final)
        self._seq = seq
        _rows.committed(plan.rows, self._chains, plan.id)
        self._hand_to_mirror_and_prune(final)
        return self._report_save(step, final, body, plan, time.perf_counter() - t0)

    # the phases of save() ----------------------------------------------------------------------
    def _plan(self, objects: dict, rng: bool, half: bool, dir_name: str) -> _SavePlan:
        """Encode the objects' states (and the RNG states) and decide how each tensor is stored,
        and each disk table's rows (every dirty row written back first); nothing is written
        to the checkpoint yet."""
        cfg = self.config
        packer = _tree.Packer()
        objects_tree = {}
        tables = _rows.find(objects)
        with _rows.holding(tables, writable=False):     # their views become $rows nodes
            refs = packer.ref = _rows.Refs(tables)
            for name, obj in objects.items():
                objects_tree[name] = {"type": f"{type(obj).__module__}.{type(obj).__qualname__}",
                                      "state": packer.encode(self._state_of(name, obj), name)}
            rng_tree = packer.encode(_rng_state(), "<rng>") if rng else None

        half_dtype = getattr(torch, cfg.half_dtype)
        entries, total = [], 0
        for path, t in packer.tensors:
            stored = t.dtype
            if (half and t.dtype in (torch.float32, torch.float64)
                    and t.numel() * t.element_size() >= cfg.half_min_bytes):
                stored = half_dtype
            nbytes = t.numel() * torch.empty((), dtype=stored).element_size()
            entries.append({"path": path, "dtype": _dtype_name(t.dtype), "stored": _dtype_name(stored),
                            "shape": list(t.shape), "bytes": nbytes, "device": str(t.device),
                            "segments": None})
            total += nbytes
        extras_blob = None
        if packer.extras:
            buf = io.BytesIO()
            torch.save(packer.extras, buf)
            extras_blob = buf.getvalue()
        uid = uuid.uuid4().hex
        saved = _rows.plan(refs.used, self._chains, cfg, dir_name, uid, len(entries))
        for s in saved:
            if s.entry is not None:
                entries.append(s.entry)
                total += s.entry["bytes"]
        segments = sum(s.entry["bytes"] // _rows.PIECE + 2 for s in saved if s.entry)
        estimate = (total + (_ALIGN + 512) * len(entries) + 64 * segments
                    + len(extras_blob or b"") + (64 << 10))
        return _SavePlan(objects_tree, rng_tree, packer.tensors, entries, extras_blob, total,
                         half, estimate, saved, uid)

    def _write(self, plan: _SavePlan, step: int, seq: int, final: Path) -> dict:
        """Write the checkpoint under a temporary name, then rename it to ``final``; returns the
        manifest. On any failure the partial directory is removed."""
        cfg = self.config
        _clean_leftovers(self.directory)
        tmp = self.directory / _tmp_name(final.name)
        bar = _progress_bar(plan.total, f"saving step {step}", cfg.progress)
        try:
            tmp.mkdir()
            files = self._write_tensors(tmp, plan, bar)
            extras = self._write_extras(tmp, plan.extras_blob, files)
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
            _write_manifest(tmp, body, cfg.fsync)     # last: its presence marks completeness
            self._commit(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            clear = self._save_error(e, step, plan.estimate)
            if clear is None:
                raise
            raise clear from e
        finally:
            if bar is not None:
                bar.close()
        return body

    def _write_tensors(self, tmp: Path, plan: _SavePlan, bar) -> dict:
        """Stream every tensor into the data files (filling in its segments); returns
        ``{file name: bytes}``."""
        cfg = self.config
        with ThreadPoolExecutor(1) as pool:
            writer = _DataWriter(tmp, cfg, pool, bar)
            staging = None
            try:
                for e, (_, t) in zip(plan.entries, plan.tensors):
                    e["segments"] = writer.begin_tensor()
                    stored = _dtype(e["stored"])
                    if staging is None and (t.is_cuda or stored != t.dtype
                                            or not t.is_contiguous()):
                        staging = _Staging(cfg.chunk_bytes)
                    for mv in _save_chunks(t, stored, cfg, staging):
                        writer.write(mv)
                for s in plan.rows:                # disk tables: file to file
                    if s.entry is not None:
                        _rows.write(s, writer, cfg.chunk_bytes)
            finally:
                writer.close()
        return dict(writer.files)

    def _write_extras(self, tmp: Path, blob: bytes | None, files: dict) -> dict | None:
        """The side file of values JSON cannot hold (added to ``files``); its manifest entry."""
        if blob is None:
            return None
        with open(tmp / EXTRAS, "wb") as f:
            f.write(blob)
            if self.config.fsync:
                os.fsync(f.fileno())
        files[EXTRAS] = len(blob)
        return {"file": EXTRAS, "bytes": len(blob), "crc32": zlib.crc32(blob)}

    def _commit(self, tmp: Path, final: Path) -> None:
        """Make the finished checkpoint visible, durably: fsync, then one rename."""
        if self.config.fsync:
            _fsync_dir(tmp)
        os.rename(tmp, final)
        if self.config.fsync:
            _fsync_dir(self.directory)

    def _save_error(self, e: BaseException, step: int, estimate: int) -> Exception | None:
        """The error to raise for an OSError during a save (None: re-raise ``e`` as it is)."""
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(self.directory).free
            return CheckpointSpaceError(
                e.errno, f"disk full while saving step {step} to {self.directory} "
                f"({human_bytes(free)} free, ~{human_bytes(estimate)} needed). The partial "
                "checkpoint was removed; earlier checkpoints are intact. Free space, lower "
                "keep=, or save with half_tables=True.")
        if isinstance(e, OSError):
            return CheckpointError(f"saving step {step} to {self.directory} failed: {e}. The "
                                   "partial checkpoint was removed; earlier ones are intact.")
        return None

    def _hand_to_mirror_and_prune(self, final: Path) -> None:
        """Queue the copy to the mirror, then delete old checkpoints here (never one that is
        still being copied)."""
        protect = self.sync.pending() if self.sync is not None else ()
        if self.sync is not None:
            self.sync.submit(final)
        prune(self.directory, self.keep, protect=[final, *protect])

    def _report_save(self, step: int, final: Path, body: dict, plan: _SavePlan,
                     seconds: float) -> dict:
        info = {"step": step, "path": str(final), "bytes": body["bytes"], "seconds": seconds,
                "bytes_per_s": body["bytes"] / seconds if seconds > 0 else None,
                "half": body["half"],
                "disk_tables": {s.table.disk.name: {"kind": s.kind, "rows": s.count,
                                                    "needs": len(s.links)}
                                for s in plan.rows}}
        if self.config.verbose:
            tables = f"; disk tables: {_rows.describe(plan.rows)}" if plan.rows else ""
            print(f"checkpoint: saved step {step} ({human_bytes(body['bytes'])}"
                  f"{', half-precision tables' if body['half'] else ''}) in {seconds:.2f} s, "
                  f"{_rate(body['bytes'], seconds)}{tables} -> {final}")
        return info

    @staticmethod
    def _check_step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}")
        return int(step)

    @staticmethod
    def _state_of(name: str, obj):
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

    def _check_space(self, need: int, step: int) -> None:
        free = shutil.disk_usage(self.directory).free
        margin = self.config.free_space_margin_bytes
        if free < need + margin:
            raise CheckpointSpaceError(
                errno.ENOSPC,
                f"not enough space to save step {step}: the checkpoint needs "
                f"~{human_bytes(need)} (+{human_bytes(margin)} margin) but {self.directory} has "
                f"{human_bytes(free)} free. Nothing was written. Delete old checkpoints or lower "
                "keep=, save to a larger disk, or pass half_tables=True (half the table bytes).")

    def _next_seq(self) -> int:
        if self._seq is None:
            seqs = [e.seq for e, _ in self._entries()]
            self._seq = max(seqs, default=0)
        return self._seq + 1

    def _final_path(self, step: int) -> Path:
        base = f"step-{step:09d}"
        revs = [e.rev for e in _scan(self.directory) if e.step == step]
        if not revs and not (self.directory / base).exists():
            return self.directory / base
        return self.directory / f"{base}-r{max(revs, default=0) + 1}"

    def _entries(self) -> list[tuple[_Entry, str]]:
        """Checkpoints here and in the mirror, newest first; local first among equals."""
        out = [(e, "local") for e in _scan(self.directory)]
        if self.sync is not None:
            out += [(e, "mirror") for e in _scan(self.sync.target)]
        out.sort(key=lambda x: (x[0].seq, x[0].step, x[0].rev, x[1] == "local"), reverse=True)
        return out

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, *, rng: bool = True, allow_half: bool | None = None, **objects) -> int | None:
        """Load the newest checkpoint that verifies into ``objects``; return its step.

        Falls back to older checkpoints when the newest is damaged (with a warning); returns
        None when there is no checkpoint at all; raises :class:`CheckpointError` when there are
        checkpoints but none can be read (so a run never silently starts over). A checkpoint
        with half-precision tables is restored only with ``allow_half=True`` (default: the
        config's ``half_tables``).
        """
        t0 = time.perf_counter()
        self._rows_touched = False
        allow_half = self.config.half_tables if allow_half is None else allow_half
        for name, obj in objects.items():
            self._state_of(name, obj)             # type check before touching anything
        candidates = self._entries()
        if not candidates:
            if self.config.verbose:
                print(f"checkpoint: none in {self.directory}"
                      f"{' or ' + str(self.sync.target) if self.sync else ''}; starting fresh")
            return None
        failures = []
        for entry, where in candidates:
            if entry.manifest is None:   # order unknown (its manifest is what is damaged): say so now
                failures.append(f"{where} {entry.path.name}: {entry.error}")
                warnings.warn(f"checkpoint {entry.path} is damaged ({entry.error}); skipping it",
                              CheckpointWarning, stacklevel=2)
        for entry, where in candidates:
            label = f"{where} {entry.path.name}"
            if entry.manifest is None:
                continue
            try:
                m = entry.manifest
                missing = [n for n in objects if n not in m["objects"]]
                if missing:
                    raise CheckpointError(
                        f"checkpoint {entry.path} has no {', '.join(map(repr, missing))}; it holds "
                        f"{', '.join(map(repr, m['objects']))}. Restore with the names used in save().")
                if m.get("half") and not allow_half:
                    raise CheckpointError(
                        f"checkpoint {entry.path} (step {m['step']}) stores its tables in "
                        f"{m.get('half_dtype')} (saved with half_tables=True): restoring it is "
                        "not exact. Pass allow_half=True to restore it anyway.")
                _check_files(entry.path, m)
                self._check_needs(entry.path, m)
                nbytes = self._load(entry, objects, rng)
            except _Damaged as e:
                failures.append(f"{label}: {e}")
                warnings.warn(f"checkpoint {entry.path} is damaged ({e}); trying an older one",
                              CheckpointWarning, stacklevel=2)
                continue
            seconds = time.perf_counter() - t0
            if m.get("half"):
                warnings.warn(f"restored step {m['step']} from half-precision ({m['half_dtype']}) "
                              "copies of the tables: values are rounded, not exact",
                              CheckpointWarning, stacklevel=2)
            if self.config.verbose:
                print(f"checkpoint: restored step {m['step']} from {entry.path} "
                      f"({human_bytes(nbytes)} in {seconds:.2f} s, {_rate(nbytes, seconds)})"
                      + (f"; skipped {len(failures)} damaged" if failures else ""))
            self.last_restore = {"step": m["step"], "path": str(entry.path), "bytes": nbytes,
                                 "seconds": seconds,
                                 "bytes_per_s": nbytes / seconds if seconds > 0 else None,
                                 "skipped": failures}
            return m["step"]
        raise CheckpointError("no checkpoint could be restored; every one is damaged:\n  "
                              + "\n  ".join(failures)
                              + ("\nDisk tables may have been partly rewritten by the attempts: "
                                 "do not train on them." if self._rows_touched else ""))

    def _load(self, entry: _Entry, objects: dict, rng: bool) -> int:
        m, cfg = entry.manifest, self.config
        # Disk tables the restored objects refer to: matched with the live ones, and their
        # chains found, before anything is read.
        nodes = _tree.rows_nodes(*(m["objects"][name]["state"] for name in objects))
        matched = _rows.match(m.get("rows") or [], {n["$rows"] for n in nodes},
                              _rows.find(objects), entry.path) if nodes else {}
        chains = {k: self._chain_of(entry, m["rows"][k]) for k in matched}
        # Destinations: the objects' live tensors where shape and dtype match (read in place,
        # no second copy), else fresh CPU tensors.
        live: dict[int, torch.Tensor] = {}
        for name, obj in objects.items():
            _tree.live_tensors(m["objects"][name]["state"], self._state_of(name, obj), live)
        wanted = _tree.tensor_indices(*(m["objects"][name]["state"] for name in objects),
                                      m.get("rng") if rng else None)
        total = sum(m["tensors"][i]["bytes"] for i in wanted)
        tensors: list = [None] * len(m["tensors"])
        bar = _progress_bar(total, f"restoring step {m['step']}", cfg.progress)
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
            extras = self._read_extras(entry.path, m)
        finally:
            if bar is not None:
                bar.close()
        # Every byte verified: the disk tables' rows (each piece checked before it is written),
        # then the state goes to the objects, the tables' own views standing for their rows.
        for k, t in matched.items():
            self._rows_touched = True
            total += _rows.restore(t, chains[k], cfg.chunk_bytes)
        with _rows.holding(list(matched.values()), writable=True):
            self._hand_over(m, objects, tensors, extras, matched)
        for k, t in matched.items():
            links = m["rows"][k]["chain"]
            _rows.committed([_rows.SaveRows(t, "same", 0, links, None)], self._chains, m["id"])
        if rng and m.get("rng") is not None:
            _set_rng_state(_tree.decode(m["rng"], tensors, extras))
        return total

    def _hand_over(self, m: dict, objects: dict, tensors: list, extras: list,
                   matched: dict) -> None:
        """``load_state_dict`` of each object with its decoded state."""
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

    def _roots(self) -> list[Path]:
        return [self.directory] + ([self.sync.target] if self.sync is not None else [])

    def _find_dir(self, first: Path, name: str, uid: str) -> tuple[Path, dict] | None:
        """The complete checkpoint directory ``name`` of id ``uid``: in ``first`` (the root of
        the checkpoint that needs it), else in the other root (local or mirror)."""
        for root in [first] + [r for r in self._roots() if r != first]:
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

    def _check_needs(self, path: Path, m: dict) -> None:
        for name, uid in needs(m):
            if self._find_dir(path.parent, name, uid) is None:
                raise _Damaged(f"it needs {name} (a base or delta of its disk tables), which is "
                               f"missing or incomplete in {' and '.join(map(str, self._roots()))}")

    def _chain_of(self, entry: _Entry, item: dict) -> list:
        """``(directory, link, tensor entry)`` of each link of a disk table's chain."""
        m, out = entry.manifest, []
        for link in item["chain"]:
            if link["id"] == m.get("id"):
                found = (entry.path, m)
            else:
                found = self._find_dir(entry.path.parent, link["dir"], link["id"])
            if found is None:
                raise _Damaged(f"it needs {link['dir']} (the {link['kind']} of disk table "
                               f"{item['name']!r}), which is missing or incomplete")
            tensors = found[1]["tensors"]
            if not 0 <= link["tensor"] < len(tensors):
                raise _Damaged(f"{link['dir']} has no tensor {link['tensor']} (the "
                               f"{link['kind']} of disk table {item['name']!r})")
            out.append((found[0], link, tensors[link["tensor"]]))
        return out

    @staticmethod
    def _read_extras(path: Path, m: dict) -> list:
        if not m.get("extras"):
            return []
        blob = (path / m["extras"]["file"]).read_bytes()
        if len(blob) != m["extras"]["bytes"] or zlib.crc32(blob) != m["extras"]["crc32"]:
            raise _Damaged(f"{m['extras']['file']}: checksum mismatch (file damaged)")
        # A pickle from your own checkpoint directory (small values that JSON cannot hold).
        return torch.load(io.BytesIO(blob), weights_only=False)

    # -- listing -----------------------------------------------------------------------------
    def checkpoints(self, verify: bool = False) -> list[dict]:
        """What is there, newest first: step, path, where (local/mirror), bytes, created time,
        half, and status: ``"ok"`` (all files present with their sizes), ``"verified"``
        (every checksum read and matched, with ``verify=True``) or ``"damaged: ..."``."""
        out = []
        for entry, where in self._entries():
            m = entry.manifest
            row = {"step": entry.step, "path": str(entry.path), "where": where,
                   "bytes": m["bytes"] if m else None,
                   "created": time.strftime("%Y-%m-%d %H:%M:%S",
                                            time.localtime(m["created_unix"])) if m else None,
                   "half": m.get("half") if m else None,
                   "needs": [name for name, _ in needs(m)] if m else [], "status": None}
            try:
                if m is None:
                    raise _Damaged(entry.error)
                _check_files(entry.path, m)
                self._check_needs(entry.path, m)
                row["status"] = "ok"
                if verify:
                    self._verify(entry)
                    row["status"] = "verified"
            except _Damaged as e:
                row["status"] = f"damaged: {e}"
            out.append(row)
        return out

    def list(self, verify: bool = False):
        """Deprecated name of :meth:`checkpoints` (a method named ``list`` hides the builtin
        inside the class)."""
        warnings.warn("CheckpointManager.list() is renamed checkpoints(); list() will be "
                      "removed", DeprecationWarning, stacklevel=2)
        return self.checkpoints(verify=verify)

    def _verify(self, entry: _Entry) -> None:
        m = entry.manifest
        with ThreadPoolExecutor(1) as pool:
            reader = _Reader(entry.path, self.config, pool, None)
            try:
                for e in m["tensors"]:
                    reader.read_tensor(e, None, f"tensor {e['path']!r}")
            finally:
                reader.close()
        self._read_extras(entry.path, m)

    def latest_step(self) -> int | None:
        """Step of the newest complete checkpoint (not verified), or None."""
        for entry, _ in self._entries():
            if entry.manifest is not None:
                return entry.manifest["step"]
        return None

    def finalize(self, **kwargs) -> None:
        """Wait for background copies to the mirror and flush it (Drive: see
        :meth:`~nbtools.checkpoint.DriveSync.finalize`). Call once at the end of training."""
        if self.sync is not None:
            self.sync.finalize(**kwargs)

    def __repr__(self) -> str:
        mirror = f", mirror={str(self.sync.target)!r}" if self.sync else ""
        return f"CheckpointManager({str(self.directory)!r}, keep={self.keep}{mirror})"
