"""One training loop for every model: dashboard, progress, checkpoints and resume."""
from __future__ import annotations

import time

from torch import nn

from ..loader import PinnedLoader
from ..optim import OffloadOptimizer

# --- the training loop ------------------------------------------------------------------------

def train(model: nn.Module, loader: PinnedLoader, optimizer: OffloadOptimizer, *, epochs: int,
          dashboard=None, checkpoints=None, every: int = 1000, log_every: int | None = None,
          progress: bool = True) -> dict:
    """Train ``model`` for ``epochs`` passes over ``loader``, resuming from a checkpoint.

    Args:
        model: a module with ``loss(*batch) -> scalar``.
        loader: a :class:`~nbtools.PinnedLoader` (its position is part of each checkpoint).
        optimizer: an :class:`~nbtools.OffloadOptimizer` over the model.
        epochs: total passes over the data, counting those done before a resume.
        dashboard: a :class:`~nbtools.Dashboard` (or anything with ``step(n)``); updated from
            this loop's thread, which is what works in Colab.
        checkpoints: a :class:`~nbtools.CheckpointManager`. The newest checkpoint is restored
            first (model, optimizer, loader, step, history); then one is saved every ``every``
            steps and at the end. A disconnect loses at most ``every`` steps. Running the cell
            again after training finished restores the last checkpoint and trains nothing.
        every: steps between checkpoints.
        log_every: steps between loss records (default: ~100 records over the run, at most
            one per 100 steps). Reading the loss is a GPU sync, so not every step.
        progress: a tqdm bar when there is no dashboard.

    Returns:
        The history, ``{"step": [...], "epoch": [...], "loss": [...], "time_s": [...]}``: mean
        loss over each ``log_every`` steps, and training seconds so far (across resumes).
    """
    if every < 1:
        raise ValueError(f"every must be a positive number of steps, got {every!r}")
    history = {"step": [], "epoch": [], "loss": [], "time_s": []}
    step = 0
    if checkpoints is not None:
        step = checkpoints.restore(model=model, optimizer=optimizer, loader=loader,
                                   history=history) or 0
    per_epoch = len(loader)
    total = epochs * per_epoch
    if log_every is None:
        log_every = min(100, max(1, total // 100))
    elapsed = history["time_s"][-1] if history["time_s"] else 0.0
    bar = None
    if progress and dashboard is None:
        from tqdm.auto import tqdm     # only when asked: import nbtools stays light
        bar = tqdm(total=total, initial=min(step, total), unit="step", desc="training")
    running, count = None, 0            # loss summed on the device since the last record
    t0 = time.perf_counter()
    try:
        while True:
            if loader.position >= per_epoch:       # saved after an epoch's last batch
                loader.set_epoch(loader.epoch + 1)
            if loader.epoch >= epochs:
                break
            for batch in loader:
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
                    bar.update(1)
                if step % log_every == 0:
                    mean = float(running) / count       # note: a CPU-GPU sync point
                    history["step"].append(step)
                    history["epoch"].append(step / per_epoch)
                    history["loss"].append(mean)
                    history["time_s"].append(elapsed + time.perf_counter() - t0)
                    running, count = None, 0
                    if bar is not None:
                        bar.set_postfix(loss=f"{mean:.4f}")
                if checkpoints is not None and step % every == 0:
                    checkpoints.save(step, model=model, optimizer=optimizer, loader=loader,
                                     history=history)
        if checkpoints is not None and checkpoints.latest_step() != step:
            checkpoints.save(step, model=model, optimizer=optimizer, loader=loader,
                             history=history)
    finally:
        if bar is not None:
            bar.close()
    return history
