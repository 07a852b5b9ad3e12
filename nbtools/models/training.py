"""One training loop for every model: dashboard, progress, checkpoints, resume, lr decay."""
from __future__ import annotations

import dataclasses
import time

import torch
from torch import nn

from ..loader import PinnedLoader
from ..optim import OffloadOptimizer

# --- the training loop ------------------------------------------------------------------------

_DECAYS = (None, "linear")


@dataclasses.dataclass
class TrainConfig:
    """Optional settings of :func:`train`."""

    every: int = 1000              # steps between checkpoints (a disconnect loses at most this)
    log_every: int | None = None   # steps between loss records (None: ~100 over the run)
    progress: bool = True          # a tqdm bar when there is no dashboard
    lr_decay: str | None = None    # "linear": word2vec's alpha -> min_alpha over the whole run
    min_lr_ratio: float = 1e-4     # the last lr / the first (word2vec: min_alpha = alpha * 1e-4)
    # each backward on this loop's thread (torch.autograd.set_multithreading_enabled(False)
    # while the loop runs, as it was after), not handed to autograd's device thread: 0.1-0.2
    # ms less host time a step where a loop is host-bound (docs/step.md). False: torch's
    # default, backward work spread over a thread per device (a model on several GPUs).
    backward_on_loop_thread: bool = True

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every must be a positive number of steps, got {self.every!r}")
        if self.log_every is not None and (not isinstance(self.log_every, int)
                                           or self.log_every < 1):
            raise ValueError(f"log_every must be a positive number of steps or None, got "
                             f"{self.log_every!r}")
        if self.lr_decay not in _DECAYS:
            raise ValueError(f"lr_decay must be one of {_DECAYS}, got {self.lr_decay!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not isinstance(self.backward_on_loop_thread, bool):
            raise TypeError(f"backward_on_loop_thread must be True or False, got "
                            f"{self.backward_on_loop_thread!r}")


def lr_factor(config: TrainConfig, progress: float) -> float:
    """The learning rate at ``progress`` (fraction of the run done, 0..1) over the first one.

    >>> lr_factor(TrainConfig(lr_decay="linear", min_lr_ratio=0.1), 0.5)
    0.55
    >>> lr_factor(TrainConfig(), 0.5)
    1.0
    """
    if config.lr_decay is None:
        return 1.0
    progress = min(max(progress, 0.0), 1.0)
    return 1.0 - (1.0 - config.min_lr_ratio) * progress


COMPILE_NOTE = "the first steps compile the GPU kernels (seconds each, once a session)"


def compile_note(model: nn.Module) -> str | None:
    """What the progress bar says before a loop's first step where that step will compile
    nbtools' GPU kernels (a model on CUDA, Triton there, none compiled yet in this process):
    tens of seconds with the GPU idle, which would otherwise look like a hang. None elsewhere."""
    from ..kernels import common
    on_gpu = any(p.is_cuda for p in model.parameters()) or any(
        getattr(getattr(m, "device", None), "type", None) == "cuda" for m in model.modules())
    return COMPILE_NOTE if on_gpu and common.triton_ok() and common.compiled() == 0 else None


def train(model: nn.Module, loader: PinnedLoader, optimizer: OffloadOptimizer, *, epochs: int,
          config: TrainConfig | None = None, dashboard=None, checkpoints=None,
          **options) -> dict:
    """Train ``model`` for ``epochs`` passes over ``loader``, resuming from a checkpoint.

    Args:
        model: a module with ``loss(*batch) -> scalar``.
        loader: a :class:`~nbtools.PinnedLoader`, a :class:`~nbtools.models.CorpusLoader` (or
            anything with their ``epoch``, ``position``, ``len()``, ``set_epoch`` and
            ``state_dict``); its position is part of each checkpoint. The number of batches
            may change from one epoch to the next.
        optimizer: an :class:`~nbtools.OffloadOptimizer` over the model (or any optimizer
            with ``param_groups``).
        epochs: total passes over the data, counting those done before a resume.
        config: :class:`TrainConfig` (checkpoint interval, logging, progress bar, lr decay).
        dashboard: a :class:`~nbtools.Dashboard` (or anything with ``step(n)``); updated from
            this loop's thread, which is what works in Colab.
        checkpoints: a :class:`~nbtools.CheckpointManager`. The newest checkpoint is restored
            first (model, optimizer, loader, step, history); then one is saved every
            ``config.every`` steps and at the end. A disconnect loses at most ``every`` steps.
            Running the cell again after training finished restores the last checkpoint and
            trains nothing.
        **options: fields of :class:`TrainConfig` given one by one (``every=500``), as before
            there was a config; they override ``config``'s.

    With ``lr_decay="linear"`` each param group's learning rate goes from the one it had when
    training started (kept as ``group["initial_lr"]``, as torch's schedulers do, so it travels
    with checkpoints) down to ``min_lr_ratio`` times it, linearly in the fraction of batches
    done: step ``t`` of ``T`` uses ``lr * (1 - (1 - min_lr_ratio) * t / T)``.

    Returns:
        The history, ``{"step": [...], "epoch": [...], "loss": [...], "time_s": [...],
        "lr": [...]}``: mean loss over each ``log_every`` steps, training seconds so far
        (across resumes), and the first param group's learning rate (None when the optimizer
        shows no ``param_groups``).
    """
    config = config or TrainConfig()
    if options:
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        unknown = sorted(set(options) - fields)
        if unknown:
            raise TypeError(f"train() got unexpected keyword arguments {unknown}; the options "
                            f"are {sorted(fields)} (or pass config=TrainConfig(...))")
        config = dataclasses.replace(config, **options)
    groups = getattr(optimizer, "param_groups", None)   # a wrapper may not show them
    if config.lr_decay is not None:
        if groups is None:
            raise TypeError(f"lr_decay={config.lr_decay!r} needs an optimizer with param_groups; "
                            f"{type(optimizer).__name__} has none")
        for group in groups:                      # before a restore replaces them
            group.setdefault("initial_lr", group["lr"])
    history = {"step": [], "epoch": [], "loss": [], "time_s": [], "lr": []}
    step = 0
    if checkpoints is not None:
        step = checkpoints.restore(model=model, optimizer=optimizer, loader=loader,
                                   history=history) or 0
        history.setdefault("lr", [None] * len(history["step"]))   # saved by an older version
    total = epochs * len(loader)      # an estimate when epochs differ in length
    log_every = config.log_every or min(100, max(1, total // 100))
    elapsed = history["time_s"][-1] if history["time_s"] else 0.0
    bar = None
    if config.progress and dashboard is None:
        from tqdm.auto import tqdm     # only when asked: import nbtools stays light
        bar = tqdm(total=total, initial=min(step, total), unit="step", desc="training")
    note = compile_note(model) if bar is not None else None
    if note:
        bar.set_postfix_str(note)
    running, count = None, 0            # loss summed on the device since the last record
    threads = torch.autograd.set_multithreading_enabled(not config.backward_on_loop_thread)
    t0 = time.perf_counter()
    try:
        while True:
            if loader.position >= len(loader):       # saved after an epoch's last batch
                loader.set_epoch(loader.epoch + 1)
            if loader.epoch >= epochs:
                break
            per_epoch = len(loader)
            for batch in loader:
                done = (loader.epoch + (loader.position - 1) / per_epoch) / epochs
                if config.lr_decay is not None:
                    factor = lr_factor(config, done)
                    for group in optimizer.param_groups:    # restored: not `groups`
                        group["lr"] = group["initial_lr"] * factor
                loss = model.loss(*batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                running = loss.detach() if running is None else running + loss.detach()
                count += 1
                if dashboard is not None:
                    dashboard.step(batch[0].shape[0])
                if bar is not None:
                    if note:        # (the first step is done; a loss record may follow)
                        note = None
                        bar.set_postfix_str("")
                    bar.update(1)
                if step % log_every == 0:
                    mean = float(running) / count       # note: a CPU-GPU sync point
                    history["step"].append(step)
                    history["epoch"].append(loader.epoch + loader.position / per_epoch)
                    history["loss"].append(mean)
                    history["time_s"].append(elapsed + time.perf_counter() - t0)
                    history["lr"].append(optimizer.param_groups[0]["lr"] if groups else None)
                    running, count = None, 0
                    if bar is not None:
                        bar.set_postfix(loss=f"{mean:.4f}")
                if checkpoints is not None and step % config.every == 0:
                    checkpoints.save(step, model=model, optimizer=optimizer, loader=loader,
                                     history=history)
        if hasattr(optimizer, "synchronize"):     # a last step's checks, if read late
            optimizer.synchronize()
        if checkpoints is not None and checkpoints.latest_step() != step:
            checkpoints.save(step, model=model, optimizer=optimizer, loader=loader,
                             history=history)
    finally:
        threads.__exit__(None, None, None)     # autograd's threads as they were before
        if bar is not None:
            bar.close()
    return history
