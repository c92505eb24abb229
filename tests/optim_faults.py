"""Interrupts at chosen lines of flatpool's code, for the flat optimizer's tests.

A tracer raises ``KeyboardInterrupt`` at the k-th interruptible line run inside flatpool. The
lines are those of ``tests/reliability/test_interrupts.py``: not ``with`` lines, not bare
``try:`` lines and not the signal guard's own primitives, where CPython cannot run a context
manager's exit atomically (bpo-29988) and flatpool defers signals instead; a raise a tracer
places there is outside what any Python code can guarantee, and no real signal lands there.
"""

from __future__ import annotations

import linecache
import os
import types
from collections.abc import Callable
from typing import Any

import flatpool

FLATPOOL_DIR = os.path.dirname(os.path.abspath(flatpool.__file__))
PRIMITIVES = tuple(os.path.join(FLATPOOL_DIR, f) for f in ("_interrupts.py", "_gcpause.py"))


def interruptible(frame: types.FrameType) -> bool:
    code = frame.f_code
    if code.co_filename.startswith(PRIMITIVES):
        return False
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return not (line.startswith("with ") or line == "try:")


def interrupt_at_line(k: int | None, mark: str = "journal.py", inside: str = FLATPOOL_DIR,
                      stop: Callable[[types.FrameType], bool] | None = None
                      ) -> tuple[Callable[..., Any], list[int]]:
    """A tracer raising ``KeyboardInterrupt`` at the ``k``-th interruptible line run in files
    under ``inside`` (``None``: only count), until a frame ``stop`` accepts starts. ``seen`` =
    [lines met, line count when a file named ``mark`` was first entered (-1: never)]."""
    seen = [0, -1]
    stopped = [False]

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if stopped[0] or not name.startswith(inside):
            return None
        if event == "call" and stop is not None and stop(frame):
            stopped[0] = True
            return None
        if event == "call" and seen[1] < 0 and name.endswith(mark):
            seen[1] = seen[0]
        if event == "line" and interruptible(frame):
            seen[0] += 1
            if seen[0] == (k if k is not None else -2) + 1:
                raise KeyboardInterrupt
        return tracer

    return tracer, seen


def interrupt_points(total: int, dense_from: int, slow: bool, spread: int = 80,
                     dense: int = 150) -> list[int]:
    """Every line with ``--slow``; else about ``spread`` spread over the whole run and every
    line of the ``dense`` from ``dense_from`` on (where changes others can see are made)."""
    if slow:
        return list(range(total))
    out = set(range(0, total, max(1, total // spread)))
    if dense_from >= 0:
        out |= set(range(dense_from, min(total, dense_from + dense)))
    return sorted(out)


__all__ = ["interrupt_at_line", "interrupt_points", "interruptible"]
