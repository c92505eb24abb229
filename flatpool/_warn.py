"""Warnings and log records that point at the user's code, not at flatpool's.

A warning's ``stacklevel`` counted by hand goes stale whenever a call path changes depth; this
walks the stack to the first frame outside the flatpool package (``flatpool.integrations``
included) and attributes the warning there.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["logger", "warn"]

logger = logging.getLogger("flatpool")
"""The one logger of the project: hook events (adopted, re-adopted, kept alive, skipped)."""

_PACKAGE_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    # flatpool.integrations lives in the repository's top-level integrations/ in a checkout
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integrations")
    + os.sep,
)


def _inside(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE_DIRS)


def caller_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` made by the caller of this function) that
    names the first frame outside flatpool."""
    level = 1
    frame = sys._getframe(1)  # the function that will call warnings.warn
    while frame is not None and _inside(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn`` attributed to the first frame outside flatpool."""
    warnings.warn(message, category, stacklevel=caller_stacklevel())
