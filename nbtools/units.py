"""Numbers as people read them: bytes, link rates, counts and durations (torch-free).

Every function takes a reading that may be missing (``None``) and shows it as ``N/A``, so the
meters, the dashboard, the planner and error messages all print the same units.
:func:`progress_bar` is the tqdm bar of bytes a long copy shows (a checkpoint, a table's file,
a pretrained load), tqdm imported on use.
"""
from __future__ import annotations


def human_bytes(n) -> str:
    """Binary units: ``512 B``, ``12.3 GiB``; ``N/A`` for a missing reading.

    >>> human_bytes(512), human_bytes(3 * 2**30), human_bytes(None)
    ('512 B', '3.0 GiB', 'N/A')
    """
    if n is None:
        return "N/A"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def fmt_bytes(n) -> str:
    """``12.3 GiB``, or ``N/A`` for a missing reading.

    >>> fmt_bytes(3 * 2**30), fmt_bytes(None)
    ('3.0 GiB', 'N/A')
    """
    return human_bytes(n)


def fmt_rate(bytes_per_s) -> str:
    """Link rates in decimal GB/s, as PCIe is specified.

    >>> fmt_rate(48.2e9), fmt_rate(None)
    ('48.2 GB/s', 'N/A')
    """
    if bytes_per_s is None:
        return "N/A"
    if abs(bytes_per_s) >= 1e9 or bytes_per_s == 0:   # negative: a cache filling costs bytes
        return f"{bytes_per_s / 1e9:.1f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def fmt_count(x) -> str:
    """``12.3k``, ``4.56M``.

    >>> fmt_count(12345), fmt_count(4.56e6), fmt_count(None)
    ('12.3k', '4.56M', 'N/A')
    """
    if x is None:
        return "N/A"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            v = x / div
            return f"{v:.3g}{suffix}" if v < 100 else f"{v:.0f}{suffix}"
    return f"{x:.3g}" if x != int(x) else f"{int(x)}"


def fmt_seconds(s) -> str:
    """Durations: ``850 µs``, ``5.1 ms``, ``2.35 s``, ``1:02:03``.

    >>> fmt_seconds(0.0051), fmt_seconds(3723), fmt_seconds(None)
    ('5.1 ms', '1:02:03', 'N/A')
    """
    if s is None:
        return "N/A"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 60:
        return f"{s:.3g} s"
    s = int(s)
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"



def positive_int(what: str, value) -> int:
    """``value`` as an int when it is a positive integer (Python or NumPy; not a bool), else a
    ValueError/TypeError that names ``what`` and what was passed.

    >>> positive_int("num_rows", 10)
    10
    """
    import numbers
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be a positive int, got {value!r} "
                        f"({type(value).__name__})")
    if value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


def progress_bar(total: int, desc: str, progress):
    """A tqdm bar of ``total`` bytes, or None (``progress=False``, nothing to do, no tqdm)."""
    if progress is False or total <= 0:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    # delay: the bar appears only for operations that last longer than a moment.
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                delay=0 if progress else 1.0, leave=False)
