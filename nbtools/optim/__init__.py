"""Any ``torch.optim`` optimizer, training offloaded tables with per-row state in host memory.

For each table, a step:
  1. takes the gradients of the rows looked up since the last step, summed per id (so an id
     that appears many times in a batch loses nothing);
  2. gathers those rows and each per-row state tensor (``exp_avg``, ``square_avg``, ...) from
     host memory onto the compute device;
  3. runs the stock optimizer on a scratch parameter holding only those rows, with the table's
     global scalar state (``step``, ASGD's ``eta``/``mu``, NAdam's ``mu_product``), exactly as
     ``torch.optim.SparseAdam`` keeps one global step;
  4. writes the rows and their state back.

Semantics are **lazy**: only rows touched since the last step change. Untouched rows get no
momentum decay and no weight decay; their state stays as it was. When every row is touched
every step, the result equals the same optimizer on a dense ``nn.Embedding``.

Optimizers whose state is per element or per row (first dimension = the rows) and whose update
treats each row on its own are supported: SGD (momentum, nesterov, weight decay), Adam, AdamW,
Adamax, NAdam, RAdam, Adadelta, Adagrad, RMSprop (centered, momentum), Rprop, ASGD, SparseAdam,
and the row-wise :class:`RowWiseAdagrad` and :class:`PartialRowWiseAdam` (nbtools.rowwise),
whose per-row state is one column wide. Others (LBFGS, Adafactor, Muon, ...) are refused: a
probe checks, on a tiny parameter, that updating rows together equals updating them one by one.
"""
from __future__ import annotations

import functools
import warnings
from collections import defaultdict

import torch
from torch import nn

from ..devices import deferred_interrupts, on_tables
from ..engine.stepper import NonFiniteGradientError, StepEngine
from ..rowwise import PartialRowWiseAdam, RowWiseAdagrad  # noqa: F401  (optimizers, in __all__)
from ..tables import OffloadedEmbedding
from .config import OffloadConfig, check_groups, concrete, rehearse_step
from .planner import Plan, plan
from .probe import UnsupportedOptimizerError, initial_row_state
from .slot import TableSlot


def _is_param(x) -> bool:
    return isinstance(x, torch.Tensor)


def _split_groups(model_or_params):
    """-> (list of (table, group overrides), list of dense param group dicts)."""
    if isinstance(model_or_params, OffloadedEmbedding):
        model_or_params = [model_or_params]
    if isinstance(model_or_params, nn.Module):
        tables = [(m, {}, name) for name, m in model_or_params.named_modules()
                  if isinstance(m, OffloadedEmbedding)]
        dense = [p for p in model_or_params.parameters() if p.requires_grad]
        return tables, ([{"params": dense}] if dense else [])
    try:
        items = list(model_or_params)
    except TypeError:
        raise TypeError(f"OffloadOptimizer takes an nn.Module, or an iterable of tables, "
                        f"parameters or param-group dicts; got {type(model_or_params).__name__}")
    tables, dense = [], []
    loose = []
    for item in items:
        if isinstance(item, dict):
            overrides = {k: v for k, v in item.items() if k != "params"}
            params = item.get("params", [])
            params = [params] if isinstance(params, (torch.Tensor, nn.Module)) else list(params)
            group_dense = []
            for p in params:
                if isinstance(p, OffloadedEmbedding):
                    tables.append((p, overrides, None))
                elif _is_param(p):
                    group_dense.append(p)
                else:
                    raise TypeError(f"param group holds a {type(p).__name__}; expected tables or "
                                    "tensors")
            if group_dense:
                dense.append({"params": group_dense, **overrides})
        elif isinstance(item, OffloadedEmbedding):
            tables.append((item, {}, None))
        elif isinstance(item, nn.Module):
            sub_tables, sub_dense = _split_groups(item)
            tables.extend(sub_tables)
            dense.extend(sub_dense)
        elif _is_param(item):
            loose.append(item)
        else:
            raise TypeError(f"OffloadOptimizer got a {type(item).__name__}; expected offloaded "
                            "tables, tensors, modules or param-group dicts")
    if loose:
        dense.insert(0, {"params": loose})
    return tables, dense


