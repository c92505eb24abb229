"""Named points inside multi-step operations where tests inject failures.

Production code calls :func:`checkpoint` at each step (allocate, copy, rebind, release, ...);
it costs one global lookup. Tests install a hook that raises at the k-th call to prove every
step rolls back cleanly (``KeyboardInterrupt`` included).
"""

from __future__ import annotations

from typing import Callable

_hook: Callable[[str], None] | None = None


def set_fault_hook(hook: Callable[[str], None] | None) -> None:
    """Install (or clear with ``None``) a function called with each step's name."""
    global _hook
    _hook = hook


def checkpoint(step: str) -> None:
    hook = _hook
    if hook is not None:
        hook(step)


class FailAt:
    """A fault hook raising ``exc_type`` at checkpoint number ``k`` (0-based) of the operations
    run while it is installed. ``steps`` records every checkpoint reached, so a sweep can raise
    at each step in turn until an operation completes without the hook firing."""

    def __init__(self, k: int, exc_type: type[BaseException] = RuntimeError) -> None:
        self.k = k
        self.exc_type = exc_type
        self.steps: list[str] = []

    def __call__(self, step: str) -> None:
        self.steps.append(step)
        if len(self.steps) == self.k + 1:
            raise self.exc_type(f"injected at checkpoint {self.k} ({step})")
