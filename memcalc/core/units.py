"""The only place where bytes become human units.

Every internal quantity is an ``int`` of bytes. GiB = 2**30 and GB = 10**9;
conversion happens only when rendering.
"""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12


def gib(n_bytes: int) -> float:
    """Bytes as GiB (2**30), for display only."""
    return n_bytes / GiB


def fmt_bytes(n_bytes: int, unit: str = "GiB", digits: int = 3) -> str:
    """Render bytes in one binary unit, e.g. ``fmt_bytes(3 * 2**30) == '3.000 GiB'``."""
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "GB": GB, "MB": MB}[unit]
    if unit == "B":
        return f"{n_bytes:,} B"
    return f"{n_bytes / scale:,.{digits}f} {unit}"


def fmt_auto(n_bytes: int) -> str:
    """Render bytes in the largest binary unit that keeps the number >= 1."""
    n = abs(n_bytes)
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n_bytes / scale:,.2f} {unit}"
    return f"{n_bytes:,} B"


def fmt_count(n: int) -> str:
    """A parameter count as 1.63B / 124.4M / 5.3K."""
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def round_up(n_bytes: int, multiple: int) -> int:
    """Round a byte count up to a multiple (the CUDA caching allocator rounds to 512 B)."""
    if multiple <= 1:
        return n_bytes
    return -(-n_bytes // multiple) * multiple
