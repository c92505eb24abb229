"""The errors a flat optimizer step raises (all :class:`flatpool.FlatPoolError`)."""

from __future__ import annotations

from ..errors import FlatPoolError


class FlatStepError(FlatPoolError):
    """A flat optimizer step cannot be set up or run as asked; nothing was changed."""


class UnsupportedOptimizerError(FlatStepError, TypeError):
    """The optimizer's math is not elementwise (or flatpool has no flat rule for it), so one
    step over a flat buffer would not be the optimizer's step."""


class NotPooledError(FlatStepError, ValueError):
    """A parameter is not where a flat step needs it: outside every given pool, or not one
    contiguous run of its slice."""


class LostPlaceError(FlatStepError, RuntimeError):
    """Kept for code that catches it: no longer raised. Since issue 30 a member that left its
    pooled place (``to_empty``, ``load_state_dict(assign=True)``, a framework's own
    re-materialization) is stepped by torch's own step, with a ``FlatStepWarning``, until it is
    back in its pool."""


__all__ = ["FlatStepError", "LostPlaceError", "NotPooledError", "UnsupportedOptimizerError"]
