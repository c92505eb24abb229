"""Errors of :mod:`flatpool.memory`, in flatpool's one hierarchy (bad inputs: ``ValueError``)."""

from __future__ import annotations

import reprlib

from ..errors import FlatPoolError, InvalidRequestError

_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 2, 40, 40


def shown(value: object, limit: int = 60) -> str:
    """A short ``repr`` of a bad input for an error message, which never raises itself (a
    hostile file's deep nesting or huge int makes ``repr`` fail)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = _short.repr(value)
    except (RecursionError, ValueError):
        text = f"<a {type(value).__name__} too deep or too large to show>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _InputError(InvalidRequestError):
    """A malformed input file; ``field`` is the offending entry's path."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class SnapshotError(_InputError):
    """An allocator snapshot is malformed."""


class ManifestError(_InputError):
    """A memory manifest (JSON) is malformed."""


class PictureError(FlatPoolError, OSError):
    """A picture cannot be written where asked; raised before any work is done."""


class MissingExtraError(FlatPoolError, ImportError):
    """An optional dependency is not installed; ``extra`` is the flatpool extra that brings it."""

    def __init__(self, message: str, extra: str) -> None:
        super().__init__(message)
        self.extra = extra
