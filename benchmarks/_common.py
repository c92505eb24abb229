"""Shared helpers: interleaved medians, results, the report's table.

Timings on a shared machine are noisy, so a figure is never compared with a baseline measured
at another time: every benchmark runs its cases round-robin (figure, baseline, figure,
baseline, ...) in one process and compares medians.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flatpool._table import table

Case = Callable[[], float]
"""One repetition of a case: does its own (untimed) setup and returns the timed seconds."""


def interleaved(cases: dict[str, Case], reps: int, warmup: int = 1) -> dict[str, list[float]]:
    """Run every case ``warmup + reps`` times, round-robin, rotating the order each round.

    Returns the timed seconds of the ``reps`` measured rounds per case.
    """
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + reps):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            gc.collect()
            t = cases[n]()
            if r >= warmup:
                out[n].append(t)
    return out


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the per-round ratios (each round's pair ran back to back)."""
    return statistics.median(a / b for a, b in zip(num, den))


RATIO_KINDS = {
    "per-round": "median over the rounds of figure / baseline, each round's pair timed back to "
                 "back (so not the quotient of the two medians beside it)",
    "per-round, CPU": "as per-round, of CPU time (time.process_time: every thread of the "
                      "process) instead of wall time",
    "of medians": "median figure / median baseline",
    "bytes": "figure bytes / baseline bytes (one measurement)",
    "per group": "op calls beyond the baseline's / FSDP2 groups (one profiled step: counts are "
                 "deterministic)",
}
"""What a ratio is; the report prints the meaning of every kind it used under its table."""


@dataclass
class Result:
    """One line of the report.

    ``figure`` and ``baseline`` are what was measured, as text: a time is the median over
    ``rounds`` rounds (interleaved), bytes one measurement. ``ratio_kind`` (a
    :data:`RATIO_KINDS` key) says what ``ratio`` is. ``ok`` is ``None`` when nothing was judged:
    no target, or a quick run (``target`` still says what a full run is held to).
    """

    bench: str
    name: str
    figure: str
    baseline: str
    ratio: float | None
    target: str
    ok: bool | None  # None: reported only (no target, or not judged in a quick run)
    note: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    ratio_kind: str = "per-round"
    rounds: int | None = None
    """How many timed rounds the figure and baseline are medians of (``None``: not times)."""

    @property
    def verdict(self) -> str:
        if self.ok is None:
            return "-" if self.target in ("", "-") else "not judged"
        return "PASS" if self.ok else "MISS"

    @property
    def measured(self) -> str:
        """What the figure and baseline are: ``median of 9 rounds`` or ``one measurement``."""
        return f"median of {self.rounds} rounds" if self.rounds else "one measurement"


def fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n >= 1 << 20:
        return f"{sign}{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{sign}{n / (1 << 10):.1f} KiB"
    return f"{sign}{n:.0f} B"


def render(results: Sequence[Result], markdown: bool = False) -> str:
    """The report's table, then what its figures and each kind of ratio in it are."""
    head = ("benchmark", "case", "figure", "baseline", "measured as", "ratio", "ratio is",
            "target", "verdict")
    rows = [(r.bench, r.name, r.figure, r.baseline, r.measured,
             "-" if r.ratio is None else f"{r.ratio:.3f}",
             "-" if r.ratio is None else r.ratio_kind, r.target, r.verdict)
            for r in results]
    lines = table(rows, head=head, rule=True, markdown=markdown)
    kinds = sorted({r.ratio_kind for r in results if r.ratio is not None})
    lines.append("")
    lines.append("figure: flatpool's measurement; baseline: the comparison measured in the same "
                 "process, interleaved with it.")
    lines += [f"ratio '{k}': {RATIO_KINDS.get(k, k)}." for k in kinds]
    return "\n".join(lines)
