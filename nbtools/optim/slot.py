"""A table's part in an optimizer step: what happens to the rows the step touched.

:class:`nbtools.OffloadOptimizer` keeps one :class:`TableSlot` per table: the table's param group
(hyper-parameters, which LR schedulers change), its scalar state (Adam's ``step``, kept once per
table as ``torch.optim.SparseAdam`` keeps it) and a scratch optimizer. In a step the slot gets
the table's :class:`~nbtools.engine.lookups.StepRows` (the unique ids, their summed gradients, the rows
``[weight | state...]`` as gathered) and updates those rows in one of two ways:

* **fused** (:meth:`TableSlot.plan_fused`, :meth:`TableSlot.queue_fused`): one Triton kernel
  (:mod:`nbtools.kernels`) reads the rows, computes the update in float32 and writes weight and
  state back through the table's :class:`~nbtools.store.rows.RowStore`, or into the gathered rows for
  the store to write behind the next step. It is queued before the host has read the step's
  checks and writes nothing when the device-side guard says the step must not go ahead;
* **generic** (:meth:`TableSlot.apply`): the stock optimizer steps a scratch parameter holding
  only the touched rows and their state, and the rows are written back in one scatter.

Neither path asks where the rows live: the store does (:mod:`nbtools.store.rows`; the table's side of
the step is :mod:`nbtools.engine.lookups`). The optimizer itself (:mod:`nbtools.optim`) runs the step
around the slots: the checks, the one host synchronisation, errors and skips.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import zlib
from collections import defaultdict
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import kernels
from ..engine import steps
from ..engine.lookups import StepRows
from ..placement import copy_unless_same
from .config import check_group, concrete, rehearse_step
from .probe import (NOT_HYPER, UnsupportedOptimizerError, check_hyper, initial_row_state,
                    set_grad, probe_row_state)
from ..tables import OffloadedEmbedding

if TYPE_CHECKING:
    from .config import OffloadConfig


@dataclasses.dataclass
class _FusedPlan:
    """A table's fused update for one step: the kernel, its scalars and options, and the
    scalar state (Adam's step) the table keeps if the step goes ahead."""

    fused: kernels.FusedUpdate
    values: list
    consts: dict
    scalar: dict
    steps: int = 0                  # the table's steps taken once this one goes ahead


class TableSlot:
    """One table's share of an OffloadOptimizer: hyper-parameters, scalar state, scratch optimizer.

    Per-row state lives in the table itself, interleaved after each row's weight
    (:meth:`OffloadedEmbedding.attach_state`).
    """

    def __init__(self, name, table: OffloadedEmbedding, cls, group: dict, config: "OffloadConfig",
                 owner, index: int = 0):
        self.name, self.table, self.cls = name, table, cls
        self.index = index            # its row in a step's scalars (steps.Turn)
        check_hyper(cls, group)
        dtype = table.compute_dtype           # the math's dtype (float32 for bf16 storage)
        row_state, self.scalar_names, full, self.scalar_template, self.row_shapes = \
            probe_row_state(cls, group, table.embedding_dim, table.device, dtype,
                            check_separable=config.probe)
        odd = {k: str(v) for k, v in row_state.items() if v != dtype}
        if odd:
            raise UnsupportedOptimizerError(
                f"{cls.__name__} keeps per-row state in another dtype than the table computes "
                f"in ({dtype}): {odd}; offloaded tables keep state in one float dtype")
        self.ctor_kwargs = dict(group)                  # what the user passed
        self.group = {"params": [], **full, **group}   # what schedulers see and change
        self.sparse = issubclass(cls, torch.optim.SparseAdam)
        self.names = list(row_state)
        table.attach_state(self.names, initial_row_state(cls, self.group, self.names), owner,
                           dims={k: math.prod(s) for k, s in self.row_shapes.items()})
        self.scalar_state = None      # created by the optimizer itself at the first step
        self._rounds = 0              # steps that went ahead (stochastic rounding's seeds)
        self.opt = None
        self.skipped_steps = 0
        self.use_fused = config.fused
        self._fused_for = self._fused = None      # fused_update's last answer, and for what
        self._name_crc = zlib.crc32(name.encode())
        if config.fused not in ("auto", True, False):
            raise ValueError(f"OffloadConfig.fused must be 'auto', True or False, "
                             f"got {config.fused!r}")

    def hyper(self) -> dict:
        return {k: v for k, v in self.group.items() if k not in NOT_HYPER}

    def fused_update(self):
        """The fused kernel for this step, or None for the generic path (the stock optimizer
        on the gathered rows). Hyper-parameters can change between steps (schedulers)."""
        if self.use_fused is False:
            return None
        store = self.table.rows
        try:          # the last answer, while nothing it depends on has changed
            key = (store.direct, store.device, self.table.compute_dtype,
                   tuple(kv for kv in self.group.items() if kv[0] != "params"))
            hash(key)
        except TypeError:                   # an unhashable hyper-parameter: ask every step
            key = None
        if key is not None and key == self._fused_for:
            return self._fused
        if not (store.direct or self.use_fused is True) or \
                not kernels.usable_on(store.device, "update"):
            self._fused_for, self._fused = key, None
            return None
        fn = kernels.fused_update_for(self.cls, self.group, self.names, self.table.compute_dtype)
        if fn is None and self.use_fused is True:
            raise UnsupportedOptimizerError(
                f"table {self.name!r}: no fused kernel for {self.cls.__name__} with "
                f"{self.hyper()} on a {self.table.compute_dtype} table; use "
                "OffloadConfig(fused='auto') to fall back to the generic path")
        self._fused_for, self._fused = key, fn
        return fn

    def _next_scalar_state(self) -> tuple[int, dict]:
        """The step number after this one, and the scalar state as the optimizer keeps it."""
        t = 1
        if self.scalar_state is not None and "step" in self.scalar_state:
            t = int(self.scalar_state["step"]) + 1       # a CPU scalar: no GPU sync
        state = {}
        for key, template in self.scalar_template.items():
            if key != "step":
                return t, None        # scalar state other than a step count: generic path only
            state[key] = torch.tensor(float(t), dtype=template.dtype) \
                if torch.is_tensor(template) else t
        return t, state

    def plan_fused(self, got: StepRows) -> "_FusedPlan | None":
        """This table's fused update for the step (the kernel, its scalars and the scalar
        state to keep if the step goes ahead), or None where it takes the generic path."""
        if self.names and not got.has_state:        # looked up before the state was attached
            return None
        fused = self.fused_update()
        if fused is None:
            return None
        t, scalar = self._next_scalar_state()
        if scalar is None:
            return None
        # Stochastic rounding's noise: new every step. Its seed follows the optimizer's step
        # count where it keeps one (Adam), else the steps this table took (SGD and
        # RowWiseAdagrad keep none: their noise was the same every step, which biases).
        steps = self._rounds + 1
        values, consts = fused.scalars(self.group, t, self._seed(
            t if "step" in self.scalar_template else steps))
        return _FusedPlan(fused, values, consts, scalar, steps)

    def writes_behind(self, got: StepRows, plan: "_FusedPlan | None") -> bool:
        """Whether this step's fused update writes the gathered rows in place, and the table
        writes them back behind the next step (:meth:`nbtools.store.tiers.WriteBehind.write_behind`)."""
        wanted = self.table.config.write_behind
        return plan is not None and wanted is not False and got.has_state \
            and self.table.rows.can_write_behind(got.rows, forced=wanted is True)

    def queue_fused(self, got: StepRows, plan: "_FusedPlan", guard: torch.Tensor,
                    hyper: torch.Tensor, in_place: bool = False) -> None:
        """Queue the fused update (it writes nothing where ``guard`` is nonzero on the
        device; it reads its scalars from ``hyper``): to the table, or ``in_place``, into the
        gathered rows (:meth:`writes_behind`)."""
        table = self.table
        layout = table.layout
        rows_w = layout.weight(got.rows) if got.has_state else got.rows
        if in_place:
            target = kernels.Target(got.rows, rows_w, layout.weight_cols,
                                    rounding=table.config.rounding, in_place=True,
                                    num_rows=table.num_embeddings)
        else:
            target = table.rows.target(got.batch.ids, layout, table.config.rounding,
                                       got.batch.num_rows)
        plan.fused(got.rows, rows_w, got.grad, target, got.batch.ids, got.batch.count, guard,
                   hyper, plan.consts)

    def graph_key(self, got: StepRows, plan: "_FusedPlan", in_place: bool) -> tuple[tuple, list]:
        """What a CUDA graph of this table's checks and update bakes in, and the objects
        named in it by identity (the graph keeps them, so no other object takes their id)."""
        store, sig = self.table.rows, steps.signature
        caps = got.captures
        if len(caps) == 1 and caps[0] is not None and got.rows is caps[0].rows:
            looked = id(caps[0])        # a captured lookup: its outputs never move
        else:
            looked = (sig(got.rows), sig(got.batch.ids), sig(got.batch.meta))
        summing = None
        if got.summing is not None:      # the per-id sum of the gradient, graphed with it
            grad, batch = got.summing
            summing = (sig(grad), self.table.deterministic) + (
                () if isinstance(looked, int) else (sig(batch.order), sig(batch.slot)))
        key = (self.index, plan.fused.rule, tuple(sorted(plan.consts.items())),
               self.table.config.rounding, got.has_state, self.table.layout.weight_cols,
               looked, sig(got.grad), summing, id(store.host), id(store.cache), in_place)
        return key, [caps[0] if caps else None, store.host, store.cache]

    def _seed(self, t: int) -> int:
        """Stochastic rounding's seed for step ``t``: a new one every step, per table."""
        return (t * 1_000_003 + self._name_crc) % (1 << 31)

    def went_ahead(self, plan: "_FusedPlan") -> None:
        """Keep the scalar state and the step count of a fused step that went ahead (or, its
        checks read late, is taken to have: :meth:`restore` undoes it)."""
        self.scalar_state, self._rounds = plan.scalar, plan.steps

    def saved(self) -> tuple:
        """What :meth:`went_ahead` changes, to :meth:`restore` if the step must not have
        happened."""
        return self.scalar_state, self._rounds

    def restore(self, saved: tuple) -> None:
        self.scalar_state, self._rounds = saved

    def commit_fused(self, plan: "_FusedPlan", count: int, sentinel: bool) -> None:
        """The step went ahead: keep its scalar state and count the bytes written."""
        self.went_ahead(plan)
        self.count_written(count, sentinel)

    def count_written(self, count: int, sentinel: bool) -> None:
        """Count the bytes a fused step wrote to host memory."""
        store = self.table.rows
        if store.cache is None:          # with a cache: counted from its statistics
            store.count_bytes((count - int(sentinel)) * store.row_bytes, h2d=False)

    def apply(self, got: StepRows, count: int, sentinel: bool) -> None:
        """The generic path: the stock optimizer on the ``count - sentinel`` touched rows,
        written back in one scatter. With no row touched (a lookup of no ids, or only padding)
        it still runs on zero rows, so the scalar state (Adam's step) advances as in the fused
        path and in torch's sparse optimizers: a shard of a ShardedEmbedding that no rank asked
        for this step keeps the same step count as the whole table would."""
        table = self.table
        layout, compute = table.layout, table.compute_dtype
        m = max(count - int(sentinel), 0)
        ids, grad, rows = got.batch.ids[:m], got.grad[:m], got.rows[:m]
        if self.names and not got.has_state:        # looked up before the state was attached
            rows = table.rows.gather(ids)
        stored = self.names or got.has_state        # rows as stored (else the lookup's values)
        weight = layout.weight(rows) if stored else rows
        p = nn.Parameter(weight.to(compute, copy=True))
        set_grad(p, grad.to(p.dtype), self.sparse)
        if self.opt is None:
            self.opt = self.cls([p], **self.ctor_kwargs)
        else:
            self.opt.param_groups[0]["params"] = [p]
        self.opt.param_groups[0].update(self.hyper())     # LR schedulers change self.group
        if self.scalar_state is not None:
            # These rows' own state, plus the table's global scalar state.
            st = {k: layout.state(rows, i).to(compute, copy=True).reshape(m, *self.row_shapes[k])
                  for i, k in enumerate(self.names)}
            st.update(self.scalar_state)
            self.opt.state = defaultdict(dict, {p: st})
        # else: the very first step lets the optimizer create its state exactly as it would
        # (Adagrad already did in its constructor).
        self.opt.step()
        st = self.opt.state[p]
        missing = [k for k in self.names if k not in st]
        if missing:
            raise UnsupportedOptimizerError(
                f"{self.cls.__name__} dropped state {missing} between steps (hyper-parameters "
                "changed?); offloaded tables need a fixed set of per-row state")
        # One write per row: [weight | state...], the layout of the table, each value rounded
        # once to its storage dtype.
        gen = None
        self._rounds += 1
        if table.config.rounding == "stochastic":
            gen = torch.Generator(device=p.device).manual_seed(self._seed(self._rounds))
        states = [st[k].reshape(m, w) for k, w in zip(self.names, layout.state_widths)]
        table.rows.scatter(ids, layout.pack(p.detach(), states, table.config.rounding, gen))
        self.scalar_state = {k: v for k, v in st.items() if k not in self.names}
        self.opt.state = defaultdict(dict)       # drop references to this step's rows
        self.opt.param_groups[0]["params"] = []

    def row_state(self, keep_cache: bool = False) -> dict:
        return {k: self.table.state_columns(k, keep_cache) for k in self.names}

    def row_state_shapes(self) -> dict:
        """Each per-row state's shape ``(rows, columns)``, without reading it."""
        t = self.table
        widths = dict(zip(t.state_names, t.layout.state_widths))
        return {k: (t.num_embeddings, widths[k]) for k in self.names}

    def state_dict(self) -> dict:
        return {
            "group": copy.deepcopy(self.hyper()),
            "scalar_state": copy.deepcopy(self.scalar_state),
            "row_state": self.row_state(keep_cache=True),
            # stochastic rounding's seeds follow the steps taken: a resumed run must draw
            # the noise the uninterrupted one would have
            "rounds": self._rounds,
        }

    def check_state_dict(self, sd: dict) -> None:
        """Raise ValueError where ``sd`` would not load into this slot (changes nothing)."""
        if not isinstance(sd, dict) or not isinstance(sd.get("row_state"), dict):
            raise ValueError(f"table {self.name!r}: its state has no per-row tensors")
        check_group(sd.get("group"), self.hyper(), f"table {self.name!r}")
        scalar = sd.get("scalar_state")
        if scalar is not None and not isinstance(scalar, dict):
            raise ValueError(f"table {self.name!r}: scalar state is a {type(scalar).__name__}, "
                             "expected a dict")
        rounds = sd.get("rounds", 0)
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
            raise ValueError(f"table {self.name!r}: rounds is {rounds!r:.40}, expected an int >= 0")
        if set(self.names) != set(sd["row_state"]):
            raise ValueError(f"table {self.name!r}: state has per-row tensors "
                             f"{sorted(sd['row_state'])}, this optimizer keeps {sorted(self.names)}")
        shapes = self.row_state_shapes()
        for key, shape in shapes.items():
            src = sd["row_state"][key]
            if not isinstance(src, torch.Tensor):
                raise ValueError(f"table {self.name!r}: state {key!r} is a {type(src).__name__}, "
                                 "expected a tensor")
            if tuple(src.shape) != shape:
                raise ValueError(f"table {self.name!r}: state {key!r} has shape {tuple(src.shape)},"
                                 f" expected {shape}")
        if "params" in sd["group"]:
            raise ValueError(f"table {self.name!r}: its hyper-parameters hold 'params' (a table's "
                             "group lists no parameters)")
        if scalar is not None:
            self._check_scalar(scalar)
        self._rehearse(concrete(sd["group"]), None if scalar is None else concrete(scalar))

    def _check_scalar(self, scalar: dict) -> None:
        """Refuse scalar state (Adam's ``step``) of other names or kinds than the optimizer
        keeps (:attr:`scalar_template`, from the probe's steps)."""
        if set(scalar) != set(self.scalar_template):
            raise ValueError(f"table {self.name!r}: scalar state has {sorted(scalar)}, "
                             f"{self.cls.__name__} keeps {sorted(self.scalar_template)}")
        for key, template in self.scalar_template.items():
            value = scalar[key]
            if torch.is_tensor(template):
                ok = (torch.is_tensor(value) and tuple(value.shape) == tuple(template.shape)
                      and not value.dtype.is_complex and value.dtype != torch.bool)
            else:
                ok = isinstance(value, type(template)) and not isinstance(value, bool)
            if not ok:
                shown = f"shape {tuple(value.shape)}" if torch.is_tensor(value) else repr(value)[:40]
                raise ValueError(f"table {self.name!r}: scalar state {key!r} is {shown} "
                                 f"({type(value).__name__}), expected one like {template!r:.40}")

    def _rehearse(self, group: dict, scalar: dict | None) -> None:
        """One step of the optimizer on a one-row stand-in, as :meth:`apply` runs it, with the
        saved hyper-parameters and scalar state: what would fail there (``lr=None``, a flag
        that adds per-row state, ``capturable`` on the CPU) is refused before anything loads."""
        merged = {**self.hyper(), **group}
        check_hyper(self.cls, merged)
        dev, dtype = self.table.device, self.table.compute_dtype
        p = nn.Parameter(torch.zeros(1, self.table.embedding_dim, dtype=dtype, device=dev))
        state = None
        if scalar is not None:
            state = {k: torch.zeros(1, *self.row_shapes[k], dtype=dtype, device=dev)
                     for k in self.names}
            state.update(scalar)

        def build(params):
            opt = self.cls(params, **self.ctor_kwargs)
            opt.param_groups[0].update(merged)
            return opt
        (after,) = rehearse_step(self.cls, [(merged, [(p, state)])], f"table {self.name!r}",
                                 build, lambda q: set_grad(q, torch.ones_like(q), self.sparse))
        after = after or {}
        missing = [k for k in self.names if k not in after]
        extra = sorted(set(after) - set(self.names) - set(self.scalar_template))
        if missing or extra:
            raise ValueError(f"table {self.name!r}: with the saved hyper-parameters "
                             f"{self.cls.__name__} keeps other state ("
                             + (f"lacks {missing}" if missing else f"adds {extra}")
                             + f") than the table holds, {self.names}")

    def load_state_dict(self, sd: dict) -> None:
        self.check_state_dict(sd)
        for key, dst in self.row_state().items():
            copy_unless_same(dst, sd["row_state"][key])
        self.group.update(copy.deepcopy(sd["group"]))
        self._rounds = int(sd.get("rounds", 0))     # (absent from checkpoints before it)
        scalar = sd["scalar_state"]
        self.scalar_state = None if scalar is None else {
            k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalar.items()}
