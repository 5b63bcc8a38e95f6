"""Sizes as the CLI shows them: ``human`` (``1.5 MiB``: status, progress, checkpoints) and
``ls_size`` (``1.5M``, as ``ls -h`` prints them)."""

from __future__ import annotations

__all__ = ["human", "ls_size"]


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def ls_size(n: int) -> str:
    """GNU ``ls -h``: bytes below 1024 as they are, then one decimal below 10 (rounded up), else whole."""
    if n < 1024:
        return str(n)
    value = float(n)
    for unit in "KMGTPE":
        value /= 1024
        if value < 1024 or unit == "E":
            if value < 10:
                tenths = -(-int(value * 10 * 1000) // 1000)  # round up, as ls does (sizes never shrink)
                return f"{tenths / 10:.1f}{unit}" if tenths < 100 else f"10{unit}"
            return f"{-(-int(value * 1000) // 1000)}{unit}"
    return str(n)
