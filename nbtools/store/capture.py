"""The capture machine: device work recorded once as a CUDA graph and replayed after.

Every CUDA graph nbtools makes is captured by :func:`capture`: an optimizer step's checks and
fused updates (:class:`nbtools.engine.steps.StepGraphs`), a table's training lookups
(:class:`LookupGraphs`) and the work a step does on a lookup's outputs, such as a write-back
behind the next step (:meth:`Captured.graphed`). One way to capture means one set of rules:

* on a side stream of the work's device, ordered after the current stream, which then waits
  for it;
* ``capture_begin``/``capture_end`` rather than ``torch.cuda.graph()``, which synchronises
  the device and empties the allocator's cache (the blocks a training loop's tensors come back
  to would move, and the step's graphs bake in their addresses);
* the ``thread_local`` error mode: a CUDA call from another thread (a disk table's read-ahead
  or write-back, the dashboard's sampler) does not invalidate the capture;
* a capture that fails resets the device's random generator
  (:func:`nbtools.devices.after_failed_capture`) and raises ``RuntimeError``: the caller runs
  that work eagerly from then on (slower, not wrong).
"""
from __future__ import annotations

import torch

from .. import devices
from ..devices import after_failed_capture
from .rows import RowBatch, unique_ids


def capture(*parts, device=None) -> tuple[list, list]:
    """Capture each callable of ``parts`` as its own CUDA graph, in order, on one side stream
    of ``device`` (default: the current one). Returns the graphs and what each part returned
    (tensors a part allocates live in its graph's own memory pool, reused by every replay).
    See the module's docs for the rules."""
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(main.device)
    side.wait_stream(main)
    graphs, outs = [], []
    try:
        with torch.cuda.stream(side):
            for part in parts:
                graph = torch.cuda.CUDAGraph()
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    outs.append(part())
                finally:
                    graph.capture_end()
                graphs.append(graph)
    except RuntimeError:
        after_failed_capture(main.device)
        raise
    main.wait_stream(side)
    return graphs, outs


def own_outputs(captures, batch, rows):
    """The one capture whose outputs ``batch`` (a RowBatch, or its ids) and ``rows`` are, or
    None."""
    if len(captures) != 1:
        return None
    cap = captures[0]
    ids = batch.ids if isinstance(batch, RowBatch) else batch
    return cap if cap.rows is rows and cap.batch.ids is ids else None


class Captured:
    """One captured lookup of ``n`` ids: static input, outputs, whether a pending lookup
    still holds its outputs, when it was released, and ``free``: events after the work that
    reads its outputs, which its next replay waits for. That work is a write-back behind the
    next step (:meth:`nbtools.store.tiers.WriteBehind.write_behind`) and, for a dedup alone (``rows`` None, a
    prefetch of host ids, replayed on a side stream without waiting for the main one), the
    main stream's reads of its ids."""

    def __init__(self, graph, flat, batch, rows):
        self.graph, self.flat, self.batch, self.rows = graph, flat, batch, rows
        self.in_use = False
        self.released = 0
        self.free = []            # events: the work that reads its outputs is done
        self.graphs = {}          # work on its outputs, as CUDA graphs (graphed)

    def graphed(self, key, fn) -> None:
        """Run ``fn`` (kernels on this capture's outputs, and on other captures' outputs
        named in ``key``) on the current stream: eagerly the first time (so its kernels are
        compiled), captured as a CUDA graph the second, replayed after that. A capture that
        fails leaves that work eager from then on (slower, not wrong)."""
        got = self.graphs.get(key)
        if got is None or got == "eager":
            self.graphs[key] = got or "seen"
            fn()
            return
        if got == "seen":
            try:
                got = self.graphs[key] = capture(fn)[0][0]
            except RuntimeError:
                self.graphs[key] = "eager"
                fn()
                return
        got.replay()


