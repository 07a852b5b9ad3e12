"""A data loader for datasets that already fit in RAM as tensors: the GPU gathers each batch.

``DataLoader`` over a ``TensorDataset`` indexes samples on the CPU, collates them, optionally
copies them into pinned memory, and only then copies them to the GPU; worker processes help,
but each batch still crosses several queues. When the whole dataset is a few tensors (id
pairs, ratings, tokenised text, small images) there is a shorter path: keep the tensors in
pinned host memory once, and let the GPU gather each shuffled batch straight from host RAM
(a zero-copy ``index_select`` over PCIe, rows read in address order), one batch ahead on a
side stream.

Determinism and resuming. The order of epoch ``e`` is a pure function of ``(seed, e)``: each
sample index ``i`` gets the key ``splitmix64(state(seed, e) + (i + 1) * golden)`` and the epoch
visits samples in increasing key order. The keys are distinct (splitmix64 is a bijection), so
the order is the same whichever device sorts them, and any epoch can be regenerated, which
makes ``state_dict() = {seed, epoch, position, ...}`` enough to resume mid-epoch exactly.
Why not ``torch.randperm`` with a seeded ``torch.Generator``: on the CPU (the only place its
result is the same on every machine) it took 4.3-5.4 s for 100M samples (measured on a 2-core
dev machine), a stall at every epoch start; the keyed sort runs on the compute device in one
``argsort`` and gives the CPU the same permutation.

Chunks and streams. Batches are gathered several at a time (a chunk of up to 256K rows,
16 MiB and 64 batches) and handed out as views, which keeps the loader's launches per batch
below the model's; rows are read in address order (sorted, then put back in batch order on the
GPU), which is several times faster over PCIe than random order for narrow rows. Chunk ``c + 1``
is gathered on a side stream while the model works through chunk ``c``; ``transform`` runs one
batch ahead on a second stream, so it never queues behind a gather. The consumer's stream waits
for an event before using a batch, and ``record_stream`` keeps the memory from being reused
before the consumer is done.

Without CUDA the same code gathers with ``index_select`` on the host tensors: same batches,
same order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import warnings
import weakref

import torch

from . import devices, hostmem
from .engine import ahead
from .devices import resolve_device

__all__ = ["PinnedLoader", "LoaderConfig", "permutation"]

_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15    # splitmix64 increment (odd: i -> i * golden is a bijection)
_MUL1 = 0xBF58476D1CE4E5B9     # splitmix64 finalizer constants
_MUL2 = 0x94D049BB133111EB
# Smaller contiguous tensors are copied into pages of their own rather than registered in place:
# registering them would lock the pages they share with neighbouring allocations.
_IN_PLACE_MIN_BYTES = 1 << 20
_SORT_MIN_ROWS = 4096       # chunks at least this large are gathered in address order,
SLAB_ROWS = 1 << 22         # sorted ~4M positions at a time
# Batches are gathered several at a time, up to this many rows, bytes and batches per chunk:
# the loader's Python and launch cost per batch then falls below the model's own indexing
CHUNK_ROWS = 1 << 18
_CHUNK_BYTES = 16 << 20
_CHUNK_BATCHES = 64


def signed64(c: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``c`` (torch has no full uint64 math)."""
    c &= _M64
    return c - (1 << 64) if c >> 63 else c


def mix_int(x: int) -> int:
    """splitmix64 finalizer on a Python int (exact, mod 2**64)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * _MUL1) & _M64
    x = ((x ^ (x >> 27)) * _MUL2) & _M64
    return x ^ (x >> 31)


def mix_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer in place on an int64 tensor: same bits on every device (the bits
    of :func:`mix_int`, as :func:`signed64` writes them).

    int64 multiplication wraps mod 2**64; ``>>`` is arithmetic on signed ints, so each shift is
    masked to make it logical.
    """
    for shift, mul in ((30, _MUL1), (27, _MUL2), (31, None)):
        x ^= (x >> shift) & ((1 << (64 - shift)) - 1)
        if mul is not None:
            x.mul_(signed64(mul))
    return x


