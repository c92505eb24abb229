"""Byte counts as people read them (``8 MiB``, ``1.50 KiB``) in tables and pictures."""

from __future__ import annotations

_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (``4 MiB``, not ``4.00 MiB``)."""
    for size, name in _UNITS:
        if abs(n) >= size:
            return f"{n // size} {name}" if n % size == 0 else f"{n / size:.2f} {name}"
    return f"{n} B"


__all__ = ["fmt_bytes"]
