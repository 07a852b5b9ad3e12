"""Fakes for tests and docs: a clock moved by hand and meter readings without a GPU.

>>> clock = FakeClock()
>>> clock.advance(1.5); clock()
1.5
"""
from __future__ import annotations

import collections

from .meters.backends import (PCIE_LANE_BYTES_PER_S, CPU_KEYS, DISK_COUNTERS, DISK_KEYS,
                              GPU_KEYS, HOST_KEYS, LINK_KEYS, NBTOOLS_KEYS, TORCH_KEYS)


class FakeClock:
    """A clock the test moves by hand: ``clock()`` returns seconds, ``clock.advance(dt)``."""

    def __init__(self, start: float = 0.0):
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


class FakeBackend:
    """Deterministic readings for tests and docs, no GPU needed.

    Every reading is an attribute in ``values`` (set it to ``None`` for N/A; the disk readings
    are N/A, as without disk tables, until :meth:`disk_io`); the raw PCIe
    counters are ``counter_bits`` wide and wrap like NVML's. Put a reader's name in ``fail``
    (``"gpu"``, ``"host"``, ``"pcie_counters"`` ...) to make it raise.

    >>> b = FakeBackend(gpu_used_bytes=1 << 30)
    >>> b.move(rx_bytes=5 << 30)          # 5 GiB into the GPU: the 32-bit counter wrapped
    >>> b.pcie_counters()[0] == (5 << 30) % 2**32
    True
    """

    DEFAULTS = {
        "gpu_used_bytes": 6 << 30, "gpu_total_bytes": 80 << 30, "gpu_process_bytes": 5 << 30,
        "gpu_util_percent": 60.0,
        "torch_allocated_bytes": 4 << 30, "torch_reserved_bytes": 5 << 30,
        "torch_peak_bytes": 4 << 30, "torch_pinned_bytes": 0,
        "host_total_bytes": 64 << 30, "host_used_bytes": 20 << 30,
        "host_available_bytes": 44 << 30, "process_rss_bytes": 12 << 30,
        "nbtools_pinned_bytes": 8 << 30, "nbtools_h2d_bytes": 0, "nbtools_d2h_bytes": 0,
        "nbtools_cache_lookup_rows": 0, "nbtools_cache_hit_rows": 0, "nbtools_cache_saved_bytes": 0,
        "nbtools_compiled_kernels": 0,
        "process_cores": 8, "host_cores": 8, "process_cpu_s": 0.0, "host_cpu_busy_s": 0.0,
        # no disk table: N/A until disk_io() pretends one moved rows
        **dict.fromkeys(DISK_KEYS),
        "pcie_gen": 5, "pcie_width": 16, "link_bytes_per_s": 16 * PCIE_LANE_BYTES_PER_S[5],
    }

    has_pcie = True

    def __init__(self, counter_bits: int = 32, clock=None, **values):
        unknown = set(values) - set(self.DEFAULTS)
        if unknown:
            raise TypeError(f"FakeBackend got unknown readings {sorted(unknown)}; "
                            f"known: {sorted(self.DEFAULTS)}")
        self.values = {**self.DEFAULTS, **values}
        self.counter_bits = counter_bits
        self.raw = [0, 0]                  # PCIe rx, tx counters as NVML would show them
        self.throughput = [None, None]     # what the blocking throughput query returns (B/s)
        self.fail: set[str] = set()
        self.calls = collections.Counter()
        self.clock = clock              # times FakeEvent.record() when given
        self.events: list[FakeEvent] = []

    def gpu_done(self) -> None:
        """The fake GPU catches up: every event recorded so far completes."""
        for e in self.events:
            e.done = True

    def move(self, rx_bytes: int = 0, tx_bytes: int = 0, nbtools: bool = False) -> None:
        """Pretend bytes crossed PCIe (rx: into the GPU); ``nbtools=True`` counts them as moved
        by nbtools too."""
        m = 1 << self.counter_bits
        self.raw = [(self.raw[0] + rx_bytes) % m, (self.raw[1] + tx_bytes) % m]
        if nbtools:
            self.values["nbtools_h2d_bytes"] += rx_bytes
            self.values["nbtools_d2h_bytes"] += tx_bytes

    def serve(self, lookups: int, hits: int, saved_bytes: int = 0) -> None:
        """Pretend a table's GPU cache of hot rows served ``hits`` of ``lookups`` unique rows,
        sparing PCIe ``saved_bytes``."""
        self.values["nbtools_cache_lookup_rows"] += lookups
        self.values["nbtools_cache_hit_rows"] += hits
        self.values["nbtools_cache_saved_bytes"] += saved_bytes

    def use_cpu(self, process_s: float = 0.0, host_s: float | None = None) -> None:
        """Pretend this process spent ``process_s`` CPU seconds and the whole machine
        ``host_s`` (default: the same) busy seconds, summed over cores."""
        self.values["process_cpu_s"] += process_s
        self.values["host_cpu_busy_s"] += process_s if host_s is None else host_s

    def compile(self, kernels: int = 1) -> None:
        """Pretend ``kernels`` GPU kernels compiled (a first launch in a session)."""
        self.values["nbtools_compiled_kernels"] += kernels

    def disk_io(self, **counts) -> None:
        """Pretend disk tables moved rows: adds to the :func:`nbtools.disk.disk_counters`
        names given (``read_bytes``, ``write_bytes``, ``read_s``, ``write_s``,
        ``lookup_rows``, ``hit_rows``, ``wait_s``, ``ahead_rows``); the first call makes the disk readings
        0 instead of N/A, as importing ``nbtools.disk`` does.

        >>> b = FakeBackend()
        >>> b.disk()["nbtools_disk_read_bytes"] is None
        True
        >>> b.disk_io(read_bytes=4096, lookup_rows=10, hit_rows=9)
        >>> b.disk()["nbtools_disk_read_bytes"], b.disk()["nbtools_disk_wait_s"]
        (4096, 0)
        """
        unknown = set(counts) - set(DISK_COUNTERS)
        if unknown:
            raise TypeError(f"FakeBackend.disk_io got unknown counters {sorted(unknown)}; "
                            f"known: {list(DISK_COUNTERS)}")
        for k in DISK_COUNTERS:
            key = f"nbtools_disk_{k}"
            self.values[key] = (self.values[key] or 0) + counts.get(k, 0)

    def _read(self, name, keys):
        self.calls[name] += 1
        if name in self.fail:
            raise RuntimeError(f"fake {name} failure")
        return {k: self.values[k] for k in keys}

    def gpu(self):
        return self._read("gpu", GPU_KEYS)

    def torch_memory(self):
        return self._read("torch_memory", TORCH_KEYS)

    def host(self):
        return self._read("host", HOST_KEYS)

    def cpu(self):
        return self._read("cpu", CPU_KEYS)

    def nbtools(self):
        return self._read("nbtools", NBTOOLS_KEYS)

    def disk(self):
        return self._read("disk", DISK_KEYS)

    def link(self):
        return self._read("link", LINK_KEYS)

    def pcie_counters(self):
        self._read("pcie_counters", ())
        return tuple(self.raw)

    def pcie_throughput(self, direction: str):
        self._read("pcie_throughput", ())
        return self.throughput[0 if direction == "rx" else 1]

    def event(self):
        """A :class:`FakeEvent` when the backend has a clock (fake GPU timing), else None
        (phases are timed with the host clock, as on a CPU)."""
        if self.clock is None:
            return None
        e = FakeEvent(self.clock)
        self.events.append(e)
        return e

    def close(self):
        pass


