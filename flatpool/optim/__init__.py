"""torch's optimizer, stepped flat: one kernel per run of adjacent pooled parameters,
bit-identical to torch's own step. See docs/optim.md.
"""

from __future__ import annotations

from ..errors import FlatStepWarning
from ._errors import FlatStepError, LostPlaceError, NotPooledError, UnsupportedOptimizerError
from ._flat import FlatOptimizer, FusedPolicy
from ._layout import Member, Segment
from ._mirror import mirror

__all__ = [
    "FlatOptimizer", "FlatStepError", "FlatStepWarning", "FusedPolicy", "LostPlaceError", "Member", "NotPooledError",
    "Segment", "UnsupportedOptimizerError", "mirror",
]