def permutation(num_samples: int, seed: int, epoch: int, device="cpu") -> torch.Tensor:
    """The order in which :class:`PinnedLoader` visits ``num_samples`` samples in ``epoch``.

    Identical on every device (the keys are exact integer hashes and distinct, so sorting them
    has one answer). int64; sorting needs about 40 bytes per sample of transient memory on
    ``device``.

    >>> permutation(6, seed=0, epoch=0).tolist() == permutation(6, seed=0, epoch=0).tolist()
    True
    >>> sorted(permutation(6, seed=0, epoch=1).tolist())
    [0, 1, 2, 3, 4, 5]
    """
    state = mix_int(mix_int(seed) + epoch)
    keys = torch.arange(1, num_samples + 1, dtype=torch.int64, device=device)
    keys.mul_(signed64(GOLDEN)).add_(signed64(state))   # the splitmix64 state of sample i
    return torch.argsort(mix_(keys))


def _page_copy(t: torch.Tensor):
    """Copy ``t`` into whole pages of its own; return (the copy, the uint8 pages holding it).

    Registering the pages then cannot collide with another registration on a shared page.
    """
    nbytes = t.numel() * t.element_size()
    pages = torch.from_numpy(hostmem.page_aligned(nbytes))
    host = pages[:nbytes].view(t.dtype).view(t.shape)
    host.copy_(t)
    return host, pages


