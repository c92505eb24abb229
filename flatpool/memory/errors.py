"""Errors of :mod:`flatpool.memory`: bad snapshots, bad manifests, a missing optional extra.

They join flatpool's one hierarchy (:class:`flatpool.errors.FlatPoolError`), so a caller that
catches flatpool errors catches these too; the bad-input ones are also ``ValueError``.
"""

from __future__ import annotations

from ..errors import FlatPoolError, InvalidRequestError


class SnapshotError(InvalidRequestError):
    """An allocator snapshot is malformed. ``field`` is the path of the offending entry,
    e.g. ``segments[2].blocks[0].size`` (``""`` for the file or object as a whole)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class ManifestError(InvalidRequestError):
    """A memory manifest (JSON) is malformed; ``field`` names the offending entry."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class MissingExtraError(FlatPoolError, ImportError):
    """An optional dependency is not installed; ``extra`` is the flatpool extra that brings it."""

    def __init__(self, message: str, extra: str) -> None:
        super().__init__(message)
        self.extra = extra


__all__ = ["ManifestError", "MissingExtraError", "SnapshotError"]
