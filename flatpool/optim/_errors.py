"""The errors a flat optimizer step raises (all :class:`flatpool.FlatPoolError`)."""

from __future__ import annotations

from ..errors import FlatPoolError


class FlatStepError(FlatPoolError):
    """A flat optimizer step cannot be set up or run as asked; nothing was changed."""


class UnsupportedOptimizerError(FlatStepError, TypeError):
    """flatpool has no flat rule for the optimizer (its math must be elementwise)."""


class NotPooledError(FlatStepError, ValueError):
    """A parameter is outside every given pool, or not one contiguous run of its slice."""


class LostPlaceError(FlatStepError, RuntimeError):
    """Kept for code that catches it, no longer raised: a member that left its pooled place is
    stepped by torch's own step, with a ``FlatStepWarning``."""
