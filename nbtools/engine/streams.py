"""The current CUDA stream, a side stream entered and events recorded, at a fraction of the host
time torch's own helpers take.

A training step of an offloaded table asks for the current stream, enters a side stream for its
write-back and records events several times a step. torch's Python helpers resolve their
arguments in Python on every call, several times the cost of the C call underneath
(benchmarks/RESULTS.md, "the step's stream calls at a tenth of their host cost"). A small
step is bound by the host, so these add up to a few percent of it.

:func:`current` and :func:`entered` go to torch's C functions directly where they exist and
the stream is on the current device; anywhere else (an older torch, another device) they fall
back to torch's own helpers, which do the same thing more slowly. ``FAST = False`` (or
``NBTOOLS_FAST_STREAMS=0`` in the environment) turns the shortcut off, so the two can be
timed against each other.
"""
from __future__ import annotations

import contextlib
import os

import torch

FAST = os.environ.get("NBTOOLS_FAST_STREAMS", "1") != "0"
_C = torch._C
_get_stream = getattr(_C, "_cuda_getCurrentStream", None)
c_set_stream = getattr(_C, "_cuda_setStream", None)
_get_device = getattr(_C, "_cuda_getDevice", None)
fast_ready = None         # None: not asked yet; True: the C calls answered as torch's own did


def fast_ok(index: int) -> bool:
    """Once: initialise CUDA through torch's helper and confirm the C calls take the
    arguments they are given here and agree with it (torch versions differ)."""
    global fast_ready
    if fast_ready is not None:
        return fast_ready
    if None in (_get_stream, c_set_stream, _get_device):
        fast_ready = False
        return False
    try:
        ours = torch.cuda.current_stream(index)
        sid, dev, kind = _get_stream(index)
        fast_ready = (sid, dev, kind) == (ours.stream_id, ours.device_index, ours.device_type)
        if fast_ready and _get_device() == index:     # (sets the stream it is already on)
            c_set_stream(stream_id=sid, device_index=dev, device_type=kind)
    except (RuntimeError, TypeError, AttributeError, ValueError):
        fast_ready = False
    return fast_ready


def current(device) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for a ``torch.device`` with an index (what
    :func:`nbtools.devices.resolve_device` gives) or a device index."""
    index = device.index if isinstance(device, torch.device) else device
    if FAST and index is not None and fast_ok(index):
        sid, dev, kind = _get_stream(index)
        return torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)
    return torch.cuda.current_stream(device)


@contextlib.contextmanager
def entered(stream: torch.cuda.Stream):
    """``with torch.cuda.stream(stream)``: work queued inside goes to ``stream``; the current
    stream is the one before again afterwards."""
    index = stream.device_index
    if not (FAST and fast_ok(index) and _get_device() == index):
        with torch.cuda.stream(stream):
            yield
        return
    sid, dev, kind = _get_stream(index)
    c_set_stream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        yield
    finally:
        c_set_stream(stream_id=sid, device_index=dev, device_type=kind)


def record(event: torch.cuda.Event, device) -> None:
    """``event.record()`` on ``device``'s current stream."""
    event.record(current(device))
