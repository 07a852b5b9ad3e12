"""The manager: save and restore training state in a directory, keep the newest few, mirror
them (e.g. to Drive), and fall back to an older checkpoint when the newest is damaged.

It decides where and which: the directory and the name of a new checkpoint, its sequence number,
whether it fits, which checkpoint a restore tries next, what is pruned and what goes to the
mirror. Writing one checkpoint is :mod:`~nbtools.checkpoint.save`'s; reading one back,
:mod:`~nbtools.checkpoint.restore`'s."""
from __future__ import annotations

import errno
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from ..devices import cuda_ok
from ..units import human_bytes
from . import restore as _restore
from . import rows as _rows
from . import save as _save
from . import tree as _tree
from .format import (PRIVATE_DIR, CheckpointConfig, CheckpointError, CheckpointSpaceError,
                     CheckpointWarning, check_files, Damaged)
from .layout import Entry, scan, needs, prune
from .mirror import DriveSync
from .rng import set_rng_state
from .save import state_of


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
            self.directory.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
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
        self._chains = {}            # id(a table's rows) -> rows.Chain: what a delta extends
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
        plan = _save.plan(objects, rng, half, self.config, self._chains, final.name)
        self._check_space(plan.estimate, step)
        seq = self._next_seq()
        body = _save.write(self.directory, plan, step, seq, final, self.config)
        self._seq = seq
        _rows.committed(plan.rows, self._chains, plan.id)
        self._hand_to_mirror_and_prune(final)
        return _save.report(step, final, body, plan, time.perf_counter() - t0,
                            self.config.verbose)

    # around save() ----------------------------------------------------------------------------
    def _hand_to_mirror_and_prune(self, final: Path) -> None:
        """Queue the copy to the mirror, then delete old checkpoints here (never one that is
        still being copied)."""
        protect = self.sync.pending() if self.sync is not None else ()
        if self.sync is not None:
            self.sync.submit(final)
        prune(self.directory, self.keep, protect=[final, *protect])

    @staticmethod
    def _check_step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise TypeError(f"step must be a non-negative int, got {step!r}")
        return int(step)

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
        revs = [e.rev for e in scan(self.directory) if e.step == step]
        if not revs and not (self.directory / base).exists():
            return self.directory / base
        return self.directory / f"{base}-r{max(revs, default=0) + 1}"

    def _entries(self) -> list[tuple[Entry, str]]:
        """Checkpoints here and in the mirror, newest first; local first among equals."""
        out = [(e, "local") for e in scan(self.directory)]
        if self.sync is not None:
            out += [(e, "mirror") for e in scan(self.sync.target)]
        out.sort(key=lambda x: (x[0].seq, x[0].step, x[0].rev, x[1] == "local"), reverse=True)
        return out

    # -- restoring ---------------------------------------------------------------------------
    def restore(self, *, rng: bool = True, allow_half: bool | None = None,
                fall_back: bool = True, **objects) -> int | None:
        """Load the newest checkpoint that verifies into ``objects``; return its step.

        Falls back to older checkpoints when the newest is damaged (with a warning); returns
        None when there is no checkpoint at all; raises :class:`CheckpointError` when there are
        checkpoints but none can be read (so a run never silently starts over). A checkpoint
        with half-precision tables is restored only with ``allow_half=True`` (default: the
        config's ``half_tables``). ``fall_back=False`` tries the newest checkpoint alone: all
        of it, or (damaged) nothing, never an older step (a sharded restore needs every rank at
        one step).
        """
        t0 = time.perf_counter()
        self._rows_touched = False
        allow_half = self.config.half_tables if allow_half is None else allow_half
        for name, obj in objects.items():
            state_of(name, obj)             # type check before touching anything
        candidates = self._entries()
        if not fall_back:
            candidates = candidates[:1]
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
                check_files(entry.path, m)
                _restore.check_needs(self._roots(), entry.path, m)
                nbytes = self._load(entry, objects, rng)
            except Damaged as e:
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
                      f"({human_bytes(nbytes)} in {seconds:.2f} s, {_save.rate(nbytes, seconds)})"
                      + (f"; skipped {len(failures)} damaged" if failures else ""))
            self.last_restore = {"step": m["step"], "path": str(entry.path), "bytes": nbytes,
                                 "seconds": seconds,
                                 "bytes_per_s": nbytes / seconds if seconds > 0 else None,
                                 "skipped": failures}
            return m["step"]
        raise CheckpointError("no checkpoint could be restored; every one is damaged:\n  "
                              + "\n  ".join(failures)
                              + ("\nDisk tables may have been partly rewritten by the attempts: "
                                 "do not train on them." if self._rows_touched else
                                 "\nNothing was restored: every object is as it was."))

    def _load(self, entry: Entry, objects: dict, rng: bool) -> int:
        m, cfg = entry.manifest, self.config
        # All or nothing: the side file (data only), the disk tables' chains and every object
        # checked against the checkpoint, and the checksums of every byte that goes into a
        # live tensor read, before the first write into anything.
        extras = _restore.read_extras(entry.path, m)
        nodes = _tree.rows_nodes(*(m["objects"][name]["state"] for name in objects))
        matched = _rows.match(m.get("rows") or [], {n["$rows"] for n in nodes},
                              _rows.find(objects), entry.path) if nodes else {}
        chains = {k: _restore.chain_of(self._roots(), entry, m["rows"][k]) for k in matched}
        with _rows.holding(list(matched.values()), writable=False):
            _restore.preflight(entry, objects, extras, matched, bool(m.get("half")))
        # Small objects (loaders, schedulers, histories) are loaded first, from fresh tensors,
        # and put back as they were if anything after fails; the RNG states are tried on
        # generators of their own. Only then does a byte go into a live tensor or table.
        staged = _restore.staged(m, objects)
        # Destinations: the other objects' live tensors where shape and dtype match (read in
        # place, no second copy), else fresh CPU tensors (restore.read_tensors).
        live: dict[int, torch.Tensor] = {}
        for name, obj in objects.items():
            if name not in staged:
                _tree.live_tensors(m["objects"][name]["state"], state_of(name, obj), live)
        wanted = _tree.tensor_indices(*(m["objects"][name]["state"] for name in objects),
                                      m.get("rng") if rng else None)
        _restore.verify(entry, cfg, which={i for i in wanted if i in live})
        for k, links in chains.items():
            _restore.verify_chain(links, m["rows"][k]["name"], cfg)
        total = sum(m["tensors"][i]["bytes"] for i in wanted)
        # (tensors read into fresh memory are checked as they are read: a damaged one
        # changes nothing live)
        tensors = _restore.read_tensors(entry, [i for i in wanted if i not in live], {}, cfg)
        rng_state = _restore.rng_of(entry, tensors, extras) if rng else None
        undo = _restore.load_staged(entry, {n: objects[n] for n in staged}, tensors, extras)
        try:
            later = _restore.read_tensors(entry, [i for i in wanted if i in live], live, cfg)
            for i, t in enumerate(later):
                if t is not None:
                    tensors[i] = t
            # Every byte verified: the disk tables' rows, then the state goes to the objects,
            # the tables' own views standing for their rows.
            for k, t in matched.items():
                self._rows_touched = True
                total += _rows.restore(t, chains[k], cfg.chunk_bytes)
            with _rows.holding(list(matched.values()), writable=True):
                _restore.hand_over(m, {n: o for n, o in objects.items() if n not in staged},
                                   tensors, extras, matched)
        except BaseException:
            undo()
            raise
        for k, t in matched.items():
            links = m["rows"][k]["chain"]
            _rows.committed([_rows.SaveRows(t, "same", 0, links, None)], self._chains, m["id"])
        if rng_state is not None:
            set_rng_state(rng_state)
        return total

    def _roots(self) -> list[Path]:
        return [self.directory] + ([self.sync.target] if self.sync is not None else [])

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
                    raise Damaged(entry.error)
                check_files(entry.path, m)
                _restore.check_needs(self._roots(), entry.path, m)
                row["status"] = "ok"
                if verify:
                    _restore.verify(entry, self.config)
                    row["status"] = "verified"
            except Damaged as e:
                row["status"] = f"damaged: {e}"
            out.append(row)
        return out

    def list(self, verify: bool = False):
        """Deprecated name of :meth:`checkpoints` (a method named ``list`` hides the builtin
        inside the class)."""
        warnings.warn("CheckpointManager.list() is renamed checkpoints(); list() will be "
                      "removed", DeprecationWarning, stacklevel=2)
        return self.checkpoints(verify=verify)

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