def _warn_if_sgd_rounds_away(table, optimizer_class) -> None:
    """Plain SGD moves a weight by lr x its gradient, often less than half a bfloat16 step:
    rounded to nearest, such updates are lost (word2vec trained with SGD as gensim trains it
    loses quality with bf16 weights; benchmarks/RESULTS.md, the word2vec tables with bf16
    weights and state). Stochastic rounding keeps them on average."""
    cfg = table.config
    if issubclass(optimizer_class, torch.optim.SGD) and cfg.dtype == torch.bfloat16 \
            and cfg.rounding == "nearest":
        warnings.warn(f"table {table.name!r}: bfloat16 weights rounded to nearest lose SGD's "
                      "small updates (an update under half a bfloat16 step rounds away); pass "
                      "rounding='stochastic' to the table, or keep its weights in float32",
                      UserWarning, stacklevel=3)


def _step_with_hooks(step):
    """``step`` as ``torch.optim.Optimizer`` wraps every optimizer's step (its pre- and
    post-hooks, global and per optimizer; the profiler's ``Optimizer.step#...`` scope), but
    with the profiler's scope only while a profiler runs, and grad mode turned off by two C
    calls instead of ``@torch.no_grad()``: torch's scope and the decorator cost host time on
    every step (benchmarks/RESULTS.md, the host cost of a step's wrappers), on a step whose
    host time is its limit on slow hosts. Marked ``hooked``, so torch does not wrap it again;
    where this torch keeps its hooks elsewhere, torch's own wrapper is left to do it."""
    try:
        from torch.optim.optimizer import _global_optimizer_post_hooks as post
        from torch.optim.optimizer import _global_optimizer_pre_hooks as pre
        profiling = torch._C._autograd._profiler_enabled
    except (ImportError, AttributeError):
        return torch.no_grad()(step)

    def hooked(self, *args, **kwargs):
        if profiling():
            with torch.autograd.profiler.record_function(
                    f"Optimizer.step#{type(self).__name__}.step"):
                return run(self, args, kwargs)
        return run(self, args, kwargs)

    def run(self, args, kwargs):
        for hook in (*pre.values(), *self._optimizer_step_pre_hooks.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"{step} must return None or a tuple of (new_args, "
                                       f"new_kwargs), but got {result}.")
                args, kwargs = result
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            out = step(self, *args, **kwargs)
        finally:
            torch._C._set_grad_enabled(grad)
        self._optimizer_step_code()
        for hook in (*self._optimizer_step_post_hooks.values(), *post.values()):
            hook(self, args, kwargs)
        return out

    hooked = functools.wraps(step)(hooked)
    hooked.hooked = True
    return hooked


