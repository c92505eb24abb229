"""Shared helpers: interleaved medians, results, the table.

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


@dataclass
class Result:
    """One line of the report."""

    bench: str
    name: str
    figure: str
    baseline: str
    ratio: float | None
    target: str
    ok: bool | None  # None: reported only, no target
    note: str = ""
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "-" if self.ok is None else ("PASS" if self.ok else "MISS")


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
    head = ("benchmark", "case", "figure", "baseline", "ratio", "target", "verdict")
    rows = [head] + [
        (r.bench, r.name, r.figure, r.baseline,
         "-" if r.ratio is None else f"{r.ratio:.3f}", r.target, r.verdict)
        for r in results
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
