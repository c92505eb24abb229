"""Test hooks for code that builds on flatpool: inject failures inside its operations.

``set_fault_hook(FailAt(k))`` makes the k-th checkpoint raise, so an integration can prove its
own calls roll back; clear it with ``set_fault_hook(None)``.
"""

from __future__ import annotations

from .ownership._faults import set_fault_hook


class FailAt:
    """A fault hook raising ``exc_type`` at checkpoint ``k`` (0-based); ``steps`` lists them."""

    def __init__(self, k: int, exc_type: type[BaseException] = RuntimeError) -> None:
        self.k = k
        self.exc_type = exc_type
        self.steps: list[str] = []

    def __call__(self, step: str) -> None:
        self.steps.append(step)
        if len(self.steps) == self.k + 1:
            raise self.exc_type(f"injected at checkpoint {self.k} ({step})")


__all__ = ["FailAt", "set_fault_hook"]