class OffloadOptimizer(torch.optim.Optimizer):
    """One optimizer for a model whose embedding tables live in host memory.

    Args:
        optimizer_class: any per-element ``torch.optim`` optimizer class (``torch.optim.Adam``).
        model_or_params: an ``nn.Module`` (its offloaded tables and ordinary parameters are
            found), or an iterable of tables, parameters and param-group dicts.
        config: :class:`OffloadConfig` (nbtools options); optional.
        **optimizer_kwargs: passed to the optimizer (``lr=...``, ``betas=...``).

    Ordinary parameters (a Linear layer on the GPU, ...) are optimised by ``optimizer_class``
    as usual. Each table gets its own param group (``param_groups[-len(tables):]``), so LR
    schedulers work. See the module docs for the lazy semantics.

    >>> from nbtools import OffloadedEmbedding
    >>> table = OffloadedEmbedding(100, 4, device="cpu")
    >>> opt = OffloadOptimizer(torch.optim.Adam, [table], lr=0.1)
    >>> table(torch.tensor([1, 2, 2])).sum().backward()
    >>> opt.step(); opt.zero_grad()
    """

    def __init__(self, optimizer_class, model_or_params, *, config: OffloadConfig | None = None,
                 **optimizer_kwargs):
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass such as "
                            f"torch.optim.Adam, got {optimizer_class!r}")
        self.config = config or OffloadConfig()
        if self.config.nonfinite not in ("raise", "skip"):
            raise ValueError(f"OffloadConfig.nonfinite must be 'raise' or 'skip', "
                             f"got {self.config.nonfinite!r}")
        if self.config.checks not in ("auto", "every_step"):
            raise ValueError(f"OffloadConfig.checks must be 'auto' or 'every_step', "
                             f"got {self.config.checks!r}")
        if not isinstance(self.config.deterministic, bool):
            raise TypeError(f"OffloadConfig.deterministic must be True or False, "
                            f"got {self.config.deterministic!r}")
        self.optimizer_class = optimizer_class
        tables, dense_groups = _split_groups(model_or_params)
        if not tables and not dense_groups:
            raise ValueError("OffloadOptimizer got no offloaded tables and no parameters")
        if dense_groups and issubclass(optimizer_class, torch.optim.SparseAdam):
            raise UnsupportedOptimizerError(
                "SparseAdam only takes sparse gradients, but the model also has ordinary "
                f"parameters ({sum(len(g['params']) for g in dense_groups)} tensors). Use "
                "torch.optim.Adam: on offloaded tables it is lazy like SparseAdam.")
        dense = optimizer_class(dense_groups, **optimizer_kwargs) if dense_groups else None
        slots: list[TableSlot] = []
        seen = set()
        for table, overrides, path in tables:
            if any(s.table is table for s in slots):
                continue
            if not table.trainable:     # e.g. from_pretrained(freeze=True): state for nothing
                warnings.warn(f"table {table.name!r} is frozen (trainable=False, as "
                              "from_pretrained(freeze=True) makes it): the optimizer keeps state "
                              "for it but never changes it; pass freeze=False, or leave the "
                              "table out of the optimizer", RuntimeWarning, stacklevel=2)
            _warn_if_sgd_rounds_away(table, optimizer_class)
            name = table.name if table.name != type(table).__name__ or not path else path
            base, k = name, 1
            while name in seen:
                k += 1
                name = f"{base}_{k}"
            seen.add(name)
            slots.append(TableSlot(name, table, optimizer_class,
                                    {**optimizer_kwargs, **overrides}, self.config, True,
                                    len(slots)))
            table.deterministic = self.config.deterministic    # its lookups' backward
        defaults = dict(dense.defaults) if dense else \
            {k: v for k, v in slots[0].group.items() if k != "params"}
        # torch.optim.Optimizer.__init__ sets up hooks and the step wrapper schedulers rely on;
        # its placeholder group is replaced right after.
        super().__init__([torch.empty(0, requires_grad=True)], defaults)
        self._dense, self._slots = dense, slots
        self.param_groups = (list(self._dense.param_groups) if self._dense else []) + \
            [s.group for s in self._slots]
        self.state = self._dense.state if self._dense else defaultdict(dict)
        names = {}
        if isinstance(model_or_params, nn.Module):
            names = {id(p): n for n, p in model_or_params.named_parameters()}
        #: the step's engine: rings, graphs, the step whose checks are read late, skips
        self.engine = StepEngine(slots, self.config, names)

    # --- what a training loop calls -----------------------------------------------------------
    @_step_with_hooks
    @on_tables
    def step(self, closure=None):
        """Update the ordinary parameters and every table's touched rows.

        Every gradient and every id is checked first, on the device; the verdicts of all
        tables and parameters come back to the host together, in one synchronisation per
        step. Only then is anything written: an out-of-range id raises ``IndexError`` and a
        non-finite gradient raises :class:`NonFiniteGradientError` (or skips the whole step,
        with ``OffloadConfig(nonfinite="skip")``), and in both cases no parameter, table row or
        optimizer state has changed.

        Where it is safe (``OffloadConfig.checks``), the flags are read one step late instead,
        and the step has no host synchronisation at all: a bad step still writes nothing (its
        kernels read the flags on the GPU), the step after it writes nothing either, and that
        later ``step()`` raises the error.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # A Ctrl-C ("interrupt kernel") that lands while the step waits for the GPU is
        # raised once the step is recorded: its updates are queued by then, and stopping
        # before its scalar state and counts are kept would leave them behind its rows.
        with deferred_interrupts():
            collected = [(slot, slot.table.collect()) for slot in self._slots]
            collected = [(slot, got) for slot, got in collected if got is not None]
            try:
                self.engine.run(collected, self._dense_grads(),
                                self._dense.step if self._dense is not None else None)
            finally:      # captured lookups' buffers may be reused from now on
                for _, got in collected:
                    got.release()
        return loss

    def _dense_grads(self) -> list:
        """(parameter, gradient values) of the ordinary parameters that have a gradient."""
        out = []
        if self._dense is None:
            return out
        for group in self._dense.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    out.append((p, p.grad._values() if p.grad.is_sparse else p.grad))
        return out

    @on_tables
    def synchronize(self) -> None:
        """Read the checks of the last step if they are still on their way (see
        ``OffloadConfig.checks``): raises the error of a bad step, else does nothing. Saving,
        loading and ``state_dict`` call it; call it after a training loop to learn whether
        its last step went ahead."""
        self.engine.synchronize()

    def __getstate__(self) -> dict:
        # torch.optim.Optimizer pickles only defaults, state and param_groups; this optimizer's
        # tables and scalar state live in its other attributes. An LR scheduler's wrapper of
        # `step` (an instance attribute holding a weak reference) stays behind, and so do the
        # pinned flag buffers; a step whose checks are on their way is read first.
        self.synchronize()
        state = dict(self.__dict__)
        state.pop("step", None)
        return state

    @on_tables
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._dense is not None:
            self._dense.zero_grad(set_to_none=set_to_none)
        for slot in self._slots:
            slot.table.clear_pending()

    def add_param_group(self, param_group: dict) -> None:
        if not hasattr(self, "_slots"):      # torch's own __init__ adds the placeholder group
            return super().add_param_group(param_group)
        raise NotImplementedError("OffloadOptimizer does not add param groups after creation; "
                                  "build a new OffloadOptimizer with all tables and parameters")

    # --- introspection ------------------------------------------------------------------------
    @property
    def tables(self) -> dict:
        """Table name -> table."""
        return {s.name: s.table for s in self._slots}

    @property
    def guard_device(self) -> torch.device | None:
        """The device its steps run with current (devices.on): its first table's."""
        return self._slots[0].table.device if self._slots else None

    @on_tables
    def table_state(self, table) -> dict:
        """Per-row state host tensors of one table (by name or object), e.g. ``exp_avg``."""
        return self.slot(table).row_state()

    def load_row_state(self, table, name: str, source, *, step=None, **options) -> None:
        """Load one per-row state of ``table`` (e.g. ``"exp_avg"``, with ``step=`` the steps
        it has seen) from an array or ``.npy`` file, streamed in chunks: docs/speedtorch.md,
        :func:`nbtools.pretrained.load_row_state`."""
        from ..pretrained import load_row_state
        self.synchronize()
        slot = self.slot(table)
        load_row_state(slot, name, source, step=step, **options,
                       initial=initial_row_state(slot.cls, slot.group, [name])[name])

    def skipped_steps(self, table=None) -> int:
        """How many steps were skipped for non-finite gradients (a skip skips every table
        and parameter; ``table`` is accepted for compatibility)."""
        if table is not None:
            return self.slot(table).skipped_steps
        return self.engine.skips

    def slot(self, table) -> TableSlot:
        """The slot (its per-row state, scalar state and update) of one table, by name or object."""
        for s in self._slots:
            if s.table is table or s.name == table:
                return s
        raise KeyError(f"no table {table!r} in this optimizer; it has {list(self.tables)}")

    # --- checkpoints --------------------------------------------------------------------------
    @on_tables
    def state_dict(self) -> dict:
        """Dense optimizer state plus, per table, hyper-parameters, scalar state and per-row
        state as the live host tensors (no copies)."""
        self.synchronize()
        return {
            "format": "nbtools.OffloadOptimizer/1",
            "optimizer_class": self.optimizer_class.__name__,
            "dense": self._dense.state_dict() if self._dense else None,
            "tables": {s.name: s.state_dict() for s in self._slots},
        }

    def check_state_dict(self, state_dict: dict) -> None:
        """Raise ValueError (what was found, what was expected) where ``state_dict`` would not
        load into this optimizer; changes nothing. :meth:`load_state_dict` runs it first, and a
        checkpoint's restore runs it before touching any object."""
        if not isinstance(state_dict, dict) or \
                state_dict.get("format") != "nbtools.OffloadOptimizer/1":
            raise ValueError("not an OffloadOptimizer state_dict (missing format "
                             "'nbtools.OffloadOptimizer/1')")
        if state_dict.get("optimizer_class") != self.optimizer_class.__name__:
            raise ValueError(f"state_dict is for {state_dict.get('optimizer_class')}, this "
                             f"optimizer is {self.optimizer_class.__name__}")
        if not isinstance(state_dict.get("tables"), dict):
            raise ValueError("state_dict has no tables (a dict of each table's state)")
        names = set(state_dict["tables"])
        if names != {s.name for s in self._slots}:
            raise ValueError(f"state_dict has tables {sorted(names)}, this optimizer has "
                             f"{sorted(s.name for s in self._slots)}")
        if (state_dict["dense"] is None) != (self._dense is None):
            raise ValueError("state_dict and optimizer disagree on having ordinary parameters")
        for slot in self._slots:
            slot.check_state_dict(state_dict["tables"][slot.name])
        if self._dense is not None:
            dense = state_dict["dense"]
            if not isinstance(dense, dict) or not isinstance(dense.get("state", {}), dict):
                raise ValueError("state_dict's ordinary parameters have no optimizer state")
            check_groups(dense.get("param_groups"), self._dense.param_groups,
                         "ordinary parameters")
            self._check_dense(dense)

    def _check_dense(self, dense: dict) -> None:
        """Refuse the ordinary parameters' saved state where torch's ``load_state_dict``
        would raise, or the next step would: parameters listed out of order or twice, a
        state that is not a dict, state tensors of other shapes, a hyper-parameter missing or
        of a value the optimizer refuses. Rehearsed on stand-ins of one element per
        dimension (state that is not per element, Adafactor's factors, is not rehearsed)."""
        if "state" not in dense:
            raise ValueError("ordinary parameters: the saved optimizer state has no state entry")
        opt = self._dense
        live = [p for g in opt.param_groups for p in g["params"]]
        ids = [i for g in dense["param_groups"] for i in g["params"]]
        if ids != list(range(len(live))):
            raise ValueError(f"ordinary parameters: the saved groups list parameters {ids[:20]}, "
                             f"expected 0..{len(live) - 1} in order")
        small, state = {}, {}
        for p in live:
            small[id(p)] = nn.Parameter(torch.zeros([1] * p.dim(), dtype=p.dtype, device=p.device),
                                        p.requires_grad)
        for i, st in dense["state"].items():
            if not isinstance(i, int) or not 0 <= i < len(live):
                continue                        # torch keeps it aside; no step reads it
            if not isinstance(st, dict):
                raise ValueError(f"ordinary parameters: the state of parameter {i} is a "
                                 f"{type(st).__name__}, expected a dict")
            p, state[i] = live[i], {}
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape):
                    v = torch.zeros(small[id(p)].shape, dtype=v.dtype)
                elif isinstance(v, torch.Tensor) and v.numel() != 1:
                    return                      # not per element: left to the optimizer
                state[i][key] = concrete(v)
        groups = [{**concrete(g), "params": [small[id(p)] for p in h["params"]]}
                  for g, h in zip(dense["param_groups"], opt.param_groups)]

        def build(_params):
            twin = type(opt)([{**h, "params": g["params"]}
                              for g, h in zip(groups, opt.param_groups)])
            twin.load_state_dict({"state": state, "param_groups": [
                {**g, "params": list(range(sum(len(x["params"]) for x in groups[:j]),
                                           sum(len(x["params"]) for x in groups[:j + 1])))}
                for j, g in enumerate(groups)]})
            return twin
        rehearse_step(type(opt), [({**{k: v for k, v in h.items() if k != "params"},
                                    **{k: v for k, v in g.items() if k != "params"}},
                                   [(q, None) for q in g["params"]])
                                  for g, h in zip(groups, opt.param_groups)],
                      "ordinary parameters", build)

    @on_tables
    def load_state_dict(self, state_dict: dict) -> None:
        self.check_state_dict(state_dict)      # nothing is changed when it does not fit
        self.engine.forget()           # what is loaded replaces a step not read back yet
        for slot in self._slots:
            slot.load_state_dict(state_dict["tables"][slot.name])     # waits for the GPU first
        if self._dense is not None:
            self._dense.load_state_dict(state_dict["dense"])
            self.param_groups[: len(self._dense.param_groups)] = self._dense.param_groups

    def __repr__(self) -> str:
        lines = [f"OffloadOptimizer({self.optimizer_class.__name__},"]
        for s in self._slots:
            lines.append(f"  table {s.name!r}: {s.table.num_embeddings:,} x {s.table.embedding_dim}"
                         f" {s.table.transfer_mode}, per-row state {s.names}")
        if self._dense is not None:
            n = sum(p.numel() for g in self._dense.param_groups for p in g["params"])
            lines.append(f"  dense: {n:,} parameters")
        return "\n".join(lines) + ")"


__all__ = ["OffloadOptimizer", "OffloadConfig", "Plan", "plan", "UnsupportedOptimizerError",
           "NonFiniteGradientError", "RowWiseAdagrad", "PartialRowWiseAdam"]
