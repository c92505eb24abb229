"""Warnings that point at the user's code: a hand-counted ``stacklevel`` goes stale whenever a
call path changes depth, so this walks to the first frame outside flatpool (and integrations).
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


def _import_machinery(filename: str) -> bool:
    # the test ``warnings`` itself uses to leave these frames out of its stacklevel count
    return "importlib" in filename and "_bootstrap" in filename


def _in_torch(filename: str) -> bool:
    torch = sys.modules.get("torch")
    where = getattr(torch, "__file__", None)
    if not where:
        return False
    return os.path.abspath(filename).startswith(os.path.dirname(os.path.abspath(where)) + os.sep)


def caller_stacklevel(*, past_torch: bool = False) -> int:
    """The caller's ``stacklevel`` naming the first frame outside flatpool (and torch, with
    ``past_torch``: a hook torch runs is the user's ``model(x)`` line's doing). importlib's
    frames are passed but not counted, since ``warnings`` skips them."""
    level = 1
    frame = sys._getframe(1)  # the function that will call warnings.warn
    while frame is not None:
        name = frame.f_code.co_filename
        if not (_inside(name) or _import_machinery(name) or (past_torch and _in_torch(name))):
            break
        frame = frame.f_back  # type: ignore[assignment]
        if frame is not None and not _import_machinery(frame.f_code.co_filename):
            level += 1
    return level


def warn(message: str, category: type[Warning], *, past_torch: bool = False) -> None:
    """``warnings.warn`` attributed to the first frame outside flatpool (and outside torch
    with ``past_torch``, for warnings from hooks torch runs)."""
    warnings.warn(message, category, stacklevel=caller_stacklevel(past_torch=past_torch))
