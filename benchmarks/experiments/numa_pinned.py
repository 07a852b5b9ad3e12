"""Does it matter on which NUMA node a table's pinned rows live, or in pages of which size? (issue
23: the same row-wise step scattered by up to 1.5x between fresh tables of one call.)

A HostTensor is zero-filled by torch's threads before it is pinned, so its pages land on the
nodes of whichever cores touched them first. This makes the same 4,000,000-row tables several
ways: as nbtools does (twice), advised into transparent huge pages or out of them
(``madvise``), and with every page bound to one node (``mbind(MPOL_BIND)`` before the first
touch), for each node; counts where a sample of their pages is (``move_pages``) and how much
of the table became huge pages (AnonHugePages); and
times, per placement, the zero-copy gather and write-back of 65,536 uniform ids
(nbtools.kernels, as a step runs them) and bench_step's floor (torch's index_select then
index_copy_), for 288- and 1,536-byte rows. The GPU's own node is read from sysfs.

    python3 benchmarks/experiments/numa_pinned.py        # GPU machine (Linux, x86-64), ~30 s
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                              # gather_words
sys.path.insert(0, os.path.join(HERE, "..", ".."))    # nbtools
from gather_words import loop_ms, unique_batches  # noqa: E402
from nbtools import hostmem, kernels  # noqa: E402

_LIBC = ctypes.CDLL(None, use_errno=True)
_MBIND, _MOVE_PAGES = 237, 279          # x86-64 syscall numbers
MPOL_BIND = 2


def nodes() -> list:
    base = "/sys/devices/system/node"
    try:
        return sorted(int(d[4:]) for d in os.listdir(base) if d.startswith("node") and
                      d[4:].isdigit())
    except OSError:
        return [0]


def gpu_node(dev) -> int | None:
    props = torch.cuda.get_device_properties(dev)
    bus = getattr(props, "pci_bus_id", None)
    dom = getattr(props, "pci_domain_id", 0)
    dev_id = getattr(props, "pci_device_id", 0)
    cands = []
    if bus is not None:
        cands.append(f"{dom:04x}:{bus:02x}:{dev_id:02x}.0")
    try:                  # nvidia-smi's "00000000:18:00.0" is sysfs' "0000:18:00.0"
        import subprocess
        got = subprocess.run(["nvidia-smi", "-i", str(dev.index or 0), "--query-gpu=pci.bus_id",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20).stdout.strip()
        if got:
            cands.append(got[-12:].lower())
    except (OSError, subprocess.SubprocessError):
        pass
    for name in cands:
        try:
            with open(f"/sys/bus/pci/devices/{name}/numa_node") as f:
                return int(f.read().strip())
        except OSError:
            continue
    return None


def bind(addr: int, nbytes: int, node: int) -> None:
    mask = (ctypes.c_ulong * 2)(1 << node, 0)
    if _LIBC.syscall(_MBIND, ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), MPOL_BIND, mask,
                     ctypes.c_ulong(65), 0) != 0:
        raise OSError(ctypes.get_errno(), "mbind failed")


def where(arr: np.ndarray, samples: int = 2000) -> dict:
    """node -> pages, of ``samples`` pages spread over ``arr``."""
    page = os.sysconf("SC_PAGE_SIZE")
    base = arr.ctypes.data
    offs = np.linspace(0, arr.nbytes - 1, samples).astype(np.int64) // page * page
    pages = (ctypes.c_void_p * samples)(*[base + int(o) for o in offs])
    status = (ctypes.c_int * samples)()
    if _LIBC.syscall(_MOVE_PAGES, 0, ctypes.c_ulong(samples), pages, None, status, 0) != 0:
        return {"?": samples}
    out = {}
    for s in status:
        out[s] = out.get(s, 0) + 1
    return out


MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def advise(addr: int, nbytes: int, advice: int) -> None:
    if _LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), advice) != 0:
        raise OSError(ctypes.get_errno(), "madvise failed")


def huge_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return -1


def table(rows: int, row_bytes: int, node) -> tuple:
    """A pinned table, its pages bound to NUMA ``node`` (an int), or advised ``"huge"`` /
    ``"small"`` (transparent huge pages or not), or as nbtools makes them (None)."""
    orig = hostmem.page_aligned

    def bound(nbytes):
        a = orig(nbytes)
        if node == "huge":
            advise(a.ctypes.data, a.nbytes, MADV_HUGEPAGE)
        elif node == "small":
            advise(a.ctypes.data, a.nbytes, MADV_NOHUGEPAGE)
        else:
            bind(a.ctypes.data, a.nbytes, node)
        return a
    if node is not None:
        hostmem.page_aligned = bound
    before = huge_kib()
    try:
        h = hostmem.HostTensor((rows, row_bytes // 4), torch.float32, name="numa")
    finally:
        hostmem.page_aligned = orig
    got = where(h._raw)
    got["huge MiB"] = (huge_kib() - before) // 1024
    return h, got


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--ids", type=int, default=65536)
    ap.add_argument("--row-bytes", default="288,1536")
    args = ap.parse_args()
    dev = torch.device("cuda")
    uniq, counts = unique_batches(args.rows, args.ids, dev)
    k = len(uniq)
    thp = {}
    for knob in ("enabled", "defrag"):
        try:
            with open(f"/sys/kernel/mm/transparent_hugepage/{knob}") as f:
                thp[knob] = f.read().strip()
        except OSError:
            thp[knob] = "?"
    print(f"# {torch.cuda.get_device_name(dev)}; NUMA nodes {nodes()}, the GPU's: "
          f"{gpu_node(dev)}; cores {os.cpu_count()}, torch threads {torch.get_num_threads()}; "
          f"transparent huge pages {thp}")
    print("| row B | pages on | where (node: pages of 2,000) | gather ms | write-back ms | "
          "floor ms |\n|---:|---|---|---:|---:|---:|")
    for row_bytes in (int(b) for b in args.row_bytes.split(",")):
        for node in [None, "small", "huge", None] + nodes():
            h, placed = table(args.rows, row_bytes, node)
            view = h.view()
            out = torch.zeros(args.ids, row_bytes // 4, device=dev)
            g = loop_ms(lambda i: kernels.gather_rows(
                view, uniq[i], counts[i], out,
                programs=kernels.zero_copy_programs(dev)), k, dev)
            p = loop_ms(lambda i: kernels.put_rows(
                view, uniq[i], counts[i], out, programs=kernels.WRITE_BEHIND_PROGRAMS), k, dev)
            f = loop_ms(lambda i: (hostmem.gather_rows(view, uniq[i]),
                                   hostmem.scatter_rows(view, uniq[i], out[:uniq[i].numel()])),
                        k, dev)
            label = {None: "as nbtools makes them", "huge": "transparent huge pages",
                     "small": "no huge pages"}.get(node, f"node {node}")
            print(f"| {row_bytes} | {label} | {placed} | {g:.3f} | {p:.3f} | {f:.3f} |",
                  flush=True)
            h.close()


if __name__ == "__main__":
    main()