class LookupGraphs:
    """CUDA graphs of a table's training lookup (deduplicate + gather), one per batch size.

    A lookup is ~20 small kernels; replaying them as one graph takes the CPU ~15 µs instead of
    ~0.3 ms, which is most of a small step. A batch size is captured once it has been seen
    ``after`` times (the last, partial batch of an epoch is never captured), at most
    ``max_shapes`` sizes per table, ``copies`` captures per size (a table looked up twice in
    a step uses two; a third lookup of the same size runs eagerly). The outputs of a capture
    are reused by its next replay, so a capture is handed out only when no pending lookup
    holds it; the optimizer's step releases them (:meth:`release`).
    """

    def __init__(self, after: int = 2, max_shapes: int = 4, copies: int = 2):
        self.after, self.max_shapes, self.copies = after, max_shapes, copies
        self._seen = {}
        self._graphs = {}
        self._key = None

    def __getstate__(self) -> dict:
        # Captures are a cache of this process's CUDA graphs: a copy (deepcopy, pickle)
        # starts without them and captures its own.
        return {"after": self.after, "max_shapes": self.max_shapes, "copies": self.copies}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    @property
    def captured(self) -> int:
        """How many captures the table holds now, over every batch size."""
        return sum(len(caps) for caps in self._graphs.values())

    @property
    def shapes_seen(self) -> int:
        """How many lookup shapes (batch size, width) were counted since the last
        :meth:`invalidate`, captured or not yet seen ``after`` times."""
        return len(self._seen)

    def invalidate(self) -> None:
        """Forget every capture (the table's memory moved)."""
        self._graphs.clear()
        self._seen.clear()

    def run(self, store, flat: torch.Tensor, padding_idx, width: int | None,
            after=None):
        """``(batch, rows, capture)`` from a graph, or None where the lookup must run eagerly.
        ``width`` None: the dedup alone (``rows`` is None). ``after``: a prefetch's, the
        main stream its side stream was ordered after (:meth:`nbtools.store.tiers.WriteBehind.before_gather`); it
        may keep one copy more, so that it need not wait for the capture whose rows the last
        write-back still reads."""
        key = (id(store.host), flat.numel(), width, flat.device)
        if self._key != key[0]:
            self.invalidate()
            self._key = key[0]
        caps = self._graphs.get(key)
        if caps is None:
            seen = self._seen[key] = self._seen.get(key, 0) + 1
            if seen <= self.after or len(self._graphs) >= self.max_shapes:
                return None
            caps = self._graphs[key] = []
        current = devices.current(flat.device)
        # Not a capture whose outputs the last write-back holds where this replay runs on
        # another stream (a prefetch's): lookups on the write-back's stream may still patch
        # from them (before_gather), and nothing orders them before such a replay.
        free = [c for c in caps if not c.in_use and not store.patches_from(c, current)]
        # The capture released longest ago: its replay waits for the last work that reads
        # its outputs (cap.free), by then all but always done; while it is not, one more copy
        # is captured (a dedup alone keeps one copy more: see Captured).
        copies = self.copies + (width is None) + (after is not None)
        cap = min(free, key=lambda c: c.released) if free else None
        if cap is None or (len(caps) < copies and not all(e.query() for e in cap.free)):
            if len(caps) >= copies:
                return None
            try:
                cap = self._capture(store, flat, padding_idx, width)
            except RuntimeError:        # this batch size runs eagerly (slower, not wrong)
                if not caps:
                    del self._graphs[key]
                    self._seen[key] = -(1 << 62)    # never counted as seen enough again
                return None
            caps.append(cap)
        patch = width is not None and store.before_gather(overwrites=(cap,), after=after)
        for event in cap.free:
            current.wait_event(event)
        cap.free = []
        cap.flat.copy_(flat)
        cap.graph.replay()
        if patch:    # read beside the main stream (a prefetch): the captures whose rows it
            # read are not replayed before it is done
            store.patch(cap.batch, cap.rows, capture=cap,
                        aside=after is not None and current != after)
        cap.in_use = True
        if store.cache is None and cap.rows is not None:   # else counted from cache statistics
            store.count_bytes(cap.rows.numel() * cap.rows.element_size(), h2d=True)
        return cap.batch, cap.rows, cap

    @staticmethod
    def _capture(store, flat, padding_idx, width) -> Captured:
        static = flat.clone()
        n = store.num_rows

        def lookup():
            batch = unique_ids(static, n, padding_idx)
            if width is None:
                return batch, None
            return batch, store.gather_batch(batch, 0, width, admit=True, written="ignore")

        main = torch.cuda.current_stream(flat.device)
        side = torch.cuda.Stream(flat.device)
        side.wait_stream(main)
        cache = store.cache if width is not None else None     # a dedup admits nothing
        if cache is not None:
            kept = [(t, t.clone()) for t in (cache.stats, cache.tick, cache.stamp)]
        with torch.cuda.stream(side):           # warm-up: kernels compiled, workspaces sized
            lookup()
            lookup()
        main.wait_stream(side)
        if cache is not None:
            # The warm-ups are not lookups of the model's: their statistics, their ticks and
            # their counts of the batch's rows are taken back (the rows they admitted stay,
            # as if admitted a little early; every row's value is where it was).
            for t, before in kept:
                t.copy_(before)
            batch = unique_ids(static, n, padding_idx)
            live = (torch.arange(batch.capacity, device=flat.device) < batch.count) & \
                (batch.ids < n)
            cache.freq.index_add_(0, batch.ids, -2 * live.int())
        (graph,), ((batch, rows),) = capture(lookup, device=flat.device)
        return Captured(graph, static, batch, rows)

    _releases = 0

    @staticmethod
    def read_here(captures, stream) -> None:
        """``stream`` reads the outputs of lookup ``captures`` up to the work queued on it so
        far: their next replay, on whatever stream, waits for that (an event, ``cap.free``)."""
        event = torch.cuda.Event()
        event.record(stream)
        for cap in captures:
            cap.free.append(event)

    @classmethod
    def release(cls, captures) -> None:
        for cap in captures:
            if cap is not None:
                cap.in_use = False
                cls._releases += 1
                cap.released = cls._releases
                if cap.rows is None:          # a dedup alone: see Captured
                    LookupGraphs.read_here([cap], devices.current(cap.flat.device))
