"""Named points inside multi-step operations where :mod:`flatpool.testing` injects failures, to
prove every step rolls back (one global lookup each)."""

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
