"""Gradients and optimizer state in pools, and one flat optimizer step per segment.

``FlatOptimizer(optimizer, pools, module=model)`` pools the gradients and the optimizer state
of parameters adopted into ``pools`` with the pools' own layout and steps each run of adjacent
parameters of one param group with torch's foreach kernel over one flat tensor: bit-identical
to ``foreach=True`` per parameter, at the cost of one kernel instead of thousands. See
docs/optim.md.
"""

from __future__ import annotations

from ..errors import FlatStepWarning
from .errors import FlatStepError, LostPlaceError, NotPooledError, UnsupportedOptimizerError
from .flat import FlatOptimizer, FusedPolicy
from .layout import Member, Segment
from .mirror import mirror

__all__ = [
    "FlatOptimizer", "FlatStepError", "FlatStepWarning", "FusedPolicy", "LostPlaceError", "Member", "NotPooledError",
    "Segment", "UnsupportedOptimizerError", "mirror",
]