class FakeEvent:
    """Stands in for ``torch.cuda.Event``: records the fake clock's time; ``query()`` is False
    until the test calls :meth:`FakeBackend.gpu_done` (the GPU has caught up)."""

    def __init__(self, clock):
        self.clock = clock
        self.done = False
        self.t = None

    def record(self, stream=None):
        self.t = self.clock()
        self.done = False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def take_grad(table):
    """The rows ``table`` looked up since the last call, exactly sized, for tests (this reads
    the unique count: a host sync; the optimizer uses ``table.collect()`` instead).

    Returns ``(ids, grad, rows, state)``: unique ids (padding row excluded), their gradients
    summed over every occurrence in every lookup (per-row scale applied), the weight rows
    and the state columns as gathered (``state`` is None when no state is attached or the
    lookups predate it). All None when no row has a gradient. Clears the pending lookups.
    """
    import torch                # here: importing nbtools.testing (fake meters) needs no torch
    got = table.collect()
    if got is None:
        return None, None, None, None
    got.sum_now()
    got.release()          # what is returned below is copied out of the capture first
    got.rows = got.rows.clone()
    bad, count, sentinel = got.batch.meta.tolist()
    if bad:
        for flat, shape in got.lookups:
            if bool(((flat < 0) | (flat >= table.num_embeddings)).any()):
                table.lookups.raise_bad_ids(flat, shape)
    m = count - sentinel
    if m == 0:
        return None, None, None, None
    lay = table.layout
    if got.has_state and table.state_names:
        state = torch.cat([lay.state(got.rows[:m], i).to(table.compute_dtype)
                           for i in range(len(table.state_names))], dim=1)
        weight = lay.weight(got.rows[:m]).to(table.compute_dtype)
    else:
        state, weight = None, got.rows[:m]
    return got.batch.ids[:m], got.grad[:m], weight, state


def train_reading_ahead(table, batches, depth: int, stray=None):
    """Train ``table`` (Adam, lr 0.05, a fixed linear head) on ``batches``, one step each, a
    disk table reading ``depth`` steps ahead (``table.prefetch`` of the coming batches; and,
    every third step, ``stray``: ids no lookup asks for, which only move rows). Returns the
    optimizer. The loop the read-ahead tests and the read-ahead stress compare with host RAM."""
    import torch
    from .optim import OffloadOptimizer
    opt = OffloadOptimizer(torch.optim.Adam, table, lr=0.05)
    head = torch.linspace(-1, 1, table.embedding_dim, device=table.device)
    ahead = table.placement == "disk" and depth > 0
    if ahead:
        for ids in batches[1:depth]:
            table.prefetch(ids)
    for i, ids in enumerate(batches):
        (table(ids) * head).sum().backward()
        if ahead and i + depth < len(batches):
            table.prefetch(batches[i + depth])
        if ahead and stray is not None and i % 3 == 1:
            table.prefetch(stray)
        opt.step()
        opt.zero_grad()
    return opt


def assert_same_rows(expected, table) -> None:
    """Assert that ``table``'s weights and every per-row state column are bit for bit those of
    ``expected`` (the same model trained elsewhere: another placement, a resumed run)."""
    import torch
    assert torch.equal(expected.weight, table.weight), f"table {table.name!r}: weights differ"
    for name in expected.state_names:
        assert torch.equal(expected.state_columns(name), table.state_columns(name)), \
            f"table {table.name!r}: state {name!r} differs"