def _tensors_in(obj):
    """Every tensor inside a (nested) tuple / list / dict batch."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors_in(o)


@dataclasses.dataclass
class LoaderConfig:
    """Settings of :class:`PinnedLoader` besides the data, the batch size, the transform and the
    device (each can also be passed to it by name: ``PinnedLoader(x, batch_size=64, seed=3)``)."""
    shuffle: bool = True       # visit samples in a new order each epoch (else 0, 1, 2, ...)
    drop_last: bool = False    # skip the last, smaller batch of each epoch
    seed: int = 0              # the order of epoch e depends only on (seed, e)
    progress: bool = False     # a tqdm bar per epoch
    # A data-parallel job (docs/distributed.md): rank `rank` of `world` gets its own slice of
    # every global batch (global batch b is the ranks' batches b, in rank order, and batch_size
    # is per rank); every rank gets the same number of batches (samples past the last whole
    # global batch are not visited that epoch). Every rank uses the same data and seed.
    rank: int = 0
    world: int = 1


def check_resume(state: dict, mine: dict, settings, kind: str, what: str) -> None:
    """Refuse a loader state that lacks its position or was saved with other ``settings``:
    resuming it would hand out other batches than the interrupted run would have."""
    missing = [k for k in ("seed", "epoch", "position") if k not in state]
    if missing:
        raise KeyError(f"{kind} state is missing {missing}; expected the dict returned by "
                       f"{kind}.state_dict(), got keys {sorted(state)}")
    differ = [f"{k}={state[k]!r} (this loader: {mine[k]!r})"
              for k in settings if k in state and state[k] != mine[k]]
    if differ:
        raise ValueError("cannot resume: the saved loader had " + ", ".join(differ) +
                         f"; build the {kind} with the same {what} and settings")


class PinnedLoader:
    """Shuffled batches of in-memory tensors, gathered by the GPU from pinned host memory.

    A drop-in for ``DataLoader(TensorDataset(*tensors), batch_size, shuffle=True)`` when the
    tensors fit in host RAM: each batch is a tuple with one tensor per input, on ``device``.

    Args:
        *tensors: CPU tensors of any dtypes and trailing shapes with the same first dimension
            (samples). A contiguous CPU tensor of 1 MiB or more is pinned in place, without a
            copy (it is read while the loader exists: do not resize it); anything else (small,
            non-contiguous, on the GPU) is copied once into pinned host memory.
        batch_size: samples per batch (the last batch of an epoch may be smaller).
        transform: ``transform(*batch) -> anything``, called on the device batch, one batch
            ahead on a CUDA stream of the loader's own (normalise, augment, negative sampling);
            its result is what the loop gets. Batches may be views into a larger chunk.
        device: ``"auto"`` (the GPU when there is one), ``"cuda"``, ``"cpu"`` or a
            ``torch.device``. On the CPU the same batches come in the same order.
        config: :class:`LoaderConfig` (``shuffle``, ``drop_last``, ``seed``, ``progress``).
        **settings: any field of :class:`LoaderConfig` by name, overriding ``config``.

    Iterating gives the rest of the current epoch (from ``position``), then ``epoch`` advances
    and ``position`` returns to 0. ``state_dict()`` / ``load_state_dict()`` resume mid-epoch.

    >>> x = torch.arange(10.0).view(5, 2)
    >>> y = torch.tensor([0, 1, 0, 1, 1])
    >>> loader = PinnedLoader(x, y, batch_size=2, device="cpu", seed=1)
    >>> len(loader)
    3
    >>> [tuple(b.shape) for b, _ in loader]
    [(2, 2), (2, 2), (1, 2)]
    >>> loader.state_dict()["epoch"], loader.state_dict()["position"]
    (1, 0)
    """

    def __init__(self, *tensors, batch_size: int, transform=None, device="auto",
                 config: LoaderConfig | None = None, **settings):
        cfg = _config(config, settings)
        shuffle, drop_last, seed, progress = cfg.shuffle, cfg.drop_last, cfg.seed, cfg.progress
        _check_tensors(tensors)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
            raise TypeError(f"batch_size must be an int, got {batch_size!r} "
                            f"({type(batch_size).__name__})")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}; pass the number "
                             "of samples per batch, e.g. batch_size=1024")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable (it gets the batch tensors), got "
                            f"{type(transform).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise TypeError(f"seed must be an int, got {seed!r} ({type(seed).__name__})")
        self.device = resolve_device(device)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.transform = transform
        self.seed = int(seed)
        self.progress = bool(progress)
        self.num_samples = int(tensors[0].shape[0])
        for key, value in (("world", cfg.world), ("rank", cfg.rank)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{key} must be an int, got {value!r}")
        if cfg.world < 1 or not 0 <= cfg.rank < cfg.world:
            raise ValueError(f"rank must be in 0..world-1 and world at least 1, got rank="
                             f"{cfg.rank}, world={cfg.world}")
        self.rank, self.world = int(cfg.rank), int(cfg.world)
        # the samples this rank visits in an epoch
        self.epoch_samples = self.num_samples if self.world == 1 else \
            self.num_samples // (self.batch_size * self.world) * self.batch_size
        self.epoch = 0
        self.position = 0        # batches of `epoch` already handed out
        self._holders = []       # keep our registrations (pin_tensor) alive
        self._host = []          # host tensors, in input order
        self._views = []         # what the device gathers from: (N, row) or (N,)
        cuda = self.device.type == "cuda"
        self._row_numel = [math.prod(t.shape[1:]) for t in tensors]
        for i, (t, row) in enumerate(zip(tensors, self._row_numel)):
            host, view = self._place(t.detach(), f"loader[{i}]", cuda)
            self._host.append(host)
            # images (N, 28, 28) gather as rows of their flattened trailing dims
            self._views.append(view.reshape(view.shape[0], row) if view.dim() > 1 else view)
        self._row_bytes = sum(n * t.element_size() for n, t in zip(self._row_numel, self._host))
        # batches are gathered several at a time (chunks of up to 256K rows and 16 MiB)
        self._chunk_batches = max(1, min(_CHUNK_BATCHES, CHUNK_ROWS // self.batch_size,
                                         _CHUNK_BYTES // max(1, self.batch_size * self._row_bytes)))
        self._slab = None        # (slab, first position, ids, places): address order of chunks
        self._side = None        # CUDA side streams, made on first use
        self._xform = None
        self._perm = None        # (epoch, order on the device, on the host if needed)
        self._token = None       # the iterator allowed to advance the loader now
        self._ahead_perm = None  # (epoch, its order on the host): coming batches (coming)

    # --- host placement ------------------------------------------------------------------
    def _place(self, t: torch.Tensor, name: str, cuda: bool):
        """Return (host tensor, tensor the device gathers from).

        The second is a zero-copy CUDA alias of pinned memory; or the host tensor itself on the
        CPU, and also on CUDA when pinning was refused (the batch is then gathered on the CPU
        and copied: same batches, slower).
        """
        in_place = t.device.type == "cpu" and t.is_contiguous()
        nbytes = t.numel() * t.element_size()
        if not cuda:
            return (t, t) if in_place else (_page_copy(t)[0],) * 2
        if nbytes == 0:   # nothing to read: no registration, no alias
            return t.cpu(), torch.empty(t.shape, dtype=t.dtype, device=self.device)
        if in_place:
            # pin_tensor shares a registration nbtools holds for this range (another loader over
            # the same tensor) and uses memory pinned by torch or the caller as it is. Small
            # tensors are not registered in place: that would lock the pages they share with
            # their neighbours. When a page is shared with memory registered before, registering
            # fails, and a private copy (below) will not.
            if nbytes >= _IN_PLACE_MIN_BYTES or hostmem.whole_range_pinned(t):
                with contextlib.suppress(hostmem.PinningError):
                    holder = hostmem.pin_tensor(t, name=name)
                    if holder.pinned:
                        self._holders.append(holder)
                        return t, hostmem.cuda_alias(t, self.device)
        host, pages = _page_copy(t)
        try:
            holder = hostmem.pin_tensor(pages, name=name)
            problem = None if holder.pinned else "fresh host pages already read as pinned"
        except hostmem.PinningError as e:
            problem = e
        if problem is not None:
            warnings.warn(f"PinnedLoader: {problem}\nGathering {name} on the CPU and copying it "
                          "to the GPU instead: same batches, slower.", stacklevel=3)
            return host, host
        self._holders.append(holder)
        return host, hostmem.cuda_alias(host, self.device)

    @property
    def chunk_batches(self) -> int:
        """Batches gathered together as one chunk (at most :data:`CHUNK_ROWS` rows, 16 MiB and
        64 batches): one launch and one hand-over for all of them."""
        return self._chunk_batches

    @property
    def tensors(self) -> tuple:
        """The host tensors the loader reads (the caller's own tensors when they were
        contiguous CPU tensors)."""
        return tuple(self._host)

    def close(self) -> None:
        """Release this loader's hold on the pinned memory (unregistered once no other loader
        uses it). The loader cannot be iterated afterwards."""
        if self._side is not None:
            self._side.synchronize()   # a prefetch may still be reading the host memory
        self._holders, self._views, self._perm = [], [], None

    def id_counts(self, column: int, num_rows: int) -> torch.Tensor:
        """How often each id ``0..num_rows-1`` occurs in input ``column`` (every sample, all
        ranks' included), counted 1M ids at a time so that no copy of the column is made:
        the counts :meth:`nbtools.OffloadedEmbedding.warm_cache` takes, for a table the
        column indexes (``table.warm_cache(loader.id_counts(0, table.num_embeddings))``).

        >>> loader = PinnedLoader(torch.tensor([3, 1, 3, 0]), batch_size=2, device="cpu")
        >>> loader.id_counts(0, 5).tolist()
        [1, 1, 0, 2, 0]
        """
        if isinstance(column, bool) or not isinstance(column, numbers.Integral) or \
                not 0 <= column < len(self._host):
            raise ValueError(f"column must be an input's index in 0..{len(self._host) - 1}, "
                             f"got {column!r}")
        data = self._host[column]
        if data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise TypeError(f"column {column} holds {data.dtype} values, not ids: pass the "
                            f"index of an integer column")
        counts = torch.zeros(num_rows, dtype=torch.int64)
        flat = data.reshape(-1)
        step = 1 << 20
        for start in range(0, flat.numel(), step):
            ids = flat[start:start + step].long()
            if len(ids) and (ids.min() < 0 or ids.max() >= num_rows):
                raise ValueError(f"column {column} holds ids {int(ids.min())}..{int(ids.max())}"
                                 f", outside 0..{num_rows - 1}: pass the table's num_embeddings")
            counts += torch.bincount(ids, minlength=num_rows)
        return counts

    # --- order ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.epoch_samples // self.batch_size
        return math.ceil(self.epoch_samples / self.batch_size)

    def permutation(self, epoch: int | None = None, device="cpu") -> torch.Tensor:
        """Sample indices in the order of ``epoch`` (default: the current one), on ``device``.

        Batch ``b`` of that epoch holds samples ``permutation(epoch)[b*batch_size:(b+1)*batch_size]``.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if not self.shuffle:
            order = torch.arange(self.num_samples, device=device)
        else:
            order = permutation(self.num_samples, self.seed, epoch, device)
        if self.world > 1:          # this rank's slice of each global batch
            bs, n = self.batch_size, self.epoch_samples
            order = order[: n * self.world].view(-1, self.world, bs)[:, self.rank].reshape(-1)
        return order

    def _load_permutation(self, epoch: int) -> None:
        """Make ``self._perm = (epoch, order on the device, order on the host or None)``."""
        if self._perm is not None and self._perm[0] == epoch:
            return
        self._perm = None    # free the previous epoch's before sorting the next
        try:
            perm = self.permutation(epoch, self.device)
        except torch.cuda.OutOfMemoryError:
            warnings.warn(f"PinnedLoader: not enough GPU memory to sort {self.num_samples:,} keys "
                          "(about 40 bytes each); ordering on the CPU instead (same order, slower)")
            perm = self.permutation(epoch, "cpu").to(self.device)
        host_perm = None
        if perm.is_cuda:
            if any(not v.is_cuda for v in self._views):   # pinning was refused for some
                host_perm = perm.cpu()
            if self.num_samples < 2**31:
                # half the GPU memory; (on the CPU, index_select is ~100x slower with int32)
                perm = perm.to(torch.int32)
            perm.record_stream(self._side)   # read there; keep it until those reads end
        self._perm = (epoch, perm, host_perm)
        self._slab = None

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first batch at the next iteration."""
        self.epoch, self.position = int(epoch), 0

    # --- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the loader is: ``{"seed", "epoch", "position", "batch_size", "num_samples",
        "shuffle", "drop_last"}`` (plain ints and bools). ``position`` counts the batches of
        ``epoch`` already handed out, so a state saved inside the loop body resumes at the
        next batch."""
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
                "batch_size": self.batch_size, "num_samples": self.num_samples,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "rank": self.rank, "world": self.world}

    def check_state_dict(self, state: dict) -> None:
        """Raise (KeyError, ValueError) where ``state`` would not resume this loader: other
        data or settings, or a position outside the epoch. Changes nothing; a checkpoint's
        restore runs it before it touches any object."""
        if not isinstance(state, dict):
            raise ValueError(f"PinnedLoader state is a {type(state).__name__}, expected the "
                             "dict returned by PinnedLoader.state_dict()")
        check_resume(state, self.state_dict(),
                     ("num_samples", "batch_size", "shuffle", "drop_last", "rank", "world"),
                     "PinnedLoader", "data")
        for key in ("seed", "epoch", "position"):
            # (a float, a string or a bool would be cut to another whole number, or overflow)
            value = state[key]
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"PinnedLoader state has {key}={value!r:.40} "
                                 f"({type(value).__name__}), expected a whole number (int)")
        if state["epoch"] < 0:
            raise ValueError(f"PinnedLoader state has epoch={state['epoch']}, expected >= 0")
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"saved position {position} is outside 0..{len(self)} "
                             "(batches per epoch)")

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`: the next batch is the one that would have followed."""
        self.check_state_dict(state)
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self.position = int(state["position"])
        self._perm = None

    # --- iteration -----------------------------------------------------------------------
    def _chunk_rows(self, c: int, nb: int) -> tuple[int, int]:
        """Positions ``[lo, hi)`` in the epoch's order that chunk ``c`` covers."""
        k, bs = self._chunk_batches, self.batch_size
        return c * k * bs, min(min((c + 1) * k, nb) * bs, self.epoch_samples)

    def address_order(self, c: int) -> tuple[tuple[int, int], torch.Tensor, torch.Tensor]:
        """``((lo, hi), ids, places)`` for chunk ``c`` of the epoch being iterated (start a loop
        first): the positions ``lo:hi`` of :meth:`permutation` it covers, their sample ids in
        increasing order and where each goes in the chunk. A CUDA loader reads a chunk of at
        least 4,096 rows from host memory in this order."""
        if self._perm is None:
            raise RuntimeError("address_order() reads the epoch being iterated: start a loop first")
        nb = len(self)
        lo, hi = self._chunk_rows(c, nb)
        return (lo, hi), *self._address_order(c, nb, lo, hi)

    def _gather_chunk(self, c: int, nb: int, main):
        """``(rows, event)``: the rows of chunk ``c`` (one tensor per input) and, on CUDA, an
        event on the side stream that fires when they are gathered."""
        if main is None:
            return self._gather_rows(c, nb), None
        # Wait for the consumer's work so far: the permutation is ready, and the gather runs at
        # most one chunk ahead of the model.
        self._side.wait_stream(main)
        torch.cuda.set_stream(self._side)   # (a third of the cost of `with torch.cuda.stream`)
        try:
            rows = self._gather_rows(c, nb)
        finally:
            torch.cuda.set_stream(main)
        return rows, self._side.record_event()

    def _gather_rows(self, c: int, nb: int):
        lo, hi = self._chunk_rows(c, nb)
        idx = self._perm[1][lo:hi]
        n = idx.shape[0]
        order = None
        if idx.is_cuda and self.shuffle and n >= _SORT_MIN_ROWS:
            # Read host RAM in address order, then put the rows back in batch order on the GPU:
            # random zero-copy reads run at ~75M rows/s whatever the row size up to 256 B,
            # sorted ones at 400M+ (benchmarks/RESULTS.md, PinnedLoader).
            idx, order = self._address_order(c, nb, lo, hi)
        chunk = []
        for v, h, row in zip(self._views, self._host, self._row_numel):
            if not row:
                rows = torch.empty((n, row), dtype=h.dtype, device=self.device)
            elif v.device == idx.device:
                rows = hostmem.gather_rows(v, idx)
                if order is not None:
                    rows = torch.empty_like(rows).index_copy_(0, order, rows)
            else:   # pinning was refused: gather on the CPU, then copy
                rows = hostmem.gather_rows(v, self._perm[2][lo:hi]).to(self.device)
            chunk.append(rows.view(n, *h.shape[1:]))
        if self.device.type == "cuda":
            hostmem.count_transfer(h2d=n * self._row_bytes)
        return tuple(chunk)

    def _address_order(self, c: int, nb: int, lo: int, hi: int):
        """``(ids, places)``: chunk ``c``'s sample ids in increasing order, and where each goes in
        the chunk. Sorted a slab of chunks at a time: one ``torch.sort`` costs ~80 us of CPU,
        more than the rest of a chunk's work."""
        size = self._chunk_batches * self.batch_size
        per_slab = max(1, SLAB_ROWS // size)
        slab = c // per_slab
        if self._slab is None or self._slab[0] != slab:
            self._slab = None
            s_lo = slab * per_slab * size
            s_hi = min(s_lo + per_slab * size, min(nb * self.batch_size, self.epoch_samples))
            perm = self._perm[1][s_lo:s_hi]
            local = torch.arange(s_hi - s_lo, device=perm.device) // size   # chunk in the slab
            keys, where = torch.sort((local << 40) | perm.long())    # ids < 2^40, chunks < 2^22
            ids = (keys & ((1 << 40) - 1)).to(perm.dtype)
            self._slab = (slab, s_lo, ids, where.sub_(local * size))
        _, s_lo, ids, where = self._slab
        return ids[lo - s_lo:hi - s_lo], where[lo - s_lo:hi - s_lo]

    def _batch_of(self, chunk, c: int, b: int) -> tuple:
        """Batch ``b`` as views into chunk ``c``."""
        first = (b - c * self._chunk_batches) * self.batch_size
        return tuple(t[first:first + self.batch_size] for t in chunk)

    def _transformed(self, batch, ready, main):
        """``(transform(*batch), event)``. On CUDA it runs one batch ahead of the model on a
        stream of its own, so that it never queues behind the next chunk's gather; it starts
        once the batch's chunk is ``ready`` and the consumer's work so far is done."""
        if main is None:
            return self.transform(*batch), None
        xs = self._xform
        xs.wait_stream(main)
        xs.wait_event(ready)
        for t in batch:
            t.record_stream(xs)   # the chunk, made on the side stream, is read here too
        torch.cuda.set_stream(xs)
        try:
            out = self.transform(*batch)
        finally:
            torch.cuda.set_stream(main)
        return out, xs.record_event()

    @staticmethod
    def _hand_over(tensors, ready, main) -> None:
        """Make the consumer's stream ``main`` wait for ``ready``, and keep the memory of
        ``tensors`` (made on a loader stream) until ``main`` is done with it."""
        if main is not None:
            main.wait_event(ready)
            for t in _tensors_in(tensors):
                if t.is_cuda:
                    t.record_stream(main)

    # --- the coming batches (nbtools.engine.ahead: a disk table reads their rows ahead) ------
    @property
    def batches_per_epoch(self) -> int:
        return len(self)

    def coming(self, epoch: int, b: int, column: int) -> torch.Tensor | None:
        """Column ``column`` of batch ``b`` of ``epoch`` as a CPU tensor, gathered from host
        memory (what the loop will get then, before it is on the device), or None past the
        data."""
        if b >= len(self) or column >= len(self._host):
            return None
        if self._ahead_perm is None or self._ahead_perm[0] != epoch:
            self._ahead_perm = (epoch, self.permutation(epoch, "cpu"))
        lo = b * self.batch_size
        hi = min(lo + self.batch_size, self.epoch_samples)
        return self._host[column].index_select(0, self._ahead_perm[1][lo:hi])

    def _consumer_stream(self):
        """The stream the loop body runs on now (None on the CPU)."""
        return None if self._side is None else devices.current(self.device)

    def __iter__(self):
        if not self._views and self._host:
            raise RuntimeError("this PinnedLoader was closed; build a new one")
        token = self._token = object()
        nb = len(self)
        if 0 < nb <= self.position:   # a state saved after the last batch means the next epoch
            self.epoch, self.position = self.epoch + 1, 0
        epoch, start = self.epoch, self.position
        if self.device.type == "cuda" and self._side is None:
            self._side = torch.cuda.Stream(device=self.device)    # gathers
            self._xform = torch.cuda.Stream(device=self.device)   # transforms
            # when the loader is collected, let its last gathers finish before the pinned memory
            # they read is unregistered and freed (weakref callbacks run before attributes go)
            weakref.finalize(self, self._side.synchronize)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm   # only when asked: import nbtools stays light
            bar = tqdm(total=nb, initial=start, desc=f"epoch {epoch}", unit="batch")
        try:
            if start < nb:
                yield from self._batches(token, start, nb, bar)
            self.epoch, self.position, self._perm = epoch + 1, 0, None
        finally:
            if bar is not None:
                bar.close()

    def _batches(self, token, start: int, nb: int, bar):
        """Batches ``start..nb-1`` of the current epoch. Several small batches are gathered as
        one chunk (fewer launches and syncs per batch) and handed out as views; the next chunk
        is gathered on the side stream while the model works through this one."""
        k = self._chunk_batches
        self._load_permutation(self.epoch)
        main = self._consumer_stream()
        chunks = {start // k: self._gather_chunk(start // k, nb, main)}   # c -> (rows, event)
        pending = None
        if self.transform is not None:
            rows, ev = chunks[start // k]
            pending = self._transformed(self._batch_of(rows, start // k, start), ev, main)
        ready = None      # (chunk, stream) that the consumer's stream already waited for
        for b in range(start, nb):
            if self._token is not token:
                raise RuntimeError("this PinnedLoader was iterated again while an earlier "
                                   "loop over it was still running; use one loop at a time")
            main = self._consumer_stream()   # the loop body may switch streams
            c = b // k
            if self.transform is None:
                rows, ev = chunks[c]
                batch = self._batch_of(rows, c, b)
                if ready != (c, main):
                    self._hand_over(rows, ev, main)
                    ready = (c, main)
            else:
                batch, ev = pending
                self._hand_over(batch, ev, main)
            if c + 1 not in chunks and (c + 1) * k < nb:
                chunks[c + 1] = self._gather_chunk(c + 1, nb, main)
                chunks.pop(c - 1, None)
            if self.transform is not None and b + 1 < nb:
                nc = (b + 1) // k
                rows, ev = chunks[nc]
                pending = self._transformed(self._batch_of(rows, nc, b + 1), ev, main)
            self.position = b + 1
            if bar is not None:
                bar.update(1)
            if self.transform is None:     # a disk table reads the coming batches' rows
                ahead.handed(self, self.epoch, b, batch)
            yield batch

    def __repr__(self):
        shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in self._host)
        ranks = f", rank={self.rank} of {self.world}" if self.world > 1 else ""
        return (f"PinnedLoader([{shapes}], batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last}, device={self.device}, seed={self.seed}{ranks}, "
                f"epoch={self.epoch}, position={self.position}/{len(self)})")


def _config(config: LoaderConfig | None, settings: dict) -> LoaderConfig:
    """``config`` with the fields named in ``settings`` replaced."""
    if config is not None and not isinstance(config, LoaderConfig):
        raise TypeError(f"config must be a LoaderConfig, got {type(config).__name__}")
    fields = [f.name for f in dataclasses.fields(LoaderConfig)]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise TypeError(f"PinnedLoader got unexpected keyword argument(s) {unknown}; its "
                        f"settings are batch_size, transform, device, config and {fields}")
    return dataclasses.replace(config or LoaderConfig(), **settings)


def _check_tensors(tensors) -> None:
    if not tensors:
        raise TypeError("PinnedLoader needs at least one tensor, e.g. "
                        "PinnedLoader(x, y, batch_size=256)")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            hint = " (wrap it with torch.from_numpy(a): no copy)" if type(t).__module__ == "numpy" \
                else " (convert it with torch.as_tensor)"
            raise TypeError(f"PinnedLoader takes tensors; argument {i} is a "
                            f"{type(t).__module__}.{type(t).__name__}{hint}")
        if t.layout != torch.strided:
            raise ValueError(f"argument {i} is a {t.layout} tensor; PinnedLoader needs dense "
                             "tensors (call .to_dense() first)")
        if t.dim() == 0:
            raise ValueError(f"argument {i} is a 0-dim tensor (a scalar); each tensor needs a "
                             "first dimension of samples")
    n = [t.shape[0] for t in tensors]
    if len(set(n)) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(f"all tensors must have the same first dimension (samples); got shapes "
                         f"{shapes}. Trim or pad them to {min(n):,} or {max(n):,} samples")
