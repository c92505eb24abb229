"""The demos' per-rank tables: sizes in MiB and aligned columns under a rule."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

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


class _Checked(Protocol):
    @property
    def checks(self) -> tuple[str, ...]: ...  # failed checks of a flatpool row; empty: passed


R = TypeVar("R", bound=_Checked)


def report(results: Sequence[Sequence[R]], seconds: float,
           render_rank: Callable[[int, Sequence[R]], str], passed: str) -> int:
    """Print every rank's table and the verdict; the exit code (1 if a flatpool row failed)."""
    for rank, rows in enumerate(results):
        print(render_rank(rank, rows) + "\n")
    failed = [r for rows in results for r in rows if r.checks]
    print(f"done in {seconds:.1f} s")
    if failed:
        print(f"FAILED: {len(failed)} flatpool row(s) did not pass their checks", file=sys.stderr)
        return 1
    print(passed)
    return 0


__all__ = ["HEAD", "MiB", "mib", "render", "report"]
