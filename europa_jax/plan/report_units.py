"""Numbers as the plan's text shows them: bytes, FLOPs, seconds in the unit that shows them."""

from __future__ import annotations


def size(x: float | None) -> str:
    """Bytes in decimal units (the budgets are 88.32 GB and 96 GB, i.e. 10^9 bytes)."""
    if x is None:
        return "n/a"
    if x == 0:
        return "0 B"
    return f"{x / 1e9:,.2f} GB" if abs(x) >= 1e8 else f"{x / 1e6:,.2f} MB"


def scaled(x: float) -> str:
    """Bytes in the decimal unit that shows them (TB for a 1T model's step, kB for a tiny
    one's), not 0.00 TB."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:,.2f} {unit}"
    return f"{x / 1e3:,.2f} kB"


def _flop(x: float) -> str:
    return f"{x / 1e12:>12,.1f} TFLOP" if x >= 1e11 else f"{x / 1e9:>12,.3f} GFLOP"


def _s(x: float) -> str:
    """Seconds in the unit that shows them (a tiny model's step is microseconds)."""
    if x >= 0.1 or x == 0:
        return f"{x:,.2f} s"
    return f"{x * 1e3:,.2f} ms" if x >= 1e-4 else f"{x * 1e6:,.2f} µs"
