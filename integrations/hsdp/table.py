"""The demos' per-rank tables: sizes in MiB and aligned columns under a rule."""

from __future__ import annotations

from collections.abc import Sequence

MiB = 1 << 20
HEAD = ("mode", "live shard storages", "live bytes", "of which flat", "stale originals",
        "training vs no fusion", "verdict")


def mib(n: int) -> str:
    return f"{n / MiB:.2f} MiB" if n % MiB else f"{n // MiB} MiB"


def render(rank: int, rows: Sequence[Sequence[str]], head: Sequence[str] = HEAD) -> str:
    """``rank``'s table: the header, a rule, one aligned line per row."""
    table = [tuple(head), *map(tuple, rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = [f"rank {rank}:"]
    for j, row in enumerate(table):
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)))
        if j == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


__all__ = ["HEAD", "MiB", "mib", "render"]
