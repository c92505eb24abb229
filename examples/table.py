"""The demos' per-rank tables: sizes in MiB and aligned columns under a rule."""

from __future__ import annotations

from collections.abc import Sequence

from flatpool._table import table

MiB = 1 << 20
HEAD = ("mode", "live shard storages", "live bytes", "of which flat", "stale originals",
        "training vs no fusion", "verdict")


def mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n % MiB else f"{n // MiB} MiB"


def render(rank: int, rows: Sequence[Sequence[str]], head: Sequence[str] = HEAD,
           title: str = "") -> str:
    """``rank``'s table: ``rank N: title``, the header, a rule, one aligned line per row."""
    first = f"rank {rank}: {title}" if title else f"rank {rank}:"
    return "\n".join([first, *table(rows, head=head, rule=True, indent="  ")])


__all__ = ["HEAD", "MiB", "mib", "render"]
