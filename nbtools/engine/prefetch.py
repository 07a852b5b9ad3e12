"""A table's next training lookup, started ahead on a CUDA side stream.

:meth:`nbtools.OffloadedEmbedding.prefetch` hands the ids the next step will look up to the
table's :class:`Prefetcher`. It deduplicates them, admits them to the cache of hot rows (if any)
and gathers their rows on a side stream while the current step computes. The next lookup of the
very same ids tensor takes the result (:meth:`Prefetcher.take`); rows that optimizer steps wrote
in between are read again first, so training is bit-identical to not prefetching.

Nothing here imports :mod:`nbtools.tables`: the prefetcher reaches its table only through the
what a table offers (``rows``, ``lookup_graphs``, its ``lookups``: ``prepare_ids``, ``result``).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import devices, kernels
from ..store.capture import LookupGraphs
from ..store.rows import RowBatch, unique_ids


@dataclasses.dataclass
class Prefetched:
    """A training lookup started ahead: the ids tensor it is for, its unique ids and rows
    (gathered on a side stream), the event that ends that work, and the unique ids of every
    step that wrote rows since, with the lookup captures those ids are outputs of (their rows
    are read again)."""

    ids: torch.Tensor
    batch: RowBatch
    rows: torch.Tensor
    event: object
    origin: object = None           # the ids as passed (a host tensor, copied by the prefetch)
    capture: object = None          # the CUDA graph capture whose outputs batch and rows are
    written: list = dataclasses.field(default_factory=list)


class Prefetcher:
    """One table's prefetch: at most one lookup started ahead, and the side stream it runs on."""

    # Whether a step's update waits for the pending prefetch where the table has no cache (with
    # one it always does: the update must not race the prefetch's admission). Without the
    # wait the update and its write-back run beside the prefetch's gather, and the rows they
    # write are made current when the prefetch is taken, as with the wait. Not waiting is
    # faster for Adam rows, whose reads and writes share the link, and level for row-wise
    # rows (benchmarks/RESULTS.md, "a prefetching step's update beside the prefetch's gather").
    UPDATE_WAITS = False

    def __init__(self, lookups):
        self.lookups = lookups       # the table's lookups (nbtools.engine.lookups.TableLookups)
        self.pending: Prefetched | None = None
        self.side_stream = None

    @property
    def table(self):
        return self.lookups.table

    def __getstate__(self) -> dict:
        # a pending prefetch and the side stream belong to this process's CUDA work: a copy
        # (deepcopy, pickle) starts without them (its next lookups simply do not prefetch)
        return {"lookups": self.lookups, "pending": None, "side_stream": None}

    def start(self, ids) -> None:
        """Deduplicate ``ids``, admit them and gather their whole rows ahead (the table's
        ``prefetch`` documents the contract)."""
        t = self.table
        origin = ids
        self.drop()
        width = t.rows.width if t.state_names else t.layout.weight_cols
        if t.device.type != "cuda":            # the same work at once: no overlap, same results
            ids = t.lookups.prepare_ids(ids)
            flat = ids.reshape(-1).long()
            with torch.no_grad():
                batch = unique_ids(flat, t.num_embeddings, t.padding_idx)
                rows = t.rows.gather_batch(batch, 0, width, admit=True)
            self.pending = Prefetched(ids, batch, rows, None, origin, None)
            return
        main = devices.current(t.device)
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(t.device)
        side = self.side_stream
        from_host = isinstance(ids, torch.Tensor) and ids.device.type == "cpu"
        if not from_host:       # ids made on the GPU: ready once what is queued so far is
            ids = t.lookups.prepare_ids(ids)
            side.wait_stream(main)
        graphs = t.config.cuda_graphs and t.rows.direct and kernels.usable_on(t.device, "rows")
        captured = None
        with devices.entered(side), torch.no_grad():
            if from_host:       # copied and deduplicated at once, beside the GPU's work
                ids = t.lookups.prepare_ids(ids)
            flat = ids.reshape(-1).long()
            if graphs:          # as one CUDA graph: the dedup (host ids: it alone), admission
                # and gather, as for a lookup
                captured = t.lookup_graphs.run(t.rows, flat, t.padding_idx,
                                         None if from_host else width,
                                         after=None if from_host else main)
            if captured is None:
                batch = unique_ids(flat, t.num_embeddings, t.padding_idx)
                made, capture = [ids, flat, batch.ids, batch.inverse, batch.meta], None
            else:
                (batch, rows, capture), made = captured, [ids, flat]
        if captured is None or from_host:
            side.wait_stream(main)          # after this step's lookups (and their admission)
            with devices.entered(side), torch.no_grad():
                # on its capped grid (RowStore.gather_batch) the gather's programs wait on
                # PCIe without holding every SM: the step's own kernels run beside it
                rows = t.rows.gather_batch(batch, 0, width, admit=True)
            made.append(rows)
        event = torch.cuda.Event()
        event.record(side)
        for x in made:
            x.record_stream(main)           # made on the side stream, used on the main one
        self.pending = Prefetched(ids, batch, rows, event, origin, capture)

    def wait(self) -> None:
        """Make the current stream wait for the pending prefetch, if any (no host sync)."""
        pre = self.pending
        if pre is not None and pre.event is not None:
            devices.current(self.table.device).wait_event(pre.event)

    def drop(self) -> None:
        """Forget the pending prefetch (after its work is done on the current stream)."""
        if self.pending is not None:
            self.wait()
            LookupGraphs.release([self.pending.capture])
            self.pending = None

    def device_ids(self, ids):
        """For the very ids a prefetch was started with, the copy it made; else None."""
        pre = self.pending
        return pre.ids if pre is not None and ids is pre.origin else None

    def matches(self, ids: torch.Tensor, width: int) -> bool:
        """Whether a training lookup of ``ids`` at ``width`` columns can take the prefetch."""
        pre = self.pending
        return pre is not None and ids is pre.ids and width == pre.rows.shape[1]

    def written(self, ids: torch.Tensor, captures=()) -> None:
        """A step writes the rows of ``ids`` (sorted unique, sentinel last; outputs of the
        lookup ``captures``, if any): a pending prefetch reads them again when it is taken."""
        if self.pending is not None:
            self.pending.written.append((ids, [c for c in captures if c is not None]))

    def take(self, flat: torch.Tensor, shape, id_order: bool = False):
        """The prefetched lookup as a table lookup returns it (``id_order``: as
        ``TableLookups._lookup`` takes it), its rows made current: rows that steps wrote since
        the prefetch are read again (the rest were not written, so they are current). Records
        the lookup as pending for the optimizer, like a lookup does."""
        t, pre = self.table, self.pending
        self.pending = None
        batch, full = pre.batch, pre.rows
        n = t.num_embeddings
        read = []               # captures whose ids the current stream reads below
        with torch.no_grad():
            for written, captures in pre.written:   # sorted unique ids, then the sentinel
                if t.rows.writing(written) and t.rows.before_gather():
                    # from their GPU copy; between two captures' outputs, as a CUDA graph
                    # (aside: the next prefetch's dedup replays on the side stream)
                    t.rows.patch(batch, full, capture=pre.capture, aside=True)
                    continue
                pos = torch.searchsorted(written, batch.ids).clamp_(max=written.numel() - 1)
                again = (written.gather(0, pos) == batch.ids) & (batch.ids < n)
                t.rows.gather_batch(          # only those rows, in place
                    RowBatch(torch.where(again, batch.ids, n), batch.inverse, batch.meta, n),
                    0, full.shape[1], into=full, written="wait")
                read.extend(captures)
        if read and t.device.type == "cuda":
            # The step that wrote them released its captures; the next prefetch of host ids
            # replays its dedup on the side stream at once, without waiting for this stream,
            # and must not overwrite those ids before they are read here.
            LookupGraphs.read_here(read, devices.current(t.device))
        return t.lookups.result(batch, full, flat, shape, pre.capture, True, id_order)
