"""torch's optimizer, stepped flat: gradients and optimizer state in pools, one kernel per run
of adjacent parameters, bit-identical to torch's own step.

``FlatOptimizer(optimizer, pools, module=model)`` makes ``optimizer.step()`` step each run of
pooled parameters of a param group with torch's own functional kernel over one flat tensor
(float32/float64), and everything a flat step cannot do exactly (other dtypes, sparse
gradients, odd state, capturable groups, parameters outside the pools) with torch's own step,
per parameter. torch's ``optimizer.state``, ``param_groups`` and ``.grad`` decide every step.
See docs/optim.md.
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
