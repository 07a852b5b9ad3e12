"""Read-ahead by the loaders: a disk table reads its coming steps' rows while the loop runs,
with no ``table.prefetch`` in the loop.

A disk table's step waits for the rows it misses in RAM unless they were read while earlier
steps ran (:mod:`nbtools.disk.readahead`). ``table.prefetch(next_ids)`` starts such reads, but
only a loop that has the coming steps' ids at hand can call it. nbtools' loaders do have them:
:class:`nbtools.PinnedLoader` knows every coming batch of an epoch (its order is a function of
the seed and the epoch). So each batch a loader hands out is noted here (:func:`handed`), and
a disk table's training lookup of one of those very tensors (:func:`follow`) starts reading
the same column of the next :data:`AHEAD` batches, crossing into the next epoch, and takes
the deduplication its read-ahead made. Results do not change: a read-ahead moves rows between
the file and RAM, never a value.

A table whose loop calls ``prefetch`` itself is left to it (while it does); ids that are not a loader's
tensor as handed out (a copy, a slice, a sum) are looked up as they come.
"""
from __future__ import annotations

import weakref

from ..disk.readahead import AHEAD

KEEP = 4        # batches whose tensors are remembered (a step looks up the one just handed)

_handed: dict = {}          # id(tensor) -> (weakref to it, feed, epoch, batch, column)
_order: list = []           # (id, entry) of the tensors noted, oldest first
# a disk table's lookups object (the owner: nbtools.engine.lookups.TableLookups, one a table,
# as long-lived) -> (weakref to feed, next position), or ("explicit", lookups it lasts); the key
# of a read-ahead is (feed, position, column)
_next = weakref.WeakKeyDictionary()


def handed(feed, epoch: int, b: int, tensors) -> None:
    """Loader ``feed`` hands out batch ``b`` of ``epoch``: ``tensors`` (one per column).
    ``feed.coming(epoch, b, column)`` must give a later batch's column as a CPU tensor (or
    None), and ``feed.batches_per_epoch`` its batches per epoch."""
    for j, t in enumerate(tensors):
        entry = (weakref.ref(t), feed, epoch, b, j)
        _handed[id(t)] = entry
        _order.append((id(t), entry))
    while len(_order) > KEEP * max(1, len(tensors)):
        key, entry = _order.pop(0)
        if _handed.get(key) is entry:         # (not a newer tensor at a reused address)
            del _handed[key]


def _source(ids):
    entry = _handed.get(id(ids))
    if entry is None or entry[0]() is not ids:
        return None
    return entry[1:]


def explicit(owner) -> None:
    """The table of lookups ``owner`` was asked to ``prefetch``: its loop reads ahead itself
    (until :data:`AHEAD` + 2 lookups pass without a call)."""
    _next[owner] = ("explicit", AHEAD + 2)


def reads_ahead_itself(owner) -> bool:
    """Whether the loop of ``owner``'s table calls ``prefetch`` itself (lately): then the
    loaders' batches start no read-ahead of their own for it."""
    state = _next.get(owner)
    return state is not None and state[0] == "explicit"


def key_of(owner, ids):
    """The key of the read-ahead a disk table's training lookup of ``ids`` (``owner``: its
    lookups) takes its deduplication from, where ``ids`` is a loader's batch as handed out
    (else None)."""
    src = _source(ids)
    if src is None or reads_ahead_itself(owner):
        return None
    feed, epoch, b, j = src
    return feed, epoch * max(1, feed.batches_per_epoch) + b, j


def follow(owner, ids, disk, padding_idx) -> None:
    """After a disk table's training lookup of ``ids`` (``owner``: its lookups; ``disk``: its
    :class:`~nbtools.disk.DiskRows`, ``padding_idx`` its padding row): where ``ids`` is a
    loader's batch as handed out, start the read-ahead of the same column of the coming
    :data:`AHEAD` batches not yet read ahead (a position past the epoch's end is the next
    epoch's batch)."""
    src = _source(ids)
    state = _next.get(owner)
    if state is not None and state[0] == "explicit":
        _next[owner] = ("explicit", state[1] - 1) if state[1] > 1 else None
        return
    if src is None:
        return
    feed, epoch, b, j = src
    nb = max(1, feed.batches_per_epoch)
    pos = epoch * nb + b
    start = pos + 1
    if state is not None and state[0]() is feed and pos < state[1] <= pos + 1 + AHEAD:
        start = state[1]                      # the ones before were started at earlier steps
    for p in range(start, pos + 1 + AHEAD):
        coming = feed.coming(p // nb, p % nb, j)
        if coming is None:
            break
        disk.read_ahead(coming, padding_idx, key=(feed, p, j))
        start = p + 1
    _next[owner] = (weakref.ref(feed), start)
